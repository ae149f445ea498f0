// TensorBoard logger: writes <log_dir>/events.out.tfevents.<time>.<host>.<pid>, a TFRecord
// file of Event protocol buffers that TensorBoard reads directly (no TensorFlow or
// protobuf library involved): each record is
//   uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
// (little-endian; masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8). The first event
// carries file_version "brain.Event:2"; every log_metrics() call adds one event per
// metric with a scalar summary (tag, simple_value) at that step. Hyper-parameters go to
// hparams.yaml beside the events file and into one text summary (tag "hparams", a
// Markdown table) that TensorBoard's Text tab shows.
//
// log_dir = save_dir/name/version_N like CsvLogger. Only global rank zero writes. save()
// flushes the file to the OS so a running TensorBoard sees the records.
#pragma once
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "tessera/trainer/logger.h"

namespace tessera::trainer {

class TensorBoardLogger : public RunDirLogger {
 public:
  explicit TensorBoardLogger(std::string save_dir = ".", std::string name = "lightning_logs",
                             std::optional<int> version = {});
  // A logger whose log_dir is `dir` exactly (no versioning).
  static std::shared_ptr<TensorBoardLogger> flat(std::string dir);
  ~TensorBoardLogger() override;
  TensorBoardLogger(const TensorBoardLogger&) = delete;
  TensorBoardLogger& operator=(const TensorBoardLogger&) = delete;

  std::string name() const override { return "tensorboard"; }
  void log_hyperparams(const std::map<std::string, std::string>& hparams) override;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) override;
  void save() override;
  void finalize() override;  // flushes and closes the file (a later log reopens a new one)

  // The events file ("" before the first write or on ranks other than zero).
  const std::string& events_path() const { return path_; }

 private:
  void open();
  void write_event(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

// --- Encoding pieces, public for tests and tools ---
namespace tfevents {
// The TFRecord masked CRC32C of [data, data + n).
uint32_t masked_crc32c(const void* data, size_t n);
// One framed record around `data`.
std::string frame_record(const std::string& data);
// Event{wall_time, step, file_version}.
std::string file_version_event(double wall_time, const std::string& version = "brain.Event:2");
// Event{wall_time, step, summary{value{tag, simple_value}}}.
std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
// Event{wall_time, step, summary{value{tag, metadata{plugin_data{plugin_name "text"}},
// tensor{dtype DT_STRING, shape [], string_val text}}}}.
std::string text_event(double wall_time, int64_t step, const std::string& tag, const std::string& text);
}  // namespace tfevents

}  // namespace tessera::trainer
