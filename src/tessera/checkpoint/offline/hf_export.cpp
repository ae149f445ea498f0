#include "tessera/checkpoint/offline/hf_export.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <set>

#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/offline/offline_publish.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kSizeHelp =
    "plain bytes, or a number with a unit: KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)";

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// transformers' name for file i (1-based) of n: "model-00001-of-00003.safetensors".
std::string shard_file_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

// A name this export writes into its output directory.
bool is_export_file_name(const std::string& n) {
  if (n == kSingleFile || n == kIndexFile) return true;
  // model-<digits>-of-<digits>.safetensors
  const std::string head = "model-", mid = "-of-", tail = ".safetensors";
  if (n.size() <= head.size() + tail.size() || n.compare(0, head.size(), head) != 0 ||
      n.compare(n.size() - tail.size(), tail.size(), tail) != 0)
    return false;
  const std::string core = n.substr(head.size(), n.size() - head.size() - tail.size());
  const size_t m = core.find(mid);
  if (m == std::string::npos || m == 0 || m + mid.size() == core.size()) return false;
  const std::string a = core.substr(0, m), b = core.substr(m + mid.size());
  auto digits = [](const std::string& s) { return s.find_first_not_of("0123456789") == std::string::npos; };
  return digits(a) && digits(b);
}

// An existing output may be replaced (with force) only when it is a directory that is
// empty or holds nothing but what an export writes: never a Tessera checkpoint, a file,
// or a directory a user keeps other files in.
void check_hf_output(const std::string& out, bool force) {
  if (!check_output_path(out, force, OutputKind::Directory, "export --format hf")) return;
  TESSERA_CHECK(is_directory(out), "refusing to replace '", out,
                "': not a directory (a Hugging Face export writes a directory)");
  for (const auto& n : list_dir(out)) {
    TESSERA_CHECK(is_export_file_name(n), "refusing to replace '", out, "': it holds '", n,
                  "', which a Hugging Face export does not write (only model*.safetensors and ", kIndexFile, ")");
  }
}

bool is_floating(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

at::ScalarType output_dtype(at::ScalarType saved, HfDtype want) {
  if (!is_floating(saved)) return saved;
  switch (want) {
    case HfDtype::BF16: return at::kBFloat16;
    case HfDtype::F16: return at::kHalf;
    case HfDtype::F32: return at::kFloat;
    case HfDtype::AsSaved: break;
  }
  return saved;
}

// The distinct first components ("model.", "optimizer.", ...) of the tensor keys, for
// an error message.
std::string key_heads(const CheckpointMetadata& m) {
  std::set<std::string> heads;
  for (const auto& k : m.keys) {
    if (!m.entries.at(k).is_tensor()) continue;
    const size_t dot = k.find('.');
    heads.insert(dot == std::string::npos ? k : k.substr(0, dot + 1));
  }
  std::string s;
  size_t shown = 0;
  for (const auto& h : heads) {
    if (shown++ == 8) {
      s += ", ...";
      break;
    }
    s += (s.empty() ? "" : ", ") + ("'" + h + "'");
  }
  return s.empty() ? "none" : s;
}

struct Item {
  std::string key;   // in the checkpoint
  std::string name;  // in the export
  at::ScalarType out_dtype;
  uint64_t bytes = 0;  // as exported
};

}  // namespace

uint64_t parse_hf_size(const std::string& text) {
  const std::string s = trim(text);
  size_t i = 0;
  unsigned __int128 mantissa = 0;
  uint64_t scale = 1;  // 10^(fraction digits)
  int digits = 0;
  bool point = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '.' && !point) {
      point = true;
      continue;
    }
    if (c < '0' || c > '9') break;
    TESSERA_CHECK(++digits <= 18, "size '", text, "': too many digits");
    mantissa = mantissa * 10 + static_cast<unsigned>(c - '0');
    if (point) scale *= 10;
  }
  TESSERA_CHECK(digits > 0, "size '", text, "' is not a size: ", kSizeHelp);
  const std::string unit = upper(trim(s.substr(i)));
  static const std::vector<std::pair<std::string, uint64_t>> units = {
      {"", 1},           {"B", 1},
      {"KB", 1000ull},   {"MB", 1000000ull},   {"GB", 1000000000ull},   {"TB", 1000000000000ull},
      {"KIB", 1ull << 10}, {"MIB", 1ull << 20}, {"GIB", 1ull << 30}, {"TIB", 1ull << 40}};
  uint64_t mult = 0;
  for (const auto& [u, v] : units)
    if (u == unit) mult = v;
  TESSERA_CHECK(mult != 0, "size '", text, "': unknown unit '", s.substr(i), "' (", kSizeHelp, ")");
  TESSERA_CHECK(mult > 1 || !point, "size '", text, "': a number of bytes must be whole");
  const unsigned __int128 bytes = mantissa * mult / scale;
  TESSERA_CHECK(bytes <= (static_cast<unsigned __int128>(1) << 62), "size '", text, "' is too large");
  TESSERA_CHECK(bytes >= 1, "size '", text, "' must be at least 1 byte");
  return static_cast<uint64_t>(bytes);
}

HfDtype parse_hf_dtype(const std::string& text) {
  if (text == "bf16") return HfDtype::BF16;
  if (text == "fp16") return HfDtype::F16;
  if (text == "fp32") return HfDtype::F32;
  throw Error(concat("dtype '", text, "': expected bf16, fp16 or fp32"));
}

std::vector<std::vector<size_t>> plan_hf_shards(const std::vector<uint64_t>& sizes, uint64_t max_shard_size) {
  std::vector<std::vector<size_t>> files;
  std::vector<size_t> current;
  uint64_t current_size = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > max_shard_size) {  // alone, in a file of its own; the current file stays open
      files.push_back({i});
      continue;
    }
    if (current_size + sizes[i] > max_shard_size) {  // never empty here: sizes[i] <= max
      files.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += sizes[i];
  }
  if (!current.empty()) files.push_back(std::move(current));
  return files;
}

namespace {

// One export, in the order of its phases: open and check the source, choose the tensors
// and their names, cut them into shard files, write the files (published together).
class HfExport {
 public:
  HfExport(const std::string& src, const HfExportOptions& options) : src_(src), options_(options) {}

  HfExportResult run(const std::string& out, bool force) {
    TESSERA_CHECK(options_.max_shard_size >= 1, "the max shard size must be at least 1 byte");
    m_ = open_checkpoint(src_);
    ChunkReader(m_).check_structure();  // what verify checks of the structure, before anything is read
    offline_check_not_source(src_, m_, out);
    choose_prefix();
    select_tensors();
    check_hf_output(out, force);
    plan_files();
    offline_publish(out, true, [&](const std::string& tmp) { write(tmp); });
    return std::move(res_);
  }

 private:
  // The prefix removed from the keys: --prefix, else "model." when some tensor key has it.
  void choose_prefix() {
    if (options_.prefix) {
      res_.prefix = *options_.prefix;
      if (!res_.prefix.empty() && res_.prefix.back() != '.') res_.prefix += '.';
      return;
    }
    res_.prefix = "model.";
    const bool any = std::any_of(m_.keys.begin(), m_.keys.end(), [&](const std::string& k) {
      return m_.entries.at(k).is_tensor() && k.compare(0, res_.prefix.size(), res_.prefix) == 0;
    });
    if (!any) res_.prefix.clear();
  }

  // The tensors under the prefix, their names and dtypes in the export, and the largest
  // tensor as saved and as converted (what the buffers hold).
  void select_tensors() {
    for (const auto& k : m_.keys) {
      const EntryInfo& e = m_.entries.at(k);
      if (!e.is_tensor() || k.compare(0, res_.prefix.size(), res_.prefix) != 0) continue;
      Item it{k, k.substr(res_.prefix.size()), output_dtype(e.dtype, options_.dtype), 0};
      TESSERA_CHECK(!it.name.empty(), "key '", k, "' of '", src_, "' is empty once the prefix '", res_.prefix,
                    "' is removed");
      it.bytes = byte_size(e.shape, it.out_dtype, k);
      largest_in_ = std::max(largest_in_, byte_size(e.shape, e.dtype, k));
      if (it.out_dtype != e.dtype) {
        converts_ = true;
        largest_out_ = std::max(largest_out_, it.bytes);
      }
      res_.total_size += it.bytes;
      items_.push_back(std::move(it));
    }
    if (items_.empty()) {
      TESSERA_CHECK(options_.prefix.has_value(), "'", src_, "' holds no tensor to export");
      throw Error(concat("--prefix '", *options_.prefix, "' matches no tensor of '", src_,
                         "' (tensor keys begin with ", key_heads(m_), ")"));
    }
    res_.tensors = items_.size();
  }

  void plan_files() {
    std::vector<uint64_t> sizes;
    for (const auto& it : items_) sizes.push_back(it.bytes);
    plan_ = plan_hf_shards(sizes, options_.max_shard_size);
    for (size_t f = 0; f < plan_.size(); ++f)
      res_.files.push_back(plan_.size() == 1 ? std::string(kSingleFile) : shard_file_name(f + 1, plan_.size()));
    if (plan_.size() > 1) res_.files.push_back(kIndexFile);
  }

  void write(const std::string& tmp) {
    ChunkReader reader(m_);
    // One buffer for the largest saved tensor takes each tensor in turn (chunks read
    // straight into it), and one for the largest converted tensor: memory stays at the
    // largest tensor whatever the model's size.
    const auto bytes_opt = at::TensorOptions().dtype(at::kByte);
    at::Tensor in_buf = at::empty({static_cast<int64_t>(largest_in_)}, bytes_opt);
    at::Tensor out_buf = at::empty({static_cast<int64_t>(converts_ ? largest_out_ : 0)}, bytes_opt);
    // The tensors in the order they are written; the kernel reads ahead of that order.
    std::vector<size_t> order;
    for (const auto& p : plan_) order.insert(order.end(), p.begin(), p.end());
    ReadAhead ahead(order.size(), [&](size_t k) {
      const Item& it = items_[order[k]];
      const EntryInfo& e = m_.entries.at(it.key);
      uint64_t n = 0;
      const sharding::Box whole = sharding::full_box(e.shape);
      for (const auto& c : reader.chunks(it.key, e, whole)) n += reader.prefetch(it.key, e, c, whole);
      return n;
    });
    size_t written = 0;
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t f = 0; f < plan_.size(); ++f) {
      std::vector<SafetensorsWriter::Spec> specs;
      for (size_t i : plan_[f]) {
        const Item& it = items_[i];
        specs.push_back({it.name, it.out_dtype, m_.entries.at(it.key).shape});
        weight_map[it.name] = res_.files[f];
      }
      SafetensorsWriter w(join_path(tmp, res_.files[f]), specs, {{"format", "pt"}});
      for (size_t i : plan_[f]) {
        ahead.before(written++);
        const Item& it = items_[i];
        const EntryInfo& e = m_.entries.at(it.key);
        const sharding::Box box = sharding::full_box(e.shape);
        at::Tensor t = in_buf.narrow(0, 0, static_cast<int64_t>(byte_size(e.shape, e.dtype, it.key)))
                           .view(e.dtype)
                           .view(e.shape);
        reader.fill_box(it.key, e, t, box, "the export");  // every element read before it is written
        if (it.out_dtype != e.dtype) {
          // copy_ converts as Tensor.to() does (round to nearest even).
          at::Tensor o = out_buf.narrow(0, 0, static_cast<int64_t>(it.bytes)).view(it.out_dtype).view(e.shape);
          o.copy_(t);
          t = o;
        }
        w.write(t);
      }
      w.finish();
    }
    if (plan_.size() > 1) write_index(tmp, weight_map);
    fsync_dir(tmp);
  }

  void write_index(const std::string& tmp, const nlohmann::json& weight_map) {
    nlohmann::json index = {{"metadata", {{"total_size", res_.total_size}}}, {"weight_map", weight_map}};
    const std::string text = index.dump(2, ' ', true) + "\n";  // json.dumps(indent=2, sort_keys=True)
    File idx(join_path(tmp, kIndexFile), "w");
    idx.write_all(text.data(), text.size());
    idx.fsync();
  }

  const std::string src_;
  const HfExportOptions& options_;
  CheckpointMetadata m_;
  HfExportResult res_;
  std::vector<Item> items_;
  uint64_t largest_in_ = 0, largest_out_ = 0;
  bool converts_ = false;
  std::vector<std::vector<size_t>> plan_;  // per file, the items it holds
};

}  // namespace

HfExportResult export_hf(const std::string& src, const std::string& out_arg, const HfExportOptions& options,
                         bool force) {
  std::string out = out_arg;  // "dir/" names "dir"
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return HfExport(src, options).run(out, force);
}

}  // namespace tessera::checkpoint
