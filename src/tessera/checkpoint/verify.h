// Verifying a checkpoint offline (`tessera ckpt verify`) or before a resume
// (checkpoint::find_resumable, resume.h): every data file present, every header valid, the
// pieces tiling every tensor, every checksum. A reader-level operation, below the offline
// tools (offline.h includes this header), so that the collective resume can use it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::checkpoint {

struct VerifyReport {
  bool ok = true;
  std::vector<std::string> problems;  // each names the file and/or key; the first 100 (verify.cpp)
  int64_t more_problems = 0;          // found past those, counted only ("and K more problem(s)")
  int64_t chunks_checked = 0;
  uint64_t bytes_checked = 0;
  bool has_checksums = true;          // false for foreign safetensors / torch files
  std::string kind;                   // the source's kind (kSourceSharded, ..., kSourceHf: format/metadata.h); "" when it could not be opened
  std::vector<std::string> notes;     // remarks that are no problem (an "hf" index's total_size)
};
// Completeness (metadata, every data file present with its size, headers valid,
// chunks tiling every tensor) and every checksum. A Hugging Face directory (interop/hf_dir.h)
// has none: its weight map is checked against the shards and every byte is read. Never
// throws for a bad checkpoint; throws ResourceError (safetensors.h) when this process runs
// out of a resource (descriptors) that says nothing about the checkpoint.
VerifyReport verify(const std::string& path);
// One part of that work, for `parts` processes verifying one checkpoint together (the
// collective checkpoint::find_resumable): every part opens the metadata and checks it; part
// `part` checks the data files r and the chunks i with r, i = part (mod parts). The parts'
// problems together are verify(path)'s.
VerifyReport verify(const std::string& path, int part, int parts);

}  // namespace tessera::checkpoint
