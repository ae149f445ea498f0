// Interoperability with Python's torch.save / torch.load (zip archive + pickle).
//  - import_torch_file: reads a torch.save'd (nested) dict of tensors — e.g. an
//    nn.Module state_dict — with the restricted unpickler of pickle_reader.h: it knows
//    the handful of globals tensors and dicts need (_rebuild_tensor_v2, *Storage,
//    OrderedDict, _rebuild_parameter) and refuses every other global, so loading never
//    runs code. Nested dicts and lists flatten to "a.b" / "a.0" FQNs; None is skipped.
//  - TorchExportWriter: writes a file that torch.load (also with weights_only=True)
//    reads as a plain dict {name: tensor}, one tensor at a time, plus a record
//    "<archive>/tessera-export" (torch.load does not read it) that marks the file as
//    Tessera's: is_tessera_torch_export() tells such a file from any other, so that
//    `--force` replaces only outputs Tessera wrote.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "tessera/checkpoint/format/metadata.h"

namespace caffe2::serialize {
class PyTorchStreamWriter;
}

namespace tessera::checkpoint {

// The whole file's tensors are held in memory (chunks with `memory` set).
CheckpointMetadata import_torch_file(const std::string& path);

// "" for a file that may be a checkpoint; for a Python pickle in place of one (the legacy,
// non-zip torch.save format, or a pickle.dump), an error message naming the file and how
// to re-save it. open_checkpoint() throws it; `tessera ckpt verify` reports it as not a
// checkpoint rather than a corrupt one.
std::string pickle_file_reason(const std::string& path);

// The name of the marker record (under the archive's folder) and what it holds.
inline constexpr const char* kTorchExportRecord = "tessera-export";
inline constexpr const char* kTorchExportMarker = "tessera-torch-export 1\n";

// Whether `path` is a regular file that TorchExportWriter wrote (a zip archive whose
// marker record holds kTorchExportMarker). False for anything else, unreadable included.
bool is_tessera_torch_export(const std::string& path);

class TorchExportWriter {
 public:
  explicit TorchExportWriter(const std::string& path);
  ~TorchExportWriter();
  void add(const std::string& name, const at::Tensor& t);
  // Writes the pickle and the zip directory.
  void finish();

 private:
  struct Item {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  std::unique_ptr<caffe2::serialize::PyTorchStreamWriter> zip_;
  std::vector<Item> items_;
  bool finished_ = false;
};

}  // namespace tessera::checkpoint
