// The Trainer's checkpoints: what one holds (model, optimizers, step and epoch, sampler
// and loop position, LR schedulers, callback states, every rank's RNG states, the
// module's extra state and hparams), saving it (blocking or in the background),
// resolving ckpt_path "last" and "auto", and restoring it, also at another world size.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>

#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/resume.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/strings.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/rng_state.h"
#include "tessera/trainer/trainer.h"

namespace fs = std::filesystem;

namespace tessera::trainer {

namespace {

// The largest step, epoch or sampler position a checkpoint may hold (2^40: over a thousand
// years of steps at 30 per second); anything above is an edited or corrupt file.
constexpr int64_t kMaxCheckpointCounter = int64_t(1) << 40;

// The entries of `rest` under "<prefix>.", without the prefix.
state::StateDict prefixed_leftovers(const state::StateDict& rest, const std::string& prefix) {
  state::StateDict out;
  rest.for_each([&](const std::string& k, const state::Value& v) {
    if (k.rfind(prefix + ".", 0) == 0) out.set(k.substr(prefix.size() + 1), v);
  });
  return out;
}

// A counter read from the checkpoint at `path`, range-checked before use: an edited
// checkpoint (re-checksummed) could hold a negative step, or one that overflows the next
// increment or the sample arithmetic of a resume.
int64_t checked_counter(const std::string& path, const state::StateDict& sd, const std::string& key,
                        const std::string& name, int64_t lo, int64_t hi) {
  const int64_t v = sd.integer(key);
  TESSERA_CHECK(v >= lo && v <= hi, "Trainer: checkpoint '", path, "' key '", name, "' is ", v, ", outside [", lo,
                ", ", hi, "] (edited or corrupt checkpoint)");
  return v;
}

}  // namespace

// The entries Fabric loads in place: model, optimizers, counters and the sampler.
fabric::FabricState Trainer::make_state() {
  fabric::FabricState st;
  st.set("model", module_->model_);
  for (size_t i = 0; i < optimizers_.size(); ++i) st.set("optimizer_" + std::to_string(i), optimizers_[i]);
  st.set(checkpoint::kGlobalStepKey, global_step_).set("epoch", epoch_);
  if (sampler_) st.set("sampler", sampler_->state());
  return st;
}

fabric::FabricState Trainer::checkpoint_state(const std::string& path) {
  TESSERA_CHECK(module_ && setup_ == Setup::Optimizers && sampler_,
                "Trainer::save_checkpoint('", path, "'): nothing to save yet (call fit first)");
  auto& f = *fabric_;
  fabric::FabricState st = make_state();
  state::StateDict loop;
  loop.set("world_size", static_cast<int64_t>(f.world_size()));
  loop.set("batch_size", options_.batch_size);
  loop.set("global_samples", static_cast<int64_t>(sampler_->position()) * f.data_parallel_size());
  loop.set("epoch_end_done", loop_.position == LoopPosition::EpochEnded);
  loop.set("val_pending", loop_.position == LoopPosition::ValidationDue);
  st.set("loop", loop);
  for (size_t i = 0; i < schedulers_.size(); ++i)
    st.set("scheduler_" + std::to_string(i), schedulers_[i].scheduler->state_dict());
  state::StateDict cbs;
  for (size_t i = 0; i < callbacks_.size(); ++i) {
    state::StateDict s = callbacks_[i]->state_dict();
    if (s.empty()) continue;
    const std::string k = callbacks_[i]->state_key();
    TESSERA_CHECK(!k.empty(), "Trainer::save_checkpoint: callback ", i,
                  " has state but an empty state_key() (override Callback::state_key)");
    cbs.set(k, std::make_shared<state::StateDict>(std::move(s)));
  }
  st.set("callbacks", cbs);
  st.set("rng", gather_rng_states(f));
  state::StateDict extra, hp;
  module_->on_save_checkpoint(extra);
  for (const auto& [k, v] : module_->hparams()) hp.set(k, v);
  st.set("extra", extra).set("hparams", hp);
  std::error_code ec;
  if (f.is_global_zero()) fs::create_directories(fs::path(path).parent_path(), ec);
  f.barrier();
  return st;
}

void Trainer::save_checkpoint(const std::string& path) { write_checkpoint(path, /*async=*/false); }

void Trainer::save_checkpoint_async(const std::string& path) { write_checkpoint(path, /*async=*/true); }

void Trainer::write_checkpoint(const std::string& path, bool async) {
  const auto t0 = std::chrono::steady_clock::now();
  fabric::FabricState st = checkpoint_state(path);  // Fabric waits for a save in flight
  const auto t1 = std::chrono::steady_clock::now();
  if (async) fabric_->save_async(path, st);
  else fabric_->save(path, st);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log::debug("Trainer: ", async ? "async " : "", "checkpoint '", path, "' held the loop ", seconds,
             " s: its state (loop, callbacks, RNG states, directory) ",
             std::chrono::duration<double>(t1 - t0).count(), " s, the save call ", seconds -
             std::chrono::duration<double>(t1 - t0).count(), " s");
  if (ckpt_stats_.saves++ == 0) ckpt_stats_.first_blocking_seconds = seconds;
  ckpt_stats_.blocking_seconds += seconds;
  each_callback([&](Callback& c) { c.on_save_checkpoint(*this, *module_, path); });
}

void Trainer::wait_for_checkpoint() {
  if (fabric_) fabric_->wait_for_checkpoint();
}

std::string Trainer::resolve_ckpt_path(const std::string& ckpt_path) {
  wait_for_checkpoint();  // a last.ckpt still being written counts once it is committed
  if (ckpt_path == "auto") return find_resumable_checkpoint();
  if (ckpt_path != "last") return ckpt_path;
  // The newest last.ckpt of the ModelCheckpoint callbacks, chosen on rank zero.
  std::string best;
  if (fabric_->is_global_zero()) {
    fs::file_time_type newest{};
    std::vector<std::string> tried;
    for (auto& c : callbacks_) {
      auto m = std::dynamic_pointer_cast<ModelCheckpoint>(c);
      if (!m) continue;
      const std::string p = m->last_path();
      tried.push_back(p);
      std::error_code ec;
      if (!fs::exists(p, ec)) continue;
      auto t = fs::last_write_time(p, ec);
      if (!ec && (best.empty() || t > newest)) {
        best = p;
        newest = t;
      }
    }
    if (best.empty()) {
      best = "\n" + (tried.empty() ? std::string("no ModelCheckpoint callback (enable_checkpointing is false)")
                                    : core::join(tried));
    }
  }
  best = fabric_->broadcast(best, 0);
  TESSERA_CHECK(best.empty() || best[0] != '\n', "Trainer: ckpt_path \"last\": no last checkpoint exists (looked for ",
                best.substr(1), ")");
  return best;
}

// "auto": the newest checkpoint that verifies among those in the ModelCheckpoint
// callbacks' directories (checkpoint::find_resumable, chosen and reported on rank zero),
// or "" (start fresh) when there is none.
std::string Trainer::find_resumable_checkpoint() {
  std::vector<std::string> dirs;
  for (auto& c : callbacks_)
    if (auto m = std::dynamic_pointer_cast<ModelCheckpoint>(c))
      if (std::find(dirs.begin(), dirs.end(), m->dirpath()) == dirs.end()) dirs.push_back(m->dirpath());
  TESSERA_CHECK(!dirs.empty(), "Trainer: ckpt_path \"auto\" looks for checkpoints in the ModelCheckpoint callbacks' "
                "directories, but there is no ModelCheckpoint callback (enable_checkpointing is false)");
  auto& f = *fabric_;
  const checkpoint::ResumeChoice choice =
      checkpoint::find_resumable(dirs, *f.comm(), [&](const std::string& line) { f.print("tessera: ", line); },
                                 checkpoint::Skipped::SetAside);
  return choice.path;
}

void Trainer::load_checkpoint(const std::string& path, bool weights_only) {
  auto& f = *fabric_;
  TESSERA_CHECK(fs::exists(path), "Trainer: checkpoint '", path, "' does not exist");
  if (weights_only) {
    fabric::FabricState st;
    st.set("model", module_->model_);
    f.load(path, st);
    return;
  }
  // Model, optimizers and the step in place; everything else (epoch, sampler, loop,
  // schedulers, callbacks, RNG states, extra) comes back as plain leftovers.
  fabric::FabricState st;
  st.set("model", module_->model_);
  for (size_t i = 0; i < optimizers_.size(); ++i) st.set("optimizer_" + std::to_string(i), optimizers_[i]);
  st.set(checkpoint::kGlobalStepKey, global_step_);
  state::StateDict rest = f.load(path, st);
  if (prefixed_leftovers(rest, "sampler").empty() && prefixed_leftovers(rest, "loop").empty()) {
    restore_from_step(path, st);
  } else {
    restore_loop(path, st, rest);
    restore_schedulers(path, rest);
    restore_callbacks(rest);
    restore_rng_states(f, prefixed_leftovers(rest, "rng"), path);
  }
  module_->on_load_checkpoint(prefixed_leftovers(rest, "extra"));
  each_callback([&](Callback& c) { c.on_load_checkpoint(*this, *module_, path); });
}

// A checkpoint written outside the Trainer (tessera_ckpt.dcp.TrainerState from a PyTorch
// job, or Fabric::save with model, optimizers and global_step) has no loop state: the
// position follows from the step as an uninterrupted run of this Trainer would have it
// (epoch = step / batches per epoch, the batch within it the remainder; the sampler
// order is this Trainer's, from its seed), the LR schedulers are where that many steps
// (or epochs) put them, and the random generators keep their seeded state.
void Trainer::restore_from_step(const std::string& path, const fabric::FabricState& st) {
  auto& f = *fabric_;
  TESSERA_CHECK(options_.accumulate_grad_batches == 1, "Trainer: checkpoint '", path, "' has no loop state ",
                "(no sampler.* or loop.* keys: written outside the Trainer) and TrainerOptions.accumulate_grad_batches ",
                "is ", options_.accumulate_grad_batches, ": the data position cannot follow from global_step alone");
  global_step_ = checked_counter(path, st.values(), checkpoint::kGlobalStepKey, checkpoint::kGlobalStepKey, 0, kMaxCheckpointCounter);
  epoch_ = global_step_ / num_training_batches_;
  const int64_t batch = global_step_ % num_training_batches_;
  state::StateDict ss = sampler_->state();
  ss.set("epoch", epoch_);
  ss.set("position", batch * options_.batch_size);
  sampler_->load_state(ss);
  loop_.position = LoopPosition::InEpoch;
  for (auto& s : schedulers_) {
    state::StateDict sd = s.scheduler->state_dict();
    sd.set("count", (s.interval == Interval::Step ? global_step_ : epoch_) / s.frequency);
    s.scheduler->load_state_dict(sd);
  }
  f.print("tessera: checkpoint '", path, "' has no Trainer loop state (written outside the Trainer): resuming at ",
          "step ", global_step_, " (epoch ", epoch_, ", batch ", batch, " of ", num_training_batches_,
          ") with its model and optimizer state; the data order and LR schedule follow from the step, the random ",
          "generators keep their seeded state");
}

// Step, epoch, the sampler position (translated through global samples when the world
// size changed) and the loop flags.
void Trainer::restore_loop(const std::string& path, const fabric::FabricState& st, const state::StateDict& rest) {
  auto& f = *fabric_;
  global_step_ = checked_counter(path, st.values(), checkpoint::kGlobalStepKey, checkpoint::kGlobalStepKey, 0, kMaxCheckpointCounter);
  epoch_ = checked_counter(path, rest, "epoch", "epoch", 0, kMaxCheckpointCounter);

  state::StateDict ss = prefixed_leftovers(rest, "sampler");
  const state::StateDict loop = prefixed_leftovers(rest, "loop");
  checked_counter(path, ss, "position", "sampler.position", 0, kMaxCheckpointCounter);
  const int64_t saved_w = checked_counter(path, ss, "num_replicas", "sampler.num_replicas", 1,
                                          checkpoint::kMaxWorldSize),
                w = f.data_parallel_size();  // the ranks that read different data
  if (saved_w != w) {
    const int64_t global = ss.integer("position") * saved_w;
    TESSERA_CHECK(global % w == 0, "Trainer: cannot resume '", path, "' on ", w, " ranks: it stopped after ", global,
                  " samples of epoch ", ss.integer("epoch"), " (", saved_w, " ranks x ", ss.integer("position"),
                  "), which ", w, " ranks cannot split evenly");
    ss.set("num_replicas", w);
    ss.set("position", global / w);
    if (loop.contains("batch_size") && loop.integer("batch_size") * saved_w != options_.batch_size * w && f.is_global_zero())
      std::cerr << "tessera: resuming at world size " << w << " with a global batch of " << options_.batch_size * w
                << " samples; the checkpoint was trained with " << loop.integer("batch_size") * saved_w
                << " (the losses will not match an uninterrupted run)" << std::endl;
  }
  sampler_->load_state(ss);
  const bool ended = loop.contains("epoch_end_done") && loop.boolean("epoch_end_done");
  const bool due = loop.contains("val_pending") && loop.boolean("val_pending");
  TESSERA_CHECK(!(ended && due), "Trainer: checkpoint '", path, "' says both that the epoch's end hooks ran ",
                "(loop.epoch_end_done) and that a validation is still due (loop.val_pending)");
  loop_.position = ended ? LoopPosition::EpochEnded : due ? LoopPosition::ValidationDue : LoopPosition::InEpoch;
}

// One state per configured scheduler, no more and no fewer.
void Trainer::restore_schedulers(const std::string& path, const state::StateDict& rest) {
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    const std::string key = "scheduler_" + std::to_string(i);
    state::StateDict s = prefixed_leftovers(rest, key);
    TESSERA_CHECK(!s.empty(), "Trainer: checkpoint '", path, "' has no state for LR scheduler ", i, " ('", key,
                  "'); configure_optimizers returned ", schedulers_.size(), " scheduler(s)");
    schedulers_[i].scheduler->load_state_dict(s);
  }
  TESSERA_CHECK(prefixed_leftovers(rest, "scheduler_" + std::to_string(schedulers_.size())).empty(), "Trainer: checkpoint '",
                path, "' holds more LR scheduler states than the ", schedulers_.size(),
                " configure_optimizers returned");
}

// Each callback with a state_key gets the state saved under it (if any).
void Trainer::restore_callbacks(const state::StateDict& rest) {
  const state::StateDict cbs = prefixed_leftovers(rest, "callbacks");
  std::map<std::string, state::StateDict> by_key;
  cbs.for_each([&](const std::string& k, const state::Value& v) {
    const size_t dot = k.find('.');
    if (dot == std::string::npos) return;
    by_key[k.substr(0, dot)].set(k.substr(dot + 1), v);
  });
  for (auto& c : callbacks_) {
    const std::string k = c->state_key();
    if (!k.empty() && by_key.count(k)) c->load_state_dict(by_key.at(k));
  }
}

}  // namespace tessera::trainer
