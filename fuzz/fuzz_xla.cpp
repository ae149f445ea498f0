// `tessera ckpt import-xla` on one torch_xla FSDP rank file made of the input (a
// torch.save zip: the bounded zip index, the restricted unpickler and shard_metadata's
// interpretation all read it). Errors are clean; an import that succeeds is written to a
// scratch directory and removed.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include "tessera/checkpoint/offline/xla_import.h"
#include "tessera/checkpoint/storage/file.h"

namespace ck = tessera::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = "/tmp/tessera-fuzz-xla-" + std::to_string(::getpid());
  static const std::string file = dir + "/checkpoint_rank-00000000-of-00000001.pth";
  static const std::string out = dir + "-out";
  if (!ck::path_exists(dir)) ck::make_dir(dir);
  FILE* f = std::fopen(file.c_str(), "wb");
  if (!f) return 0;
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    (void)ck::import_xla(dir, out, false);
  } catch (const std::exception&) {
  }
  try {
    if (ck::path_exists(out)) ck::remove_all(out);
  } catch (const std::exception&) {
  }
  return 0;
}
