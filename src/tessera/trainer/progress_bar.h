// Progress bar of the Trainer (rank zero only). On a terminal it redraws one line in
// place ('\r', then the line, then spaces over whatever the previous line had left):
//   train epoch 0  37/100 [step 37/500]  12.3 it/s  ETA 0:05  loss=0.4213 val_loss=0.5
// When the output is not a terminal it prints plain, newline-terminated lines instead,
// at most one every `refresh_rate` batches and at most one per second (plus the summary
// line of each stage in finish()), so log files stay short.
//
// ETA: until the end of the stage, which is its last batch (`total`, when known) or, in
// training, `max_steps` (when set), whichever comes first at the rates seen so far; "?"
// while no rate is known; omitted when neither bound is set.
//
// Stages nest: start() while a stage is running (validation in the middle of a training
// epoch) suspends it, leaving its line in place; the inner stage's finish() resumes it.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

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
  // Ends the current stage: the final line (TTY) / the stage summary (plain); resumes the
  // stage it had suspended, if any.
  void finish();

  bool tty() const { return tty_; }
  bool enabled() const { return opt_.enabled; }

 private:
  struct Stage {
    std::string name;
    int64_t epoch = 0, total = -1, max_steps = -1;
    int64_t done = 0, step = 0, step_first = -1;
    double t0 = 0, t_first = 0, last_print = 0;
    bool printed = false;
    std::map<std::string, double> metrics;
  };
  double now() const;
  std::string line(const Stage& s, bool final_line, double t) const;
  void draw(const std::string& text);
  ProgressBarOptions opt_;
  std::ostream* out_;
  bool tty_ = false, active_ = false;
  Stage st_;
  std::vector<Stage> suspended_;
  size_t last_width_ = 0, max_width_ = 0;
};

}  // namespace tessera::trainer
