#include "tessera/checkpoint/reader.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <algorithm>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/interop/hf_dir.h"
#include "tessera/checkpoint/interop/torch_file.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

namespace {

// tessera.world_size of a consolidated file: decimal digits only, in [1, kMaxWorldSize].
int parse_world_size(const std::string& s, const std::string& path) {
  bool ok = !s.empty() && s.size() <= 8;
  int64_t v = 0;
  for (char c : s) {
    ok = ok && c >= '0' && c <= '9';
    if (ok) v = v * 10 + (c - '0');
  }
  TESSERA_CHECK(ok && v >= 1 && v <= kMaxWorldSize, "'", path, "': __metadata__ tessera.world_size '", s,
                "' is not a world size in [1, ", kMaxWorldSize, "]");
  return static_cast<int>(v);
}

CheckpointMetadata from_safetensors(const std::string& path) {
  SafetensorsReader r(path);
  CheckpointMetadata m;
  const std::string fmt = r.meta("tessera.format");
  m.source_kind = fmt == "tessera-consolidated" ? kSourceConsolidated : kSourceSafetensors;
  m.location = path;
  m.crc_block = r.crc_block();
  nlohmann::json kinds = nlohmann::json::object(), values = nlohmann::json::object(), keys = nlohmann::json::array();
  try {
    const std::string what = concat("'", path, "': __metadata__ ");
    if (!r.meta("tessera.kinds").empty()) kinds = parse_json_strict(r.meta("tessera.kinds"), what + "tessera.kinds");
    if (!r.meta("tessera.values").empty()) values = parse_json_strict(r.meta("tessera.values"), what + "tessera.values");
    if (!r.meta("tessera.keys").empty()) keys = parse_json_strict(r.meta("tessera.keys"), what + "tessera.keys");
    if (!r.meta("tessera.world_size").empty()) m.world_size = parse_world_size(r.meta("tessera.world_size"), path);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(concat("'", path, "': malformed Tessera __metadata__: ", e.what()));
  }
  TESSERA_CHECK(kinds.is_object() && values.is_object() && keys.is_array(), "'", path,
                "': malformed Tessera __metadata__ (kinds/values/keys)");
  for (const auto& t : r.entries()) {
    EntryInfo e;
    e.kind = kinds.contains(t.name) && kinds[t.name].is_string() ? kinds[t.name].get<std::string>() : std::string(kTensorKind);
    TESSERA_CHECK(e.kind == kTensorKind || e.kind == kShardedKind, "'", path, "' key '", t.name, "': bad kind '", e.kind, "'");
    e.dtype = t.dtype;
    e.shape = t.shape;
    if (t.nbytes() > 0) {
      ChunkInfo c;
      c.box = sharding::full_box(t.shape);
      c.file = path;
      c.name = t.name;
      c.begin = t.begin;
      c.end = t.end;
      if (const auto* crcs = r.crcs(t.name)) c.crcs = *crcs;
      e.chunks.push_back(std::move(c));
    }
    m.entries.emplace(t.name, std::move(e));
  }
  for (auto it = values.begin(); it != values.end(); ++it) {
    TESSERA_CHECK(!m.entries.count(it.key()), "'", path, "': key '", it.key(), "' is both a tensor and a value");
    EntryInfo e;
    e.value = decode_value(it.value().dump(), concat("'", path, "' key '", it.key(), "'"));
    e.kind = state::kind_name(e.value);
    m.entries.emplace(it.key(), std::move(e));
  }
  for (const auto& k : keys)
    if (k.is_string() && m.entries.count(k.get<std::string>())) m.keys.push_back(k.get<std::string>());
  if (m.keys.size() != m.entries.size()) {  // foreign file or keys incomplete: header (offset) order
    m.keys.clear();
    for (const auto& t : r.entries()) m.keys.push_back(t.name);
    for (auto it = values.begin(); it != values.end(); ++it) m.keys.push_back(it.key());
  }
  return m;
}

bool looks_like_zip(const std::string& path) {
  File f = open_for_reading(path);
  if (f.size() < 4) return false;
  char b[4];
  f.pread_exact(0, b, 4);
  return b[0] == 'P' && b[1] == 'K' && b[2] == 3 && b[3] == 4;
}

}  // namespace

// What a directory without the metadata holds decides the message (reader.h).
std::string not_a_checkpoint_reason(const std::string& path) {
  if (is_regular_file(path)) return pickle_file_reason(path);
  if (!is_directory(path) || path_exists(join_path(path, kMetadataFile))) return "";
  if (is_hf_directory(path)) return "";
  int64_t safetensors = 0;
  bool dcp = false;
  int64_t xla = 0;  // torch_xla FSDP rank files (NAME_rank-XXXXXXXX-of-YYYYYYYY.pth)
  std::string first;
  for (const auto& n : list_dir(path)) {
    if (n.compare(0, 9, "data-rank") == 0 && core::ends_with(n, ".safetensors")) return "";  // Tessera's, metadata lost
    dcp |= n == ".metadata";
    if (core::ends_with(n, ".pth") && n.find("_rank-") != std::string::npos && n.find("-of-") != std::string::npos) ++xla;
    if (core::ends_with(n, ".safetensors")) {
      ++safetensors;
      if (first.empty() || n < first) first = n;
    }
  }
  std::string what, hint;
  if (safetensors > 0 && !dcp) {
    what = concat("a directory of ", safetensors, " safetensors file(s) (not a Hugging Face model directory: ",
                  "no ", kHfIndexFile, " or ", kHfSingleFile, ")");
    if (!first.empty()) hint = concat("; verify its files one by one: tessera ckpt verify ", join_path(path, first));
  } else if (xla > 0 && !dcp) {
    what = concat("a torch_xla FSDP checkpoint (", xla, " rank file(s))");
    hint = concat("; import it first: tessera ckpt import-xla ", path, " -o OUT");
  } else if (dcp) {
    what = "a PyTorch Distributed Checkpoint (.metadata)";
    hint = concat("; import it first: tessera ckpt import-dcp ", path, " -o OUT");
  } else {
    what = "a directory";
  }
  return concat("'", path, "' is not a Tessera checkpoint: it is ", what, " without ", kMetadataFile, hint);
}

CheckpointMetadata open_checkpoint(const std::string& path) {
  // A name no line-based tool can pass on safely is refused (docs/checkpoint-format.md §4).
  return open_checkpoint(CheckedPath::check(path));
}

CheckpointMetadata open_checkpoint(const CheckedPath& checked) {
  const std::string& path = checked;
  std::string p = path;
  if (!path_exists(p)) {
    const std::string aside = aside_sibling(p);
    TESSERA_CHECK(!aside.empty(), "checkpoint '", path, "' does not exist");
    p = aside;
  }
  if (is_directory(p)) {
    // A Hugging Face model directory (no Tessera metadata; an index or model.safetensors).
    if (is_hf_directory(p)) return open_hf_directory(p);
    const std::string mf = join_path(p, kMetadataFile);
    const std::string why_mf = not_regular_file_reason(mf);
    if (why_mf == "does not exist") {
      const std::string foreign = not_a_checkpoint_reason(p);
      TESSERA_CHECK(foreign.empty(), foreign);
    }
    TESSERA_CHECK(why_mf.empty(), "'", path, "' is not a Tessera checkpoint: '", kMetadataFile, "' ",
                  why_mf == "does not exist" ? "is missing" : why_mf + ": '" + mf + "'",
                  " (incomplete or foreign directory)");
    std::string text;
    {
      File f = open_for_reading(mf);  // a ResourceError when out of descriptors
      const uint64_t n = f.size();
      TESSERA_CHECK(n <= kMaxMetadataBytes, "'", mf, "' is ", n, " bytes, more than the limit of ", kMaxMetadataBytes);
      text.resize(n);
      f.pread_exact(0, text.data(), n);
    }
    CheckpointMetadata m = parse_metadata(text, p);
    check_metadata_checksum(text, concat("'", mf, "'"));  // after parsing: structural errors keep their messages
    for (const auto& [name, size] : m.files) {
      const std::string fp = join_path(p, name);
      const std::string why = not_regular_file_reason(fp);
      TESSERA_CHECK(why.empty(), "checkpoint '", path, "': data file '", name, "' ",
                    why == "does not exist" ? "is missing" : why + ": '" + fp + "'");
      File f = open_for_reading(fp);
      TESSERA_CHECK(f.size() == size, "checkpoint '", path, "': data file '", name, "' is ", f.size(),
                    " bytes, the metadata says ", size, " (truncated or replaced)");
    }
    for (const auto& [k, e] : m.entries)
      for (const auto& c : e.chunks) {
        bool listed = false;
        for (const auto& f : m.files) listed |= f.first == c.file;
        TESSERA_CHECK(listed, "checkpoint '", path, "' key '", k, "': chunk file '", c.file, "' is not listed in files");
      }
    return m;
  }
  const std::string why = not_regular_file_reason(p);
  TESSERA_CHECK(why.empty(), "'", path, "' is neither a checkpoint directory nor a file: it ", why);
  if (looks_like_zip(p)) return import_torch_file(p);
  const std::string pickled = pickle_file_reason(p);
  TESSERA_CHECK(pickled.empty(), pickled);
  return from_safetensors(p);
}

bool is_tessera_checkpoint(const std::string& path) {
  if (is_directory(path)) return is_regular_file(join_path(path, kMetadataFile));
  if (!is_regular_file(path)) return false;
  try {
    SafetensorsReader r(path);
    return !r.meta("tessera.format").empty();
  } catch (const Error&) {
    return false;
  }
}

size_t ChunkReader::max_open_files() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 128;
  return static_cast<size_t>(std::clamp<uint64_t>(static_cast<uint64_t>(rl.rlim_cur) / 8, 2, 128));
}

ChunkReader::ChunkReader(const CheckpointMetadata& meta) : meta_(meta), max_open_(max_open_files()) {}

void ChunkReader::close_files(size_t keep) {
  while (open_.size() > keep) {
    auto it = readers_.find(open_.back());
    open_.pop_back();
    if (it == readers_.end()) continue;
    io_.forget(it->second->path());
    it->second->close_file();
  }
}

const SafetensorsReader& ChunkReader::reader(const std::string& file) {
  auto it = readers_.find(file);
  if (it != readers_.end() && it->second->file_open()) {
    auto pos = std::find(open_.begin(), open_.end(), file);
    if (pos != open_.end()) open_.splice(open_.begin(), open_, pos);
    return *it->second;
  }
  auto open = [&] {
    if (it != readers_.end()) {
      it->second->file();  // opens it again: the same file, or an error
      return;
    }
    const std::string p = meta_.source_kind == kSourceSharded || meta_.source_kind == kSourceHf ? join_path(meta_.location, file)
                                                                                   : meta_.location;
    auto r = std::make_unique<SafetensorsReader>(p);
    it = readers_.emplace(file, std::move(r)).first;
  };
  close_files(max_open_ - 1);
  try {
    open();
  } catch (const ResourceError&) {
    if (open_.empty()) throw;
    close_files(0);  // out of descriptors all the same: give back every one this reader holds, once
    open();
  }
  open_.push_front(file);
  return *it->second;
}

const SafetensorsReader& ChunkReader::data_file(int64_t rank) {
  const std::string name = data_file_name(static_cast<int>(rank));
  const SafetensorsReader& r = reader(name);
  if (identified_.count(rank)) return r;
  const std::string where = concat("checkpoint '", meta_.location, "': data file '", name, "'");
  TESSERA_CHECK(r.meta("tessera.format") == "tessera-data" && r.meta("tessera.version") == "2", where,
                " is not a data file of format version 2 (tessera.format '", r.meta("tessera.format"),
                "', tessera.version '", r.meta("tessera.version"), "')");
  TESSERA_CHECK(r.meta("tessera.save_id") == meta_.save_id, where, " belongs to another save (save id '",
                r.meta("tessera.save_id"), "', the metadata's is '", meta_.save_id, "'): replaced or mixed up");
  TESSERA_CHECK(r.meta("tessera.rank") == std::to_string(rank), where, " was written as rank '", r.meta("tessera.rank"),
                "': renamed or mixed up");
  TESSERA_CHECK(r.crc_block() == meta_.crc_block, where, " has checksum blocks of ", r.crc_block(),
                " bytes, the metadata says ", meta_.crc_block);
  check_contents(rank, r, where);
  identified_.insert(rank);
  return r;
}

void ChunkReader::check_contents(int64_t rank, const SafetensorsReader& r, const std::string& where) const {
  // The identity of each piece, where the writer recorded it (tessera.offsets: tensor name ->
  // the piece's offsets in its tensor): a piece stored under the right name in the wrong
  // file (two equal-shaped pieces swapped between files) is refused.
  std::map<std::string, std::vector<int64_t>> offsets;
  const bool has_offsets = !r.meta(kPieceOffsetsKey).empty();
  if (has_offsets) {
    const nlohmann::json j = parse_json_strict(r.meta(kPieceOffsetsKey), concat(where, ": ", kPieceOffsetsKey));
    TESSERA_CHECK(j.is_object(), where, ": ", kPieceOffsetsKey, " is not a JSON object");
    for (const auto& [name, v] : j.items()) {
      TESSERA_CHECK(v.is_array(), where, ": ", kPieceOffsetsKey, " of tensor '", name, "' is not an array");
      std::vector<int64_t> o;
      for (const auto& x : v) {
        TESSERA_CHECK(x.is_number_integer(), where, ": ", kPieceOffsetsKey, " of tensor '", name,
                      "' holds a value that is not an integer");
        o.push_back(x.get<int64_t>());
      }
      offsets.emplace(name, std::move(o));
    }
  }
  // Every piece the layouts place in this file is there (dtype, shape, place), and nothing else.
  size_t expected = 0;
  for (const auto& k : meta_.keys) {
    const EntryInfo& e = meta_.entries.at(k);
    if (!e.layout) continue;
    const sharding::Layout& L = *e.layout;
    for (int64_t i : L.pieces_in_file(rank)) {
      const sharding::Box box = L.box(e.shape, i);
      if (box.empty()) continue;
      ++expected;
      const std::string name = piece_name(k, L, e.shape, i);
      const TensorEntry* t = r.find(name);
      TESSERA_CHECK(t != nullptr, "'", r.path(), "' key '", k, "': piece ", i, " ", box.to_string(), " (tensor '",
                    name, "') is not in the data file (incomplete or mixed-up checkpoint)");
      TESSERA_CHECK(t->dtype == e.dtype && t->shape == box.sizes, "'", r.path(), "' key '", k, "': tensor '", name,
                    "' has dtype ", dtype_name(t->dtype), " and shape ", core::shape_string(t->shape),
                    ", the layout says ", dtype_name(e.dtype), " ", core::shape_string(box.sizes));
      if (!has_offsets) continue;
      auto o = offsets.find(name);
      TESSERA_CHECK(o != offsets.end(), "'", r.path(), "' key '", k, "': tensor '", name, "' has no entry in ",
                    kPieceOffsetsKey);
      TESSERA_CHECK(o->second == box.offsets, "'", r.path(), "' key '", k, "': tensor '", name,
                    "' holds the piece at offsets ", core::shape_string(o->second), ", the layout places the piece at ",
                    core::shape_string(box.offsets), " in this file (pieces swapped or mixed up)");
    }
  }
  if (r.entries().size() == expected && (!has_offsets || offsets.size() == expected)) return;
  // Something more than the layouts place here: name it.
  std::set<std::string> want;
  for (const auto& k : meta_.keys) {
    const EntryInfo& e = meta_.entries.at(k);
    if (!e.layout) continue;
    for (int64_t i : e.layout->pieces_in_file(rank))
      if (!e.layout->box(e.shape, i).empty()) want.insert(piece_name(k, *e.layout, e.shape, i));
  }
  for (const auto& t : r.entries())
    TESSERA_CHECK(want.count(t.name), "'", r.path(), "': tensor '", t.name,
                  "' is no piece of any layout in the metadata (a foreign or mixed-up data file)");
  for (const auto& [name, o] : offsets)
    TESSERA_CHECK(want.count(name), "'", r.path(), "': ", kPieceOffsetsKey, " names tensor '", name,
                  "', which is no piece of any layout in the metadata");
  throw Error(concat("'", r.path(), "': its tensors are not the pieces the metadata places there"));
}

void ChunkReader::check_structure(int part, int parts) {
  TESSERA_CHECK(parts >= 1 && part >= 0 && part < parts, "check_structure: part ", part, " of ", parts,
                " is out of range");
  if (meta_.source_kind != kSourceSharded) return;  // one file, validated when it was opened
  if (meta_.version >= 2) {
    for (int64_t r = part; r < meta_.world_size; r += parts) data_file(r);
    return;
  }
  int64_t index = 0;
  for (const auto& f : meta_.files)
    if (index++ % parts == part) reader(f.first);
}

std::vector<ChunkInfo> ChunkReader::chunks(const std::string& fqn, const EntryInfo& e, const sharding::Box& box) {
  std::vector<ChunkInfo> out;
  if (!e.layout) {
    for (const auto& c : e.chunks)
      if (!c.box.empty() && sharding::intersect(c.box, box)) out.push_back(c);
    return out;
  }
  for (int64_t i : e.layout->overlapping(e.shape, box)) out.push_back(locate_piece(fqn, e, i));
  return out;
}

ChunkInfo ChunkReader::locate_piece(const std::string& fqn, const EntryInfo& e, int64_t i) {
  const sharding::Layout& L = *e.layout;
  ChunkInfo c;
  c.box = L.box(e.shape, i);
  const int64_t rank = L.file_of(i);
  const SafetensorsReader& r = data_file(rank);
  c.file = data_file_name(static_cast<int>(rank));
  c.name = piece_name(fqn, L, e.shape, i);
  const TensorEntry* t = r.find(c.name);
  TESSERA_CHECK(t != nullptr, "'", r.path(), "' key '", fqn, "': piece ", c.box.to_string(), " (tensor '", c.name,
                "') is not in the data file (incomplete or mixed-up checkpoint)");
  TESSERA_CHECK(t->dtype == e.dtype && t->shape == c.box.sizes, "'", r.path(), "' key '", fqn, "': tensor '", c.name,
                "' has dtype ", dtype_name(t->dtype), " and shape ", core::shape_string(t->shape), ", the layout says ",
                dtype_name(e.dtype), " ", core::shape_string(c.box.sizes));
  const std::vector<uint32_t>* crcs = r.crcs(c.name);
  TESSERA_CHECK(crcs != nullptr, "'", r.path(), "' key '", fqn, "': tensor '", c.name, "' has no checksums");
  c.begin = t->begin;
  c.end = t->end;
  c.crcs = *crcs;
  return c;
}

ChunkReader::Located ChunkReader::locate(const std::string& fqn, const EntryInfo& e) {
  Located l;
  const sharding::Box whole = sharding::full_box(e.shape);
  if (!e.layout) {
    l.chunks = chunks(fqn, e, whole);
    return l;
  }
  l.pieces = e.layout->overlapping(e.shape, whole);
  l.chunks.reserve(l.pieces.size());
  for (int64_t i : l.pieces) l.chunks.push_back(locate_piece(fqn, e, i));
  return l;
}

void ChunkReader::check_header_entry(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c) {
  const SafetensorsReader& r = reader(c.file);
  const TensorEntry* t = r.find(c.name);
  TESSERA_CHECK(t != nullptr, "'", r.path(), "' key '", fqn, "': tensor '", c.name, "' is not in the data file");
  TESSERA_CHECK(t->dtype == e.dtype && t->shape == c.box.sizes && t->begin == c.begin && t->end == c.end, "'",
                r.path(), "' key '", fqn, "': the data file's entry '", c.name,
                "' disagrees with the metadata (dtype, shape or byte range)");
}

void ChunkReader::check_blocks(const std::string& path, const std::string& fqn, const ChunkInfo& c, uint64_t base,
                               const char* data, uint64_t n) const {
  if (c.crcs.empty()) return;
  const uint64_t block = meta_.crc_block, nbytes = c.end - c.begin;
  for (uint64_t off = base; off < base + n; off += block) {
    const uint64_t len = std::min(block, nbytes - off);
    const uint64_t bi = off / block;
    TESSERA_CHECK(bi < c.crcs.size(), "'", path, "' key '", fqn, "' chunk ", c.box.to_string(), ": block ", bi,
                  " has no checksum (", c.crcs.size(), " recorded)");
    TESSERA_CHECK(crc32c(data + (off - base), len) == c.crcs[bi], "'", path, "' key '", fqn,
                  "' chunk ", c.box.to_string(), ": checksum mismatch in block ", bi, " (bytes ", c.begin + off, "..",
                  c.begin + off + len, ") — the checkpoint is corrupt");
  }
}

ChunkReader::Range ChunkReader::range_of(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c,
                                         const sharding::Box& ov) const {
  Range r;
  // Row-major strides of the chunk, and the first and last element of the overlap (all
  // below the chunk's element count, which parsing bounded by 2^62 bytes).
  const size_t nd = c.box.dim();
  r.strides.assign(nd, 1);
  for (size_t d = nd; d-- > 1;) r.strides[d - 1] = r.strides[d] * c.box.sizes[d];
  for (size_t d = 0; d < nd; ++d) {
    r.first += (ov.offsets[d] - c.box.offsets[d]) * r.strides[d];
    r.last += (ov.offsets[d] + ov.sizes[d] - 1 - c.box.offsets[d]) * r.strides[d];
  }
  const uint64_t is = itemsize(e.dtype), nbytes = c.end - c.begin;
  const uint64_t o0 = static_cast<uint64_t>(r.first) * is, o1 = static_cast<uint64_t>(r.last + 1) * is;
  auto where = [&] { return concat("'", meta_.location, "' key '", fqn, "' chunk ", c.box.to_string()); };
  TESSERA_CHECK(nbytes == static_cast<uint64_t>(c.box.numel()) * is && o1 <= nbytes, where(), ": byte range of ",
                nbytes, " bytes does not hold the chunk's elements");
  r.b0 = o0;
  r.b1 = o1;
  r.block = nbytes;
  if (!c.crcs.empty()) {
    // Widened to whole checksum blocks. A valid block size is a multiple of 8 (parsing
    // checks it), so the widened range starts and ends on whole elements: checked again
    // here, since the buffer below holds (b1 - b0) / itemsize elements read from b0.
    r.block = meta_.crc_block;
    if (r.block < kMinCrcBlock || r.block > kMaxCrcBlock || r.block % 8 != 0) check_crc_block(r.block, where());
    TESSERA_CHECK(c.crcs.size() == num_blocks(nbytes, r.block), where(), ": ", c.crcs.size(), " checksums for ",
                  num_blocks(nbytes, r.block), " blocks");
    r.b0 = o0 / r.block * r.block;
    r.b1 = std::min(nbytes, o1 / r.block * r.block + (o1 % r.block != 0 ? r.block : 0));
    TESSERA_CHECK(r.b0 % is == 0 && r.b1 % is == 0, where(), ": checksum block size ", r.block, " splits ",
                  dtype_name(e.dtype), " elements");
  }
  r.exact = r.b0 == o0 && r.b1 == o1;
  return r;
}

uint64_t ChunkReader::prefetch(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c,
                               const sharding::Box& dst_box) {
  auto ov = sharding::intersect(dst_box, c.box);
  if (!ov || c.memory.defined()) return 0;
  check_header_entry(fqn, e, c);
  const Range r = range_of(fqn, e, c, *ov);
  const File& f = reader(c.file).file();
  if (r.b1 - r.b0 < DirectReader::kMinBytes || !io_.direct(f)) f.will_need(c.begin + r.b0, r.b1 - r.b0);
  return r.b1 - r.b0;
}

int64_t ChunkReader::copy_into(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c, at::Tensor& dst,
                               const sharding::Box& dst_box) {
  auto ov = sharding::intersect(dst_box, c.box);
  if (!ov) return 0;
  if (c.memory.defined()) return sharding::copy_overlap(dst, dst_box, c.memory, c.box);
  check_header_entry(fqn, e, c);
  const SafetensorsReader& r = reader(c.file);
  const Range rg = range_of(fqn, e, c, *ov);
  const uint64_t is = itemsize(e.dtype);
  // Checksum blocks this reader verified before need no second check: the bytes of the
  // overlap are read alone, not widened to whole blocks. (A reshard to many ranks reads a
  // few hundred bytes of each source block for every output rank: widening re-read and
  // re-checked each 4 MiB block a thousand times.)
  std::vector<bool>* seen = nullptr;
  bool verified = false;
  uint64_t blk0 = 0, blk1 = 0;
  if (!c.crcs.empty()) {
    seen = &checked_[{r.path(), c.begin}];
    if (seen->size() != c.crcs.size()) seen->assign(c.crcs.size(), false);
    blk0 = rg.b0 / rg.block;
    blk1 = (rg.b1 + rg.block - 1) / rg.block;
    verified = blk1 <= seen->size();
    for (uint64_t k = blk0; verified && k < blk1; ++k) verified = (*seen)[k];
  }
  const uint64_t block = verified ? 1 : rg.block;
  const uint64_t b0 = verified ? static_cast<uint64_t>(rg.first) * is : rg.b0;
  const uint64_t b1 = verified ? static_cast<uint64_t>(rg.last + 1) * is : rg.b1;
  // Fast path: the overlap is one contiguous byte range of the chunk (whole rows, or
  // the whole chunk), the range needs no widening to checksum blocks, and the
  // destination holds it contiguously on the CPU: read straight into the destination
  // (a sharded load of a consolidated file reads each rank's rows this way).
  at::Tensor view = *ov == dst_box ? dst : sharding::narrow_to(dst, dst_box, *ov);
  const bool whole_rows = c.box.dim() == 0 || std::equal(ov->sizes.begin() + 1, ov->sizes.end(), c.box.sizes.begin() + 1);
  const bool direct = whole_rows && (rg.exact || verified) && view.device().is_cpu() && view.is_contiguous();
  // A device destination is filled from a pinned host buffer (a DMA copy per chunk piece).
  at::Tensor buf = direct ? view
                          : at::empty({static_cast<int64_t>((b1 - b0) / is)},
                                      at::TensorOptions().dtype(e.dtype).pinned_memory(!view.device().is_cpu()));
  TESSERA_CHECK(static_cast<uint64_t>(buf.numel()) * is == b1 - b0, "internal: a ", b1 - b0,
                "-byte read into a buffer of ", buf.numel(), " elements");
  auto* p = static_cast<char*>(buf.data_ptr());
  // Checks the checksum blocks of the `n` bytes at `at` (from b0; block-aligned).
  auto check = [&](uint64_t at, const char* q, uint64_t n) {
    if (!verified) check_blocks(r.path(), fqn, c, b0 + at, q, n);
  };
  if (b1 - b0 >= DirectReader::kMinBytes) {
    // Segments of whole checksum blocks, read and checked two at a time off this thread.
    io_.read(r.file(), c.begin + b0, p, b1 - b0, c.crcs.empty() ? 1 : block, check);
  } else {
    r.file().pread_exact(c.begin + b0, p, b1 - b0);
    check(0, p, b1 - b0);
  }
  if (seen != nullptr && !verified)
    for (uint64_t k = blk0; k < blk1 && k < seen->size(); ++k) (*seen)[k] = true;
  if (direct) return ov->numel();
  at::Tensor src = buf.as_strided(ov->sizes, rg.strides, rg.first - static_cast<int64_t>(b0 / is));
  view.copy_(src);
  return ov->numel();
}

at::Tensor ChunkReader::read_box(const std::string& fqn, const EntryInfo& e, const sharding::Box& box) {
  at::Tensor t = at::empty(box.sizes, at::TensorOptions().dtype(e.dtype));
  fill_box(fqn, e, t, box, "the box read");
  return t;
}

void ChunkReader::fill_box(const std::string& fqn, const EntryInfo& e, at::Tensor& dst, const sharding::Box& box,
                           const std::string& what) {
  int64_t n = 0;
  for (const auto& c : chunks(fqn, e, box)) n += copy_into(fqn, e, c, dst, box);
  check_covered(fqn, n, box, what);
}

void ChunkReader::fill_box(const std::string& fqn, const EntryInfo& e, const Located& located, at::Tensor& dst,
                           const sharding::Box& box, const std::string& what) {
  int64_t n = 0;
  if (!e.layout) {
    for (const auto& c : located.chunks) n += copy_into(fqn, e, c, dst, box);
  } else {
    TESSERA_CHECK(located.pieces.size() == located.chunks.size(), "internal: key '", fqn, "' located without pieces");
    for (int64_t i : e.layout->overlapping(e.shape, box)) {
      auto it = std::lower_bound(located.pieces.begin(), located.pieces.end(), i);
      TESSERA_CHECK(it != located.pieces.end() && *it == i, "internal: key '", fqn, "': piece ", i, " was not located");
      n += copy_into(fqn, e, located.chunks[static_cast<size_t>(it - located.pieces.begin())], dst, box);
    }
  }
  check_covered(fqn, n, box, what);
}

void ChunkReader::check_covered(const std::string& fqn, int64_t n, const sharding::Box& box,
                                const std::string& what) const {
  TESSERA_CHECK(n == box.numel(), "'", meta_.location, "' key '", fqn, "': the chunks cover ", n, " of the ",
                box.numel(), " elements of ", box.to_string(), " -- ", what, " would hold memory never read ",
                "from the checkpoint (incomplete or tampered checkpoint)");
}

void ChunkReader::verify_chunk(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c) {
  if (c.memory.defined()) return;
  check_header_entry(fqn, e, c);
  const SafetensorsReader& r = reader(c.file);
  const uint64_t nbytes = c.end - c.begin;
  if (c.crcs.empty()) return;
  const uint64_t block = meta_.crc_block;
  // Windows of whole blocks, each read like a load's (direct I/O, two segments in
  // flight, checked as they land) into one reused buffer: the chunk is never held whole.
  const uint64_t window = std::max<uint64_t>(block, (32u << 20) / block * block);
  verify_buf_.resize(static_cast<size_t>(std::min(window, nbytes)));
  char* q = verify_buf_.data();
  for (uint64_t w = 0; w < nbytes; w += window) {
    const uint64_t n = std::min(window, nbytes - w);
    if (n >= DirectReader::kMinBytes) {
      io_.read(r.file(), c.begin + w, q, n, block,
               [&](uint64_t at, const char* d, uint64_t k) { check_blocks(r.path(), fqn, c, w + at, d, k); });
    } else {
      r.file().pread_exact(c.begin + w, q, n);
      check_blocks(r.path(), fqn, c, w, q, n);
    }
  }
}

}  // namespace tessera::checkpoint
