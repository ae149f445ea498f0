// Trainer loggers: the Logger interface every logger implements (CsvLogger in
// csv_logger.h, TensorBoardLogger in tensorboard_logger.h) and what they share: the
// RunDirLogger base (run directory chosen once, on rank zero), the versioned run directory
// (<save_dir>/<name>/version_<N>) and hparams.yaml.
//
// Every rank holds the logger object; only global rank zero writes. The Trainer calls
// setup() once on every rank before anything is logged; `share` broadcasts a string
// from rank zero (collective), so the run directory is chosen once, by rank zero, and
// every rank reports the same log_dir().
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace tessera::trainer {

class Logger {
 public:
  virtual ~Logger() = default;
  // Called once by the Trainer on every rank before anything is logged. `rank_zero`:
  // whether this rank writes. `share` broadcasts a string from rank zero to all ranks
  // (collective: every rank calls setup) so the run directory is chosen once. The built-in
  // loggers choose it once per object: a second setup (fit, then test) keeps it and calls
  // no `share` on any rank.
  virtual void setup(bool rank_zero, const std::function<std::string(const std::string&)>& share) = 0;
  virtual std::string name() const = 0;     // "csv", "tensorboard"
  virtual std::string log_dir() const = 0;  // valid after setup
  virtual void log_hyperparams(const std::map<std::string, std::string>& hparams) = 0;
  // One row of scalars at `step` (the Trainer adds "epoch" to the map itself).
  virtual void log_metrics(const std::map<std::string, double>& metrics, int64_t step) = 0;
  virtual void save() {}      // flush to disk (called every log_every_n_steps and at the end)
  virtual void finalize() {}  // end of fit/validate/test
};
using LoggerPtr = std::shared_ptr<Logger>;

// Where a logger writes: either `flat_dir` exactly, or save_dir/name/version_<N>
// (save_dir/version_<N> when name is empty) with N = `version` or the next free one.
struct RunDirSpec {
  std::string save_dir = ".";
  std::string name = "lightning_logs";
  std::optional<int> version;
  std::optional<std::string> flat_dir;
};

// The part the built-in loggers (CsvLogger, TensorBoardLogger) share: the RunDirSpec they
// were made with, the run directory setup() chose and whether this rank writes. setup()
// chooses the directory once per object (setup_run_dir below); a second setup keeps it
// and calls no `share`. A logger used before setup (on its own, outside a Trainer) sets
// itself up as the single writer through writes().
class RunDirLogger : public Logger {
 public:
  void setup(bool rank_zero, const std::function<std::string(const std::string&)>& share) override;
  std::string log_dir() const override { return dir_; }

 protected:
  // save_dir/name/version_N (N = version, or the next free one); with an empty name,
  // save_dir/version_N.
  RunDirLogger(std::string save_dir, std::string name, std::optional<int> version);
  // A default-constructed L whose directory is `dir` exactly (the loggers' flat()).
  template <typename L>
  static std::shared_ptr<L> make_flat(std::string dir) {
    auto logger = std::make_shared<L>();
    static_cast<RunDirLogger&>(*logger).spec_.flat_dir = std::move(dir);
    return logger;
  }
  // Called by setup() on the writing rank once the directory is chosen; when it throws,
  // the logger does not count as set up.
  virtual void on_writer_setup() {}
  // Whether this rank writes; sets the logger up as the single writer first if nothing has.
  bool writes();

 private:
  RunDirSpec spec_;
  std::string dir_;
  bool write_ = false, set_up_ = false;
};

// The first free "version_N" below root/name (root itself when name is empty): one
// more than the largest existing version_<digits> directory, 0 when there is none.
std::string next_version_dir(const std::string& root, const std::string& name = "lightning_logs");

// Resolves `spec` to a directory and creates it (and its parents). With no fixed
// version the version directory is claimed atomically (a concurrent run on the same
// root gets the next one). Throws tessera::Error naming the directory when it cannot
// be created. Called on rank zero only.
std::string create_run_dir(const RunDirSpec& spec);

// Shared by the loggers' setup() (RunDirLogger::setup): rank zero creates the directory,
// every rank gets its path through `share`.
std::string setup_run_dir(const RunDirSpec& spec, bool rank_zero,
                          const std::function<std::string(const std::string&)>& share);

// A YAML scalar for `s`: plain when YAML reads it back as the same string, double-quoted
// with escapes otherwise (empty, reserved indicators, ": " / " #", leading/trailing
// spaces, control characters, and words YAML would read as null/bool/number).
std::string yaml_scalar(const std::string& s);

// Writes <dir>/hparams.yaml ("key: value" lines in key order, "{}" when empty) through
// a temporary file and a rename.
void write_hparams_yaml(const std::string& dir, const std::map<std::string, std::string>& hparams);

// Writes `content` to `path` atomically: <path>.tmp, flush, rename over `path`.
void write_file_atomic(const std::string& path, const std::string& content);

}  // namespace tessera::trainer
