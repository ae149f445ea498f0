// Distributed save (sharded and full) and async save.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/checksum.h"
#include "tessera/checkpoint/file_io.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/device.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/stream_copy.h"
#include "tessera/sharding/chunk.h"

namespace tessera::checkpoint {

namespace {

// Seconds from a to b, for the debug-level phase timers of full and async saves.
double sec(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

using state::Value;

// Broadcasts rank 0's outcome ("" = ok) and throws it everywhere when it is an error.
void agree(distributed::Communicator& comm, const std::string& rank0_error, const std::string& what) {
  const std::string e = comm.broadcast_bytes(rank0_error, 0);
  TESSERA_CHECK(e.empty(), what, ": ", e);
}

EntryInfo describe(const std::string& fqn, const Value& v) {
  EntryInfo e;
  if (auto t = std::get_if<at::Tensor>(&v)) {
    TESSERA_CHECK(t->defined(), "cannot save key '", fqn, "': undefined tensor");
    e.kind = "tensor";
    e.dtype = t->scalar_type();
    e.shape = t->sizes().vec();
    dtype_name(e.dtype);  // throws for unsupported dtypes
  } else if (auto s = std::get_if<sharding::ShardedTensor>(&v)) {
    TESSERA_CHECK(s->defined(), "cannot save key '", fqn, "': undefined sharded tensor");
    e.kind = "sharded";
    e.dtype = s->dtype();
    e.shape = s->shape();
    dtype_name(e.dtype);
  } else {
    e.kind = state::kind_name(v);
    e.value = v;
  }
  return e;
}

std::string prepare_target(const std::string& path, bool dir, std::string& tmp) {
  try {
    recover_siblings(path);
    check_replaceable(path);
    tmp = temp_sibling(path);
    if (dir) make_dir(tmp);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

// One writer per box. Ranks that hold the same box (the replica groups of HYBRID_SHARD
// each hold the whole model, sharded the same way) would otherwise all write it, and
// the tiling check would reject the overlap. Every rank lists the boxes it could write
// (or its error, "E..."); the lists are exchanged, and each distinct box goes to one of
// its holders: the one with the fewest bytes assigned so far, largest boxes first, the
// lowest rank on a tie, so replica groups share the writing. Every rank computes the
// same assignment from the same lists. Returns, for each of `mine`, whether this rank
// writes it; `err` gets the errors of all ranks (the same text on every rank).
std::vector<bool> plan_writers(const std::vector<Piece>& mine, const std::string& local_err,
                               distributed::Communicator& comm, std::string& err) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& p : mine)
    list.push_back({p.fqn, p.box.offsets, p.box.sizes,
                    static_cast<uint64_t>(p.box.numel()) * c10::elementSize(p.dtype)});
  const auto all = comm.all_gather_bytes(local_err.empty() ? "C" + list.dump() : "E" + local_err);
  err.clear();
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r][0] == 'E') err += concat(err.empty() ? "" : "; ", "rank ", r, ": ", all[r].substr(1));
  std::vector<bool> keep(mine.size(), false);
  if (!err.empty()) return keep;
  using BoxKey = std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>>;
  struct Holders {
    uint64_t bytes = 0;
    std::vector<int> ranks;  // ascending
  };
  std::map<BoxKey, Holders> boxes;
  for (size_t r = 0; r < all.size(); ++r)
    for (const auto& j : nlohmann::json::parse(all[r].substr(1))) {
      Holders& h = boxes[BoxKey{j[0].get<std::string>(), j[1].get<std::vector<int64_t>>(),
                                j[2].get<std::vector<int64_t>>()}];
      h.bytes = j[3].get<uint64_t>();
      h.ranks.push_back(static_cast<int>(r));
    }
  std::vector<std::pair<const BoxKey*, const Holders*>> order;
  for (const auto& [k, h] : boxes) order.emplace_back(&k, &h);
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second->bytes > b.second->bytes; });
  std::vector<uint64_t> load(all.size(), 0);
  std::set<BoxKey> written_here;
  for (const auto& [k, h] : order) {
    int w = h->ranks[0];
    for (int r : h->ranks)
      if (load[static_cast<size_t>(r)] < load[static_cast<size_t>(w)]) w = r;
    load[static_cast<size_t>(w)] += h->bytes;
    if (w == comm.rank()) written_here.insert(*k);
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    const BoxKey k{mine[i].fqn, mine[i].box.offsets, mine[i].box.sizes};
    keep[i] = written_here.erase(k) > 0;  // a box listed twice by one rank is written once
  }
  return keep;
}

void save_sharded(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm) {
  const int rank = comm.rank();
  auto flat = flatten_values(sd);
  std::string tmp, err;
  if (rank == 0) err = prepare_target(path, true, tmp);
  agree(comm, err, concat("saving '", path, "'"));
  tmp = comm.broadcast_bytes(tmp, 0);

  CheckpointMetadata m;
  m.world_size = comm.size();
  m.crc_block = kCrcBlock;
  std::vector<Piece> pieces;
  std::string local_err;
  try {
    for (const auto& [fqn, v] : flat) {
      EntryInfo e = describe(fqn, *v);
      if (auto t = std::get_if<at::Tensor>(v)) {
        if (rank == 0 && t->numel() > 0) {  // replicated: rank 0 writes it
          const at::Tensor tt = *t;
          pieces.push_back({fqn, e.dtype, sharding::full_box(e.shape), [tt] { return tt; }});
        }
      } else if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
        for (const auto& sh : s->local_shards()) {
          if (sh.meta.box.empty()) continue;
          const at::Tensor tt = sh.tensor;
          pieces.push_back({fqn, e.dtype, sh.meta.box, [tt] { return tt; }});
        }
      }
      m.keys.push_back(fqn);
      m.entries.emplace(fqn, std::move(e));
    }
  } catch (const std::exception& e) {
    local_err = e.what();
  }
  const std::vector<bool> keep = plan_writers(pieces, local_err, comm, err);
  if (err.empty()) {
    std::string mine;
    try {
      std::vector<Piece> writing;
      for (size_t i = 0; i < pieces.size(); ++i)
        if (keep[i]) writing.push_back(std::move(pieces[i]));
      mine = to_json(write_data_file(tmp, data_file_name(rank), writing));
    } catch (const std::exception& e) {
      mine = std::string("E") + e.what();
    }
    if (mine.empty() || mine[0] != 'E') mine = "D" + mine;
    auto all = comm.all_gather_bytes(mine);
    if (rank == 0) {
      for (size_t r = 0; r < all.size(); ++r)
        if (all[r][0] == 'E') err += concat(err.empty() ? "" : "; ", "rank ", r, ": ", all[r].substr(1));
      if (err.empty()) {
        try {
          for (size_t r = 0; r < all.size(); ++r) {
            DataFileResult d = data_file_result_from_json(all[r].substr(1));
            m.files.emplace_back(d.file, d.size);
            for (auto& [fqn, c] : d.chunks) {
              auto it = m.entries.find(fqn);
              TESSERA_CHECK(it != m.entries.end(), "rank ", r, " saved key '", fqn, "' that rank 0 does not have");
              it->second.chunks.push_back(std::move(c));
            }
          }
          for (const auto& k : m.keys)
            if (m.entries[k].is_tensor()) check_tiling(k, m.entries[k]);
          write_metadata_file(tmp, m);
          commit_rename(tmp, path);
        } catch (const std::exception& e) {
          err = e.what();
        }
      }
    }
  }
  if (rank == 0 && !err.empty()) {
    try {
      remove_all(tmp);
    } catch (const std::exception&) {
    }
  }
  agree(comm, err, concat("saving '", path, "'"));
}

// Bytes of a sharded tensor gathered to rank 0 at a time by a consolidated save.
constexpr int64_t kGatherSliceBytes = 16 << 20;

void save_full(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm) {
  // The phases, for TESSERA_LOG_LEVEL=debug: gathering, waiting for the writer, finishing.
  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();
  double gather_s = 0, wait_s = 0;
  const int rank = comm.rank();
  auto flat = flatten_values(sd);
  std::string tmp, err;
  if (rank == 0) err = prepare_target(path, false, tmp);
  agree(comm, err, concat("saving '", path, "'"));

  CheckpointMetadata m;
  m.world_size = comm.size();
  std::vector<SafetensorsWriter::Spec> specs;
  for (const auto& [fqn, v] : flat) {
    EntryInfo e = describe(fqn, *v);
    if (e.is_tensor()) specs.push_back({fqn, e.dtype, e.shape});
    m.keys.push_back(fqn);
    m.entries.emplace(fqn, std::move(e));
  }
  std::unique_ptr<SafetensorsWriter> w;
  if (rank == 0) {
    try {
      w = std::make_unique<SafetensorsWriter>(tmp, specs, consolidated_header(m));
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  // Rank 0 writes each piece on a second thread while the next one is gathered, one
  // piece in flight: the disk and the network work at the same time, and the extra
  // memory stays at two slices of kGatherSliceBytes (a sharded tensor is gathered as
  // runs of rows, never whole).
  std::future<void> writing;
  auto wait_write = [&] {
    if (!writing.valid()) return;
    const auto t0 = Clock::now();
    try {
      writing.get();
    } catch (const std::exception& e) {
      if (err.empty()) err = e.what();
    }
    wait_s += sec(t0, Clock::now());
  };
  auto put = [&](at::Tensor piece, bool part) {
    wait_write();
    if (!err.empty()) return;
    writing = std::async(std::launch::async, [&w, piece = std::move(piece), part] {
      if (part) w->write_part(piece);
      else w->write(piece);
    });
  };
  // Every rank takes part in every gather, even after rank 0 failed, so that nobody hangs.
  for (const auto& [fqn, v] : flat) {
    if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
      const std::vector<int64_t>& shape = s->shape();
      const int64_t numel = s->numel();
      if (shape.empty() || numel == 0) {
        at::Tensor full = s->gather(0);
        if (rank == 0) put(full, false);
        continue;
      }
      const int64_t row_bytes = numel / shape[0] * static_cast<int64_t>(c10::elementSize(s->dtype()));
      const int64_t rows = std::max<int64_t>(1, kGatherSliceBytes / std::max<int64_t>(row_bytes, 1));
      for (int64_t r0 = 0; r0 < shape[0]; r0 += rows) {
        sharding::Box region{std::vector<int64_t>(shape.size(), 0), shape};
        region.offsets[0] = r0;
        region.sizes[0] = std::min(rows, shape[0] - r0);
        // A run inside one of rank 0's own shards needs no collective and no copy: rank
        // 0 writes it from the shard (every rank knows the shards, so all skip alike).
        const sharding::Shard* own = nullptr;
        bool in_rank0 = false;
        for (const auto& m : s->shards_metadata())
          in_rank0 |= m.placement.rank == 0 && sharding::contains(m.box, region);
        if (in_rank0) {
          if (rank == 0) {
            for (const auto& sh : s->local_shards())
              if (sharding::contains(sh.meta.box, region)) own = &sh;
            if (own == nullptr) {  // reported after the loop, which every rank finishes (no hang)
              if (err.empty())
                err = concat("key '", fqn, "': rank 0 holds no local shard with rows ", region.to_string(),
                             " that its shard metadata gives it");
            } else {
              at::Tensor view = sharding::narrow_to(own->tensor, own->meta.box, region);
              put(view.is_contiguous() ? view : view.contiguous(), true);
            }
          }
          continue;
        }
        const auto t0 = Clock::now();
        at::Tensor piece = s->gather_region(region, 0);
        gather_s += sec(t0, Clock::now());
        if (rank == 0) put(piece, true);
      }
    } else if (auto t = std::get_if<at::Tensor>(v)) {
      if (rank == 0) put(*t, false);
    }
  }
  wait_write();
  const auto t_finish = Clock::now();
  if (rank == 0) {
    if (err.empty()) {
      try {
        w->finish();
        commit_rename(tmp, path);
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    w.reset();
    if (!err.empty()) {
      try {
        remove_all(tmp);
      } catch (const std::exception&) {
      }
    }
  }
  log::debug("save_full('", path, "') rank ", rank, ": ", sec(t_start, Clock::now()), " s: gathering ", gather_s,
             " s, waiting for the writer ", wait_s, " s, finishing (fsync, rename) ", sec(t_finish, Clock::now()), " s");
  agree(comm, err, concat("saving '", path, "'"));
}

}  // namespace

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
                                                std::vector<c10::Device>& staged) {
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
      auto all = s->shards_metadata();
      for (auto& m : all) m.placement.device = c10::kCPU;
      out->set(k, sharding::ShardedTensor::from_parts(std::move(local), all, s->shape(), s->dtype(), bg));
    } else if (auto d = std::get_if<std::shared_ptr<state::StateDict>>(&v); d && *d) {
      out->set(k, snapshot_into(**d, bg, staged));
    } else {
      out->set(k, v);
    }
  }
  return out;
}

std::shared_ptr<state::StateDict> snapshot(const state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& bg) {
  std::vector<c10::Device> staged;
  auto out = snapshot_into(sd, bg, staged);
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

AsyncSave save_async(const state::StateDict& sd, const std::string& path, std::shared_ptr<distributed::Communicator> comm,
                     const SaveOptions& options) {
  TESSERA_CHECK(comm != nullptr, "save_async: no communicator");
  // The phases of the blocking part, for TESSERA_LOG_LEVEL=debug.
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  finish_pending_save();
  const auto t1 = Clock::now();
  auto bg = background_comm(comm);
  const auto t2 = Clock::now();
  auto snap = snapshot(sd, bg);
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
      save(*snap, path, *bg, options);
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
    log::debug("save_async('", path, "'): returned after ", sec(t0, Clock::now()), " s: waiting for the previous save ",
               sec(t0, t1), " s, background communicator ", sec(t1, t2), " s, snapshot of ", bytes >> 20, " MiB ",
               sec(t2, t3), " s, starting the writer ", sec(t3, Clock::now()), " s");
  }
  return AsyncSave(st);
}

void set_async_save_hook_for_tests(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(g_pending_mu);
  g_test_hook = std::move(hook);
}

void save(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm, const SaveOptions& options) {
  // A save waits for an async one in flight (they would race on the same files).
  if (!tl_background) finish_pending_save();
  if (options.mode == SaveMode::Full) save_full(sd, path, comm);
  else save_sharded(sd, path, comm);
}

}  // namespace tessera::checkpoint
