// Tessera's restricted unpickler on raw pickle bytes (the data.pkl of torch.save files,
// DCP .metadata, the items of .distcp files): every input is refused with an error or
// read into a tree that is walked; nothing executes, nothing crashes, nothing leaks, and
// every tensor view lies inside its storage (its first and last elements are read here,
// in instrumented code, so that ASan sees a view that reaches outside).
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <set>
#include <string>

#include "tessera/checkpoint/interop/pickle_reader.h"

namespace pk = tessera::checkpoint::pickle;

namespace {

// What torch.save files and DCP metadata may name, together.
const std::set<std::string>& allowed() {
  static const std::set<std::string> g = [] {
    std::set<std::string> s = pk::torch_save_globals();
    const std::string m = "torch.distributed.checkpoint.metadata.";
    for (const char* n : {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                          "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"})
      s.insert(m + n);
    for (const char* n : {"torch.distributed.checkpoint.filesystem._StorageInfo", "torch.float32", "torch.int64",
                          "torch.strided", "torch.contiguous_format", "torch.serialization._get_layout",
                          "builtins.getattr", "pathlib.PosixPath"})
      s.insert(n);
    return s;
  }();
  return g;
}

// Reads the bytes of a tensor view's first and last element.
uint64_t touch(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  const auto* base = static_cast<const uint8_t*>(t.storage().data());
  const size_t el = t.element_size();
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  uint64_t sum = 0;
  for (int64_t e : {t.storage_offset(), last})
    for (size_t b = 0; b < el; ++b) sum += base[static_cast<size_t>(e) * el + b];
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  try {
    // Every persistent id names a storage of four floats (a torch.save record).
    const pk::PyPtr root = pk::unpickle("fuzz", in, allowed(), [](const pk::PyPtr&) {
      auto o = pk::make(pk::Py::Storage);
      o->t = at::zeros({4}, at::kFloat);
      return o;
    });
    volatile uint64_t sink = 0;
    (void)pk::flatten(
        *root, "",
        [&](const std::string& key, const pk::Py& v) -> std::string {
          if (v.kind == pk::Py::Tensor) sink = sink + touch(v.t);
          sink = sink + key.size();
          return "";
        },
        [&](const std::string& key) { sink = sink + key.size(); });
  } catch (const std::exception&) {
  }
  return 0;
}
