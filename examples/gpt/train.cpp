// The `gpt train` command: the TrainingModule (model, AdamW with warmup + cosine decay,
// --init-from weights, throughput timing), the run directory, --resume, and the Trainer run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "data.h"
#include "model.h"
#include "run_lock.h"
#include "settings.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/resume.h"
#include "tessera/core/blas.h"
#include "tessera/core/cpu_allocator.h"
#include "tessera/core/device.h"
#include "tessera/distributed/shm_times.h"
#include "tessera/distributed/world.h"
#include "tessera/optim/adam.h"
#include "tessera/state/module_state.h"
#include "tessera/strategy/factory.h"
#include "tessera/strategy/strategy.h"
#include "tessera/trainer/csv_logger.h"
#include "tessera/trainer/trainer.h"
#include "train.h"

using namespace tessera;
using gpt::TrainArgs;
namespace fs = std::filesystem;

namespace {

std::string lowercase(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The TrainingModule: the model, AdamW (one-pass by default, --adamw) with linear warmup +
// cosine decay (stepped after every optimizer step, saved in checkpoints by the Trainer),
// next-byte cross-entropy.
struct GptModule : trainer::TrainingModule {
  TrainArgs args;
  gpt::Config cfg;
  gpt::Gpt net{nullptr};
  std::shared_ptr<torch::optim::AdamW> opt;
  int64_t start_step = 0;

  GptModule(TrainArgs a, gpt::Config c) : args(std::move(a)), cfg(c) {}

  torch::nn::AnyModule configure_model() override {
    at::manual_seed(args.seed);  // the same initial weights on every rank
    // Each block through the strategy's module-init context: under FSDP a block is a
    // unit, sharded as soon as it is built (no rank ever holds the whole model); under
    // DDP or a single device it is simply built.
    // Under --tp the model is cut over Fabric's tensor-parallel group (a group of one
    // otherwise: the plain model).
    cfg.tp = fabric().tensor_parallel();
    net = gpt::Gpt(cfg, [this](const std::function<torch::nn::AnyModule()>& b) { return init_module(b); });
    return torch::nn::AnyModule(net);
  }
  trainer::OptimizerConfig configure_optimizers() override {
    const auto options = torch::optim::AdamWOptions(args.lr).betas({0.9, 0.95}).weight_decay(args.weight_decay);
    if (args.adamw == "libtorch") opt = std::make_shared<torch::optim::AdamW>(net->parameters(), options);
    else opt = std::make_shared<optim::AdamW>(net->parameters(), options);
    auto sched = std::make_shared<trainer::WarmupCosineLR>(opt, args.warmup_steps, args.decay_steps, args.min_lr_ratio);
    return {opt, sched};
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    log("lr", opt->param_groups()[0].options().get_lr());  // the lr this step uses
    auto ac = fabric().autocast();
    return net->loss(model().forward<at::Tensor>(b.inputs), b.targets);
  }
  void validation_step(const trainer::Batch& b, int64_t) override {
    auto ac = fabric().autocast();
    log("val_loss", net->loss(model().forward<at::Tensor>(b.inputs), b.targets).item<double>(), /*prog_bar=*/true,
        /*sync_dist=*/true);
  }
  std::map<std::string, std::string> hparams() const override {
    return {{"n_layer", std::to_string(cfg.n_layer)}, {"n_head", std::to_string(cfg.n_head)},
            {"d_model", std::to_string(cfg.d_model)}, {"seq_len", std::to_string(cfg.seq_len)},
            {"tie_weights", cfg.tie_weights ? "true" : "false"}, {"lr", std::to_string(args.lr)},
            {"batch_size", std::to_string(args.batch_size)}, {"seed", std::to_string(args.seed)}};
  }
  void on_train_start() override { start_step = global_step(); }

  // --init-from: the checkpoint's weights replace the seed's initial ones before the
  // first step; the step count and the optimizer start fresh. The load target is the
  // strategy's module state in its default kind (sharded under FSDP, as Fabric::load
  // reads it), so each rank reads only what it holds: under FSDP its rows of every
  // parameter. The metadata was checked against this model before
  // (gpt::check_init_weights). Collective.
  std::string init_prefix;  // "model." or "" (gpt::init_weights_prefix)
  void on_fit_start() override {
    if (args.init_from.empty()) return;
    strategy::Strategy& s = fabric().strategy();
    state::StateDict target;
    s.module_state(s.default_state_dict_type()).for_each([&](const std::string& k, const state::Value& v) {
      // Copies (the state dict aliases the live weights): read into them, then apply.
      if (const auto* t = std::get_if<at::Tensor>(&v)) target.set(init_prefix + k, t->detach().clone());
      else if (const auto* st = std::get_if<sharding::ShardedTensor>(&v)) target.set(init_prefix + k, st->clone());
      else throw std::runtime_error("--init-from: the model's state holds a " + std::string(state::kind_name(v)) +
                                    " under '" + k + "'");
    });
    checkpoint::LoadOptions lax;
    lax.strict = false;  // the checkpoint may hold more than weights (optimizer state, hparams, ...)
    const checkpoint::LoadResult res = checkpoint::load(target, args.init_from, *fabric().comm(), lax);
    if (!res.missing.empty() || !res.mismatched.empty()) {
      std::string what;
      for (const auto& k : res.missing) what += " missing " + k + ";";
      for (const auto& k : res.mismatched) what += " " + k + ";";
      throw std::runtime_error("--init-from: '" + args.init_from + "' does not hold this model's weights:" + what);
    }
    state::StateDict weights;
    target.for_each([&](const std::string& k, const state::Value& v) { weights.set(k.substr(init_prefix.size()), v); });
    const std::vector<std::string> rest = s.load_module_state(weights, /*strict=*/false);
    if (!rest.empty()) throw std::runtime_error("--init-from: the model did not take '" + rest.front() + "'");
    fabric().print("gpt: initial weights from '", args.init_from, "' (", res.loaded.size(), " tensors", 
                   init_prefix.empty() ? "" : " under model.", "); step 0, fresh optimizer");
  }

  // Training throughput: from the end of the first batch of this run (warm-up excluded)
  // to the end of the last one, without the time spent validating in between.
  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> first_end, last_end, val_start;
  double val_seconds = 0, pending_val = 0;  // pending: validation after the last timed batch
  int64_t timed_batches = 0;
  // Over the same window: this rank's time in shared-memory collectives (they run in the
  // training thread: DDP's all-reduces inside backward, FSDP's gathers) and, of it, the
  // time spent waiting for the other ranks to arrive.
  distributed::SharedMemoryTimes shm_first, shm_last;
  void on_train_batch_end(const at::Tensor&, const trainer::Batch&, int64_t) override {
    last_end = Clock::now();
    shm_last = distributed::shared_memory_times();
    if (!first_end) {
      first_end = last_end;
      shm_first = shm_last;
    } else {
      ++timed_batches;
      val_seconds += pending_val;
    }
    pending_val = 0;
  }
  int64_t last_val_step = -1;  // global step of the last validation in fit
  void on_validation_start() override { val_start = Clock::now(); }
  void on_validation_end() override {
    last_val_step = global_step();
    if (first_end && val_start) pending_val += std::chrono::duration<double>(Clock::now() - *val_start).count();
  }
  double train_seconds() const {
    if (!first_end) return 0;
    return std::chrono::duration<double>(*last_end - *first_end).count() - val_seconds;
  }
};

void check(bool ok, const std::string& msg) {
  if (!ok) throw CLI::ValidationError(msg);
}

// What `dir` holds of an earlier run ("checkpoints/, metrics.csv"), or "" when nothing:
// a new or empty directory, or one with only run.lock (a run that ended before writing).
std::string earlier_run(const std::string& dir) {
  std::string found;
  for (const char* name : {"checkpoints", "metrics.csv", "hparams.yaml"}) {
    std::error_code ec;  // anything by that name counts, even a dangling symlink
    if (fs::symlink_status(fs::path(dir) / name, ec).type() == fs::file_type::not_found) continue;
    found += (found.empty() ? "" : ", ") + std::string(name) + (std::string(name) == "checkpoints" ? "/" : "");
  }
  return found;
}

// Takes OUT/run.lock on rank 0 (the rank that writes the metadata, metrics.csv and
// hparams.yaml) for the rest of the process and, for a new run (no --resume, no
// --overwrite), refuses a directory that holds an earlier run: its last checkpoint and
// metrics would be replaced. Every rank raises rank 0's refusal, so a second run with
// the same --out stops at start on all of its ranks, before anything is written.
void lock_run_dir(gpt::RunDirLock& lock, const TrainArgs& a, fabric::Fabric& f) {
  std::string err;
  if (f.is_global_zero()) {
    err = lock.acquire(a.out);
    const std::string found = err.empty() && a.resume.empty() && !a.overwrite ? earlier_run(a.out) : "";
    if (!found.empty())
      err = "run directory '" + a.out + "' holds an earlier run (" + found + "); continue it with --resume last (or auto), "
            "start a new run over it with --overwrite (its checkpoints/last.ckpt, metrics.csv and hparams.yaml are "
            "replaced), or choose another --out";
  }
  for (const auto& e : f.comm()->all_gather_bytes(err))
    if (!e.empty()) throw std::runtime_error(e);
}

// --resume auto found no checkpoint to continue from: this run starts at step 0 and
// writes a new OUT/metrics.csv. The earlier attempt's file (rows up to a checkpoint that
// did not verify and was set aside, or of a job that failed before its first checkpoint)
// is not replaced: rank 0, which holds run.lock, renames it
// OUT/metrics.earlier-<UTC time>.csv (a free name) and says so. Keeping its rows in the new
// file instead would mix two runs' values for the same steps. Every rank raises rank 0's
// error (a failed rename stops the run before anything is written).
void keep_earlier_metrics(const std::string& out, fabric::Fabric& f) {
  std::string err, kept;
  if (f.is_global_zero()) {
    const fs::path from = fs::path(out) / "metrics.csv";
    std::error_code ec;
    if (fs::symlink_status(from, ec).type() != fs::file_type::not_found) {
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      ::gmtime_r(&now, &tm);
      char stamp[32];
      std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
      err = "cannot keep the earlier attempt's '" + from.string() + "': no free name metrics.earlier-" + stamp +
            "[-N].csv; nothing was changed";
      for (int n = 0; n < 1000; ++n) {
        const fs::path to = fs::path(out) / ("metrics.earlier-" + std::string(stamp) +
                                             (n ? "-" + std::to_string(n) : std::string()) + ".csv");
        if (fs::symlink_status(to, ec).type() != fs::file_type::not_found) continue;
        fs::rename(from, to, ec);
        err = ec ? "cannot keep the earlier attempt's '" + from.string() + "' as '" + to.string() + "': " +
                       ec.message() + "; nothing was changed (move it away yourself and restart)"
                 : "";
        kept = to.string();
        break;
      }
    }
  }
  for (const auto& e : f.comm()->all_gather_bytes(err))
    if (!e.empty()) throw std::runtime_error(e);
  if (!kept.empty()) f.print("gpt: starting fresh: the earlier attempt's metrics.csv is kept as ", kept);
}

// The checkpoint --resume names: 'last' is OUT/checkpoints/last.ckpt (where the
// Trainer's ModelCheckpoint writes it). Not for 'auto' (checkpoint::find_resumable).
std::string resume_path(const TrainArgs& a) {
  return a.resume == "last" ? (fs::path(a.out) / "checkpoints" / "last.ckpt").string() : a.resume;
}

// Resuming: the checkpoint's model-shaping hparams, checked like the flags (and against
// its weights), must equal the flags given explicitly; those not given take the
// checkpoint's values. Returns the checkpoint's global step.
int64_t adopt_checkpoint_settings(TrainArgs& a, const std::string& path, fabric::Fabric& f) {
  if (!fs::exists(path)) throw std::runtime_error("--resume: checkpoint '" + path + "' does not exist");
  const checkpoint::CheckpointMetadata meta = checkpoint::open_checkpoint(path);
  const gpt::Config stored = gpt::stored_config(meta);
  gpt::check_stored_weights(meta, stored);
  const gpt::Config flags{a.n_layer, a.n_head, a.d_model, a.seq_len, a.tie_weights};
  std::string mismatch, adopted;
  for (const auto& k : gpt::config_keys()) {
    const std::string want = gpt::config_value(flags, k), have = gpt::config_value(stored, k);
    if (want == have) continue;
    if (a.given.count(k)) {
      const std::string flag = k == "tie_weights" ? "--tie-weights" : std::string(gpt::shape_setting(k).flag) + " " + want;
      mismatch += (mismatch.empty() ? "" : "; ") + flag + " but the checkpoint has " + k + " " + have;
    } else {
      adopted += (adopted.empty() ? "" : ", ") + k + " " + have;
    }
  }
  if (!mismatch.empty())
    throw std::runtime_error("--resume: '" + path + "' holds another model: " + mismatch +
                             " (a resumed run keeps the checkpoint's shape; leave these flags out to use its values)");
  a.n_layer = stored.n_layer;
  a.n_head = stored.n_head;
  a.d_model = stored.d_model;
  a.seq_len = stored.seq_len;
  a.tie_weights = stored.tie_weights;
  if (!adopted.empty()) f.print("gpt: resuming with the checkpoint's ", adopted);
  auto step = meta.entries.find(checkpoint::kGlobalStepKey);
  const int64_t* s = step == meta.entries.end() ? nullptr : std::get_if<int64_t>(&step->second.value);
  if (!s) throw std::runtime_error("--resume: '" + path + "' has no integer global_step (not a checkpoint of gpt train)");
  return *s;
}

}  // namespace

namespace gpt {

int run_train(TrainArgs a) {
  // Ranks and batch split (the environment of tessera run, torchrun, srun or mpirun when started by one).
  const bool launched = distributed::started_by_launcher();
  const distributed::World env_world = launched ? distributed::World::from_env() : distributed::World{};
  const int world = launched ? env_world.world_size : (a.devices > 0 ? a.devices : 1);
  const int local = launched ? env_world.local_world_size : world;
  if (launched && a.devices > 0 && a.devices != local)
    throw CLI::ValidationError("--devices " + std::to_string(a.devices) + " disagrees with the launcher's " +
                               std::to_string(local) + " ranks per node (omit --devices under tessera run)");
  // Tensor parallelism: groups of --tp consecutive ranks inside a node, whole heads per
  // rank, and under sequence parallelism seq_len / tp positions per rank.
  check(local % a.tp == 0, "--tp " + std::to_string(a.tp) + " must divide the " + std::to_string(local) +
                               " ranks per node (--devices / the launcher): a tensor-parallel group stays inside a node");
  check(a.n_head % a.tp == 0, "--tp " + std::to_string(a.tp) + " must divide --n-head " + std::to_string(a.n_head) +
                                  " (each rank computes whole attention heads)");
  if (a.tp > 1 && a.sequence_parallel)
    check(a.seq_len % a.tp == 0, "--seq-len " + std::to_string(a.seq_len) + " must be a multiple of --tp " +
                                     std::to_string(a.tp) + " under sequence parallelism (or --no-sequence-parallel)");
  if (a.tp > 1 && a.sharding == "hybrid")  // a (replicate, shard, tp) mesh: consolidated checkpoints
    check(a.state_dict != "sharded", "--state-dict sharded with --sharding hybrid and --tp " + std::to_string(a.tp) +
                                         ": a (replicate, shard, tp) mesh has no sharded checkpoint form yet (use full, "
                                         "its default)");
  const int dp = world / a.tp;  // the ranks that see different batches
  check(a.batch_size % dp == 0, "--batch-size " + std::to_string(a.batch_size) + " (the global batch) must be a " +
                                    "multiple of the " + std::to_string(dp) + " data-parallel ranks");
  check(a.d_model % a.n_head == 0, "--d-model " + std::to_string(a.d_model) + " must be a multiple of --n-head " +
                                       std::to_string(a.n_head));
  // The command line's strategy, parsed once (main.cpp admits only these names).
  using strategy::StrategyKind;
  const StrategyKind kind = strategy::parse_strategy(a.strategy);
  if (kind == StrategyKind::Single)
    check(world == 1, "--strategy single runs one process, but " + std::to_string(world) +
                          " ranks were asked for (--devices / the launcher)");
  if (a.decay_steps == 0) a.decay_steps = a.max_steps;
  if (a.warmup_steps < 0) a.warmup_steps = std::min<int64_t>(30, a.decay_steps / 10);
  check(a.warmup_steps < a.decay_steps, "--warmup-steps " + std::to_string(a.warmup_steps) +
                                            " must be smaller than --lr-decay-steps (default --max-steps) " +
                                            std::to_string(a.decay_steps));
  if (a.sharding != "full") check(kind == StrategyKind::Fsdp, "--sharding " + a.sharding + " needs --strategy fsdp");
  check(!a.overwrite || a.resume.empty(), "--overwrite and --resume exclude each other: --resume continues the run in "
                                          "--out, --overwrite starts a new one over it");
  if (!a.init_from.empty()) {
    check(a.resume.empty(), "--init-from and --resume exclude each other: --resume continues a run (weights, optimizer, "
                            "step), --init-from starts a new one at step 0 from a checkpoint's weights");
    check(fs::exists(a.init_from), "--init-from: checkpoint '" + a.init_from + "' does not exist");
  }

  trainer::TrainerOptions o;
  o.fabric.accelerator = a.accelerator;
  o.fabric.strategy = a.strategy;
  o.fabric.devices = local;
  o.fabric.num_nodes = std::max(1, world / std::max(1, local));
  o.fabric.precision = a.precision;
  o.fabric.comm.timeout = std::chrono::milliseconds(std::max<int64_t>(1, std::llround(a.comm_timeout * 1000)));
  using SS = strategy::ShardingStrategy;
  o.fabric.fsdp.sharding = a.sharding == "full"      ? SS::FullShard
                           : a.sharding == "grad-op" ? SS::ShardGradOp
                           : a.sharding == "none"    ? SS::NoShard
                                                     : SS::HybridShard;
  // --state-dict left out: the strategy's default (sharded for fsdp, full for the others).
  o.fabric.tensor_parallel_size = a.tp;
  o.fabric.sequence_parallel = a.sequence_parallel;
  o.fabric.state_dict_type = a.state_dict.empty() && a.tp > 1 && a.sharding == "hybrid" ? strategy::StateDictType::Full
                             : a.state_dict.empty()      ? strategy::default_state_dict_type(kind)
                             : a.state_dict == "sharded" ? strategy::StateDictType::Sharded
                                                         : strategy::StateDictType::Full;
  o.max_steps = a.max_steps;
  o.batch_size = a.batch_size / dp;
  o.seed = a.seed;
  o.gradient_clip_val = a.grad_clip > 0 ? std::optional<double>(a.grad_clip) : std::nullopt;
  o.log_every_n_steps = a.log_every;
  o.eval_batch_size = o.batch_size;
  o.default_root_dir = a.out;  // checkpoints in OUT/checkpoints
  o.checkpoint_every_n_train_steps = a.ckpt_every;
  o.checkpoint_async = a.async_ckpt;
  // OUT/metrics.csv and OUT/hparams.yaml; a resumed run keeps the earlier rows up to its step.
  auto csv = trainer::CsvLogger::flat(a.out);
  csv->keep_existing(!a.resume.empty());
  o.loggers = {csv};
  if (a.val_every > 0) o.val_check_interval = trainer::BatchCount(a.val_every);
  if (a.limit_val_batches >= 0) o.limit_val_batches = trainer::BatchCount(a.limit_val_batches);  // 0: none
  o.enable_progress_bar = a.progress_bar;

  trainer::Trainer t(o);  // without a launcher and devices > 1: runs the ranks and exits
  auto& f = t.fabric();
  gpt::RunDirLock lock;
  lock_run_dir(lock, a, f);
  std::string resume;
  if (a.resume == "auto") {
    // The newest checkpoint in OUT/checkpoints that verifies, chosen on rank 0 (every rank
    // gets its path), or a fresh start: then the earlier attempt's metrics.csv is kept
    // aside (keep_earlier_metrics) and hparams.yaml is written again.
    const std::string dir = (fs::path(a.out) / "checkpoints").string();
    // A damaged checkpoint is set aside (renamed X.unverified-<time>), never replaced by this
    // run's next save of the same name.
    resume = checkpoint::find_resumable({dir}, *f.comm(), [&](const std::string& line) { f.print("gpt: ", line); },
                                        checkpoint::Skipped::SetAside)
                 .path;
    csv->keep_existing(!resume.empty());
    if (resume.empty()) keep_earlier_metrics(a.out, f);
  } else if (!a.resume.empty()) {
    resume = resume_path(a);
  }
  if (!resume.empty()) {
    const int64_t step = adopt_checkpoint_settings(a, resume, f);
    if (step >= a.max_steps) {  // nothing to train: leave the checkpoint and metrics.csv as they are
      f.print("gpt: nothing left to do: '", resume, "' is at step ", step, " and --max-steps is ", a.max_steps,
              "; the run directory is unchanged (raise --max-steps to train further)");
      return 0;
    }
  }
  std::string init_prefix;
  if (!a.init_from.empty()) {  // every weight of the model, with its shape, before anything is built
    const checkpoint::CheckpointMetadata meta = checkpoint::open_checkpoint(a.init_from);
    init_prefix = gpt::init_weights_prefix(meta);
    gpt::check_init_weights(meta, gpt::Config{a.n_layer, a.n_head, a.d_model, a.seq_len, a.tie_weights}, init_prefix);
  }
  const int threads = a.threads > 0 ? a.threads
                                    : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / local);
  at::set_num_threads(threads);

  const std::vector<std::string> files = a.data.empty() ? gpt::default_data_files() : a.data;
  gpt::Dataset data = gpt::make_dataset(gpt::read_text(files), a.seq_len, a.val_fraction);
  gpt::Config cfg{a.n_layer, a.n_head, a.d_model, a.seq_len, a.tie_weights};
  f.print("gpt: ", data.total_bytes, " bytes from ", files.size(), " file(s): ", data.train.size(),
          " training / ", data.val.size(), " validation windows of ", a.seq_len, "+1 bytes");
  f.print("gpt: ", a.n_layer, " layers, ", a.n_head, " heads, d_model ", a.d_model, ", strategy ", a.strategy,
          " on ", world, " rank(s)",
          a.tp > 1 ? tessera::concat(" (dp ", world / a.tp, " x tp ", a.tp, a.sequence_parallel ? ", sequence parallel" : "", ")")
                   : std::string(),
          ", global batch ", a.batch_size, ", ", threads, " thread(s) per rank");

  const std::string metrics_path = (fs::path(a.out) / "metrics.csv").string();
  GptModule m(a, cfg);
  m.init_prefix = init_prefix;
  // --limit-val-batches 0: no validation data at all (neither in fit nor at the end).
  const trainer::TensorData val =
      a.limit_val_batches == 0 ? trainer::TensorData{} : trainer::TensorData{data.val.inputs, data.val.targets};
  const auto t0 = std::chrono::steady_clock::now();
  const trainer::Metrics fitted =
      t.fit(m, {data.train.inputs, data.train.targets}, a.val_every > 0 ? val : trainer::TensorData{}, resume);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The final validation loss over the held-out split (its first --limit-val-batches batches).
  double val_loss = std::nan("");
  if (!val.empty() && m.last_val_step == t.global_step() && fitted.count("val_loss")) {
    val_loss = fitted.at("val_loss");  // fit validated at the last step already
  } else if (!val.empty()) {
    const trainer::Metrics vm = t.validate(m, val);
    if (vm.count("val_loss")) val_loss = vm.at("val_loss");
  }
  const int64_t steps = t.global_step() - m.start_step;
  const double tok_s = m.timed_batches > 0 && m.train_seconds() > 0 ? static_cast<double>(m.timed_batches * a.batch_size * a.seq_len) /
                                                 std::max(m.train_seconds(), 1e-9)
                                           : 0.0;
  std::ostringstream s;
  s << std::setprecision(6) << "gpt: done step=" << t.global_step() << " steps_this_run=" << steps
    << " val_loss=" << val_loss << " tokens_per_s=" << std::setprecision(4) << tok_s << " seconds=" << secs
    << " params=" << gpt::count_parameters(cfg);
  f.print(s.str());
  // Checkpoints: how long the training loop waited for them (with --async-ckpt, only the
  // copy of the state; the writes ran beside training).
  {
    const auto& cs = t.checkpoint_stats();
    std::ostringstream c;
    c << std::setprecision(4) << "gpt: checkpoints saves=" << cs.saves << " blocking_s=" << cs.blocking_seconds
      << " first_blocking_s=" << cs.first_blocking_seconds << " async=" << (a.async_ckpt ? 1 : 0);
    f.print(c.str());
  }
  // Shared-memory collectives in the timed steps: the largest rank's time in them and the
  // largest and smallest rank's time waiting for the others (a rank that reaches a
  // collective first waits there for the last).
  if (f.comm()->uses_shared_memory() && m.timed_batches > 0) {
    const double in_coll = m.shm_last.seconds - m.shm_first.seconds;
    const double waiting = m.shm_last.waiting_seconds - m.shm_first.waiting_seconds;
    // One collective: every rank's pair (seconds in collectives, seconds waiting).
    const at::Tensor all = f.comm()->all_gather(at::tensor({in_coll, waiting}, at::kDouble).view({1, 2}));
    const double in_max = all.select(1, 0).max().item<double>();
    const double wait_max = all.select(1, 1).max().item<double>();
    const double wait_min = all.select(1, 1).min().item<double>();
    std::ostringstream c;
    c << std::setprecision(4) << "gpt: shared-memory collectives=" << m.shm_last.collectives - m.shm_first.collectives
      << " in_collectives_s=" << in_max << " waiting_for_peers_s_max=" << wait_max
      << " waiting_for_peers_s_min=" << wait_min << " train_s=" << m.train_seconds();
    f.print(c.str());
  }
  // Host memory: the largest rank's peak resident set (ru_maxrss, KiB on Linux), and the
  // CPU memory policy it ran under (core/cpu_allocator.h).
  {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    const double rss_mib = f.comm()->all_reduce_double(static_cast<double>(ru.ru_maxrss) / 1024.0, distributed::ReduceOp::Max);
    std::ostringstream h;
    h << std::setprecision(4) << "gpt: host peak_rss_mib=" << rss_mib
      << " cpu_allocator=" << core::to_string(core::cpu_allocator_policy());
    if (core::cpu_allocator_policy() == core::CpuAllocatorPolicy::Caching) {
      // What the caching allocator held at its busiest and keeps idle now (largest rank).
      const core::CpuAllocatorStats cs = core::cpu_allocator_stats();
      const auto mib = [&](size_t b) {
        return f.comm()->all_reduce_double(static_cast<double>(b) / 1048576.0, distributed::ReduceOp::Max);
      };
      const double peak_in_use = mib(cs.peak_in_use_bytes), idle = mib(cs.idle_bytes);
      h << " cache_peak_in_use_mib=" << peak_in_use << " cache_idle_mib=" << idle;
    }
    h << " blas=\"" << core::blas_summary() << "\"";
    f.print(h.str());
  }
  // On a GPU: the caching allocator's peak on this rank, and model FLOPs utilisation
  // (6 N per token for the weights, 12 L d T for attention, forward and backward) against
  // the GPU's bf16 dense peak (--peak-tflops, or the known figure for its model).
  if (f.device().is_cuda()) {
    std::ostringstream g;
    const double flops_per_token = 6.0 * static_cast<double>(gpt::count_parameters(cfg)) +
                                   12.0 * static_cast<double>(a.n_layer * a.d_model * a.seq_len);
    const double peak = a.peak_tflops > 0 ? a.peak_tflops : core::peak_tflops(f.device()).value_or(0);
    g << std::setprecision(4) << "gpt: gpu " << f.device() << " peak_mem_mib="
      << static_cast<double>(core::peak_allocated_bytes(f.device()).value_or(0)) / (1 << 20);
    if (peak > 0) g << " mfu=" << tok_s / world * flops_per_token / (peak * 1e12) << " peak_tflops=" << peak;
    std::cout << g.str() << std::endl;  // every rank: peaks differ per rank
  }
  f.print("gpt: metrics ", metrics_path, "; checkpoint ", t.last_checkpoint_path());
  return 0;
}

}  // namespace gpt
