// Progress bar of the Trainer (rank zero only). On a terminal it redraws one line in
// place ('\r', then the line, then spaces over whatever the previous line had left):
//   train epoch 0  37/100 [step 37/500]  12.3 it/s  ETA 0:05  loss=0.4213 val_loss=0.5
// When the output is not a terminal it prints plain, newline-terminated lines instead,
// at most one every `refresh_rate` batches and at most one per second (plus the summary
// line of each stage in finish()), so log files stay short.
//
// ETA: from the batches left in the stage when `total` is known, else from the steps
// left until `max_steps` when that is set; omitted otherwise.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <string>

namespace tessera::trainer {

struct ProgressBarOptions {
  bool enabled = true;
  std::optional<bool> tty;  // unset: isatty(stderr) (or of stdout when writing to std::cout)
  int refresh_rate = 1;     // redraw every n batches (>= 1)
  // Longest line drawn on a terminal (longer lines are cut so '\r' can redraw them);
  // 0: the terminal's width when writing to std::cerr/std::cout on a terminal, else no limit.
  int width = 0;
  // Seconds on a monotonic clock; unset: std::chrono::steady_clock. Tests inject one.
  std::function<double()> clock;
};

class ProgressBar {
 public:
  explicit ProgressBar(ProgressBarOptions o = {}, std::ostream* out = nullptr /* nullptr: std::cerr */);
  // stage: "train", "validate", "test"; total: batches in this epoch/stage (-1 unknown);
  // max_steps: the run's step limit (-1 none), used for the ETA when total is unknown.
  void start(const std::string& stage, int64_t epoch, int64_t total, int64_t max_steps = -1);
  // After each batch: batch index within the stage (0-based), global step, the metrics
  // to show (loss and prog_bar ones).
  void update(int64_t batch, int64_t global_step, const std::map<std::string, double>& metrics);
  void finish();  // ends the line (TTY) / prints the stage summary (plain)

  bool tty() const { return tty_; }
  bool enabled() const { return opt_.enabled; }

 private:
  double now() const;
  std::string line(bool final_line, double t) const;
  void draw(const std::string& text);
  ProgressBarOptions opt_;
  std::ostream* out_;
  bool tty_ = false, active_ = false;
  std::string stage_;
  int64_t epoch_ = 0, total_ = -1, max_steps_ = -1;
  int64_t done_ = 0, step_ = 0, start_step_ = 0;
  double t0_ = 0, last_print_ = 0, t_first_ = 0;
  int64_t step_first_ = -1;
  bool printed_ = false;
  size_t last_width_ = 0, max_width_ = 0;
  std::map<std::string, double> metrics_;
};

}  // namespace tessera::trainer
