// A Hugging Face model directory made of the input: a 4-byte little-endian length, that
// many bytes of model.safetensors.index.json, and the rest as its one shard
// model-00001-of-00001.safetensors. Opened as a checkpoint (the weight map checked
// against the shard's header) and, when that succeeds, every tensor read whole.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/sharding/chunk.h"

namespace ck = tessera::checkpoint;

namespace {

void write_file(const std::string& path, const char* data, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return;
  if (n) std::fwrite(data, 1, n, f);
  std::fclose(f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = "/tmp/tessera-fuzz-hf-" + std::to_string(::getpid());
  if (!ck::path_exists(dir)) ck::make_dir(dir);
  if (size < 4) return 0;
  uint64_t n = 0;
  for (int k = 0; k < 4; ++k) n |= static_cast<uint64_t>(data[k]) << (8 * k);
  if (n > size - 4) n = size - 4;
  const char* p = reinterpret_cast<const char*>(data) + 4;
  write_file(dir + "/model.safetensors.index.json", p, n);
  write_file(dir + "/model-00001-of-00001.safetensors", p + n, size - 4 - n);
  try {
    const ck::CheckpointMetadata meta = ck::open_checkpoint(dir);
    ck::ChunkReader reader(meta);
    for (const auto& k : meta.keys) {
      const ck::EntryInfo& e = meta.entries.at(k);
      if (e.is_tensor()) (void)reader.read_box(k, e, tessera::sharding::full_box(e.shape));
    }
  } catch (const std::exception&) {
  }
  return 0;
}
