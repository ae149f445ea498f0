#include "tessera/trainer/csv_logger.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "tessera/core/error.h"

namespace fs = std::filesystem;

namespace tessera::trainer {

CsvLogger::CsvLogger(std::string save_dir, std::string name, std::optional<int> version)
    : RunDirLogger(std::move(save_dir), std::move(name), version) {}

std::shared_ptr<CsvLogger> CsvLogger::flat(std::string dir) { return make_flat<CsvLogger>(std::move(dir)); }

void CsvLogger::on_writer_setup() {
  if (!keep_existing_) return;
  const std::string path = metrics_path();
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  std::ifstream in(path);
  TESSERA_CHECK(in, "CsvLogger: cannot read the existing '", path, "' (keep_existing)");
  auto split = [](const std::string& line) {
    std::vector<std::string> cells;
    size_t p = 0;
    while (true) {
      const size_t c = line.find(',', p);
      cells.push_back(line.substr(p, c == std::string::npos ? std::string::npos : c - p));
      if (c == std::string::npos) return cells;
      p = c + 1;
    }
  };
  std::string line;
  std::getline(in, line);
  const std::vector<std::string> header = split(line);
  TESSERA_CHECK(header.size() >= 2 && header[0] == "step" && header[1] == "epoch", "CsvLogger: the existing '", path,
                "' does not start with the columns step,epoch (keep_existing will not overwrite it)");
  std::vector<Row> rows;  // committed to the logger only once the whole file has been read
  auto number = [&](const std::string& cell, int64_t line_no) {
    char* end = nullptr;
    const double v = std::strtod(cell.c_str(), &end);
    TESSERA_CHECK(!cell.empty() && end && *end == '\0', "CsvLogger: the existing '", path, "' line ", line_no,
                  ": '", cell, "' is not a number (keep_existing will not overwrite it)");
    return v;
  };
  for (int64_t no = 2; std::getline(in, line); ++no) {
    if (line.empty()) continue;
    const std::vector<std::string> cells = split(line);
    TESSERA_CHECK(cells.size() == header.size(), "CsvLogger: the existing '", path, "' line ", no, " has ",
                  cells.size(), " cells, its header ", header.size(), " (keep_existing will not overwrite it)");
    Row r{static_cast<int64_t>(number(cells[0], no)), std::nullopt, {}};
    if (!cells[1].empty()) r.epoch = number(cells[1], no);
    for (size_t i = 2; i < cells.size(); ++i)
      if (!cells[i].empty()) r.values.emplace(header[i], number(cells[i], no));
    rows.push_back(std::move(r));
  }
  columns_.assign(header.begin() + 2, header.end());
  rows_ = std::move(rows);
  previous_rows_ = rows_.size();
}

void CsvLogger::log_hyperparams(const std::map<std::string, std::string>& hparams) {
  if (!writes()) return;
  write_hparams_yaml(log_dir(), hparams);
}

void CsvLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
  if (!writes() || metrics.empty()) return;
  if (previous_rows_ > 0) {  // the first row of this run: drop the old rows it redoes
    rows_.erase(std::remove_if(rows_.begin(), rows_.end(), [&](const Row& r) { return r.step >= step; }),
                rows_.end());
    previous_rows_ = 0;
  }
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
  if (!writes()) return;
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
