#include "tessera/checkpoint/offline.h"

#include <ATen/ATen.h>

#include <iomanip>
#include <sstream>

#include "tessera/checkpoint/crc32c.h"
#include "tessera/checkpoint/file_io.h"
#include "tessera/checkpoint/interop.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

std::string value_str(const state::Value& v) {
  if (auto p = std::get_if<int64_t>(&v)) return std::to_string(*p);
  if (auto p = std::get_if<double>(&v)) {
    std::ostringstream os;
    os << std::setprecision(17) << *p;
    return os.str();
  }
  if (auto p = std::get_if<bool>(&v)) return *p ? "true" : "false";
  if (auto p = std::get_if<std::string>(&v)) return "\"" + (p->size() > 40 ? p->substr(0, 40) + "..." : *p) + "\"";
  if (auto p = std::get_if<state::Bytes>(&v)) return std::to_string(p->data.size()) + " bytes";
  return "{}";
}

// An output path may be written: absent, or replaceable with --force.
void check_output(const std::string& out, bool force, bool file_output) {
  if (!path_exists(out)) {
    TESSERA_CHECK(is_directory(parent_dir(out)), "output '", out, "': directory '", parent_dir(out), "' does not exist");
    return;
  }
  TESSERA_CHECK(force, "output '", out, "' exists; pass --force to replace it");
  if (is_directory(out)) {
    TESSERA_CHECK(list_dir(out).empty() || is_tessera_checkpoint(out), "refusing to replace '", out,
                  "': a non-empty directory that is not a Tessera checkpoint");
  } else {
    TESSERA_CHECK(file_output || is_tessera_checkpoint(out), "refusing to replace '", out,
                  "': not a Tessera checkpoint");
  }
}

// The dimension a saved tensor was split along (where its chunks start at different
// offsets); 0 when it is in one piece.
int64_t split_dim(const EntryInfo& e) {
  for (size_t d = 0; d < e.shape.size(); ++d)
    for (const auto& c : e.chunks)
      if (c.box.offsets[d] != 0) return static_cast<int64_t>(d);
  return 0;
}

void write_consolidated(const CheckpointMetadata& m, const std::string& tmp) {
  ChunkReader reader(m);
  std::vector<SafetensorsWriter::Spec> specs;
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (e.is_tensor()) specs.push_back({k, e.dtype, e.shape});
  }
  SafetensorsWriter w(tmp, specs, consolidated_header(m));
  // One buffer, sized for the largest tensor, takes every tensor in turn (chunks are
  // read straight into it): memory stays at the largest tensor, and its pages are
  // faulted in once rather than for every tensor.
  uint64_t largest = 0;
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (e.is_tensor()) largest = std::max(largest, byte_size(e.shape, e.dtype, k));
  }
  at::Tensor buffer = at::empty({static_cast<int64_t>(largest)}, at::TensorOptions().dtype(at::kByte));
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (!e.is_tensor()) continue;
    const sharding::Box box = sharding::full_box(e.shape);
    at::Tensor t = buffer.narrow(0, 0, static_cast<int64_t>(byte_size(e.shape, e.dtype, k))).view(e.dtype).view(e.shape);
    for (const auto& c : e.chunks) reader.copy_into(k, e, c, t, box);
    w.write(t);
  }
  w.finish();
}

}  // namespace

std::string inspect(const std::string& path) {
  CheckpointMetadata m = open_checkpoint(path);
  std::ostringstream os;
  uint64_t total = 0;
  struct Row {
    std::string key, kind, dtype, shape, chunks, bytes;
  };
  std::vector<Row> rows;
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (e.is_tensor()) {
      const uint64_t b = byte_size(e.shape, e.dtype, k);
      total += b;
      rows.push_back({k, e.kind, dtype_name(e.dtype), shape_str(e.shape), std::to_string(e.chunks.size()),
                      std::to_string(b)});
    } else {
      rows.push_back({k, e.kind, "-", value_str(e.value), "-", "-"});
    }
  }
  os << "checkpoint: " << path << "\n";
  os << "kind: " << m.source_kind;
  if (m.source_kind == "sharded" || m.source_kind == "consolidated")
    os << " (format version " << m.version << ", world size at save " << m.world_size << ")";
  os << "\n";
  if (m.source_kind == "sharded") os << "data files: " << m.files.size() << "\n";
  os << "entries: " << m.keys.size() << ", tensor bytes: " << total << "\n\n";
  Row head{"KEY", "KIND", "DTYPE", "SHAPE/VALUE", "CHUNKS", "BYTES"};
  size_t w[6] = {0, 0, 0, 0, 0, 0};
  auto widen = [&](const Row& r) {
    const std::string* f[6] = {&r.key, &r.kind, &r.dtype, &r.shape, &r.chunks, &r.bytes};
    for (int i = 0; i < 6; ++i) w[i] = std::max(w[i], f[i]->size());
  };
  widen(head);
  for (auto& r : rows) widen(r);
  auto print = [&](const Row& r) {
    const std::string* f[6] = {&r.key, &r.kind, &r.dtype, &r.shape, &r.chunks, &r.bytes};
    for (int i = 0; i < 6; ++i) os << std::left << std::setw(static_cast<int>(w[i]) + 2) << *f[i];
    os << "\n";
  };
  print(head);
  for (auto& r : rows) print(r);
  return os.str();
}

VerifyReport verify(const std::string& path) {
  VerifyReport rep;
  CheckpointMetadata m;
  try {
    m = open_checkpoint(path);
  } catch (const std::exception& e) {
    rep.ok = false;
    rep.problems.push_back(e.what());
    return rep;
  }
  ChunkReader reader(m);
  if (m.source_kind == "sharded") {
    for (const auto& [name, size] : m.files) {
      try {
        reader.reader(name);
      } catch (const std::exception& e) {
        rep.problems.push_back(e.what());
      }
    }
  }
  rep.has_checksums = m.source_kind == "sharded" || m.source_kind == "consolidated";
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    for (const auto& c : e.chunks) {
      try {
        if (rep.has_checksums && c.crcs.empty() && c.end > c.begin)
          throw Error(concat("key '", k, "' chunk ", c.box.to_string(), ": no checksum recorded"));
        reader.verify_chunk(k, e, c);
        rep.chunks_checked++;
        rep.bytes_checked += c.end - c.begin;
      } catch (const std::exception& ex) {
        rep.problems.push_back(ex.what());
      }
    }
  }
  rep.ok = rep.problems.empty();
  return rep;
}

// Writes `out` through a temporary sibling: `write(tmp)` fills it, then one atomic
// rename publishes it; on any error the temporary is removed and `out` is untouched.
template <typename F>
void publish_via_temp(const std::string& out, F&& write) {
  const std::string tmp = temp_sibling(out);
  try {
    write(tmp);
    commit_rename(tmp, out);
  } catch (...) {
    remove_all(tmp);
    throw;
  }
}

void consolidate(const std::string& src, const std::string& out, bool force) {
  CheckpointMetadata m = open_checkpoint(src);
  check_output(out, force, false);
  publish_via_temp(out, [&](const std::string& tmp) { write_consolidated(m, tmp); });
}

void reshard(const std::string& src, int world_size, const std::string& out, bool force) {
  TESSERA_CHECK(world_size >= 1, "reshard: world size must be at least 1, got ", world_size);
  CheckpointMetadata m = open_checkpoint(src);
  check_output(out, force, false);
  ChunkReader reader(m);
  publish_via_temp(out, [&](const std::string& tmp) {
    make_dir(tmp);
    CheckpointMetadata o;
    o.world_size = world_size;
    o.crc_block = kCrcBlock;
    o.keys = m.keys;
    for (const auto& k : m.keys) {
      EntryInfo e = m.entries.at(k);
      e.chunks.clear();
      if (e.kind == "sharded" && e.shape.empty()) e.kind = "tensor";
      o.entries.emplace(k, std::move(e));
    }
    for (int r = 0; r < world_size; ++r) {
      std::vector<Piece> pieces;
      for (const auto& k : m.keys) {
        const EntryInfo& e = m.entries.at(k);
        if (!e.is_tensor()) continue;
        sharding::Box box;
        if (o.entries.at(k).kind == "sharded") {
          box = sharding::chunk_box(e.shape, split_dim(e), world_size, r);
        } else if (r == 0) {
          box = sharding::full_box(e.shape);
        } else {
          continue;
        }
        if (box.empty()) continue;
        pieces.push_back({k, e.dtype, box, [&reader, &e, k, box] { return reader.read_box(k, e, box); }});
      }
      DataFileResult d = write_data_file(tmp, data_file_name(r), pieces);
      o.files.emplace_back(d.file, d.size);
      for (auto& [fqn, c] : d.chunks) o.entries.at(fqn).chunks.push_back(std::move(c));
    }
    write_metadata_file(tmp, o);
  });
}

void export_checkpoint(const std::string& src, ExportFormat format, const std::string& out, bool force) {
  if (format == ExportFormat::Safetensors) {
    CheckpointMetadata m = open_checkpoint(src);
    check_output(out, force, true);
    publish_via_temp(out, [&](const std::string& tmp) { write_consolidated(m, tmp); });
    return;
  }
  CheckpointMetadata m = open_checkpoint(src);
  check_output(out, force, true);
  ChunkReader reader(m);
  publish_via_temp(out, [&](const std::string& tmp) {
    {
      TorchExportWriter w(tmp);
      for (const auto& k : m.keys) {
        const EntryInfo& e = m.entries.at(k);
        if (e.is_tensor()) w.add(k, reader.read_box(k, e, sharding::full_box(e.shape)));
      }
      w.finish();
    }
    File(tmp, "r").fsync();  // PyTorchStreamWriter does not fsync
  });
}

}  // namespace tessera::checkpoint
