// CSV logger: <save_dir>/<name>/version_<N>/metrics.csv (one row per logged step;
// columns "step", "epoch" and then every metric name in order of first appearance;
// empty cells where a row has no value) and hparams.yaml. Only global rank 0 writes;
// the run directory (next free version) is chosen by rank 0 in setup() and shared with
// the other ranks. metrics.csv is rewritten atomically (temporary file + rename) on every
// save(), so a reader never sees a torn file.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/trainer/logger.h"

namespace tessera::trainer {

class CsvLogger : public RunDirLogger {
 public:
  // log_dir = save_dir/name/version_N (N = version, or the next free one); with an
  // empty name, save_dir/version_N.
  explicit CsvLogger(std::string save_dir = ".", std::string name = "lightning_logs",
                     std::optional<int> version = {});
  // A logger whose log_dir is `dir` exactly (no versioning), e.g. for
  // options.loggers.push_back(CsvLogger::flat(dir)).
  static std::shared_ptr<CsvLogger> flat(std::string dir);

  std::string name() const override { return "csv"; }
  void log_hyperparams(const std::map<std::string, std::string>& hparams) override;
  // Names "step" and "epoch" are columns of their own: "epoch" fills the epoch column;
  // "step" is refused (the step is the argument). Names may not contain a comma, quote
  // or newline.
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) override;
  void save() override;
  void finalize() override { save(); }

  std::string metrics_path() const { return log_dir() + "/metrics.csv"; }

  // Keep the rows of a metrics.csv already in the run directory (a resumed run writing
  // to the same flat or fixed-version directory) instead of replacing them: setup()
  // reads them back (an unreadable file is an error naming it, never overwritten), and
  // the first row this run logs, at step s, drops the old rows at steps >= s (the part
  // of the earlier run after its checkpoint, which this run redoes). Call before setup.
  CsvLogger& keep_existing(bool on = true) {
    keep_existing_ = on;
    return *this;
  }

 private:
  struct Row {
    int64_t step;
    std::optional<double> epoch;
    std::map<std::string, double> values;
  };
  bool keep_existing_ = false;
  size_t previous_rows_ = 0;  // rows_[0, previous_rows_) came from the existing file
  std::vector<std::string> columns_;
  std::vector<Row> rows_;
  void on_writer_setup() override;  // keep_existing: reads the earlier metrics.csv back
};

}  // namespace tessera::trainer
