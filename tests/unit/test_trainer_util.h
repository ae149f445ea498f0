// Helpers shared by the Trainer tests: reading metrics.csv, comparing loss curves, a tiny
// regression dataset and the options every in-process test starts from.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/trainer/trainer.h"
#include "test_util.h"
#include "unit/harness.h"

namespace tessera::testing {

// A temporary directory removed with its contents at the end of the scope.
struct TempDir {
  std::string path;
  TempDir() : path(temp_dir("tessera-trainer")) {}
  ~TempDir() {
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

inline Csv read_csv(const std::string& path) {
  Csv c;
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot read " << path;
  std::string line;
  bool first = true;
  while (std::getline(in, line)) {
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
