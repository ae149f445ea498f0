#include "tessera/checkpoint/format/metadata.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"
#include "tessera/sharding/spec.h"

namespace tessera::checkpoint {

using json = nlohmann::json;

namespace {

// The most JSON values and member names (together) a metadata file may hold, counted while it
// is parsed, before the next one is stored: the parsed document costs about 30-80 bytes per
// value and parsing about 0.25 us per value, so hostile metadata under kMaxMetadataBytes costs
// at most a few hundred MB and a few seconds instead of gigabytes (issue 44 item 3). Real
// metadata holds far fewer: a version-2 tensor entry about 27, a list piece 7 (2-D), a
// version-1 chunk about 22 (a version-1 file of more than ~190,000 chunks is refused). The
// writers refuse to commit more (to_json); python/tessera_ckpt: MAX_METADATA_ITEMS.
constexpr uint64_t kMaxMetadataItems = 1ull << 22;
// A list layout's pieces per data file (sharding/layout.cpp's bound, checked there again).
constexpr int64_t kMaxListPiecesPerFile = 64;

// The dtypes a checkpoint may name (docs/checkpoint-format.md §1), in the order messages list them.
constexpr const char* kDtypeNames[] = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"};

std::string to_hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    s.push_back(d[c >> 4]);
    s.push_back(d[c & 15]);
  }
  return s;
}

std::string from_hex(const std::string& s, const std::string& what) {
  TESSERA_CHECK(s.size() % 2 == 0, what, ": odd-length hex");
  auto nib = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw Error(concat(what, ": bad hex digit"));
  };
  std::string out(s.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(nib(s[2 * i]) * 16 + nib(s[2 * i + 1]));
  return out;
}

// An integer in [lo, hi], checked before any narrowing (a value above 2^63 or 2^32 is
// out of range, never wrapped or truncated); errors name `what` and the value.
int64_t get_int_in(const json& j, int64_t lo, int64_t hi, const std::string& what) {
  TESSERA_CHECK(j.is_number_integer(), what, ": expected an integer, got ", j.dump());
  bool ok;
  int64_t v = 0;
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    ok = hi >= 0 && u <= static_cast<uint64_t>(hi);
    if (ok) v = static_cast<int64_t>(u);
  } else {
    v = j.get<int64_t>();
    ok = v <= hi;
  }
  TESSERA_CHECK(ok && v >= lo, what, " is ", j.dump(), ", outside [", lo, ", ", hi, "]");
  return v;
}

json value_json(const state::Value& v) {
  if (auto p = std::get_if<int64_t>(&v)) return {{"kind", "int"}, {"value", *p}};
  if (auto p = std::get_if<double>(&v)) {
    uint64_t bits;
    std::memcpy(&bits, p, 8);
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(bits));
    json j = {{"kind", "float"}, {"bits", buf}};
    j["value"] = std::isfinite(*p) ? json(*p) : json(nullptr);
    return j;
  }
  if (auto p = std::get_if<bool>(&v)) return {{"kind", "bool"}, {"value", *p}};
  if (auto p = std::get_if<std::string>(&v)) return {{"kind", "string"}, {"value", *p}};
  if (auto p = std::get_if<state::Bytes>(&v)) return {{"kind", "bytes"}, {"hex", to_hex(p->data)}};
  if (auto p = std::get_if<std::shared_ptr<state::StateDict>>(&v)) {
    TESSERA_CHECK(!*p || (*p)->empty(), "internal: non-empty dict is flattened before encoding");
    return {{"kind", "dict"}};
  }
  throw Error(concat("a ", state::kind_name(v), " is not a plain value"));
}

state::Value value_from_json(const json& j, const std::string& what) {
  TESSERA_CHECK(j.is_object() && j.contains("kind") && j["kind"].is_string(), what, ": value has no kind");
  const std::string k = j["kind"].get<std::string>();
  auto need = [&](const char* field, bool ok) {
    TESSERA_CHECK(j.contains(field) && ok, what, ": ", k, " value has a missing or bad '", field, "'");
  };
  if (k == "int") {
    need("value", j.contains("value") && j["value"].is_number_integer());
    return get_int_in(j["value"], std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                      what + " value");
  }
  if (k == "float") {
    need("bits", j.contains("bits") && j["bits"].is_string() && j["bits"].get<std::string>().size() == 16);
    const std::string b = from_hex(j["bits"].get<std::string>(), what);
    uint64_t bits = 0;
    for (unsigned char c : b) bits = (bits << 8) | c;
    double d;
    std::memcpy(&d, &bits, 8);
    // "value" is for people reading the file; it must say what "bits" says (null for
    // NaN and infinities), so an edit of the readable number cannot go unnoticed.
    const bool agrees = !j.contains("value") ||
                        (std::isfinite(d) ? j["value"].is_number() && j["value"].get<double>() == d &&
                                                std::signbit(j["value"].get<double>()) == std::signbit(d)
                                          : j["value"].is_null());
    TESSERA_CHECK(agrees, what, ": float value ", j["value"].dump(), " disagrees with its bits ", j["bits"].dump());
    return d;
  }
  if (k == "bool") {
    need("value", j.contains("value") && j["value"].is_boolean());
    return j["value"].get<bool>();
  }
  if (k == "string") {
    need("value", j.contains("value") && j["value"].is_string());
    return j["value"].get<std::string>();
  }
  if (k == "bytes") {
    need("hex", j.contains("hex") && j["hex"].is_string());
    return state::Bytes{from_hex(j["hex"].get<std::string>(), what)};
  }
  if (k == "dict") return std::make_shared<state::StateDict>();
  throw Error(concat(what, ": unknown value kind '", k, "'"));
}

uint64_t get_u64(const json& j, const std::string& what) {
  TESSERA_CHECK(j.is_number_unsigned(), what, ": expected a non-negative integer, got ", j.dump());
  return j.get<uint64_t>();
}

std::vector<int64_t> get_dims(const json& j, const std::string& what) {
  TESSERA_CHECK(j.is_array(), what, ": expected an array of dimensions");
  std::vector<int64_t> v;
  for (const auto& d : j) {
    TESSERA_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, what, ": bad dimension ", d.dump());
    v.push_back(d.get<int64_t>());
  }
  return v;
}

}  // namespace

std::string encode_value(const state::Value& v) { return value_json(v).dump(); }

state::Value decode_value(const std::string& text, const std::string& what) {
  return value_from_json(parse_json_strict(text, what), what);
}


void check_plain_name(const std::string& name, const std::string& what) {
  TESSERA_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
                    name.find('\\') == std::string::npos && name.find('\0') == std::string::npos && name.size() < 256,
                what, ": file name '", name, "' is not a plain name inside the checkpoint directory");
}

void check_tiling(const std::string& fqn, const EntryInfo& e) {
  // The whole tensor must be addressable: its byte size (and so its element count) fits
  // in 2^62, checked without wrapping (byte_size), before any box arithmetic.
  byte_size(e.shape, e.dtype, concat("key '", fqn, "': shape ", core::shape_string(e.shape)));
  const sharding::Box whole = sharding::full_box(e.shape);
  // No two of the chunks below `limit` overlap (sharding::first_overlap's sweep, not every pair).
  auto check_overlap = [&](size_t limit) {
    const auto o = sharding::first_overlap(limit, [&](size_t i) -> const sharding::Box& { return e.chunks[i].box; });
    TESSERA_CHECK(!o, "key '", fqn, "': chunks ", e.chunks[o->first].box.to_string(), " and ",
                  e.chunks[o->second].box.to_string(), " overlap");
  };
  for (size_t i = 0; i < e.chunks.size(); ++i) {
    const ChunkInfo& c = e.chunks[i];
    try {
      TESSERA_CHECK(c.box.dim() == e.shape.size() && c.box.offsets.size() == c.box.sizes.size(), "key '", fqn,
                    "': chunk ", c.box.to_string(), " has the wrong number of dimensions for shape of rank ",
                    e.shape.size());
      for (size_t d = 0; d < c.box.dim(); ++d)
        TESSERA_CHECK(c.box.offsets[d] >= 0 && c.box.sizes[d] >= 0, "key '", fqn, "': chunk ", c.box.to_string(),
                      " has negative offsets or sizes");
      // Every chunk, empty ones included, lies inside the shape (no offset + size wraps).
      TESSERA_CHECK(sharding::inside_shape(e.shape, c.box), "key '", fqn, "': chunk ", c.box.to_string(),
                    " lies outside the shape ", whole.to_string());
    } catch (const Error&) {
      check_overlap(i);  // an overlap before the bad chunk is named first, as a chunk-by-chunk check does
      throw;
    }
  }
  check_overlap(e.chunks.size());
  int64_t volume = 0;  // inside the shape and disjoint: the sum stays <= whole.numel()
  for (const auto& c : e.chunks) volume += c.box.numel();
  TESSERA_CHECK(volume == whole.numel(), "key '", fqn, "': the chunks cover ", volume, " of ", whole.numel(),
                " elements (incomplete checkpoint)");
}

// "metadata_crc32c" as to_json prints it: a top-level key of dump(1) starts a line with
// one space of indent (nested keys have more, and a newline inside a string is escaped).
constexpr const char* kMetadataCrcMarker = "\n \"metadata_crc32c\": \"";

namespace {

// The fields every version's metadata has.
json header_json(const CheckpointMetadata& m, int version) {
  json j;
  j["format"] = "tessera-checkpoint";
  j["version"] = version;
  j["world_size"] = m.world_size;
  j["crc32c_block"] = m.crc_block;
  return j;
}

std::string to_json_v1(const CheckpointMetadata& m) {
  json j = header_json(m, 1);
  j["files"] = json::array();
  for (auto& [n, s] : m.files) j["files"].push_back({{"name", n}, {"size", s}});
  j["keys"] = m.keys;
  json entries = json::object();
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (!e.is_tensor()) {
      entries[k] = value_json(e.value);
      continue;
    }
    json je = {{"kind", e.kind}, {"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"chunks", json::array()}};
    for (const auto& c : e.chunks) {
      json crcs = json::array();
      for (uint32_t x : c.crcs) crcs.push_back(crc_hex(x));
      je["chunks"].push_back({{"offsets", c.box.offsets},
                              {"sizes", c.box.sizes},
                              {"file", c.file},
                              {"name", c.name},
                              {"byte_range", {c.begin, c.end}},
                              {"crc32c", crcs}});
    }
    entries[k] = je;
  }
  j["entries"] = entries;
  j["metadata_crc32c"] = "00000000";
  std::string text = j.dump(1);
  const size_t at = text.find(kMetadataCrcMarker);
  TESSERA_CHECK(at != std::string::npos, "internal: metadata checksum placeholder not found");
  const std::string hex = crc_hex(crc32c(text.data(), text.size()));
  text.replace(at + std::string(kMetadataCrcMarker).size(), 8, hex);
  return text;
}

// Version 2's checksum member: the last of the text.
constexpr const char* kMetadataCrcTail = ",\"metadata_crc32c\":\"";
constexpr size_t kTailBytes = 20 + 8 + 2;  // marker, 8 hex digits, "}

json files_json(const sharding::FileMap& f) {
  json j = {{"first", f.first}, {"step", f.step}};
  if (f.replicas > 1) {
    j["replicas"] = f.replicas;
    j["replica_step"] = f.replica_step;
    j["shift"] = f.shift;
  }
  return j;
}

json layout_json(const sharding::Layout& L) {
  using R = sharding::Layout::Rule;
  switch (L.rule) {
    case R::Whole: return {{"rule", "whole"}, {"file", L.file}};
    case R::Chunk: return {{"rule", "chunk"}, {"dim", L.dim}, {"pieces", L.pieces}, {"files", files_json(L.files)}};
    case R::Flat:
      return {{"rule", "flat"},
              {"numel", L.flat_numel},
              {"offset", L.flat_offset},
              {"pieces", L.pieces},
              {"files", files_json(L.files)}};
    case R::List: {
      json pieces = json::array();
      for (const auto& p : L.list) pieces.push_back(json::array({p.file, p.box.offsets, p.box.sizes}));
      return {{"rule", "list"}, {"pieces", pieces}};
    }
    case R::Tp: {
      json inner;
      auto one_or_all = [](const std::vector<int64_t>& v) { return v.size() == 1 ? json(v[0]) : json(v); };
      switch (L.inner) {
        case R::Chunk: inner = {{"rule", "chunk"}, {"dim", L.inner_dim}, {"pieces", L.pieces}}; break;
        case R::Flat:
          inner = {{"rule", "flat"},
                   {"numel", one_or_all(L.inner_numel)},
                   {"offset", one_or_all(L.inner_offset)},
                   {"pieces", L.pieces}};
          break;
        default: inner = {{"rule", "whole"}};
      }
      return {{"rule", "tp"},       {"dim", L.dim},   {"stripes", L.stripes},
              {"tp", L.tp},         {"inner", inner}, {"files", files_json(L.files)}};
    }
  }
  return {};
}

json entry_json_v2(const std::string& k, const EntryInfo& e) {
  if (!e.is_tensor()) return value_json(e.value);
  TESSERA_CHECK(e.layout.has_value(), "internal: key '", k, "' has no layout for format version 2 or 3");
  return {{"kind", e.kind}, {"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"layout", layout_json(*e.layout)}};
}

std::string to_json_v2(const CheckpointMetadata& m, int version) {
  json j = header_json(m, version);
  j["save_id"] = m.save_id;
  j["keys"] = m.keys;
  json entries = json::object();
  for (const auto& k : m.keys) {
    entries[k] = entry_json_v2(k, m.entries.at(k));
  }
  j["entries"] = std::move(entries);
  std::string text = j.dump();
  TESSERA_CHECK(!text.empty() && text.back() == '}', "internal: metadata text is not an object");
  text.pop_back();
  text += kMetadataCrcTail;
  text += "00000000\"}";
  const std::string hex = crc_hex(crc32c(text.data(), text.size()));
  text.replace(text.size() - 10, 8, hex);
  return text;
}

}  // namespace

std::string entry_json(const EntryInfo& e) { return entry_json_v2("", e).dump(); }

int format_version_for(const CheckpointMetadata& m) {
  for (const auto& kv : m.entries) {
    const auto& L = kv.second.layout;
    if (L && (L->rule == sharding::Layout::Rule::Tp || L->files.interleaved())) return 3;
  }
  return kFormatVersionRules;
}

std::string to_json(const CheckpointMetadata& m) {
  TESSERA_CHECK(m.version >= 1 && m.version <= kFormatVersion, "internal: cannot write metadata of format version ",
                m.version);
  // Past version 1, the version is what the layouts need (format_version_for).
  std::string text;
  if (m.version == 1) {
    text = to_json_v1(m);
  } else {
    text = to_json_v2(m, format_version_for(m));
  }
  TESSERA_CHECK(text.size() <= kMaxMetadataBytes, "the checkpoint's metadata would be ", text.size(),
                " bytes, more than the ", kMaxMetadataBytes, "-byte limit every reader enforces (", m.keys.size(),
                " keys): nothing is committed");
  const uint64_t items = count_json_items(text);
  TESSERA_CHECK(items <= kMaxMetadataItems, "the checkpoint's metadata would hold ", items,
                " JSON values and keys, more than the ", kMaxMetadataItems, " every reader enforces (", m.keys.size(),
                " keys): nothing is committed");
  return text;
}

std::string new_save_id() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  static const char* d = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[static_cast<size_t>(i)] = d[(v >> (60 - 4 * i)) & 15];
  return s;
}

std::string piece_name(const std::string& fqn, const sharding::Layout& layout, const std::vector<int64_t>& shape,
                       int64_t i) {
  using R = sharding::Layout::Rule;
  if (layout.rule != R::List && layout.rule != R::Tp) return fqn;
  // The non-empty pieces of the entry in piece i's file, in piece order.
  int64_t k = 0, total = 0;
  if (layout.rule == R::List) {
    const int64_t f = layout.list.at(static_cast<size_t>(i)).file;
    for (size_t j = 0; j < layout.list.size(); ++j) {
      if (layout.list[j].file != f || layout.list[j].box.empty()) continue;
      if (static_cast<int64_t>(j) < i) ++k;
      ++total;
    }
  } else {
    for (int64_t j : layout.pieces_in_file(layout.file_of(i))) {
      if (layout.box(shape, j).empty()) continue;
      if (j < i) ++k;
      ++total;
    }
  }
  return total == 1 ? fqn : concat(fqn, "@", k);
}

void check_metadata_checksum(const std::string& text, const std::string& where) {
  const std::string tail = kMetadataCrcTail;
  if (text.find(kMetadataCrcMarker) == std::string::npos && text.size() >= kTailBytes &&
      text.compare(text.size() - kTailBytes, tail.size(), tail) == 0 && text.back() == '}' &&
      text[text.size() - 2] == '"') {  // version 2: the last member
    std::string zeroed = text;
    zeroed.replace(text.size() - 10, 8, "00000000");
    const uint32_t want = parse_crc_hex(text.substr(text.size() - 10, 8), where + " metadata_crc32c");
    const uint32_t got = crc32c(zeroed.data(), zeroed.size());
    TESSERA_CHECK(got == want, where, ": metadata checksum mismatch (metadata_crc32c ", crc_hex(want), ", computed ",
                  crc_hex(got), ") — the metadata is corrupt");
    return;
  }
  const std::string marker = kMetadataCrcMarker;
  const size_t at = text.find(marker);
  TESSERA_CHECK(at != std::string::npos && text.find(marker, at + 1) == std::string::npos &&
                    at + marker.size() + 8 <= text.size(),
                where, ": no metadata_crc32c where the writer puts it — the metadata is corrupt (or hand-edited)");
  std::string zeroed = text;
  zeroed.replace(at + marker.size(), 8, "00000000");
  const uint32_t want = parse_crc_hex(text.substr(at + marker.size(), 8), where + " metadata_crc32c");
  const uint32_t got = crc32c(zeroed.data(), zeroed.size());
  TESSERA_CHECK(got == want, where, ": metadata checksum mismatch (metadata_crc32c ", crc_hex(want), ", computed ",
                crc_hex(got), ") — the metadata is corrupt");
}

// `o[key]` of a JSON value read from a file, or null where `o` is no object or has no such
// key (nlohmann's const operator[] on a missing key is undefined behaviour: found by
// fuzz_metadata).
static const json& field(const json& o, const char* key) {
  static const json null_value;
  if (!o.is_object()) return null_value;
  const auto it = o.find(key);
  return it == o.end() ? null_value : *it;
}

namespace {

// Every field of a layout is range-checked here, in this order, with the words of
// python/tessera_ckpt/_format_metadata.py parse_layout (issue 44 item 5: one rule and one message per
// field in both readers; tests/checkpoint/test_metadata_agreement.cpp runs each crafted file
// through both). `what` is "'DIR/tessera-checkpoint.json' key 'FQN'".
sharding::FileMap files_from_json(const json& j, int64_t pieces, int64_t world_size, int version,
                                  const std::string& what, const char* holders_are = "layout.pieces") {
  TESSERA_CHECK(j.is_object(), what, ": layout.files is not an object");
  sharding::FileMap f;
  f.first = get_int_in(field(j, "first"), 0, world_size - 1, what + " layout.files.first");
  f.step = get_int_in(field(j, "step"), 1, world_size, what + " layout.files.step");
  if (j.contains("replicas")) {  // replicas, replica_step and shift come together
    f.replicas = get_int_in(field(j, "replicas"), 1, world_size, what + " layout.files.replicas");
    f.replica_step = get_int_in(field(j, "replica_step"), 0, world_size - 1, what + " layout.files.replica_step");
    f.shift = get_int_in(field(j, "shift"), 0, std::numeric_limits<int64_t>::max(),
                         what + " layout.files.shift");  // any: taken mod replicas
  }
  // All of them at most 2^20: no product below wraps. Replica groups follow each other or
  // interleave inside each step (sharding::FileMap).
  TESSERA_CHECK(f.replicas == 1 || f.replica_step >= pieces * f.step || (f.interleaved() && version >= 3), what,
                ": layout.files.replica_step ", f.replica_step, " is below ", holders_are, " * layout.files.step = ",
                pieces * f.step, " (two pieces would share a file)",
                f.interleaved() ? "; interleaved replica groups need format version 3" : "");
  const int64_t last = f.first + (pieces - 1) * f.step + (f.replicas - 1) * f.replica_step;
  TESSERA_CHECK(last < world_size, what, ": layout.files reach data file ", last, ", outside [0, ", world_size - 1,
                "]");
  return f;
}

// Version 3's tp rule: the tensor-parallel cut, then the inner rule of every TP piece, then
// the files of its pieces·tp holders.
sharding::Layout tp_layout_from_json(const json& j, const std::vector<int64_t>& shape, int64_t world_size,
                                     const std::string& what) {
  const int64_t big = std::numeric_limits<int64_t>::max();
  const int64_t rank = static_cast<int64_t>(shape.size());
  TESSERA_CHECK(rank > 0, what, ": a tp layout needs a tensor of at least one dimension");
  const int64_t dim = get_int_in(field(j, "dim"), 0, rank - 1, what + " layout.dim");
  const int64_t stripes = get_int_in(field(j, "stripes"), 1, sharding::kMaxStripes, what + " layout.stripes");
  const int64_t tp = get_int_in(field(j, "tp"), 1, world_size, what + " layout.tp");
  const json& in = field(j, "inner");
  TESSERA_CHECK(in.is_object(), what, ": layout.inner is not an object");
  const json& rule_j = field(in, "rule");
  const std::string rule = rule_j.is_string() ? rule_j.get<std::string>() : "";
  TESSERA_CHECK(rule == "whole" || rule == "chunk" || rule == "flat", what, ": unknown layout.inner.rule ",
                rule_j.dump(), " (known: whole, chunk, flat)");
  sharding::Layout inner = sharding::Layout::whole(0);
  std::vector<int64_t> numel, offset;
  if (rule == "chunk") {
    const int64_t d = get_int_in(field(in, "dim"), 0, rank - 1, what + " layout.inner.dim");
    inner = sharding::Layout::chunk(d, get_int_in(field(in, "pieces"), 1, world_size, what + " layout.inner.pieces"));
  } else if (rule == "flat") {
    // One integer, or one per TP piece (tp of them).
    auto ints = [&](const char* name) {
      const json& v = field(in, name);
      const std::string at = concat(what, " layout.inner.", name);
      std::vector<int64_t> out;
      if (!v.is_array()) {
        out.push_back(get_int_in(v, 0, big, at));
        return out;
      }
      TESSERA_CHECK(static_cast<int64_t>(v.size()) == tp, at, " holds ", v.size(), " values (1, or layout.tp = ", tp,
                    ")");
      for (size_t t = 0; t < v.size(); ++t) out.push_back(get_int_in(v[t], 0, big, concat(at, "[", t, "]")));
      return out;
    };
    numel = ints("numel");
    offset = ints("offset");
    inner = sharding::Layout::flat(numel[0], offset[0],
                                   get_int_in(field(in, "pieces"), 1, world_size, what + " layout.inner.pieces"));
  }
  const int64_t holders = (rule == "whole" ? 1 : inner.pieces) * tp;
  TESSERA_CHECK(holders <= world_size, what, ": layout.inner.pieces ", holders / tp, " x layout.tp ", tp,
                " holders exceed world_size ", world_size);
  const sharding::FileMap files =
      files_from_json(field(j, "files"), holders, world_size, 3, what, "layout.inner.pieces * layout.tp");
  return sharding::Layout::tensor_parallel(dim, stripes, tp, inner, files, numel, offset);
}

sharding::Layout layout_from_json(const json& j, const std::vector<int64_t>& shape, int64_t world_size,
                                  int version, const std::string& what) {
  TESSERA_CHECK(j.is_object(), what, ": layout is not an object");
  const json& rule_j = field(j, "rule");
  const std::string rule = rule_j.is_string() ? rule_j.get<std::string>() : "";
  TESSERA_CHECK(rule == "whole" || rule == "chunk" || rule == "flat" || rule == "list" || (rule == "tp" && version >= 3),
                what, ": unknown layout rule ", rule_j.dump(),
                version >= 3 ? " (known: whole, chunk, flat, list, tp)"
                             : " (known: whole, chunk, flat, list; tp needs format version 3)");
  if (rule == "tp") {
    sharding::Layout L = tp_layout_from_json(j, shape, world_size, what);
    L.validate(shape, world_size, what);
    return L;
  }
  const int64_t big = std::numeric_limits<int64_t>::max();
  const int64_t rank = static_cast<int64_t>(shape.size());
  sharding::Layout L;
  if (rule == "whole") {
    L = sharding::Layout::whole(get_int_in(field(j, "file"), 0, world_size - 1, what + " layout.file"));
  } else if (rule == "chunk" || rule == "flat") {
    TESSERA_CHECK(rank > 0, what, ": a ", rule,
                  " layout needs a tensor of at least one dimension (a 0-dimensional one is whole)");
    if (rule == "chunk") {
      const int64_t dim = get_int_in(field(j, "dim"), 0, rank - 1, what + " layout.dim");
      const int64_t pieces = get_int_in(field(j, "pieces"), 1, world_size, what + " layout.pieces");
      L = sharding::Layout::chunk(dim, pieces, files_from_json(field(j, "files"), pieces, world_size, version, what));
    } else {
      const int64_t numel = get_int_in(field(j, "numel"), 0, big, what + " layout.numel");
      const int64_t offset = get_int_in(field(j, "offset"), 0, big, what + " layout.offset");
      const int64_t pieces = get_int_in(field(j, "pieces"), 1, world_size, what + " layout.pieces");
      int64_t n = 1;  // <= 2^62: the shape's byte size was checked first
      for (int64_t d : shape) n = d == 0 ? 0 : n * d;
      TESSERA_CHECK(static_cast<__int128>(offset) + n <= numel, what, ": layout.offset ", offset, " + the tensor's ",
                    n, " elements exceed layout.numel ", numel);
      L = sharding::Layout::flat(numel, offset, pieces, files_from_json(field(j, "files"), pieces, world_size, version, what));
    }
  } else {
    L.rule = sharding::Layout::Rule::List;
    const json& ps = field(j, "pieces");
    TESSERA_CHECK(ps.is_array(), what, ": layout.pieces is not an array");
    const int64_t most = kMaxListPiecesPerFile * world_size;
    TESSERA_CHECK(static_cast<int64_t>(ps.size()) <= most, what, ": layout.pieces lists ", ps.size(),
                  " pieces, more than ", kMaxListPiecesPerFile, " per data file (", most,
                  " for world_size ", world_size, ")");
    L.list.reserve(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) {
      const json& p = ps[i];
      const std::string at = concat(what, " layout.pieces[", i, "]");
      TESSERA_CHECK(p.is_array() && p.size() == 3, at, " is not [file, offsets, sizes]");
      sharding::LayoutPiece lp;
      lp.file = get_int_in(p[0], 0, world_size - 1, at + " file");
      lp.box.offsets = get_dims(p[1], at + " offsets");
      lp.box.sizes = get_dims(p[2], at + " sizes");
      L.list.push_back(std::move(lp));
    }
  }
  L.validate(shape, world_size, what);  // a list's boxes: rank, inside the shape, not empty, no overlap, cover
  return L;
}

// The entries of `j` in key order, checked alike in both versions: keys are strings, each
// has an entry and appears once, every entry has a kind; plain values are decoded, and a
// tensor entry's dtype and shape read before `tensor` completes it (its chunks, version 1,
// or its layout, version 2).
void parse_entries(const json& j, CheckpointMetadata& m, const std::string& where,
                   const std::function<void(const json& je, EntryInfo& e, const std::string& fqn,
                                            const std::string& what)>& tensor) {
  TESSERA_CHECK(field(j, "keys").is_array() && field(j, "entries").is_object(), where, ": keys/entries missing");
  const json& entries = field(j, "entries");
  for (const auto& k : field(j, "keys")) {
    TESSERA_CHECK(k.is_string(), where, ": a key is not a string");
    const std::string fqn = k.get<std::string>();
    TESSERA_CHECK(entries.contains(fqn), where, ": key '", fqn, "' has no entry");
    TESSERA_CHECK(!m.entries.count(fqn), where, ": key '", fqn, "' listed twice");
    const json& je = entries[fqn];
    const std::string what = concat(where, " key '", fqn, "'");
    TESSERA_CHECK(je.is_object() && je.contains("kind") && field(je, "kind").is_string(), what, ": no kind");
    EntryInfo e;
    e.kind = field(je, "kind").get<std::string>();
    if (e.kind != kTensorKind && e.kind != kShardedKind) {
      e.value = value_from_json(je, what);
    } else {
      const json& dt = field(je, "dtype");
      bool known = false;
      for (const char* name : kDtypeNames) known = known || (dt.is_string() && dt.get<std::string>() == name);
      TESSERA_CHECK(known, what, ": unknown dtype ", dt.dump(), " (known: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");
      e.dtype = parse_dtype(dt.get<std::string>(), what);
      e.shape = get_dims(field(je, "shape"), what + " shape");
      tensor(je, e, fqn, what);
    }
    m.keys.push_back(fqn);
    m.entries.emplace(fqn, std::move(e));
  }
}

void parse_v2(const json& j, CheckpointMetadata& m, const std::string& where) {
  const json& sid = field(j, "save_id");
  bool hex = sid.is_string() && sid.get<std::string>().size() == 16;
  if (hex)
    for (char c : sid.get<std::string>()) hex = hex && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
  TESSERA_CHECK(hex, where, ": save_id ", sid.dump(), " is not 16 lowercase hex digits");
  m.save_id = sid.get<std::string>();
  TESSERA_CHECK(field(j, "keys").is_array() && field(j, "entries").is_object(), where, ": keys/entries missing");
  const json& entries = field(j, "entries");
  TESSERA_CHECK(entries.size() == field(j, "keys").size(), where, ": ", entries.size(), " entries for ",
                field(j, "keys").size(), " keys");
  parse_entries(j, m, where, [&](const json& je, EntryInfo& e, const std::string&, const std::string& what) {
    byte_size(e.shape, e.dtype, concat(what, ": shape ", core::shape_string(e.shape)));  // <= 2^62 bytes
    e.layout = layout_from_json(field(je, "layout"), e.shape, m.world_size, m.version, what);
  });
}

}  // namespace

CheckpointMetadata parse_metadata(const std::string& text, const std::string& dir) {
  const std::string where = concat("'", join_path(dir, kMetadataFile), "'");
  json j = parse_json_bounded(text, concat(where, ": metadata"), kMaxMetadataItems);
  TESSERA_CHECK(j.is_object() && j.value("format", "") == "tessera-checkpoint", where,
                ": not Tessera checkpoint metadata (no \"format\": \"tessera-checkpoint\")");
  CheckpointMetadata m;
  m.source_kind = kSourceSharded;
  m.location = dir;
  try {
    TESSERA_CHECK(j.contains("version") && j["version"].is_number_integer(), where, ": no integer version");
    const json& jv = j["version"];
    const bool known = jv.is_number_unsigned() ? jv.get<uint64_t>() >= 1 && jv.get<uint64_t>() <= kFormatVersion
                                               : jv.get<int64_t>() >= 1 && jv.get<int64_t>() <= kFormatVersion;
    TESSERA_CHECK(known, where, ": format version ", jv.dump(), " is not supported (this reader reads versions 1..",
                  kFormatVersion, ")");
    m.version = static_cast<int>(jv.get<int64_t>());
    TESSERA_CHECK(j.contains("world_size"), where, ": no world_size");
    m.world_size = static_cast<int>(get_int_in(j["world_size"], 1, kMaxWorldSize, where + " world_size"));
    m.crc_block = get_u64(j["crc32c_block"], where + " crc32c_block");
    check_crc_block(m.crc_block, where + " crc32c_block");
    if (m.version >= 2) {
      parse_v2(j, m, where);
      return m;
    }
    TESSERA_CHECK(j["files"].is_array(), where, ": files is not an array");
    for (const auto& f : j["files"]) {
      TESSERA_CHECK(f.is_object() && f.contains("name") && field(f, "name").is_string(), where, ": bad files entry");
      check_plain_name(field(f, "name").get<std::string>(), where);
      m.files.emplace_back(field(f, "name").get<std::string>(), get_u64(field(f, "size"), where + " file size"));
    }
    // Every writer (save, reshard) writes one data file per rank, so the file list and
    // the world size must agree.
    TESSERA_CHECK(m.files.size() == static_cast<size_t>(m.world_size), where, ": world_size is ", m.world_size,
                  " but ", m.files.size(), " data files are listed (one per rank)");
    parse_entries(j, m, where, [&](const json& je, EntryInfo& e, const std::string& fqn, const std::string& what) {
      TESSERA_CHECK(field(je, "chunks").is_array(), what, ": chunks is not an array");
      for (const auto& jc : field(je, "chunks")) {
        ChunkInfo c;
        c.box.offsets = get_dims(field(jc, "offsets"), what + " chunk offsets");
        c.box.sizes = get_dims(field(jc, "sizes"), what + " chunk sizes");
        TESSERA_CHECK(field(jc, "file").is_string() && field(jc, "name").is_string(), what, ": chunk without file/name");
        c.file = field(jc, "file").get<std::string>();
        check_plain_name(c.file, what);
        c.name = field(jc, "name").get<std::string>();
        const json& br = field(jc, "byte_range");
        TESSERA_CHECK(br.is_array() && br.size() == 2, what, ": bad byte_range");
        c.begin = get_u64(br[0], what + " byte_range");
        c.end = get_u64(br[1], what + " byte_range");
        TESSERA_CHECK(c.begin <= c.end && c.end - c.begin == byte_size(c.box.sizes, e.dtype, what), what,
                      ": byte_range [", c.begin, ", ", c.end, "] does not match chunk ", c.box.to_string());
        TESSERA_CHECK(field(jc, "crc32c").is_array() && field(jc, "crc32c").size() == num_blocks(c.end - c.begin, m.crc_block),
                      what, ": chunk ", c.box.to_string(), " needs ", num_blocks(c.end - c.begin, m.crc_block),
                      " checksums");
        for (const auto& x : field(jc, "crc32c")) {
          TESSERA_CHECK(x.is_string(), what, ": checksum is not a string");
          c.crcs.push_back(parse_crc_hex(x.get<std::string>(), what));
        }
        e.chunks.push_back(std::move(c));
      }
      try {
        check_tiling(fqn, e);
      } catch (const Error& err) {  // name the metadata file, as every other error here does
        throw Error(concat(where, ": ", err.what()));
      }
    });
  } catch (const nlohmann::json::exception& e) {
    throw Error(concat(where, ": malformed metadata: ", e.what()));
  }
  return m;
}

}  // namespace tessera::checkpoint
