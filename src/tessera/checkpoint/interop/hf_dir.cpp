#include "tessera/checkpoint/interop/hf_dir.h"

#include <nlohmann/json.hpp>

#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>

#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {

namespace {

using json = nlohmann::json;

// At most this many problems are spelled out in one error.
constexpr size_t kMaxProblemsShown = 20;

std::string real_path_or_empty(const std::string& p) {
  char* r = ::realpath(p.c_str(), nullptr);
  if (r == nullptr) return "";
  std::string s = r;
  std::free(r);
  return s;
}

// Why the file `name` of `dir` may not be read ("" when it may): a symbolic link is
// followed only when its target lies inside the directory (a weight map must not make a
// reader open other files of this machine); a FIFO, a device or a directory is refused.
std::string file_problem(const std::string& dir, const std::string& name) {
  const std::string path = join_path(dir, name);
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return concat("'", path, "' does not exist");
  if (S_ISLNK(st.st_mode)) {
    char target[PATH_MAX + 1] = {0};
    const ssize_t n = ::readlink(path.c_str(), target, PATH_MAX);
    const std::string to = n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string("?");
    const std::string real = real_path_or_empty(path), real_dir = real_path_or_empty(dir);
    if (real.empty()) return concat("'", path, "' is a symbolic link to '", to, "', which does not exist");
    const std::string inside = real_dir == "/" ? real_dir : real_dir + "/";
    if (real_dir.empty() || real.size() <= inside.size() || real.compare(0, inside.size(), inside) != 0)
      return concat("'", path, "' is a symbolic link to '", to, "' (", real,
                    "), outside the directory: refusing to follow it (copy the file into the directory)");
  }
  const std::string why = not_regular_file_reason(path);
  return why.empty() ? "" : concat("'", path, "' ", why);
}

// A file name the weight map may give: one plain name inside the directory (no path, no
// "." or "..", no control character, under 256 bytes).
bool plain_name(const std::string& n) {
  if (n.empty() || n == "." || n == ".." || n.size() >= 256) return false;
  for (unsigned char c : n)
    if (c == '/' || c == '\\' || c < 0x20 || c == 0x7f) return false;
  return true;
}

// The series of a shard name "<prefix>-<i>-of-<n>.safetensors" (transformers' and DCP's
// names): "<prefix>\n<n>", or "" for another name.
std::string series_of(const std::string& name) {
  const std::string tail = ".safetensors";
  if (name.size() <= tail.size() || name.compare(name.size() - tail.size(), tail.size(), tail) != 0) return "";
  const std::string core = name.substr(0, name.size() - tail.size());
  const size_t of = core.rfind("-of-");
  if (of == std::string::npos) return "";
  const std::string n = core.substr(of + 4), head = core.substr(0, of);
  const size_t dash = head.rfind('-');
  if (dash == std::string::npos) return "";
  const std::string i = head.substr(dash + 1);
  auto digits = [](const std::string& s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos; };
  return digits(i) && digits(n) ? head.substr(0, dash) + "\n" + n : "";
}

// "'a'", "'a' and 'b'", "'a', 'b' and 'c'".
std::string quoted_list(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i == 0 ? "" : i + 1 == v.size() ? " and " : ", ") + ("'" + v[i] + "'");
  return s;
}

// A shard's tensors by data offset, ties (empty tensors) by name: one order for the keys
// and the messages, the Python reader's too.
std::vector<const TensorEntry*> in_data_order(const SafetensorsReader& r) {
  std::vector<const TensorEntry*> v;
  for (const auto& t : r.entries()) v.push_back(&t);
  std::sort(v.begin(), v.end(), [](const TensorEntry* a, const TensorEntry* b) {
    if (a->begin != b->begin) return a->begin < b->begin;
    return a->end != b->end ? a->end < b->end : a->name < b->name;
  });
  return v;
}

struct Index {
  std::map<std::string, std::string> weight_map;  // tensor -> file, sorted by tensor
  std::optional<uint64_t> total_size;
  std::string bad_total_size;  // a total_size that is no byte count, as JSON text (a note)
};

Index read_index(const std::string& dir) {
  const std::string path = join_path(dir, kHfIndexFile);
  const std::string where = concat("'", path, "'");
  const std::string bad = file_problem(dir, kHfIndexFile);
  TESSERA_CHECK(bad.empty(), bad);
  const json j = parse_json_strict(read_small_file(path, kMaxHfIndexBytes), where);
  TESSERA_CHECK(j.is_object(), where, " is not a JSON object");
  Index ix;
  if (j.contains("metadata") && !j["metadata"].is_null()) {
    const json& md = j["metadata"];
    TESSERA_CHECK(md.is_object(), where, ": metadata is not an object");
    if (md.contains("total_size") && !md["total_size"].is_null()) {
      const json& ts = md["total_size"];
      if (ts.is_number_unsigned()) {
        ix.total_size = ts.get<uint64_t>();
      } else if (ts.is_number_float() && ts.get<double>() >= 0 && ts.get<double>() < 18446744073709551616.0 &&
                 std::floor(ts.get<double>()) == ts.get<double>()) {
        ix.total_size = static_cast<uint64_t>(ts.get<double>());  // some writers store the count as a float (1234.0)
      } else {
        ix.bad_total_size = ts.dump();  // informational only: a note, as a count that is off
      }
    }
  }
  TESSERA_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), where, ": no weight_map object");
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    TESSERA_CHECK(it.value().is_string(), where, ": the weight_map value of '", it.key(), "' is not a string");
    ix.weight_map[it.key()] = it.value().get<std::string>();
  }
  TESSERA_CHECK(!ix.weight_map.empty(), where, ": the weight map names no tensor");
  return ix;
}

// Reading a directory, in phases: which shards to read (the index's weight map, or the
// single file), every shard's header, the weight map against the shards, the checksum
// blocks, then the checkpoint's description. Problems are collected across the phases and
// thrown together (HfDirectoryError), so that one error names every disagreement.
class HfDirectoryRead {
 public:
  explicit HfDirectoryRead(const std::string& dir)
      : dir_(dir), iq_(concat("'", join_path(dir, kHfIndexFile), "'")) {}

  HfDirectory run() {
    out_.has_index = path_exists(join_path(dir_, kHfIndexFile));
    if (out_.has_index) map_shards_from_index();
    else by_file_[kHfSingleFile] = {};
    open_shards();
    check_shards_against_map();
    check_crc_blocks();
    throw_problems();
    describe();
    return std::move(out_);
  }

 private:
  // The shards the weight map names, and those of the same series it does not.
  void map_shards_from_index() {
    ix_ = read_index(dir_);
    out_.total_size = ix_.total_size;
    if (!ix_.bad_total_size.empty())
      out_.notes.push_back(concat(iq_, ": metadata.total_size is ", ix_.bad_total_size, ", not a byte count: ignored ",
                                  "(not an error: Hugging Face's readers do not use it)"));
    for (const auto& [t, f] : ix_.weight_map) {
      if (plain_name(f)) by_file_[f].push_back(t);
      else problems_.push_back(concat(iq_, ": tensor '", t, "' is mapped to '", escape_path(f),
                                      "', which is not a plain file name inside the directory"));
    }
    TESSERA_CHECK(by_file_.count(kHfSingleFile) || !path_exists(join_path(dir_, kHfSingleFile)), "'", dir_,
                  "' holds both ", kHfSingleFile, " and ", kHfIndexFile, ", whose weight map does not name it: ",
                  "which of them is the model is ambiguous (transformers would read ", kHfSingleFile,
                  "); remove the stale one");
    // A shard of the same series that the map does not name (model-00002-of-00003 when
    // the map names 00001 and 00003) is read too: its tensors are unmapped.
    std::set<std::string> series;
    for (const auto& [f, tensors] : by_file_)
      if (!series_of(f).empty()) series.insert(series_of(f));
    if (!series.empty()) {
      std::vector<std::string> names = list_dir(dir_);
      std::sort(names.begin(), names.end());
      for (const auto& n : names)
        if (!by_file_.count(n) && series.count(series_of(n))) by_file_[n] = {};
    }
  }

  // Every shard's header, parsed and checked; its descriptor closed at once (a model of
  // thousands of shards is opened one file at a time).
  void open_shards() {
    for (const auto& [f, tensors] : by_file_) {
      const std::string path = join_path(dir_, f);
      if (!path_exists(path)) {  // (a shard found by listing the directory has no tensor mapped)
        problems_.push_back(tensors.empty() ? concat("'", path, "' does not exist")
                                            : concat(iq_, ": shard '", f, "' is missing (the weight map puts ",
                                                     tensors.size(), " tensor(s) there, e.g. '", tensors.front(), "')"));
        continue;
      }
      const std::string bad = file_problem(dir_, f);
      if (!bad.empty()) {
        problems_.push_back(bad);
        continue;
      }
      try {
        auto r = std::make_unique<SafetensorsReader>(path);
        r->close_file();
        shards_.emplace(f, std::move(r));
      } catch (const ResourceError&) {
        throw;
      } catch (const std::exception& e) {
        problems_.push_back(e.what());
      }
    }
  }

  // The shards against each other (a tensor in two of them) and against the weight map
  // when there is one (a tensor mapped to a shard that does not hold it, or held by a shard
  // without being mapped).
  void check_shards_against_map() {
    std::map<std::string, std::vector<std::string>> holders;  // tensor -> the shards holding it
    for (const auto& [f, r] : shards_)
      for (const auto& t : r->entries()) holders[t.name].push_back(join_path(dir_, f));
    for (const auto& [t, files] : holders)
      if (files.size() > 1)
        problems_.push_back(
            concat("tensor '", t, "' is in ", files.size(), " shards, ", quoted_list(files), " (duplicated)"));
    if (!out_.has_index) return;
    for (const auto& [t, f] : ix_.weight_map) {
      auto s = shards_.find(f);
      if (s == shards_.end() || s->second->find(t) != nullptr) continue;
      auto h = holders.find(t);
      problems_.push_back(concat(iq_, ": tensor '", t, "' is mapped to '", f, "', but '", join_path(dir_, f),
                                 "' does not hold it",
                                 h == holders.end() ? "" : " (it is in " + quoted_list(h->second) + ")"));
    }
    for (const auto& [f, r] : shards_)
      for (const TensorEntry* t : in_data_order(*r))
        if (!ix_.weight_map.count(t->name))
          problems_.push_back(concat("'", join_path(dir_, f), "': tensor '", t->name, "' is not in the weight map of ",
                                     iq_, " (unmapped)"));
  }

  // Checksums (a Tessera export carries them): one block size for the whole directory.
  void check_crc_blocks() {
    CheckpointMetadata& m = out_.meta;
    std::string crc_file;
    for (const auto& [f, r] : shards_) {
      if (r->crc_block() == 0) continue;
      if (m.crc_block == 0) {
        m.crc_block = r->crc_block();
        crc_file = f;
      } else if (r->crc_block() != m.crc_block) {
        problems_.push_back(concat("'", join_path(dir_, f), "' has checksum blocks of ", r->crc_block(), " bytes, '",
                                   join_path(dir_, crc_file), "' of ", m.crc_block, " (shards of different writers)"));
      }
    }
  }

  void throw_problems() {
    if (problems_.empty()) return;
    std::string msg = problems_.front();
    for (size_t i = 1; i < problems_.size() && i < kMaxProblemsShown; ++i) msg += "; " + problems_[i];
    if (problems_.size() > kMaxProblemsShown)
      msg += concat("; and ", problems_.size() - kMaxProblemsShown, " more problem(s)");
    throw HfDirectoryError(msg, std::move(problems_));
  }

  // The checkpoint: one whole-tensor entry per tensor, in each shard's data order.
  void describe() {
    CheckpointMetadata& m = out_.meta;
    m.source_kind = kSourceHf;
    m.location = dir_;
    m.world_size = 1;
    for (const auto& [f, r] : shards_) {
      m.files.emplace_back(f, r->file_size());
      for (const TensorEntry* t : in_data_order(*r)) {
        EntryInfo e;
        e.kind = kTensorKind;
        e.dtype = t->dtype;
        e.shape = t->shape;
        if (t->nbytes() > 0) {
          ChunkInfo c;
          c.box = sharding::full_box(t->shape);
          c.file = f;
          c.name = t->name;
          c.begin = t->begin;
          c.end = t->end;
          if (const auto* crcs = r->crcs(t->name)) c.crcs = *crcs;
          e.chunks.push_back(std::move(c));
        }
        out_.file_of[t->name] = f;
        out_.tensor_bytes += t->nbytes();
        m.keys.push_back(t->name);
        m.entries.emplace(t->name, std::move(e));
      }
    }
    if (out_.total_size && *out_.total_size != out_.tensor_bytes)
      out_.notes.push_back(concat(iq_, ": metadata.total_size is ", *out_.total_size, " but the tensors hold ",
                                  out_.tensor_bytes,
                                  " bytes (not an error: Hugging Face's readers do not check it either)"));
  }

  const std::string dir_, iq_;  // iq_: "'DIR/model.safetensors.index.json'" for messages
  HfDirectory out_;
  Index ix_;
  std::map<std::string, std::vector<std::string>> by_file_;  // file -> the tensors mapped there, sorted
  std::map<std::string, std::unique_ptr<SafetensorsReader>> shards_;
  std::vector<std::string> problems_;
};

}  // namespace

bool is_hf_directory(const std::string& dir) {
  return is_directory(dir) && !path_exists(join_path(dir, kMetadataFile)) &&
         (path_exists(join_path(dir, kHfIndexFile)) || path_exists(join_path(dir, kHfSingleFile)));
}

HfDirectory read_hf_directory(const std::string& dir) { return HfDirectoryRead(dir).run(); }

CheckpointMetadata open_hf_directory(const std::string& dir) { return read_hf_directory(dir).meta; }

}  // namespace tessera::checkpoint
