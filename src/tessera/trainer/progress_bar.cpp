#include "tessera/trainer/progress_bar.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "tessera/core/error.h"

namespace tessera::trainer {

namespace {
// h:mm:ss, or m:ss under an hour.
std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  char buf[48];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buf;
}
std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}
// Batches per second as "12.3 it/s", or "4.50 s/it" when slower than one per second.
std::string rate_text(double per_second) {
  char buf[32];
  if (!(per_second > 0) || !std::isfinite(per_second)) return "? it/s";
  if (per_second >= 1)
    std::snprintf(buf, sizeof buf, "%.1f it/s", per_second);
  else
    std::snprintf(buf, sizeof buf, "%.2f s/it", 1.0 / per_second);
  return buf;
}
// Minimum seconds between two lines: plain output (log files) and terminal redraws.
constexpr double kPlainInterval = 1.0, kTtyInterval = 0.1;
}  // namespace

ProgressBar::ProgressBar(ProgressBarOptions o, std::ostream* out) : opt_(std::move(o)), out_(out ? out : &std::cerr) {
  TESSERA_CHECK(opt_.refresh_rate >= 1, "ProgressBar: refresh_rate must be >= 1, got ", opt_.refresh_rate);
  TESSERA_CHECK(opt_.width >= 0, "ProgressBar: width must be >= 0, got ", opt_.width);
  int fd = out_ == &std::cerr || out_ == &std::clog ? 2 : out_ == &std::cout ? 1 : -1;
  tty_ = opt_.tty ? *opt_.tty : (fd >= 0 && ::isatty(fd));
  max_width_ = static_cast<size_t>(opt_.width);
  struct winsize ws {};
  if (tty_ && max_width_ == 0 && fd >= 0 && ::ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1)
    max_width_ = ws.ws_col - 1;  // leave the last column free so the cursor never wraps
}

double ProgressBar::now() const {
  if (opt_.clock) return opt_.clock();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void ProgressBar::start(const std::string& stage, int64_t epoch, int64_t total, int64_t max_steps) {
  if (!opt_.enabled) return;
  if (active_) finish();
  active_ = true;
  stage_ = stage;
  epoch_ = epoch;
  total_ = total;
  max_steps_ = max_steps;
  done_ = 0;
  step_ = 0;
  step_first_ = -1;
  printed_ = false;
  metrics_.clear();
  t0_ = last_print_ = now();
  last_width_ = 0;
  if (tty_) draw(line(false, t0_));
}

std::string ProgressBar::line(bool final_line, double t) const {
  const double elapsed = t - t0_;
  const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0;
  std::string s = stage_;
  if (stage_ == "train") s += " epoch " + std::to_string(epoch_);
  s += ": " + std::to_string(done_);
  if (total_ >= 0) s += "/" + std::to_string(total_);
  if (stage_ == "train" && step_first_ >= 0) {
    s += " [step " + std::to_string(step_);
    if (max_steps_ >= 0) s += "/" + std::to_string(max_steps_);
    s += "]";
  }
  s += "  " + rate_text(rate);
  if (final_line) {
    s += "  " + clock_text(elapsed);
  } else {
    // ETA: batches left in the stage at the stage's batch rate, else optimizer steps left
    // until max_steps at the step rate seen since the first batch.
    std::optional<double> eta;
    if (total_ >= 0 && rate > 0) {
      eta = static_cast<double>(std::max<int64_t>(total_ - done_, 0)) / rate;
    } else if (total_ < 0 && max_steps_ >= 0 && step_first_ >= 0 && t > t_first_ && step_ > step_first_) {
      const double step_rate = static_cast<double>(step_ - step_first_) / (t - t_first_);
      eta = static_cast<double>(std::max<int64_t>(max_steps_ - step_, 0)) / step_rate;
    }
    if (eta)
      s += "  ETA " + clock_text(*eta);
    else if (total_ >= 0 || max_steps_ >= 0)
      s += "  ETA ?";
  }
  for (const auto& [k, v] : metrics_) s += "  " + k + "=" + number(v);
  return s;
}

void ProgressBar::draw(const std::string& text) {
  std::string s = text;
  if (max_width_ > 0 && s.size() > max_width_) s.resize(max_width_);
  const size_t w = s.size();
  if (w < last_width_) s.append(last_width_ - w, ' ');  // clear the tail of the longer previous line
  *out_ << '\r' << s << std::flush;
  last_width_ = w;
}

void ProgressBar::update(int64_t batch, int64_t global_step, const std::map<std::string, double>& metrics) {
  if (!opt_.enabled || !active_) return;
  const double t = now();
  done_ = batch + 1;
  step_ = global_step;
  if (step_first_ < 0) {
    step_first_ = global_step;
    t_first_ = t;
  }
  for (const auto& [k, v] : metrics) metrics_[k] = v;
  const bool last = total_ >= 0 && done_ >= total_;
  if (done_ % opt_.refresh_rate != 0 && !last) return;
  if (tty_) {
    if (!last && t - last_print_ < kTtyInterval && printed_) return;
    draw(line(false, t));
  } else {
    // Plain lines: the first after a second, then at most one a second; the stage's
    // summary comes from finish().
    if (t - last_print_ < kPlainInterval) return;
    *out_ << line(false, t) << '\n' << std::flush;
  }
  last_print_ = t;
  printed_ = true;
}

void ProgressBar::finish() {
  if (!opt_.enabled || !active_) return;
  active_ = false;
  const std::string s = line(true, now());
  if (tty_) {
    draw(s);
    *out_ << '\n' << std::flush;
  } else {
    *out_ << s << '\n' << std::flush;
  }
}

}  // namespace tessera::trainer
