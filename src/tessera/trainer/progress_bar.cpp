#include "tessera/trainer/progress_bar.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "tessera/core/env.h"
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
  const int fd = out_ == &std::cerr || out_ == &std::clog ? 2 : out_ == &std::cout ? 1 : -1;
  // A rank whose stderr a launcher shows on its terminal (distributed::launch sets
  // TESSERA_TTY_COLUMNS, the columns left after its "[rank R] " prefix, and redraws
  // what comes after '\r' live): draw in place as on a terminal of that width.
  int relayed_columns = 0;
  if (fd == 2 && !::isatty(2))
    relayed_columns = static_cast<int>(env::get_int("TESSERA_TTY_COLUMNS", 0, 1 << 16).value_or(0));
  tty_ = opt_.tty ? *opt_.tty : (fd >= 0 && (::isatty(fd) || relayed_columns > 0));
  max_width_ = static_cast<size_t>(opt_.width);
  struct winsize ws {};
  if (tty_ && max_width_ == 0 && fd >= 0 && ::ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1)
    max_width_ = ws.ws_col - 1;  // leave the last column free so the cursor never wraps
  else if (tty_ && max_width_ == 0 && relayed_columns > 1)
    max_width_ = static_cast<size_t>(relayed_columns - 1);
}

double ProgressBar::now() const {
  if (opt_.clock) return opt_.clock();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void ProgressBar::start(const std::string& stage, int64_t epoch, int64_t total, int64_t max_steps) {
  if (!opt_.enabled) return;
  if (active_) {  // nested stage: keep the outer one's line and resume it in finish()
    if (tty_ && last_width_ > 0) *out_ << '\n';
    suspended_.push_back(std::move(st_));
  }
  active_ = true;
  st_ = Stage{};
  st_.name = stage;
  st_.epoch = epoch;
  st_.total = total;
  st_.max_steps = max_steps;
  st_.t0 = st_.last_print = now();
  last_width_ = 0;
  if (tty_) draw(line(st_, false, st_.t0));
}

std::string ProgressBar::line(const Stage& st, bool final_line, double t) const {
  const double elapsed = t - st.t0;
  const double rate = elapsed > 0 ? static_cast<double>(st.done) / elapsed : 0;
  const bool train = st.name == "train";
  std::string s = st.name;
  if (train) s += " epoch " + std::to_string(st.epoch);
  s += ": " + std::to_string(st.done);
  if (st.total >= 0) s += "/" + std::to_string(st.total);
  if (train && st.step_first >= 0) {
    s += " [step " + std::to_string(st.step);
    if (st.max_steps >= 0) s += "/" + std::to_string(st.max_steps);
    s += "]";
  }
  s += "  " + rate_text(rate);
  if (final_line) {
    s += "  " + clock_text(elapsed);
  } else {
    // ETA: the stage ends at its last batch or, in training, at max_steps, whichever
    // comes first: batches left at the stage's batch rate, and optimizer steps left until
    // max_steps at the step rate seen since the first batch; the smaller one.
    std::optional<double> eta;
    if (st.total >= 0 && rate > 0) eta = static_cast<double>(std::max<int64_t>(st.total - st.done, 0)) / rate;
    if (train && st.max_steps >= 0 && st.step_first >= 0 && t > st.t_first && st.step > st.step_first) {
      const double step_rate = static_cast<double>(st.step - st.step_first) / (t - st.t_first);
      const double to_max = static_cast<double>(std::max<int64_t>(st.max_steps - st.step, 0)) / step_rate;
      if (!eta || to_max < *eta) eta = to_max;
    }
    if (eta)
      s += "  ETA " + clock_text(*eta);
    else if (st.total >= 0 || st.max_steps >= 0)
      s += "  ETA ?";
  }
  for (const auto& [k, v] : st.metrics) s += "  " + k + "=" + number(v);
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
  st_.done = batch + 1;
  st_.step = global_step;
  if (st_.step_first < 0) {
    st_.step_first = global_step;
    st_.t_first = t;
  }
  for (const auto& [k, v] : metrics) st_.metrics[k] = v;
  const bool last = st_.total >= 0 && st_.done >= st_.total;
  if (st_.done % opt_.refresh_rate != 0 && !last) return;
  if (tty_) {
    if (!last && st_.printed && t - st_.last_print < kTtyInterval) return;
    draw(line(st_, false, t));
  } else {
    // Plain lines: the first after a second, then at most one a second; the stage's
    // summary comes from finish().
    if (t - st_.last_print < kPlainInterval) return;
    *out_ << line(st_, false, t) << '\n' << std::flush;
  }
  st_.last_print = t;
  st_.printed = true;
}

void ProgressBar::finish() {
  if (!opt_.enabled || !active_) return;
  const std::string s = line(st_, true, now());
  if (tty_) {
    draw(s);
    *out_ << '\n' << std::flush;
  } else {
    *out_ << s << '\n' << std::flush;
  }
  last_width_ = 0;
  active_ = !suspended_.empty();
  if (active_) {  // resume the outer stage: its next update draws a fresh line
    st_ = std::move(suspended_.back());
    suspended_.pop_back();
    st_.printed = false;
  }
}

}  // namespace tessera::trainer
