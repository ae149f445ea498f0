// What the tests that run the GPT example (examples/gpt) share: where the programs are,
// the environment to start them in, and gpt's metrics.csv as numbers.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "support/test_util.h"

namespace tessera::testing::gpt {

inline const std::string kGpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
inline const std::string kCli = TESSERA_CLI;
// metrics.csv as column -> (step -> value); the first column is the step, empty cells
// are skipped.
inline std::map<std::string, std::map<int64_t, double>> read_metrics(const std::string& path) {
  std::map<std::string, std::map<int64_t, double>> out;
  std::istringstream in(read_bytes(path));
  auto split = [](const std::string& l) {
    std::vector<std::string> v;
    std::string c;
    std::istringstream ls(l);
    while (std::getline(ls, c, ',')) v.push_back(c);
    return v;
  };
  std::string line;
  if (!std::getline(in, line)) return out;
  const std::vector<std::string> header = split(line);
  while (std::getline(in, line)) {
    const auto cells = split(line);
    if (cells.empty()) continue;
    const int64_t step = std::atoll(cells[0].c_str());
    for (size_t i = 1; i < cells.size() && i < header.size(); ++i)
      if (!cells[i].empty()) out[header[i]][step] = std::strtod(cells[i].c_str(), nullptr);
  }
  return out;
}

// The train_loss column: step -> value.
inline std::map<int64_t, double> train_losses(const std::string& path) { return read_metrics(path)["train_loss"]; }

}  // namespace tessera::testing::gpt
