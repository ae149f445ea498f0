#include "tessera/checkpoint/interop/torch_file.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <map>
#include <variant>

#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/interop/pickle_reader.h"
#include "tessera/checkpoint/interop/zip_index.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace {

using pickle::Py;
using pickle::PyPtr;

// One metadata entry per leaf of the unpickled tree, under its dotted key.
void flatten_obj(const std::string& path, const PyPtr& root, CheckpointMetadata& m) {
  const std::string why = pickle::flatten(*root, "", [&](const std::string& key, const Py& o) -> std::string {
    EntryInfo e;
    switch (o.kind) {
      case Py::None: return "";  // carries no state
      case Py::Tensor:
        e.kind = kTensorKind;
        e.dtype = o.t.scalar_type();
        e.shape = o.t.sizes().vec();
        if (o.t.numel() > 0) {
          ChunkInfo c;
          c.box = sharding::full_box(e.shape);
          c.file = path;
          c.name = key;
          c.memory = o.t;
          e.chunks.push_back(std::move(c));
        }
        break;
      case Py::Int: e.kind = "int"; e.value = o.i; break;
      case Py::Float: e.kind = "float"; e.value = o.f; break;
      case Py::Bool: e.kind = "bool"; e.value = o.b; break;
      case Py::Str: e.kind = "string"; e.value = o.s; break;
      case Py::Bytes: e.kind = "bytes"; e.value = state::Bytes{o.s}; break;
      default: return concat("key '", key, "' holds a ", pickle::kind_text(o), ", which a checkpoint cannot hold");
    }
    if (m.entries.count(key)) return concat("key '", key, "' appears twice");
    m.keys.push_back(key);
    m.entries.emplace(key, std::move(e));
    return "";
  });
  TESSERA_CHECK(why.empty(), "'", path, "': ", why);
}

// Pickle writing helpers.
void put_str(std::string& p, const std::string& s) {
  p.push_back('X');
  const uint32_t n = static_cast<uint32_t>(s.size());
  for (int k = 0; k < 4; ++k) p.push_back(static_cast<char>((n >> (8 * k)) & 0xff));
  p += s;
}
void put_int(std::string& p, int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) {
    p.push_back('J');
    const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(v));
    for (int k = 0; k < 4; ++k) p.push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  } else {
    p.push_back(static_cast<char>(0x8a));
    p.push_back(8);
    const uint64_t u = static_cast<uint64_t>(v);
    for (int k = 0; k < 8; ++k) p.push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  }
}
void put_ints(std::string& p, const std::vector<int64_t>& v) {
  if (v.empty()) {
    p.push_back(')');
    return;
  }
  p.push_back('(');
  for (auto x : v) put_int(p, x);
  p.push_back('t');
}

}  // namespace

CheckpointMetadata import_torch_file(const std::string& path) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const std::exception& e) {
    throw Error(concat("'", path, "' is not a readable torch.save archive: ", e.what()));
  }
  TESSERA_CHECK(zip->hasRecord("data.pkl"), "'", path, "' is not a torch.save file (no data.pkl; a TorchScript "
                "archive written by torch::save / torch.jit.save is not a dict of tensors)");
  PyPtr root;
  try {
    root = pickle::read_torch_archive(*zip, concat("'", path, "'"));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(concat("'", path, "': cannot read: ", e.what()));
  }
  TESSERA_CHECK(root->kind == Py::Dict, "'", path, "' does not hold a dict (a state_dict) at the top level");
  CheckpointMetadata m;
  m.source_kind = kSourceTorch;
  m.location = path;
  flatten_obj(path, root, m);
  return m;
}

bool is_tessera_torch_export(const std::string& path) {
  if (!is_regular_file(path)) return false;
  try {
    File f(path, "r");
    const ZipIndex zip(f, concat("'", path, "'"));
    // torch.save names every record "<archive>/<name>"; the archive folder is the writer's choice.
    for (const auto& [name, r] : zip.records()) {
      const size_t slash = name.find('/');
      if (slash == std::string::npos || name.compare(slash + 1, std::string::npos, kTorchExportRecord) != 0) continue;
      return zip.read(name, 64) == kTorchExportMarker;
    }
  } catch (const ResourceError&) {
    throw;  // out of descriptors: not an answer about the file
  } catch (const Error&) {
  }
  return false;
}

TorchExportWriter::TorchExportWriter(const std::string& path) {
  try {
    zip_ = std::make_unique<caffe2::serialize::PyTorchStreamWriter>(path);
  } catch (const std::exception& e) {
    throw Error(concat("cannot create '", path, "': ", e.what()));
  }
}

TorchExportWriter::~TorchExportWriter() = default;

void TorchExportWriter::add(const std::string& name, const at::Tensor& t) {
  TESSERA_CHECK(!finished_, "export: add after finish");
  at::Tensor c = t.cpu().contiguous();
  bool known = false;
  for (auto& [n, s] : pickle::torch_storage_classes()) known |= s == c.scalar_type();
  TESSERA_CHECK(known, "export: key '", name, "' has dtype ", c.scalar_type(), " which torch export does not support");
  const std::string rec = "data/" + std::to_string(items_.size());
  zip_->writeRecord(rec, c.data_ptr(), c.numel() * c.element_size());
  items_.push_back({name, c.scalar_type(), c.sizes().vec()});
}

void TorchExportWriter::finish() {
  TESSERA_CHECK(!finished_, "export: finish called twice");
  std::string p = "\x80\x02}(";
  for (size_t i = 0; i < items_.size(); ++i) {
    const Item& it = items_[i];
    put_str(p, it.name);
    p += "ctorch._utils\n_rebuild_tensor_v2\n(";
    p += "(";
    put_str(p, "storage");
    for (auto& [n, s] : pickle::torch_storage_classes())
      if (s == it.dtype) p += std::string("ctorch\n") + n + "\n";
    put_str(p, std::to_string(i));
    put_str(p, "cpu");
    int64_t numel = 1;
    for (auto d : it.shape) numel *= d;
    put_int(p, numel);
    p += "tQ";
    put_int(p, 0);
    put_ints(p, it.shape);
    std::vector<int64_t> strides(it.shape.size(), 1);
    for (size_t d = it.shape.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(it.shape[d], 1);
    put_ints(p, strides);
    p += "\x89";
    p += "ccollections\nOrderedDict\n)R";
    p += "tR";
  }
  p += "u.";
  zip_->writeRecord("data.pkl", p.data(), p.size());
  zip_->writeRecord("byteorder", "little", 6);
  zip_->writeRecord(kTorchExportRecord, kTorchExportMarker, std::strlen(kTorchExportMarker));
  zip_->writeEndOfFile();
  zip_.reset();
  finished_ = true;
}

std::string pickle_file_reason(const std::string& path) {
  // A pickle starts with PROTO (0x80) and its protocol (2 for torch.save's legacy format);
  // read as a safetensors header length, those bytes and the next six give a number far
  // beyond the file, which no safetensors file has.
  File f(path, "r");
  const uint64_t size = f.size();
  if (size < 8) return "";
  unsigned char b[8];
  f.pread_exact(0, b, 8);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | b[k];
  if (b[0] != 0x80 || b[1] < 2 || b[1] > 5 || n <= size - 8) return "";
  return concat("'", path, "' is a Python pickle, not a zip archive or a safetensors file: the legacy (non-zip) ",
                "torch.save format is not supported; re-save it with torch.save(obj, path, ",
                "_use_new_zipfile_serialization=True) (the default since torch 1.6)");
}

}  // namespace tessera::checkpoint
