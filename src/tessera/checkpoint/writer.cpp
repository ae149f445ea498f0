#include "tessera/checkpoint/writer.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string_view>
#include <unordered_map>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/interop/torch_file.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/sync_queue.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {

using json = nlohmann::json;

std::string data_file_name(int rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "data-rank%05d.safetensors", rank);
  return buf;
}

std::map<std::string, std::string> data_file_identity(int rank, const std::string& save_id) {
  return {{"tessera.version", "2"}, {"tessera.rank", std::to_string(rank)}, {"tessera.save_id", save_id}};
}

DataFileResult write_data_file(const std::string& dir, const std::string& name, const std::vector<Piece>& pieces,
                               const std::map<std::string, std::string>& identity, SyncQueue* sync) {
  std::vector<SafetensorsWriter::Spec> specs;
  specs.reserve(pieces.size());
  std::unordered_map<std::string_view, int> count, seen;
  for (const auto& p : pieces) count[p.fqn]++;
  for (const auto& p : pieces) {
    const int n = count[p.fqn];
    specs.push_back({n == 1 ? p.fqn : concat(p.fqn, "@", seen[p.fqn]++), p.dtype, p.box.sizes});
  }
  const std::string path = join_path(dir, name);
  std::map<std::string, std::string> meta = identity;
  meta["tessera.format"] = "tessera-data";
  // Each piece's place in its tensor (its identity beside its name and shape): the JSON
  // object of name -> offsets, keys sorted as nlohmann::json writes an object.
  std::vector<size_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return specs[a].name < specs[b].name; });
  std::string offsets = "{";
  for (size_t i : order) {
    if (offsets.size() > 1) offsets.push_back(',');
    append_json_string(offsets, specs[i].name);
    offsets += ":[";
    for (size_t d = 0; d < pieces[i].box.offsets.size(); ++d) {
      if (d) offsets.push_back(',');
      offsets += std::to_string(pieces[i].box.offsets[d]);
    }
    offsets.push_back(']');
  }
  offsets.push_back('}');
  meta[kPieceOffsetsKey] = std::move(offsets);
  SafetensorsWriter w(path, specs, std::move(meta));
  for (size_t i = 0; i < pieces.size(); ++i) {
    at::Tensor t = pieces[i].data();
    TESSERA_CHECK(t.defined() && t.sizes().vec() == pieces[i].box.sizes, "key '", pieces[i].fqn,
                  "': piece ", pieces[i].box.to_string(), " has the wrong shape");
    w.write(t);
  }
  File unsynced;
  auto written = w.finish(sync != nullptr ? &unsynced : nullptr);
  DataFileResult r;
  r.file = name;
  if (sync != nullptr) {
    r.size = unsynced.size();
    sync->add(std::move(unsynced));
  } else {
    r.size = File(path, "r").size();
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    ChunkInfo c;
    c.box = pieces[i].box;
    c.file = name;
    c.name = specs[i].name;
    c.begin = written[i].begin;
    c.end = written[i].end;
    c.crcs = written[i].crcs;
    r.chunks.emplace_back(pieces[i].fqn, std::move(c));
  }
  return r;
}

void layouts_from_chunks(CheckpointMetadata& m) {
  for (auto& [fqn, e] : m.entries) {
    if (!e.is_tensor()) continue;
    sharding::Layout L;
    L.rule = sharding::Layout::Rule::List;
    std::vector<const ChunkInfo*> stored;  // a list names only stored (non-empty) pieces
    for (const auto& c : e.chunks) {
      if (c.box.empty()) continue;
      int rank = -1;
      for (int64_t r = 0; r < m.world_size && rank < 0; ++r)
        if (data_file_name(static_cast<int>(r)) == c.file) rank = static_cast<int>(r);
      TESSERA_CHECK(rank >= 0, "internal: key '", fqn, "' has a chunk in '", c.file, "', no data file of the checkpoint");
      L.list.push_back({rank, c.box});
      stored.push_back(&c);
    }
    if (L.list.size() == 1 && L.list[0].box == sharding::full_box(e.shape)) L = sharding::Layout::whole(L.list[0].file);
    for (size_t i = 0; i < stored.size(); ++i)
      TESSERA_CHECK(piece_name(fqn, L, e.shape, static_cast<int64_t>(i)) == stored[i]->name, "internal: key '", fqn,
                    "' chunk ", stored[i]->box.to_string(), " is named '", stored[i]->name,
                    "' in its data file, its layout names it '", piece_name(fqn, L, e.shape, static_cast<int64_t>(i)),
                    "'");
    L.validate(e.shape, m.world_size, concat("key '", fqn, "'"));
    e.layout = std::move(L);
    e.chunks.clear();
  }
}

void write_metadata_file(const std::string& dir, const CheckpointMetadata& m) { write_metadata_text(dir, to_json(m)); }

void write_metadata_text(const std::string& dir, const std::string& text) {
  TESSERA_CHECK(text.size() <= kMaxMetadataBytes, "the checkpoint's metadata would be ", text.size(),
                " bytes, more than the ", kMaxMetadataBytes, "-byte limit every reader enforces: nothing is committed");
  File f(join_path(dir, kMetadataFile), "w");
  f.write_all(text.data(), text.size());
  f.fsync();
  f.close();
  fsync_dir(dir);
}

std::map<std::string, std::string> consolidated_header(const CheckpointMetadata& m) {
  json kinds = json::object(), values = json::object();
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (e.is_tensor()) kinds[k] = e.kind;
    else values[k] = json::parse(encode_value(e.value));
  }
  return {{"tessera.format", "tessera-consolidated"},
          {"tessera.kinds", kinds.dump()},
          {"tessera.values", values.dump()},
          {"tessera.keys", json(m.keys).dump()},
          {"tessera.world_size", std::to_string(m.world_size)}};
}

bool is_replaceable_output(const std::string& path) {
  if (is_directory(path)) return list_dir(path).empty() || is_tessera_checkpoint(path);
  return is_tessera_checkpoint(path) || is_tessera_torch_export(path);
}

void check_replaceable(const std::string& path) {
  if (!path_exists(path)) return;
  TESSERA_CHECK(is_replaceable_output(path), "refusing to save to '", path, "': it exists and is not a Tessera ",
                "checkpoint (", is_directory(path) ? "a non-empty directory without " + std::string(kMetadataFile)
                                                  : std::string("a file that is neither a Tessera safetensors file nor a Tessera torch export"),
                "); nothing was touched");
}

bool check_output_path(const std::string& out, bool force, OutputKind kind, const std::string& command) {
  std::string bare = out;
  while (bare.size() > 1 && bare.back() == '/') bare.pop_back();
  struct stat st;
  if (::lstat(bare.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    char target[4096];
    const ssize_t n = ::readlink(bare.c_str(), target, sizeof target);
    throw Error(concat("output '", out, "' is a symbolic link (to '", n > 0 ? std::string(target, n) : "?", "'): ",
                       command, " neither replaces a link nor writes through one; give the path to write (the ",
                       "link's target, or another name)"));
  }
  const std::string suffix = ".safetensors";
  const bool safetensors_name =
      bare.size() >= suffix.size() && bare.compare(bare.size() - suffix.size(), suffix.size(), suffix) == 0;
  TESSERA_CHECK(kind == OutputKind::File || !safetensors_name, "output '", out, "' ends in .safetensors, but ",
                command, " writes a directory; give a directory name (then `tessera ckpt consolidate DIR -o ",
                base_name(bare), "` writes one safetensors file)");
  if (!path_exists(bare)) {
    TESSERA_CHECK(is_directory(parent_dir(bare)), "output '", out, "': directory '", parent_dir(bare),
                  "' does not exist");
    return false;
  }
  TESSERA_CHECK(force, "output '", out, "' exists; pass --force to replace it");
  return true;
}

}  // namespace tessera::checkpoint
