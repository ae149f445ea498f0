// Helpers shared by the Trainer and logger tests: reading metrics.csv, reading TensorBoard
// event files back (an independent TFRecord + protobuf reader with its own bitwise CRC32C,
// nothing shared with the logger), comparing loss curves, a tiny regression dataset and
// the options every in-process test starts from.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessera/trainer/trainer.h"
#include "support/test_util.h"
#include "support/harness.h"

namespace tessera::testing {

// A temporary directory (temp_dir) removed with its contents at the end of the scope,
// unless the test has failed by then: then it stays for a post-mortem (see temp_dirs.cpp).
struct TempDir {
  std::string path;
  TempDir() : path(temp_dir("tessera-trainer")) {}
  ~TempDir() {
    if (::testing::Test::HasFailure()) return;
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

struct Csv {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::string col(size_t row, const std::string& name) const {
    for (size_t i = 0; i < header.size(); ++i)
      if (header[i] == name) return i < rows[row].size() ? rows[row][i] : "";
    return "<no column " + name + ">";
  }
  bool has(const std::string& name) const {
    for (const auto& h : header)
      if (h == name) return true;
    return false;
  }
};

// The lines of `text` without their '\n'.
inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// metrics.csv as the CsvLogger writes it (no quoting): the first line is the header.
inline Csv read_csv(const std::string& path) {
  Csv c;
  EXPECT_TRUE(std::filesystem::is_regular_file(path)) << "cannot read " << path;
  bool first = true;
  for (const std::string& line : lines_of(read_bytes(path))) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    if (!line.empty() && line.back() == ',') cells.emplace_back();
    if (first) c.header = cells;
    else c.rows.push_back(cells);
    first = false;
  }
  return c;
}

// step -> value of `column` for the rows that have one.
inline std::map<int64_t, double> column_of(const Csv& c, const std::string& column) {
  std::map<int64_t, double> out;
  if (!c.has(column)) return out;
  for (size_t r = 0; r < c.rows.size(); ++r) {
    const std::string v = c.col(r, column);
    if (!v.empty()) out[std::stoll(c.col(r, "step"))] = std::stod(v);
  }
  return out;
}

inline std::map<int64_t, double> losses_of(const Csv& c) { return column_of(c, "train_loss"); }

// ------------------------- TensorBoard event files, read back independently of the logger
// CRC32C, one bit at a time (reflected polynomial 0x82F63B78).
inline uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
  }
  return ~c;
}
inline uint32_t masked(uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }
inline uint64_t le(const std::string& s, size_t pos, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[pos + i]);
  return v;
}

struct Records {
  std::vector<std::string> data;
  std::string error;  // "" when every byte was a whole, valid record
};

inline Records read_tfrecords(const std::string& bytes) {
  Records r;
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (bytes.size() - pos < 12) {
      r.error = "truncated header at offset " + std::to_string(pos);
      return r;
    }
    const uint64_t len = le(bytes, pos, 8);
    if (static_cast<uint32_t>(le(bytes, pos + 8, 4)) != masked(crc32c_bitwise(bytes.substr(pos, 8)))) {
      r.error = "length crc mismatch at offset " + std::to_string(pos);
      return r;
    }
    if (bytes.size() - pos - 12 < len + 4) {
      r.error = "truncated record at offset " + std::to_string(pos);
      return r;
    }
    std::string data = bytes.substr(pos + 12, len);
    if (static_cast<uint32_t>(le(bytes, pos + 12 + len, 4)) != masked(crc32c_bitwise(data))) {
      r.error = "data crc mismatch at offset " + std::to_string(pos);
      return r;
    }
    r.data.push_back(std::move(data));
    pos += 12 + len + 4;
  }
  return r;
}

// Protocol buffer fields of one message (throws std::runtime_error on malformed input).
struct Field {
  int number, wire;
  uint64_t value = 0;  // varint, fixed32, fixed64
  std::string bytes;   // length-delimited
};
inline uint64_t varint(const std::string& s, size_t& pos) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (pos >= s.size()) throw std::runtime_error("truncated varint");
    const unsigned char b = s[pos++];
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
  throw std::runtime_error("varint too long");
}
inline std::vector<Field> fields(const std::string& s) {
  std::vector<Field> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const uint64_t key = varint(s, pos);
    Field f{static_cast<int>(key >> 3), static_cast<int>(key & 7)};
    if (f.wire == 0) {
      f.value = varint(s, pos);
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      if (s.size() - pos < static_cast<size_t>(n)) throw std::runtime_error("truncated fixed field");
      f.value = le(s, pos, n);
      pos += n;
    } else if (f.wire == 2) {
      const uint64_t n = varint(s, pos);
      if (s.size() - pos < n) throw std::runtime_error("truncated length-delimited field");
      f.bytes = s.substr(pos, n);
      pos += n;
    } else {
      throw std::runtime_error("unexpected wire type " + std::to_string(f.wire));
    }
    out.push_back(std::move(f));
  }
  return out;
}

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  struct Value {
    std::string tag;
    std::optional<float> simple_value;
    std::string plugin, text;
  };
  std::vector<Value> values;
};
inline Event decode_event(const std::string& data) {
  Event e;
  for (const Field& f : fields(data)) {
    if (f.number == 1 && f.wire == 1) std::memcpy(&e.wall_time, &f.value, 8);
    if (f.number == 2 && f.wire == 0) e.step = static_cast<int64_t>(f.value);
    if (f.number == 3 && f.wire == 2) e.file_version = f.bytes;
    if (f.number == 5 && f.wire == 2) {
      for (const Field& sv : fields(f.bytes)) {  // Summary.value
        if (sv.number != 1) continue;
        Event::Value v;
        for (const Field& vf : fields(sv.bytes)) {
          if (vf.number == 1) v.tag = vf.bytes;
          if (vf.number == 2 && vf.wire == 5) {
            const uint32_t bits = static_cast<uint32_t>(vf.value);
            float x;
            std::memcpy(&x, &bits, 4);
            v.simple_value = x;
          }
          if (vf.number == 9)  // metadata.plugin_data.plugin_name
            for (const Field& md : fields(vf.bytes))
              if (md.number == 1)
                for (const Field& pd : fields(md.bytes))
                  if (pd.number == 1) v.plugin = pd.bytes;
          if (vf.number == 8)  // tensor: dtype must be DT_STRING (7), string_val
            for (const Field& tf : fields(vf.bytes)) {
              if (tf.number == 1 && tf.value != 7) throw std::runtime_error("text tensor dtype is not DT_STRING");
              if (tf.number == 8) v.text = tf.bytes;
            }
        }
        e.values.push_back(std::move(v));
      }
    }
  }
  return e;
}

inline std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().find("tfevents") != std::string::npos) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// tag -> step -> value of the scalar events in every event file of `dir`, in file-name
// order (a later file's value at the same step wins); every file must be whole and valid.
inline std::map<std::string, std::map<int64_t, float>> scalars_in(const std::string& dir) {
  std::map<std::string, std::map<int64_t, float>> out;
  for (const auto& f : event_files(dir)) {
    Records rec = read_tfrecords(read_bytes(f));
    EXPECT_EQ(rec.error, "") << f;
    for (const auto& d : rec.data) {
      const Event e = decode_event(d);
      for (const auto& v : e.values)
        if (v.simple_value) out[v.tag][e.step] = *v.simple_value;
    }
  }
  return out;
}

// The scalars of `tag` in `tb` (scalars_in) are the values of `csv` (column_of) at the
// same steps, as floats (what TensorBoard keeps).
inline void expect_tensorboard_matches_csv(const std::map<std::string, std::map<int64_t, float>>& tb,
                                           const std::string& tag, const std::map<int64_t, double>& csv) {
  SCOPED_TRACE(tag);
  ASSERT_FALSE(csv.empty());
  ASSERT_TRUE(tb.count(tag));
  ASSERT_EQ(tb.at(tag).size(), csv.size());
  for (const auto& [step, v] : csv) {
    ASSERT_TRUE(tb.at(tag).count(step)) << "step " << step;
    EXPECT_EQ(tb.at(tag).at(step), static_cast<float>(v)) << "step " << step;
  }
}

// Every step of `want` in [from, to] is in `got` with the same value (relative 1e-5).
inline void expect_same(const std::map<int64_t, double>& got, const std::map<int64_t, double>& want, int64_t from,
                        const std::string& what, int64_t to = INT64_MAX) {
  int compared = 0;
  for (auto& [step, v] : want) {
    if (step < from || step > to) continue;
    ASSERT_TRUE(got.count(step)) << what << ": no value at step " << step;
    EXPECT_NEAR(got.at(step), v, 1e-5 * std::max(1.0, std::abs(v))) << what << " step " << step;
    ++compared;
  }
  EXPECT_GT(compared, 0) << what;
}

// The "logdir <dir>" line rank 0 of a trainer scenario prints.
inline std::string logdir_of(const RanksResult& r) {
  auto it = r.out.find(0);
  if (it == r.out.end()) return "";
  for (auto& l : it->second)
    if (l.rfind("logdir ", 0) == 0) return l.substr(7);
  return "";
}

// Sorted names of the entries of `dir` (files and directories).
inline std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : std::filesystem::directory_iterator(dir, ec)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// y = sin(sum(x)) on n cosine-valued 3-feature rows.
inline trainer::TensorData regression_data(int64_t n, double phase = 0.0) {
  at::Tensor x = at::cos(at::arange(n * 3, at::kFloat).reshape({n, 3}) * 0.7 + phase);
  return {x, x.sum(1, /*keepdim=*/true).sin()};
}

inline trainer::TrainerOptions local_options(const std::string& root) {
  trainer::TrainerOptions o;
  o.fabric.accelerator = "cpu";
  o.default_root_dir = root;
  o.batch_size = 4;
  o.log_every_n_steps = 1;
  o.enable_progress_bar = false;
  return o;
}

}  // namespace tessera::testing
