// CSV logger: <root>/<name>/version_<N>/metrics.csv (one row per logged step; columns
// "step", "epoch" and every metric name in order of first appearance, empty cells where
// a step did not log a metric) and hparams.yaml. Only global rank 0 writes; the run
// directory (next free version) is chosen by rank 0 and shared with the other ranks.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tessera::trainer {

class CsvLogger {
 public:
  // `dir`: the run directory (already versioned); `write`: whether this rank writes.
  CsvLogger(std::string dir, bool write);
  // The first free "version_N" below root/name.
  static std::string next_version_dir(const std::string& root, const std::string& name = "lightning_logs");

  void log_hparams(const std::map<std::string, std::string>& hparams);
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step, int64_t epoch);
  // Rewrites metrics.csv with every row so far (columns may have grown).
  void save();
  const std::string& dir() const { return dir_; }
  std::string metrics_path() const { return dir_ + "/metrics.csv"; }

 private:
  struct Row {
    int64_t step, epoch;
    std::map<std::string, double> values;
  };
  std::string dir_;
  bool write_;
  std::vector<std::string> columns_;
  std::vector<Row> rows_;
};

}  // namespace tessera::trainer
