#include "tessera/trainer/tensorboard_logger.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "tessera/core/crc32c.h"
#include "tessera/core/error.h"

namespace fs = std::filesystem;

namespace tessera::trainer {

// ---------------------------------------------------------------- encoding
namespace tfevents {
namespace {
// Protocol buffer wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
// Field numbers (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto,
// tensor.proto).
constexpr int kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
constexpr int kSummaryValue = 1;
constexpr int kValueTag = 1, kValueSimpleValue = 2, kValueTensor = 8, kValueMetadata = 9;
constexpr int kMetadataPluginData = 1, kPluginName = 1;
constexpr int kTensorDtype = 1, kTensorShape = 2, kTensorStringVal = 8;
constexpr uint64_t kDtString = 7;

void put_varint(std::string& o, uint64_t v) {
  while (v >= 0x80) {
    o += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  o += static_cast<char>(v);
}
void put_key(std::string& o, int field, int wire) { put_varint(o, (static_cast<uint64_t>(field) << 3) | wire); }
void put_le32(std::string& o, uint32_t v) {
  for (int i = 0; i < 4; ++i) o += static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_le64(std::string& o, uint64_t v) {
  for (int i = 0; i < 8; ++i) o += static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_double(std::string& o, double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  put_le64(o, bits);
}
void put_float(std::string& o, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  put_le32(o, bits);
}
void put_bytes(std::string& o, int field, const std::string& bytes) {
  put_key(o, field, kLengthDelimited);
  put_varint(o, bytes.size());
  o += bytes;
}
std::string event_head(double wall_time, std::optional<int64_t> step) {
  std::string e;
  put_key(e, kEventWallTime, kFixed64);
  put_double(e, wall_time);
  if (step) {
    put_key(e, kEventStep, kVarint);
    put_varint(e, static_cast<uint64_t>(*step));  // negative steps: two's complement, 10 bytes
  }
  return e;
}
std::string summary_event(double wall_time, int64_t step, const std::string& value) {
  std::string summary;
  put_bytes(summary, kSummaryValue, value);
  std::string e = event_head(wall_time, step);
  put_bytes(e, kEventSummary, summary);
  return e;
}
}  // namespace

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t crc = core::crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string frame_record(const std::string& data) {
  std::string len;
  put_le64(len, data.size());
  std::string r = len;
  put_le32(r, masked_crc32c(len.data(), len.size()));
  r += data;
  put_le32(r, masked_crc32c(data.data(), data.size()));
  return r;
}

std::string file_version_event(double wall_time, const std::string& version) {
  std::string e = event_head(wall_time, std::nullopt);
  put_bytes(e, kEventFileVersion, version);
  return e;
}

std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;
  put_bytes(v, kValueTag, tag);
  put_key(v, kValueSimpleValue, kFixed32);
  put_float(v, value);
  return summary_event(wall_time, step, v);
}

std::string text_event(double wall_time, int64_t step, const std::string& tag, const std::string& text) {
  std::string plugin, metadata, tensor, v;
  put_bytes(plugin, kPluginName, "text");
  put_bytes(metadata, kMetadataPluginData, plugin);
  put_key(tensor, kTensorDtype, kVarint);
  put_varint(tensor, kDtString);
  put_bytes(tensor, kTensorShape, "");  // a scalar: no dims
  put_bytes(tensor, kTensorStringVal, text);
  put_bytes(v, kValueTag, tag);
  put_bytes(v, kValueMetadata, metadata);
  put_bytes(v, kValueTensor, tensor);
  return summary_event(wall_time, step, v);
}
}  // namespace tfevents

// ---------------------------------------------------------------- logger
namespace {
double wall_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  std::string h = buf;
  for (char& c : h)
    if (c == '/') c = '_';
  return h;
}
}  // namespace

TensorBoardLogger::TensorBoardLogger(std::string save_dir, std::string name, std::optional<int> version)
    : RunDirLogger(std::move(save_dir), std::move(name), version) {}

std::shared_ptr<TensorBoardLogger> TensorBoardLogger::flat(std::string dir) {
  return make_flat<TensorBoardLogger>(std::move(dir));
}

TensorBoardLogger::~TensorBoardLogger() {
  if (file_) std::fclose(file_);
}

void TensorBoardLogger::open() {
  if (file_) return;
  const std::string stem = "events.out.tfevents." + std::to_string(static_cast<int64_t>(wall_now())) + "." +
                           host_name() + "." + std::to_string(::getpid());
  // 'x': never append to (or clobber) another writer's file; a second file in the same
  // second from this process gets a suffix.
  for (int i = 0; !file_; ++i) {
    path_ = (fs::path(log_dir()) / (i == 0 ? stem : stem + "." + std::to_string(i))).string();
    file_ = std::fopen(path_.c_str(), "wbx");
    TESSERA_CHECK(file_ || (errno == EEXIST && i < 1000), "TensorBoardLogger: cannot create '", path_,
                  "': ", std::strerror(errno));
  }
  write_event(tfevents::file_version_event(wall_now()));
}

void TensorBoardLogger::write_event(const std::string& event) {
  const std::string rec = tfevents::frame_record(event);
  TESSERA_CHECK(std::fwrite(rec.data(), 1, rec.size(), file_) == rec.size(), "TensorBoardLogger: writing '",
                path_, "' failed: ", std::strerror(errno));
}

void TensorBoardLogger::log_hyperparams(const std::map<std::string, std::string>& hparams) {
  if (!writes()) return;
  write_hparams_yaml(log_dir(), hparams);
  if (hparams.empty()) return;
  // A Markdown table for TensorBoard's Text tab ('|' escaped inside cells).
  auto cell = [](const std::string& s) {
    std::string o;
    for (char c : s) {
      if (c == '|') o += '\\';
      o += c == '\n' ? ' ' : c;
    }
    return o;
  };
  std::string table = "| hyper-parameter | value |\n|---|---|\n";
  for (const auto& [k, v] : hparams) table += "| " + cell(k) + " | " + cell(v) + " |\n";
  open();
  write_event(tfevents::text_event(wall_now(), 0, "hparams", table));
}

void TensorBoardLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
  if (!writes() || metrics.empty()) return;
  open();
  const double t = wall_now();
  for (const auto& [k, v] : metrics) {
    TESSERA_CHECK(!k.empty(), "TensorBoardLogger: empty metric name at step ", step);
    write_event(tfevents::scalar_event(t, step, k, static_cast<float>(v)));
  }
}

void TensorBoardLogger::save() {
  if (!file_) return;
  TESSERA_CHECK(std::fflush(file_) == 0, "TensorBoardLogger: flushing '", path_, "' failed: ", std::strerror(errno));
}

void TensorBoardLogger::finalize() {
  if (!file_) return;
  save();
  const int rc = std::fclose(file_);
  file_ = nullptr;
  TESSERA_CHECK(rc == 0, "TensorBoardLogger: closing '", path_, "' failed: ", std::strerror(errno));
}

}  // namespace tessera::trainer
