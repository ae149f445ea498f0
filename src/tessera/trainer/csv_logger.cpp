#include "tessera/trainer/csv_logger.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tessera/core/error.h"

namespace fs = std::filesystem;

namespace tessera::trainer {

CsvLogger::CsvLogger(std::string dir, bool write) : dir_(std::move(dir)), write_(write) {
  if (!write_) return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  TESSERA_CHECK(!ec, "CsvLogger: cannot create the log directory '", dir_, "': ", ec.message());
}

std::string CsvLogger::next_version_dir(const std::string& root, const std::string& name) {
  const fs::path base = fs::path(root) / name;
  int next = 0;
  std::error_code ec;
  if (fs::is_directory(base, ec)) {
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("version_", 0) != 0 || !e.is_directory()) continue;
      const std::string num = n.substr(8);
      if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos) continue;
      next = std::max(next, std::stoi(num) + 1);
    }
  }
  return (base / ("version_" + std::to_string(next))).string();
}

namespace {
// A YAML scalar: plain when safe, double-quoted otherwise.
std::string yaml_scalar(const std::string& s) {
  const bool plain = !s.empty() && s.find_first_of(":#{}[],&*!|>'\"%@`\n") == std::string::npos && s.front() != ' ' &&
                     s.back() != ' ' && s.front() != '-' && s.front() != '?';
  if (plain) return s;
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o + "\"";
}
}  // namespace

void CsvLogger::log_hparams(const std::map<std::string, std::string>& hparams) {
  if (!write_) return;
  const std::string path = dir_ + "/hparams.yaml";
  std::ofstream out(path);
  TESSERA_CHECK(out, "CsvLogger: cannot write '", path, "'");
  if (hparams.empty()) out << "{}\n";
  for (const auto& [k, v] : hparams) out << yaml_scalar(k) << ": " << yaml_scalar(v) << "\n";
}

void CsvLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step, int64_t epoch) {
  if (!write_ || metrics.empty()) return;
  for (const auto& [k, v] : metrics) {
    TESSERA_CHECK(k != "step" && k != "epoch", "CsvLogger: metric name '", k, "' is reserved");
    TESSERA_CHECK(k.find_first_of(",\"\n") == std::string::npos, "CsvLogger: metric name '", k,
                  "' contains a comma, quote or newline");
    if (std::find(columns_.begin(), columns_.end(), k) == columns_.end()) columns_.push_back(k);
  }
  rows_.push_back({step, epoch, metrics});
}

void CsvLogger::save() {
  if (!write_) return;
  const std::string path = metrics_path(), tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    TESSERA_CHECK(out, "CsvLogger: cannot write '", tmp, "'");
    out << "step,epoch";
    for (const auto& c : columns_) out << "," << c;
    out << "\n";
    char buf[64];
    for (const auto& r : rows_) {
      out << r.step << "," << r.epoch;
      for (const auto& c : columns_) {
        out << ",";
        auto it = r.values.find(c);
        if (it != r.values.end()) {
          std::snprintf(buf, sizeof buf, "%.10g", it->second);
          out << buf;
        }
      }
      out << "\n";
    }
    TESSERA_CHECK(out.good(), "CsvLogger: writing '", tmp, "' failed");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TESSERA_CHECK(!ec, "CsvLogger: cannot rename '", tmp, "' to '", path, "': ", ec.message());
}

}  // namespace tessera::trainer
