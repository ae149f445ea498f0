// The gpt example's settings, checked in one place whether they come from the command
// line or from a checkpoint:
//  - numeric flags: integers and finite floats within ranges, with errors that print
//    the bound readably (CLI11's own Range/PositiveNumber print DBL_MAX in full and let
//    "nan" through);
//  - the model-shaping settings (n_layer, n_head, d_model, seq_len, tie_weights): one
//    table of ranges, used by the `gpt train` flags and by the hparams a checkpoint
//    stores, read by `gpt sample` and by `gpt train --resume` (a checkpoint is input
//    like any other: an edited hparams.n_head = 0 must not reach a division);
//  - the weights a checkpoint holds are compared with the shapes its hparams imply
//    before any model is built (n_layer = 100000 must not allocate anything).
#pragma once
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/format/safetensors.h"

namespace gpt {

// %g of a bound or a value ("0.9", "1e+06").
inline std::string short_number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// A whole decimal integer (optional sign, digits, nothing else), or nothing.
inline std::optional<int64_t> parse_int(const std::string& s) {
  if (s.empty() || s.size() > 20) return std::nullopt;
  size_t i = s[0] == '-' || s[0] == '+' ? 1 : 0;
  if (i == s.size()) return std::nullopt;
  for (size_t j = i; j < s.size(); ++j)
    if (s[j] < '0' || s[j] > '9') return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno == ERANGE || end != s.c_str() + s.size()) return std::nullopt;
  return static_cast<int64_t>(v);
}

// "" when `text` is an integer in [lo, hi], else what is wrong with it.
inline std::string check_int_text(const std::string& text, int64_t lo, int64_t hi) {
  const std::optional<int64_t> v = parse_int(text);
  const std::string range = hi == std::numeric_limits<int64_t>::max()
                                ? "an integer >= " + std::to_string(lo)
                                : "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (!v || *v < lo || *v > hi) return "must be " + range + ", got '" + text + "'";
  return "";
}

// "" when `text` is a finite number in the range (lo excluded when lo_open), else what is wrong.
inline std::string check_float_text(const std::string& text, double lo, double hi, bool lo_open) {
  char* end = nullptr;
  const double v = text.empty() ? std::nan("") : std::strtod(text.c_str(), &end);
  const std::string range = std::string(lo_open ? "> " : ">= ") + short_number(lo) +
                            (std::isinf(hi) ? std::string() : " and <= " + short_number(hi));
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v))
    return "must be a finite number " + range + ", got '" + text + "'";
  if ((lo_open ? v <= lo : v < lo) || v > hi) return "must be " + range + ", got '" + text + "'";
  return "";
}

// CLI11 validators over the functions above (CLI11 prefixes the flag's name).
inline CLI::Validator int_in(int64_t lo, int64_t hi = std::numeric_limits<int64_t>::max()) {
  return CLI::Validator([lo, hi](std::string& s) { return check_int_text(s, lo, hi); }, "INT");
}
inline CLI::Validator float_in(double lo, double hi, bool lo_open = false) {
  return CLI::Validator([lo, hi, lo_open](std::string& s) { return check_float_text(s, lo, hi, lo_open); }, "FLOAT");
}
inline CLI::Validator positive_float() { return float_in(0, std::numeric_limits<double>::infinity(), true); }
inline CLI::Validator non_negative_float() { return float_in(0, std::numeric_limits<double>::infinity()); }

// The model-shaping settings: hparams key, flag, range. The upper bounds are far above
// anything this example trains on a CPU, and low enough that no product of them
// overflows when shapes are computed.
struct ShapeSetting {
  const char* key;
  const char* flag;
  int64_t lo, hi;
};
inline const std::vector<ShapeSetting>& shape_settings() {
  static const std::vector<ShapeSetting> s = {{"n_layer", "--n-layer", 1, 1024},
                                              {"n_head", "--n-head", 1, 1024},
                                              {"d_model", "--d-model", 1, 65536},
                                              {"seq_len", "--seq-len", 1, 1048576}};
  return s;
}
inline const ShapeSetting& shape_setting(const std::string& key) {
  for (const auto& s : shape_settings())
    if (key == s.key) return s;
  throw std::logic_error("gpt: no shape setting " + key);
}
inline CLI::Validator shape_flag(const std::string& key) {
  const ShapeSetting& s = shape_setting(key);
  return int_in(s.lo, s.hi);
}
inline int64_t& config_field(Config& c, const std::string& key) {
  if (key == "n_layer") return c.n_layer;
  if (key == "n_head") return c.n_head;
  if (key == "d_model") return c.d_model;
  return c.seq_len;
}
inline std::string config_value(const Config& c, const std::string& key) {
  if (key == "tie_weights") return c.tie_weights ? "true" : "false";
  Config copy = c;
  return std::to_string(config_field(copy, key));
}
inline std::vector<std::string> config_keys() { return {"n_layer", "n_head", "d_model", "seq_len", "tie_weights"}; }

// The hparams value `key` of a checkpoint, as text (hparams are stored as strings).
inline std::optional<std::string> stored_hparam(const tessera::checkpoint::CheckpointMetadata& m,
                                                const std::string& key) {
  auto it = m.entries.find("hparams." + key);
  if (it == m.entries.end()) return std::nullopt;
  const std::string* s = std::get_if<std::string>(&it->second.value);
  if (!s)
    throw std::runtime_error("checkpoint '" + m.location + "': hparams." + key + " is of kind '" + it->second.kind + "'" +
                             ", not the text gpt train stores");
  return *s;
}

// The model configuration stored in a checkpoint's hparams, checked like the flags.
inline Config stored_config(const tessera::checkpoint::CheckpointMetadata& m) {
  const std::string where = "checkpoint '" + m.location + "': ";
  Config c;
  for (const auto& s : shape_settings()) {
    const std::optional<std::string> v = stored_hparam(m, s.key);
    if (!v) throw std::runtime_error(where + "has no hparams." + s.key + " (not a checkpoint of gpt train)");
    const std::string bad = check_int_text(*v, s.lo, s.hi);
    if (!bad.empty()) throw std::runtime_error(where + "hparams." + s.key + " " + bad + " (as " + s.flag + ")");
    config_field(c, s.key) = *parse_int(*v);
  }
  const std::optional<std::string> tie = stored_hparam(m, "tie_weights");
  if (!tie) throw std::runtime_error(where + "has no hparams.tie_weights (not a checkpoint of gpt train)");
  if (*tie != "true" && *tie != "false")
    throw std::runtime_error(where + "hparams.tie_weights must be 'true' or 'false', got '" + *tie + "'");
  c.tie_weights = *tie == "true";
  if (c.d_model % c.n_head != 0)
    throw std::runtime_error(where + "hparams.d_model " + std::to_string(c.d_model) + " is not a multiple of " +
                             "hparams.n_head " + std::to_string(c.n_head) + " (as --d-model / --n-head)");
  return c;
}

// The shape of every weight of Gpt(c), by state-dict key (model.h's module names).
inline std::map<std::string, std::vector<int64_t>> weight_shapes(const Config& c) {
  const int64_t d = c.d_model;
  std::map<std::string, std::vector<int64_t>> w = {{"tok.weight", {kVocab, d}}, {"pos.weight", {c.seq_len, d}},
                                                   {"ln_f.weight", {d}},         {"ln_f.bias", {d}}};
  if (!c.tie_weights) w["head.weight"] = {kVocab, d};
  const std::vector<std::pair<std::string, std::vector<int64_t>>> block = {
      {"ln1.weight", {d}},    {"ln1.bias", {d}},         {"qkv.weight", {3 * d, d}}, {"qkv.bias", {3 * d}},
      {"proj.weight", {d, d}}, {"proj.bias", {d}},       {"ln2.weight", {d}},        {"ln2.bias", {d}},
      {"fc.weight", {4 * d, d}}, {"fc.bias", {4 * d}},   {"fc_out.weight", {d, 4 * d}}, {"fc_out.bias", {d}}};
  for (int64_t i = 0; i < c.n_layer; ++i)
    for (const auto& [k, s] : block) w["blocks." + std::to_string(i) + "." + k] = s;
  return w;
}

inline std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// "a; b; c; d; and N more": the first problems of a weights check, for one error line.
inline std::string first_problems(const std::vector<std::string>& problems) {
  std::string what;
  for (size_t i = 0; i < problems.size() && i < 4; ++i) what += (i ? "; " : "") + problems[i];
  if (problems.size() > 4) what += "; and " + std::to_string(problems.size() - 4) + " more";
  return what;
}

// "n_layer 4, n_head 4, ...": a model's shape settings, for error messages.
inline std::string config_text(const Config& c) {
  std::string t;
  for (const auto& k : config_keys()) t += (t.empty() ? "" : ", ") + k + " " + config_value(c, k);
  return t;
}

// Checks, from the metadata alone, that the checkpoint's "model." tensors are exactly
// the weights of Gpt(c) with their shapes; the error lists the first differences.
inline void check_stored_weights(const tessera::checkpoint::CheckpointMetadata& m, const Config& c) {
  const auto want = weight_shapes(c);
  std::vector<std::string> problems;
  for (const auto& [k, shape] : want) {
    auto it = m.entries.find("model." + k);
    if (it == m.entries.end() || !it->second.is_tensor())
      problems.push_back("model." + k + " " + shape_text(shape) + " is missing");
    else if (it->second.shape != shape)
      problems.push_back("model." + k + " is " + shape_text(it->second.shape) + ", not " + shape_text(shape));
  }
  for (const auto& [k, e] : m.entries)
    if (k.rfind("model.", 0) == 0 && e.is_tensor() && !want.count(k.substr(6)))
      problems.push_back(k + " is not a weight of that model");
  if (problems.empty()) return;
  const std::string what = first_problems(problems);
  const std::string hp = config_text(c);
  throw std::runtime_error("checkpoint '" + m.location + "': its weights do not match its hparams (" + hp +
                           "): " + what);
}

// --init-from: where a checkpoint keeps gpt's weights. Under "model." in a checkpoint of
// gpt train (or of any Fabric/Trainer state whose module is "model"), else at the top
// level (a bare state dict from another writer: "tok.weight", "blocks.0.qkv.weight", ...).
inline std::string init_weights_prefix(const tessera::checkpoint::CheckpointMetadata& m) {
  for (const auto& [k, e] : m.entries)
    if (e.is_tensor() && k.rfind("model.", 0) == 0) return "model.";
  return "";
}

// Checks, from the metadata alone, that the checkpoint holds exactly the weights of
// Gpt(c) under `prefix` (every one present, as a float32 tensor of its shape; no other
// tensor under the prefix, or at all when the prefix is empty). The error names the file
// and the first keys at fault, and the checkpoint's own hparams when it has some.
inline void check_init_weights(const tessera::checkpoint::CheckpointMetadata& m, const Config& c,
                               const std::string& prefix) {
  const auto want = weight_shapes(c);
  std::vector<std::string> problems;
  for (const auto& [k, shape] : want) {
    auto it = m.entries.find(prefix + k);
    if (it == m.entries.end())
      problems.push_back(prefix + k + " " + shape_text(shape) + " is missing");
    else if (!it->second.is_tensor())
      problems.push_back(prefix + k + " is a " + it->second.kind + " value, not a tensor");
    else if (it->second.shape != shape)
      problems.push_back(prefix + k + " is " + shape_text(it->second.shape) + ", not " + shape_text(shape));
    else if (it->second.dtype != at::kFloat)
      problems.push_back(prefix + k + " is " + tessera::checkpoint::dtype_name(it->second.dtype) +
                         ", not F32 (gpt's weights are float32)");
  }
  for (const auto& [k, e] : m.entries)
    if (e.is_tensor() && k.rfind(prefix, 0) == 0 && !want.count(k.substr(prefix.size())))
      problems.push_back(k + " " + shape_text(e.shape) + " is not a weight of this model");
  if (problems.empty()) return;
  const std::string what = first_problems(problems);
  const std::string hp = config_text(c);
  std::string stored;
  try {
    stored = config_text(stored_config(m));
  } catch (const std::exception&) {
    // no (usable) hparams: a checkpoint of another writer
  }
  throw std::runtime_error("--init-from: '" + m.location + "' does not hold the weights of this model (" + hp +
                           "; keys " + (prefix.empty() ? "<fqn>" : "model.<fqn>") + "): " + what +
                           (stored.empty() ? std::string()
                                           : " (the checkpoint's hparams: " + stored + "; give the same model flags)"));
}

}  // namespace gpt
