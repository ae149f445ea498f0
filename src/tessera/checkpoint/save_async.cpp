// Async saves (a snapshot to host memory, then the write on a background thread over a
// communicator split off the caller's) and the save() entry point.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/save_steps.h"
#include "tessera/checkpoint/test_hooks.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/device.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/stream_copy.h"

namespace tessera::checkpoint {

using state::Value;

// ------------------------------------------------------------------ async

struct AsyncSave::State {
  std::thread thread;
  std::mutex join_mu;  // held while joining
  std::mutex mu;       // guards finished
  bool finished = false;
  std::exception_ptr error;
  ~State() {
    if (thread.joinable()) thread.join();
  }
};

namespace {
std::mutex g_pending_mu;
thread_local bool tl_background = false;
std::shared_ptr<AsyncSave::State> g_pending;
std::function<void()> g_test_hook;  // set_async_save_hook_for_tests; guarded by g_pending_mu

struct SplitCache {
  std::mutex mu;
  std::vector<std::pair<std::weak_ptr<distributed::Communicator>, std::shared_ptr<distributed::Communicator>>> items;
};
SplitCache& split_cache() {
  static SplitCache c;
  return c;
}

std::shared_ptr<distributed::Communicator> background_comm(const std::shared_ptr<distributed::Communicator>& comm) {
  auto& c = split_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto& [w, bg] : c.items)
    if (w.lock() == comm) return bg;
  std::vector<int> all(static_cast<size_t>(comm->size()));
  for (int r = 0; r < comm->size(); ++r) all[static_cast<size_t>(r)] = r;
  auto bg = comm->split({all});
  TESSERA_CHECK(bg != nullptr, "async save: could not create the background communicator");
  c.items.emplace_back(comm, bg);
  return bg;
}

// Device tensors are staged into pinned host buffers with asynchronous copies; the
// devices they came from are recorded so that the snapshot synchronizes each once.
at::Tensor host_copy(const at::Tensor& t, std::vector<c10::Device>& staged) {
  if (t.device().is_cpu()) {
    // The copy is the blocking part of an async save (TESSERA_LOG_LEVEL=debug shows its
    // phases). A contiguous tensor is copied with streaming stores (core/stream_copy.h):
    // the writer thread reads the copy later, so it need not pass through this core's
    // cache (a tensor copy ran at 4.8 GB/s here, memcpy at 9.8, 152 MB, one thread).
    if (!t.is_contiguous()) return t.detach().clone(at::MemoryFormat::Contiguous);
    at::Tensor h = at::empty(t.sizes(), t.options());
    if (t.numel() > 0) core::copy_streaming(h.data_ptr(), t.data_ptr(), t.nbytes());
    return h;
  }
  at::Tensor h = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true));
  h.copy_(t.detach(), /*non_blocking=*/true);
  if (std::find(staged.begin(), staged.end(), t.device()) == staged.end()) staged.push_back(t.device());
  return h;
}

std::shared_ptr<state::StateDict> snapshot_into(const state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& bg,
                                                std::vector<c10::Device>& staged, bool sharded, const std::string& prefix) {
  auto out = std::make_shared<state::StateDict>();
  for (const auto& k : sd.keys()) {
    const Value& v = sd.at(k);
    if (auto t = std::get_if<at::Tensor>(&v)) {
      out->set(k, host_copy(*t, staged));
    } else if (auto s = std::get_if<sharding::ShardedTensor>(&v)) {
      std::vector<sharding::Shard> local;
      for (const auto& sh : s->local_shards()) {
        sharding::Shard c{host_copy(sh.tensor, staged), sh.meta};
        c.meta.placement.device = c10::kCPU;
        local.push_back(std::move(c));
      }
      // Over the background communicator, unless a sharded save is asked of a tensor on a
      // subgroup (the shard groups of HYBRID_SHARD): it maps the pieces to ranks through the
      // subgroup's members and runs no collective over it. (A full save gathers over the
      // tensor's communicator, which must be the background one.) A rule-made tensor stays
      // one (its list is never built for a sharded save).
      const auto& own = s->comm();
      TESSERA_CHECK(sharded || own->size() == bg->size(), "save_async: key '", prefix, k, "' is sharded over a group of ",
                    own->size(), " of the ", bg->size(),
                    " ranks (HYBRID_SHARD's shard groups, or a data-parallel group under tensor parallelism), which a ",
                    "full (consolidated) background save cannot gather; save it with SaveMode::Sharded, or pass the ",
                    "strategy's full state dict");
      const auto& comm = sharded && own->size() != bg->size() ? own : bg;
      if (s->metadata_is_rule_only()) {  // one shard per rank, or one per stripe (a tp rule)
        out->set(k, sharding::ShardedTensor::from_rule(std::move(local), *s->layout(), s->shape(), s->dtype(), comm));
      } else {
        auto all = s->shards_metadata();
        for (auto& m : all) m.placement.device = c10::kCPU;
        out->set(k, sharding::ShardedTensor::from_parts(std::move(local), all, s->shape(), s->dtype(), comm, s->layout()));
      }
    } else if (auto d = std::get_if<std::shared_ptr<state::StateDict>>(&v); d && *d) {
      out->set(k, snapshot_into(**d, bg, staged, sharded, prefix + k + "."));
    } else {
      out->set(k, v);
    }
  }
  return out;
}

std::shared_ptr<state::StateDict> snapshot(const state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& bg,
                                           bool sharded) {
  std::vector<c10::Device> staged;
  auto out = snapshot_into(sd, bg, staged, sharded, "");
  for (const auto& d : staged) core::synchronize(d);  // the pinned copies are complete
  return out;
}

}  // namespace

std::shared_ptr<distributed::Communicator> prepare_async_save(const std::shared_ptr<distributed::Communicator>& comm) {
  TESSERA_CHECK(comm != nullptr, "prepare_async_save: no communicator");
  return background_comm(comm);
}

void finish_pending_save() {
  try {
    wait_for_pending_save();
  } catch (const std::exception& e) {
    log::warn("the previous async checkpoint save failed: ", e.what());
  }
}

void wait_for_pending_save() {
  std::shared_ptr<AsyncSave::State> p;
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    p = std::move(g_pending);
  }
  if (p) AsyncSave(p).wait();
}

void AsyncSave::wait() {
  TESSERA_CHECK(s_ != nullptr, "AsyncSave::wait on an empty handle");
  {
    std::lock_guard<std::mutex> lock(s_->join_mu);
    if (s_->thread.joinable()) s_->thread.join();
  }
  if (s_->error) std::rethrow_exception(s_->error);
}

bool AsyncSave::done() const {
  if (!s_) return true;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->finished;
}

namespace {
// save() and the background thread of save_async(), the path checked where it entered.
void save_checked(const state::StateDict& sd, const CheckedPath& path, distributed::Communicator& comm,
                  const SaveOptions& options) {
  // A save waits for an async one in flight (they would race on the same files).
  if (!tl_background) finish_pending_save();
  if (options.mode == SaveMode::Full) save_full(sd, path, comm);
  else save_sharded(sd, path, comm);
}
}  // namespace

AsyncSave save_async(const state::StateDict& sd, const std::string& unchecked_path,
                     std::shared_ptr<distributed::Communicator> comm, const SaveOptions& options) {
  TESSERA_CHECK(comm != nullptr, "save_async: no communicator");
  const CheckedPath path = CheckedPath::check(unchecked_path);  // every rank alike, before any collective
  // The phases of the blocking part, for TESSERA_LOG_LEVEL=debug.
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  finish_pending_save();
  const auto t1 = Clock::now();
  auto bg = background_comm(comm);
  const auto t2 = Clock::now();
  auto snap = snapshot(sd, bg, options.mode == SaveMode::Sharded);
  const auto t3 = Clock::now();
  auto st = std::make_shared<AsyncSave::State>();
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    hook = g_test_hook;
  }
  st->thread = std::thread([snap, path, bg, options, hook, raw = st.get()] {
    tl_background = true;
    try {
      if (hook) hook();
      save_checked(*snap, path, *bg, options);
    } catch (...) {
      raw->error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(raw->mu);
    raw->finished = true;
  });
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    g_pending = st;
  }
  if (log::level() <= log::Level::Debug) {
    int64_t bytes = 0;
    for (const auto& [k, v] : snap->flatten()) {
      if (auto t = std::get_if<at::Tensor>(v)) bytes += static_cast<int64_t>(t->nbytes());
      if (auto s = std::get_if<sharding::ShardedTensor>(v))
        for (const auto& sh : s->local_shards()) bytes += static_cast<int64_t>(sh.tensor.nbytes());
    }
    using log::seconds;
    log::debug("save_async('", path.str(), "'): returned after ", seconds(t0, Clock::now()),
               " s: waiting for the previous save ", seconds(t0, t1), " s, background communicator ", seconds(t1, t2),
               " s, snapshot of ", bytes >> 20, " MiB ", seconds(t2, t3), " s, starting the writer ",
               seconds(t3, Clock::now()), " s");
  }
  return AsyncSave(st);
}

void set_async_save_hook_for_tests(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(g_pending_mu);
  g_test_hook = std::move(hook);
}

void save(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm, const SaveOptions& options) {
  save_checked(sd, CheckedPath::check(path), comm, options);  // every rank alike, before any collective
}

}  // namespace tessera::checkpoint
