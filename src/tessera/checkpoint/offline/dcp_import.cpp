// tessera ckpt import-dcp: a PyTorch Distributed Checkpoint directory (torch 2.x,
// FileSystemWriter) as a Tessera sharded checkpoint. Format notes, from torch 2.x's
// torch/distributed/checkpoint (metadata.py, filesystem.py, default_planner.py):
//  - DIR/.metadata: pickle.dump(Metadata) (protocol 4): state_dict_metadata {fqn:
//    TensorStorageMetadata(properties=TensorProperties (pickled as a tuple: dtype,
//    layout, requires_grad, memory-format enum, pin_memory[, strides]), size=torch.Size,
//    chunks=[ChunkStorageMetadata(offsets, sizes)]) | BytesStorageMetadata()},
//    storage_data {MetadataIndex(fqn, offset, index): _StorageInfo(relative_path,
//    offset, length[, transform_descriptors])}, planner_data, storage_meta, version.
//  - DIR/__<rank>_<i>.distcp: written by rank <rank> (thread <i>); each item at
//    [offset, offset + length) is, with the default serialization (torch_save) and no
//    stream transforms (the default), the torch.save archive (zip, pickle protocol 2) of
//    one tensor chunk or of one non-tensor value.
#include "tessera/checkpoint/offline/dcp_import.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/interop/pickle_reader.h"
#include "tessera/checkpoint/offline/offline_publish.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace {

using pickle::ForbiddenGlobal;
using pickle::kind_text;
using pickle::make;
using pickle::Py;
using pickle::PyPtr;

const std::vector<std::pair<const char*, at::ScalarType>>& dtypes() {
  static const std::vector<std::pair<const char*, at::ScalarType>> t = {
      {"torch.float32", at::kFloat}, {"torch.float64", at::kDouble}, {"torch.float16", at::kHalf},
      {"torch.bfloat16", at::kBFloat16}, {"torch.int64", at::kLong}, {"torch.int32", at::kInt},
      {"torch.int16", at::kShort}, {"torch.int8", at::kChar}, {"torch.uint8", at::kByte}, {"torch.bool", at::kBool}};
  return t;
}

// What .metadata may name: DCP's metadata classes and what they hold.
const std::set<std::string>& metadata_globals() {
  static const std::set<std::string> g = [] {
    std::set<std::string> s;
    for (const char* n : {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                          "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"})
      s.insert(std::string("torch.distributed.checkpoint.metadata.") + n);
    s.insert("torch.distributed.checkpoint.filesystem._StorageInfo");
    s.insert("torch.Size");
    for (const auto& [n, t] : dtypes()) s.insert(n);
    // dtypes Tessera cannot hold: named, so the error says which tensor has one
    for (const char* n : {"torch.complex64", "torch.complex128", "torch.uint16", "torch.uint32", "torch.uint64",
                          "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz"})
      s.insert(n);
    for (const char* n : {"torch.strided", "torch.sparse_coo", "torch.contiguous_format", "torch.channels_last",
                          "torch.preserve_format"})
      s.insert(n);
    // StorageMeta.checkpoint_id: the path the writer was given (recorded, never used)
    for (const char* n : {"pathlib.PosixPath", "pathlib.PurePosixPath", "pathlib._local.PosixPath",
                          "pathlib._local.PurePosixPath"})
      s.insert(n);
    for (const char* n : {"collections.OrderedDict", "builtins.set", "builtins.frozenset"}) s.insert(n);
    // How torch and Python 3.11 pickle a layout (_get_layout("torch.strided")) and an enum
    // member (getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")): both are read
    // as names of constants, and only with those arguments (see pickle_reader.h).
    s.insert("torch.serialization._get_layout");
    s.insert("builtins.getattr");
    return s;
  }();
  return g;
}

// ------------------------------------------------------------ reading DCP's objects

// The BUILD state of an object of class `cls` (a dict of attributes).
const Py& attrs(const PyPtr& o, const std::string& cls, const std::string& where) {
  TESSERA_CHECK(o && o->kind == Py::Object && o->s == cls, where, ": expected a ", cls, ", found a ",
                o ? (o->kind == Py::Object ? o->s : std::string(kind_text(*o))) : "nothing");
  TESSERA_CHECK(o->state && o->state->kind == Py::Dict, where, ": ", cls, " without its attributes");
  return *o->state;
}

PyPtr attr(const Py& d, const std::string& name, const std::string& where, bool required = true) {
  for (const auto& [k, v] : d.dict)
    if (k->kind == Py::Str && k->s == name) return v;
  TESSERA_CHECK(!required, where, ": attribute '", name, "' is missing");
  return nullptr;
}

std::vector<int64_t> int_list(const PyPtr& o, const std::string& where) {
  TESSERA_CHECK(o && (o->kind == Py::Tuple || o->kind == Py::List), where, ": expected a tuple of integers");
  std::vector<int64_t> v;
  for (const auto& x : o->items) {
    TESSERA_CHECK(x->kind == Py::Int, where, ": expected a tuple of integers");
    v.push_back(x->i);
  }
  return v;
}

int64_t int_value(const PyPtr& o, const std::string& where) {
  TESSERA_CHECK(o && o->kind == Py::Int, where, ": expected an integer");
  return o->i;
}

const std::string kMeta = "torch.distributed.checkpoint.metadata.";

// Where one item of the checkpoint lies.
struct ItemLoc {
  std::string file;  // relative to the DCP directory
  uint64_t offset = 0, length = 0;
  int writer = 0;    // the rank that wrote the file
};

// "__<rank>_<i>.distcp" -> rank; -1 for any other name.
int writer_of(const std::string& name) {
  const std::string suffix = ".distcp";
  if (name.size() <= 2 + suffix.size() || name.compare(0, 2, "__") != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string mid = name.substr(2, name.size() - 2 - suffix.size());
  const size_t us = mid.find('_');
  if (us == std::string::npos || us == 0 || us > 7 || us + 1 == mid.size()) return -1;
  for (size_t k = 0; k < mid.size(); ++k)
    if (k != us && (mid[k] < '0' || mid[k] > '9')) return -1;
  return std::stoi(mid.substr(0, us));
}

// Reads a range of a file as a zip archive, for PyTorchStreamReader.
class RangeAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  RangeAdapter(const File& f, uint64_t offset, uint64_t length) : f_(f), offset_(offset), length_(length) {}
  size_t size() const override { return length_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* = "") const override {
    if (pos >= length_) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, length_ - pos));
    f_.pread_exact(offset_ + pos, buf, n);
    return n;
  }

 private:
  const File& f_;
  uint64_t offset_, length_;
};

// The path of the DCP file `name` (".metadata" or a data file) in `dir`, once it is known
// to be a regular file that lies in `dir`: a symbolic link is followed only when its
// target is inside the DCP directory; a link that leads out of it (a checkpoint that reads
// other files of this machine), a FIFO (which would block the open), a device or a
// directory is refused, naming it.
std::string dcp_file(const std::string& dir, const std::string& name, const char* what) {
  const std::string path = join_path(dir, name);
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    char target[PATH_MAX + 1] = {0};
    const ssize_t n = ::readlink(path.c_str(), target, PATH_MAX);
    const std::string to = n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string("?");
    char* rd = ::realpath(dir.c_str(), nullptr);
    char* rp = ::realpath(path.c_str(), nullptr);
    const std::string real_dir = rd ? rd : "", real = rp ? rp : "";
    ::free(rd);
    ::free(rp);
    TESSERA_CHECK(!real.empty(), what, " '", path, "' is a symbolic link to '", to, "', which does not exist");
    TESSERA_CHECK(!real_dir.empty() && real.size() > real_dir.size() + 1 &&
                      real.compare(0, real_dir.size() + 1, real_dir + "/") == 0,
                  what, " '", path, "' is a symbolic link to '", to, "' (", real,
                  "), outside the DCP directory: refusing to follow it (copy the file into the directory)");
  }
  const std::string why = not_regular_file_reason(path);
  TESSERA_CHECK(why.empty(), what, " '", path, "' ", why);
  return path;
}

class ItemReader {
 public:
  explicit ItemReader(std::string dir) : dir_(std::move(dir)) {}

  // The object torch.save wrote as item `key` (`what` describes it in errors).
  PyPtr read(const ItemLoc& loc, const std::string& key) {
    const std::string path = join_path(dir_, loc.file);
    const File& f = file(loc.file);
    const uint64_t size = f.size();
    TESSERA_CHECK(loc.offset <= size && loc.length <= size - loc.offset, "'", path, "' is truncated: it has ", size,
                  " bytes, and the item of '", key, "' lies at bytes [", loc.offset, ", ", loc.offset + loc.length, ")");
    const std::string where = concat("'", path, "' (item of '", key, "' at byte ", loc.offset, ")");
    try {
      caffe2::serialize::PyTorchStreamReader zip(std::make_shared<RangeAdapter>(f, loc.offset, loc.length));
      return pickle::read_torch_archive(zip, where);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(concat(where, " is not a torch.save archive (DCP's default torch_save serialization): ",
                         first_line(e.what())));
    }
  }

 private:
  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

  const File& file(const std::string& name) {
    auto it = files_.find(name);
    if (it == files_.end()) {
      const std::string path = dcp_file(dir_, name, "DCP data file");
      it = files_.emplace(name, std::make_unique<File>(path, "r")).first;
    }
    return *it->second;
  }

  std::string dir_;
  std::map<std::string, std::unique_ptr<File>> files_;
};

// A non-tensor value as Tessera plain values: None, bool, int, float, str and bytes as they
// are, lists, tuples and dicts flattened below `key` ("key.0", "key.name"), None skipped,
// empty containers as empty dicts. Returns "" or why the value is not plain.
std::string flatten_plain(const std::string& key, const Py& v, std::vector<std::pair<std::string, state::Value>>& out) {
  return pickle::flatten(
      v, key,
      [&](const std::string& k, const Py& x) -> std::string {
        switch (x.kind) {
          case Py::None: return "";
          case Py::Bool: out.emplace_back(k, x.b); return "";
          case Py::Int: out.emplace_back(k, x.i); return "";
          case Py::Float: out.emplace_back(k, x.f); return "";
          case Py::Str: out.emplace_back(k, x.s); return "";
          case Py::Bytes: out.emplace_back(k, state::Bytes{x.s}); return "";
          case Py::Object: return concat("a ", x.s, " object");
          default: return concat("a ", kind_text(x));
        }
      },
      [&](const std::string& k) { out.emplace_back(k, std::make_shared<state::StateDict>()); });
}

struct TensorPlan {
  std::string fqn;
  EntryInfo entry;                                    // kind, dtype, shape
  std::vector<std::pair<sharding::Box, ItemLoc>> chunks;  // non-empty, as DCP wrote them
};

// One import, in the order of its phases: read .metadata (where every item lies, then what
// each key holds), check the data files it uses and number the output's, write the
// checkpoint. Errors name .metadata, the key, or the data file and the chunk.
class DcpImport {
 public:
  DcpImport(const std::string& dir, const DcpImportOptions& options)
      : dir_(dir), mw_("'" + join_path(dir, ".metadata") + "'"), options_(options), items_(dir) {}

  DcpImportResult run(const std::string& out, bool force) {
    const PyPtr root = read_metadata();
    const Py& md = attrs(root, kMeta + "Metadata", mw_);
    read_storage_data(md);
    read_state_dict_metadata(md);
    check_data_files();
    number_output_files();
    write(out, force);
    return std::move(res_);
  }

 private:
  PyPtr read_metadata() {
    TESSERA_CHECK(is_directory(dir_), "'", dir_, "' is not a directory (a DCP checkpoint is one)");
    const std::string meta_path = join_path(dir_, ".metadata");
    struct stat st;
    TESSERA_CHECK(::lstat(meta_path.c_str(), &st) == 0, "'", dir_, "' is not a DCP checkpoint: it has no .metadata");
    dcp_file(dir_, ".metadata", "DCP metadata");
    // 256 MiB: the unpickler may use up to 128 bytes per byte of it (pickle_reader.h)
    const std::string text = read_small_file(meta_path, 256ull << 20);
    return pickle::unpickle(mw_, text, metadata_globals());
  }

  // storage_data: (fqn, chunk offsets) -> where the item lies.
  void read_storage_data(const Py& md) {
    const PyPtr storage = attr(md, "storage_data", mw_);
    TESSERA_CHECK(storage->kind == Py::Dict, mw_, ": storage_data is a ", kind_text(*storage), ", not a dict");
    for (const auto& [k, v] : storage->dict) {
      const Py& idx = attrs(k, kMeta + "MetadataIndex", mw_ + " storage_data key");
      const PyPtr fqn = attr(idx, "fqn", mw_);
      TESSERA_CHECK(fqn->kind == Py::Str, mw_, ": a MetadataIndex fqn is a ", kind_text(*fqn));
      const std::string where = concat(mw_, " storage_data['", fqn->s, "']");
      const PyPtr off = attr(idx, "offset", where, false);
      std::vector<int64_t> offsets;
      if (off && off->kind != Py::None) offsets = int_list(off, where);
      const Py& info = attrs(v, "torch.distributed.checkpoint.filesystem._StorageInfo", where);
      const PyPtr rel = attr(info, "relative_path", where);
      TESSERA_CHECK(rel->kind == Py::Str, where, ": relative_path is a ", kind_text(*rel));
      const PyPtr transforms = attr(info, "transform_descriptors", where, false);
      TESSERA_CHECK(!transforms || transforms->kind == Py::None ||
                        ((transforms->kind == Py::List || transforms->kind == Py::Tuple) && transforms->items.empty()),
                    where, ": stored through stream transforms (transform_descriptors), which this importer does not "
                           "decode; save without storage extensions");
      ItemLoc loc;
      loc.file = rel->s;
      check_plain_name(loc.file, where);
      loc.writer = writer_of(loc.file);
      TESSERA_CHECK(loc.writer >= 0 && loc.writer < (1 << 20), where, ": data file '", loc.file,
                    "' is not named __<rank>_<n>.distcp as FileSystemWriter names them");
      const int64_t o = int_value(attr(info, "offset", where), where), n = int_value(attr(info, "length", where), where);
      TESSERA_CHECK(o >= 0 && n >= 0, where, ": negative offset or length");
      loc.offset = static_cast<uint64_t>(o);
      loc.length = static_cast<uint64_t>(n);
      TESSERA_CHECK(locs_.emplace(std::make_pair(fqn->s, offsets), loc).second, where, ": listed twice");
    }
  }

  // state_dict_metadata: tensors (their chunks) and non-tensor values, in DCP's order.
  void read_state_dict_metadata(const Py& md) {
    const PyPtr sdm = attr(md, "state_dict_metadata", mw_);
    TESSERA_CHECK(sdm->kind == Py::Dict, mw_, ": state_dict_metadata is a ", kind_text(*sdm), ", not a dict");
    o_.crc_block = kCrcBlock;
    for (const auto& [k, v] : sdm->dict) {
      TESSERA_CHECK(k->kind == Py::Str, mw_, ": a state_dict_metadata key is a ", kind_text(*k));
      const std::string& fqn = k->s;
      TESSERA_CHECK(!fqn.empty(), mw_, ": an empty key");
      if (v->kind == Py::Object && v->s == kMeta + "BytesStorageMetadata") add_value(fqn);
      else add_tensor(fqn, v);
    }
  }

  void add_key(const std::string& key, EntryInfo e) {
    TESSERA_CHECK(o_.entries.emplace(key, std::move(e)).second, mw_, ": key '", key,
                  "' appears twice (a value flattened onto another key)");
    o_.keys.push_back(key);
  }

  // A non-tensor value: read now (it is small) and kept as plain values, or skipped with
  // --skip-non-tensors when it is not plain.
  void add_value(const std::string& fqn) {
    const std::string where = concat(mw_, " key '", fqn, "'");
    auto it = locs_.find({fqn, {}});
    TESSERA_CHECK(it != locs_.end(), where, ": no storage_data entry for this value");
    used_.emplace(it->second.file, it->second.writer);
    PyPtr value;
    std::vector<std::pair<std::string, state::Value>> flat;
    std::string why;
    try {
      value = items_.read(it->second, fqn);
      why = flatten_plain(fqn, *value, flat);
    } catch (const ForbiddenGlobal& e) {
      why = e.what();
    }
    if (!why.empty()) {
      TESSERA_CHECK(options_.skip_non_tensors, "'", join_path(dir_, it->second.file), "': the value of '", fqn,
                    "' is not a plain Python value (", why,
                    "); pass --skip-non-tensors to import the checkpoint without it");
      res_.skipped.emplace_back(fqn, why);
      return;
    }
    for (auto& [key, val] : flat) {
      EntryInfo e;
      e.kind = state::kind_name(val);
      e.value = std::move(val);
      add_key(key, std::move(e));
      ++res_.values;
    }
  }

  // A tensor: its dtype and shape, and its chunks, which must tile it; read at write time.
  void add_tensor(const std::string& fqn, const PyPtr& v) {
    const std::string where = concat(mw_, " key '", fqn, "'");
    const Py& tsm = attrs(v, kMeta + "TensorStorageMetadata", where);
    TensorPlan p;
    p.fqn = fqn;
    p.entry.shape = int_list(attr(tsm, "size", where), where);
    for (int64_t d : p.entry.shape) TESSERA_CHECK(d >= 0, where, ": negative size");
    // TensorProperties, pickled as (dtype, layout, requires_grad, memory format, pin_memory[, strides]).
    const PyPtr props = attr(tsm, "properties", where);
    TESSERA_CHECK(props->kind == Py::Object && props->s == kMeta + "TensorProperties" && props->state &&
                      props->state->kind == Py::Tuple && props->state->items.size() >= 2,
                  where, ": unreadable TensorProperties");
    const PyPtr dt = props->state->items[0], layout = props->state->items[1];
    TESSERA_CHECK(dt->kind == Py::Global, where, ": the dtype is a ", kind_text(*dt));
    TESSERA_CHECK(layout->kind == Py::Global && layout->s == "torch.strided", where, ": layout ",
                  layout->kind == Py::Global ? layout->s : kind_text(*layout), " (only strided tensors are imported)");
    bool known = false;
    for (const auto& [n, t] : dtypes())
      if (dt->s == n) p.entry.dtype = t, known = true;
    TESSERA_CHECK(known, where, ": dtype ", dt->s, " has no Tessera (safetensors) counterpart");
    const PyPtr chunks = attr(tsm, "chunks", where);
    TESSERA_CHECK(chunks->kind == Py::List || chunks->kind == Py::Tuple, where, ": chunks is a ", kind_text(*chunks));
    EntryInfo tiling = p.entry;
    for (const auto& c : chunks->items) {
      const Py& cm = attrs(c, kMeta + "ChunkStorageMetadata", where);
      sharding::Box box{int_list(attr(cm, "offsets", where), where), int_list(attr(cm, "sizes", where), where)};
      TESSERA_CHECK(box.offsets.size() == p.entry.shape.size() && box.sizes.size() == p.entry.shape.size(), where,
                    ": chunk ", box.to_string(), " does not have the tensor's ", p.entry.shape.size(), " dimensions");
      for (size_t d = 0; d < box.sizes.size(); ++d)
        TESSERA_CHECK(box.offsets[d] >= 0 && box.sizes[d] >= 0 && box.offsets[d] <= p.entry.shape[d] &&
                          box.sizes[d] <= p.entry.shape[d] - box.offsets[d],
                      where, ": chunk ", box.to_string(), " lies outside the shape");
      if (box.empty()) continue;
      auto it = locs_.find({fqn, box.offsets});
      TESSERA_CHECK(it != locs_.end(), where, ": no storage_data entry for chunk ", box.to_string());
      ChunkInfo ci;
      ci.box = box;
      tiling.chunks.push_back(ci);
      p.chunks.emplace_back(box, it->second);
      used_.emplace(it->second.file, it->second.writer);
    }
    try {
      check_tiling(fqn, tiling);
    } catch (const Error& e) {
      throw Error(concat(mw_, ": ", e.what()));
    }
    p.entry.kind = p.chunks.size() == 1 && p.chunks[0].first == sharding::full_box(p.entry.shape) ? kTensorKind : kShardedKind;
    add_key(fqn, p.entry);
    ++res_.tensors;
    tensors_.push_back(std::move(p));
  }

  // Every file .metadata uses must be there (all missing ones named at once) and be a
  // plain file of the directory.
  void check_data_files() {
    std::vector<std::string> missing;
    for (const auto& [file, w] : used_) {
      struct stat fst;
      if (::lstat(join_path(dir_, file).c_str(), &fst) != 0) missing.push_back(file);
    }
    if (!missing.empty()) {
      std::string names;
      for (size_t k = 0; k < missing.size() && k < 10; ++k) names += concat(k ? ", " : "", "'", missing[k], "'");
      if (missing.size() > 10) names += concat(" and ", missing.size() - 10, " more");
      throw Error(concat(mw_, " places data in ", missing.size(), " file(s) that do not exist in '", dir_, "': ", names));
    }
    for (const auto& [file, w] : used_) dcp_file(dir_, file, "DCP data file");
  }

  // The output has one data file per rank that wrote a file the metadata uses, in rank
  // order (a gap in the ranks, a writer left with nothing after DCP's deduplication,
  // leaves no empty file behind), so that the number of files written is bounded by what
  // the metadata uses, never by a file name. .distcp files the metadata does not use are
  // left alone and reported.
  void number_output_files() {
    for (const auto& [file, w] : used_) out_rank_.emplace(w, 0);
    int world_size = 0;
    for (auto& [w, r] : out_rank_) r = world_size++;
    world_size = std::max(world_size, 1);
    res_.world_size = world_size;
    o_.world_size = world_size;
    o_.save_id = new_save_id();
    for (const auto& name : list_dir(dir_)) {
      const std::string suffix = ".distcp";
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
          !used_.count(name))
        res_.ignored.push_back(name);
    }
    std::sort(res_.ignored.begin(), res_.ignored.end());
  }

  // Each output data file holds its DCP writer's chunks, read one at a time as it is
  // written; published through a temporary sibling.
  void write(const std::string& out, bool force) {
    CheckpointMetadata src;
    src.location = dir_;
    offline_check_not_source(dir_, src, out);
    if (check_output_path(out, force, OutputKind::Directory, "import-dcp")) check_replaceable(out);
    offline_publish(out, true, [&](const std::string& tmp) {
      for (int r = 0; r < o_.world_size; ++r) {
        DataFileResult d = write_data_file(tmp, data_file_name(r), pieces_of(r), data_file_identity(r, o_.save_id));
        for (auto& [fqn, c] : d.chunks) o_.entries.at(fqn).chunks.push_back(std::move(c));
      }
      layouts_from_chunks(o_);
      write_metadata_file(tmp, o_);
    });
  }

  // The pieces of output file `r`: every chunk its DCP writer wrote, each read (and checked
  // against the metadata) when the writer asks for its bytes.
  std::vector<Piece> pieces_of(int r) {
    std::vector<Piece> pieces;
    for (const auto& p : tensors_) {
      for (const auto& [box, loc] : p.chunks) {
        if (out_rank_.at(loc.writer) != r) continue;
        const TensorPlan* plan = &p;
        const sharding::Box b = box;
        const ItemLoc l = loc;
        pieces.push_back({p.fqn, p.entry.dtype, box, [this, plan, b, l] {
                            const PyPtr v = items_.read(l, plan->fqn);
                            const std::string where = concat("'", join_path(dir_, l.file), "' (chunk ", b.to_string(),
                                                             " of '", plan->fqn, "')");
                            TESSERA_CHECK(v->kind == Py::Tensor, where, ": holds a ", kind_text(*v), ", not a tensor");
                            TESSERA_CHECK(v->t.scalar_type() == plan->entry.dtype, where, ": dtype ",
                                          v->t.scalar_type(), ", the metadata says ", plan->entry.dtype);
                            TESSERA_CHECK(v->t.sizes().vec() == b.sizes, where, ": shape ", v->t.sizes(),
                                          ", the metadata says ", b.to_string());
                            return v->t.contiguous();
                          }});
        ++res_.chunks;
        res_.bytes += byte_size(box.sizes, p.entry.dtype, p.fqn);
      }
    }
    return pieces;
  }

  const std::string dir_, mw_;  // mw_: "'DIR/.metadata'" for messages
  const DcpImportOptions& options_;
  ItemReader items_;
  std::map<std::pair<std::string, std::vector<int64_t>>, ItemLoc> locs_;  // storage_data
  // The data files the import reads: those .metadata places a value or a non-empty chunk
  // in (never what the directory's file names suggest), and the ranks that wrote them.
  std::map<std::string, int> used_;  // file -> writer rank
  std::map<int, int> out_rank_;      // DCP writer rank -> output data file
  std::vector<TensorPlan> tensors_;
  CheckpointMetadata o_;             // the output's metadata
  DcpImportResult res_;
};

}  // namespace

DcpImportResult import_dcp(const std::string& dir, const std::string& out, bool force,
                           const DcpImportOptions& options) {
  return DcpImport(dir, options).run(out, force);
}

}  // namespace tessera::checkpoint
