#include "tessera/trainer/csv_logger.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "tessera/core/error.h"

namespace tessera::trainer {

CsvLogger::CsvLogger(std::string save_dir, std::string name, std::optional<int> version) {
  spec_.save_dir = std::move(save_dir);
  spec_.name = std::move(name);
  spec_.version = version;
}

std::shared_ptr<CsvLogger> CsvLogger::flat(std::string dir) {
  auto l = std::make_shared<CsvLogger>();
  l->spec_.flat_dir = std::move(dir);
  return l;
}

void CsvLogger::setup(bool rank_zero, const std::function<std::string(const std::string&)>& share) {
  if (set_up_) return;  // once per object: every rank has the same state, so no rank waits in share
  dir_ = setup_run_dir(spec_, rank_zero, share);
  write_ = rank_zero;
  set_up_ = true;
}

void CsvLogger::log_hyperparams(const std::map<std::string, std::string>& hparams) {
  if (!set_up_) setup(true, {});  // used on its own, outside a Trainer: a single writer
  if (!write_) return;
  write_hparams_yaml(dir_, hparams);
}

void CsvLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
  if (!set_up_) setup(true, {});
  if (!write_ || metrics.empty()) return;
  Row row{step, std::nullopt, {}};
  for (const auto& [k, v] : metrics) {
    TESSERA_CHECK(k != "step", "CsvLogger: metric name 'step' is reserved (the step is the log_metrics argument)");
    TESSERA_CHECK(!k.empty() && k.find_first_of(",\"\r\n") == std::string::npos, "CsvLogger: metric name '", k,
                  "' is empty or contains a comma, quote or newline");
    if (k == "epoch") {
      row.epoch = v;
      continue;
    }
    if (std::find(columns_.begin(), columns_.end(), k) == columns_.end()) columns_.push_back(k);
    row.values.emplace(k, v);
  }
  rows_.push_back(std::move(row));
}

namespace {
// The shortest of %.15g / %.17g that reads back as the same double.
std::string format_value(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

void CsvLogger::save() {
  if (!set_up_) setup(true, {});
  if (!write_) return;
  std::string csv = "step,epoch";
  for (const auto& c : columns_) csv += "," + c;
  csv += "\n";
  for (const auto& r : rows_) {
    csv += std::to_string(r.step) + ",";
    if (r.epoch) csv += format_value(*r.epoch);
    for (const auto& c : columns_) {
      csv += ",";
      auto it = r.values.find(c);
      if (it != r.values.end()) csv += format_value(it->second);
    }
    csv += "\n";
  }
  write_file_atomic(metrics_path(), csv);
}

}  // namespace tessera::trainer
