// The Communicator's front: creation (rendezvous and process groups, process_group.h),
// attachment of the shared-memory channel, subgroups, and each collective's argument
// checks and route: the shared-memory channel (shm_channel.h) for CPU tensors of a
// one-host group, otherwise the c10d routes (c10d_routes.h).
#include "tessera/distributed/communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <set>

#include "tessera/core/cpu_allocator.h"
#include "tessera/core/env.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/strings.h"
#include "tessera/distributed/arrivals.h"
#include "tessera/distributed/c10d_routes.h"
#include "tessera/distributed/collective_common.h"
#include "tessera/distributed/process_group.h"
#include "tessera/distributed/shm_channel.h"

namespace tessera::distributed {

at::Tensor Pending::wait() {
  if (!done_) {
    TESSERA_CHECK(finish_, "wait() on an empty Pending collective");
    result_ = finish_();
    done_ = true;
    finish_ = nullptr;
  }
  return result_;
}

struct Communicator::Impl {
  World world;
  CommOptions options;
  // Numbers the collectives and explains timeouts (arrivals.h); before c10d, which uses it.
  std::unique_ptr<ArrivalBoard> board;
  std::unique_ptr<C10dRoutes> c10d;  // the process groups (none for a single process) and their routes
  std::unique_ptr<ShmChannel> shm;   // CPU collectives of a one-host group
  int rank = 0;
  int size = 1;
  std::vector<int> members;
  std::string prefix = "tessera";
  int split_counter = 0;
  // Communicator::counts(); atomic because an async save's thread may read them.
  std::atomic<int64_t> n_all_reduce{0}, n_all_gather{0}, n_reduce_scatter{0}, n_broadcast{0}, n_all_to_all{0};
  std::atomic<int64_t> b_all_reduce{0}, b_all_gather{0}, b_reduce_scatter{0};

  GroupPlace place() const { return {world.rank, world.world_size, rank, size}; }
  ShmChannel* shm_for(const at::Tensor& t) const { return t.is_cpu() ? shm.get() : nullptr; }
  template <typename F>
  auto guarded(const char* what, const at::Tensor& t, F&& f) -> decltype(f()) {
    return place().guarded(what, t, std::forward<F>(f));
  }
  // A collective over the shared-memory channel, as collective #seq.
  template <typename F>
  void over_shm(const char* what, const at::Tensor& t, int64_t seq, F&& f) {
    board->waited(what, t, seq, [&] { f(); return 0; });
  }
  // The routes of a group whose c10d groups are `groups`, with the board over their store.
  void make_routes(ProcessGroups groups) {
    board = std::make_unique<ArrivalBoard>(groups.store, place(), options.timeout,
                                           world.rank == 0 && !world.agent_store);
    c10d = std::make_unique<C10dRoutes>(std::move(groups), options, place(), *board);
  }
};

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

std::shared_ptr<Communicator> Communicator::create(const World& world, const CommOptions& options) {
  check_options(options);
  log::set_rank(world.is_distributed() ? world.rank : -1);
  core::install_cpu_allocator();  // Tessera's CPU memory policy (core/cpu_allocator.h)
  auto impl = std::make_unique<Impl>();
  impl->world = world;
  impl->options = effective_options(options);
  impl->rank = world.rank;
  impl->size = world.world_size;
  impl->members.resize(world.world_size);
  std::iota(impl->members.begin(), impl->members.end(), 0);
  impl->make_routes(create_world_groups(world, impl->options, impl->prefix));
  if (world.is_distributed()) impl->c10d->probe_bf16();
  std::shared_ptr<Communicator> comm(new Communicator(std::move(impl)));
  comm->attach_shared_memory();
  return comm;
}

void Communicator::attach_shared_memory() {
  Impl& I = *impl_;
  if (I.size == 1 || !I.c10d->groups().gloo) return;
  const bool want = env::get_bool("TESSERA_SHM").value_or(I.options.shared_memory);
  // Every rank decides from the same gathered keys, so all take the same path.
  const auto keys = all_gather_bytes(want ? shm_host_key() : std::string());
  const bool one_host = std::all_of(keys.begin(), keys.end(), [&](const std::string& k) {
    return !k.empty() && k == keys[0];
  });
  if (!one_host) {
    log::debug("shared-memory collectives off: ", want ? "the ranks are not all on one host" : "disabled");
    return;
  }
  const size_t cap = (size_t{64} << 20) / (2 * static_cast<size_t>(I.size));
  const size_t chunk = std::max<size_t>(4096, std::min(I.options.shm_chunk_bytes, cap) / 64 * 64);
  std::unique_ptr<ShmChannel> ch;
  std::string error;
  try {
    if (I.rank == 0) ch = ShmChannel::create(I.size, chunk);
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::string name = broadcast_bytes(ch ? ch->name() : std::string());
  if (name.empty()) {
    if (I.rank == 0) log::warn("shared-memory collectives off, using Gloo: ", error);
    return;
  }
  try {
    if (I.rank != 0) ch = ShmChannel::open(name, I.rank, I.size, chunk);
  } catch (const std::exception& e) {
    error = e.what();
  }
  const bool everyone = all_reduce_int(ch ? 1 : 0, ReduceOp::Min) == 1;
  if (ch) ch->unlink();  // every rank has tried to open it by now
  if (!everyone) {
    if (!error.empty()) log::warn("shared-memory collectives off, using Gloo: ", error);
    return;
  }
  ch->set_timeout(I.options.timeout);
  log::debug("shared-memory collectives on: ", I.size, " ranks, ", chunk, "-byte chunks");
  I.shm = std::move(ch);
}

bool Communicator::uses_shared_memory() const { return impl_->shm != nullptr; }

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return impl_->size; }
int Communicator::global_rank() const { return impl_->world.rank; }
const std::vector<int>& Communicator::members() const { return impl_->members; }
const World& Communicator::world() const { return impl_->world; }
const CommOptions& Communicator::options() const { return impl_->options; }
Communicator::Capabilities Communicator::capabilities(bool cuda) const {
  return impl_->c10d->caps(cuda);
}
Communicator::Counts Communicator::counts() const {
  const Impl& I = *impl_;
  return {I.n_all_reduce.load(),     I.n_all_gather.load(), I.n_reduce_scatter.load(),
          I.n_broadcast.load(),      I.n_all_to_all.load(), I.b_all_reduce.load(),
          I.b_all_gather.load(),     I.b_reduce_scatter.load()};
}

// ---------------------------------------------------------------- all_reduce
Pending Communicator::all_reduce_async(at::Tensor tensor, ReduceOp op) {
  Impl& I = *impl_;
  ++I.n_all_reduce;
  I.b_all_reduce += static_cast<int64_t>(tensor.nbytes());
  const int64_t seq = I.board->issue();
  const int n = I.size;
  if (n == 1 || tensor.numel() == 0) return Pending([tensor] { return tensor; });
  if (ShmChannel* shm = I.shm_for(tensor)) {
    // Done when this returns: the data is in shared memory, not in flight.
    at::Tensor work_t = tensor.is_contiguous() ? tensor : tensor.contiguous();
    I.over_shm("all_reduce", tensor, seq, [&] { shm->all_reduce(work_t, op); });
    finish_avg(work_t, op, n);
    if (!work_t.is_same(tensor)) tensor.copy_(work_t);
    return Pending([tensor] { return tensor; });
  }
  return I.c10d->all_reduce(tensor, op);
}

void Communicator::all_reduce(at::Tensor& tensor, ReduceOp op) { all_reduce_async(tensor, op).wait(); }

// ---------------------------------------------------------------- all_gather
Pending Communicator::all_gather_async(const at::Tensor& local, const std::vector<int64_t>& sizes, at::Tensor out) {
  Impl& I = *impl_;
  ++I.n_all_gather;
  const int64_t seq = I.board->issue();
  const int n = I.size, me = I.rank;
  TESSERA_CHECK(local.dim() >= 1, "all_gather needs a tensor of at least one dimension, got a scalar");
  TESSERA_CHECK(static_cast<int>(sizes.size()) == n, "all_gather: ", sizes.size(),
                " dim-0 sizes given for a group of ", n, " ranks");
  TESSERA_CHECK(local.size(0) == sizes[me], "all_gather: rank ", me, " holds ", local.size(0),
                " rows but dim0_sizes says ", sizes[me]);
  const int64_t maxs = *std::max_element(sizes.begin(), sizes.end());
  const int64_t total = core::exclusive_offsets(sizes)[n];
  I.b_all_gather += c10::multiply_integers(rest_shape(local, total)) * static_cast<int64_t>(local.element_size());
  if (out.defined()) {
    TESSERA_CHECK(out.is_contiguous() && out.sizes().vec() == rest_shape(local, total) &&
                      out.scalar_type() == local.scalar_type() && out.device() == local.device(),
                  "all_gather: the output tensor (", out.scalar_type(), " ", out.sizes(), " on ", out.device(),
                  ", contiguous ", out.is_contiguous(), ") is not a contiguous ", local.scalar_type(), " ",
                  at::IntArrayRef(rest_shape(local, total)), " on ", local.device());
  }
  if (n == 1) {
    if (!out.defined()) return Pending([local] { return local; });
    if (out.data_ptr() != local.data_ptr() || out.numel() == 0) out.copy_(local);
    return Pending([out] { return out; });
  }
  if (!out.defined()) out = at::empty(rest_shape(local, total), local.options());
  if (maxs == 0) return Pending([out] { return out; });
  if (ShmChannel* shm = I.shm_for(local)) {
    const at::Tensor send = local.contiguous();
    const auto counts = element_counts(sizes, total > 0 ? out.numel() / total : 0);
    I.over_shm("all_gather", local, seq, [&] { shm->all_gather(send, counts, out); });
    return Pending([out] { return out; });
  }
  return I.c10d->all_gather(local, sizes, out);
}

at::Tensor Communicator::all_gather(const at::Tensor& local, const std::vector<int64_t>& sizes) {
  return all_gather_async(local, sizes).wait();
}

at::Tensor Communicator::all_gather(const at::Tensor& local) {
  TESSERA_CHECK(local.dim() >= 1, "all_gather needs a tensor of at least one dimension, got a scalar");
  std::vector<int64_t> sizes(size(), 0);
  if (size() > 1) {
    at::Tensor mine = at::full({1}, local.size(0), at::kLong);
    at::Tensor all = all_gather_async(mine, std::vector<int64_t>(size(), 1)).wait();
    for (int r = 0; r < size(); ++r) sizes[r] = all[r].item<int64_t>();
  } else {
    sizes[0] = local.size(0);
  }
  return all_gather(local, sizes);
}

// ------------------------------------------------------------ reduce_scatter
Pending Communicator::reduce_scatter_async(const at::Tensor& full, const std::vector<int64_t>& sizes,
                                           ReduceOp op) {
  Impl& I = *impl_;
  ++I.n_reduce_scatter;
  const int64_t seq = I.board->issue();
  const int n = I.size, me = I.rank;
  TESSERA_CHECK(full.dim() >= 1, "reduce_scatter needs a tensor of at least one dimension");
  TESSERA_CHECK(static_cast<int>(sizes.size()) == n, "reduce_scatter: ", sizes.size(),
                " dim-0 sizes given for a group of ", n, " ranks");
  const int64_t total = core::exclusive_offsets(sizes)[n];
  TESSERA_CHECK(full.size(0) == total, "reduce_scatter: the tensor has ", full.size(0),
                " rows but the pieces add up to ", total);
  I.b_reduce_scatter += static_cast<int64_t>(full.nbytes());
  if (n == 1) return Pending([full] { return full; });
  const int64_t mine = sizes[me];
  const int64_t maxs = *std::max_element(sizes.begin(), sizes.end());
  if (maxs == 0) return Pending([full] { return at::empty(rest_shape(full, 0), full.options()); });
  if (ShmChannel* shm = I.shm_for(full)) {
    const at::Tensor in = full.contiguous();
    const auto counts = element_counts(sizes, total > 0 ? in.numel() / total : 0);
    at::Tensor r = at::empty(rest_shape(in, mine), in.options());
    I.over_shm("reduce_scatter", full, seq, [&] { shm->reduce_scatter(in, counts, op, r); });
    finish_avg(r, op, n);
    return Pending([r] { return r; });
  }
  return I.c10d->reduce_scatter(full, sizes, op);
}

at::Tensor Communicator::reduce_scatter(const at::Tensor& full, const std::vector<int64_t>& sizes,
                                        ReduceOp op) {
  return reduce_scatter_async(full, sizes, op).wait();
}

at::Tensor Communicator::reduce_scatter(const at::Tensor& full, ReduceOp op) {
  TESSERA_CHECK(full.dim() >= 1 && full.size(0) % size() == 0, "reduce_scatter: dim 0 (",
                full.dim() ? full.size(0) : 0, ") is not divisible by the group size ", size(),
                "; pass per-rank sizes");
  return reduce_scatter(full, std::vector<int64_t>(size(), full.size(0) / size()), op);
}

// ---------------------------------------------------------------- broadcast
Pending Communicator::broadcast_async(at::Tensor tensor, int src) {
  Impl& I = *impl_;
  ++I.n_broadcast;
  const int64_t seq = I.board->issue();
  TESSERA_CHECK(src >= 0 && src < I.size, "broadcast source rank ", src, " is outside the group of ",
                I.size);
  if (I.size == 1 || tensor.numel() == 0) return Pending([tensor] { return tensor; });
  if (ShmChannel* shm = I.shm_for(tensor)) {
    at::Tensor work_t = tensor.is_contiguous() ? tensor : tensor.contiguous();
    I.over_shm("broadcast", tensor, seq, [&] { shm->broadcast(work_t, src); });
    if (!work_t.is_same(tensor)) tensor.copy_(work_t);
    return Pending([tensor] { return tensor; });
  }
  return I.c10d->broadcast(tensor, src);
}

void Communicator::broadcast(at::Tensor& tensor, int src) { broadcast_async(tensor, src).wait(); }

// ---------------------------------------------------------------- all_to_all
at::Tensor Communicator::all_to_all(const at::Tensor& send, const std::vector<int64_t>& send_sizes,
                                    const std::vector<int64_t>& recv_sizes) {
  Impl& I = *impl_;
  ++I.n_all_to_all;
  I.board->issue();
  const int n = I.size;
  TESSERA_CHECK(send.dim() >= 1, "all_to_all needs a tensor of at least one dimension");
  TESSERA_CHECK(static_cast<int>(send_sizes.size()) == n && static_cast<int>(recv_sizes.size()) == n,
                "all_to_all: ", send_sizes.size(), " send and ", recv_sizes.size(), " receive sizes for a group of ",
                n, " ranks");
  const int64_t total_send = std::accumulate(send_sizes.begin(), send_sizes.end(), int64_t{0});
  TESSERA_CHECK(send.size(0) == total_send, "all_to_all: the tensor has ", send.size(0),
                " rows but the send sizes add up to ", total_send);
  if (n == 1) return send;
  return I.c10d->all_to_all(send, send_sizes, recv_sizes);
}

// ------------------------------------------------------- barrier and helpers
void Communicator::barrier() {
  Impl& I = *impl_;
  if (I.size == 1) return;
  // A one-element all-reduce: unlike c10d's barrier it honours the timeout on every
  // backend and reports a dead peer the same way as any collective.
  at::Tensor t = at::zeros({1}, at::kInt);
  I.guarded("barrier", t, [&] { all_reduce_async(t, ReduceOp::Sum).wait(); return 0; });
}

std::string Communicator::broadcast_bytes(const std::string& bytes, int src) {
  if (size() == 1) return bytes;
  at::Tensor len = at::full({1}, static_cast<int64_t>(rank() == src ? bytes.size() : 0), at::kLong);
  broadcast(len, src);
  const int64_t n = len.item<int64_t>();
  at::Tensor buf = at::empty({n}, at::kByte);
  if (rank() == src && n > 0) std::memcpy(buf.data_ptr(), bytes.data(), n);
  broadcast(buf, src);
  return std::string(static_cast<const char*>(buf.data_ptr()), n);
}

std::vector<std::string> Communicator::all_gather_bytes(const std::string& bytes) {
  if (size() == 1) return {bytes};
  at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  at::Tensor lens = all_gather(len, std::vector<int64_t>(size(), 1));
  std::vector<int64_t> sizes(size());
  for (int r = 0; r < size(); ++r) sizes[r] = lens[r].item<int64_t>();
  at::Tensor mine = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
  at::Tensor all = all_gather(mine, sizes);
  std::vector<std::string> out;
  const char* p = all.numel() ? static_cast<const char*>(all.data_ptr()) : nullptr;
  for (int r = 0; r < size(); ++r) {
    out.emplace_back(p, sizes[r]);
    p += sizes[r];
  }
  return out;
}

int64_t Communicator::all_reduce_int(int64_t value, ReduceOp op) {
  at::Tensor t = at::full({1}, value, at::kLong);
  all_reduce(t, op);
  return t.item<int64_t>();
}

double Communicator::all_reduce_double(double value, ReduceOp op) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  all_reduce(t, op);
  return t.item<double>();
}

// ---------------------------------------------------------------- subgroups
std::shared_ptr<Communicator> Communicator::split(const std::vector<std::vector<int>>& groups,
                                                 const std::optional<CommOptions>& options) {
  Impl& I = *impl_;
  const int id = I.split_counter++;
  std::set<int> seen;
  int mine = -1;
  for (size_t g = 0; g < groups.size(); ++g) {
    TESSERA_CHECK(!groups[g].empty(), "split: group ", g, " is empty");
    for (int r : groups[g]) {
      TESSERA_CHECK(r >= 0 && r < I.size, "split: rank ", r, " in group ", g,
                    " is outside the group of ", I.size);
      TESSERA_CHECK(seen.insert(r).second, "split: rank ", r, " appears in more than one group");
      if (r == I.rank) mine = static_cast<int>(g);
    }
  }
  if (mine < 0) return nullptr;
  const auto& grp = groups[mine];
  auto impl = std::make_unique<Impl>();
  impl->world = I.world;
  impl->options = effective_options(options.value_or(I.options));
  impl->size = static_cast<int>(grp.size());
  impl->rank = static_cast<int>(std::find(grp.begin(), grp.end(), I.rank) - grp.begin());
  for (int r : grp) impl->members.push_back(I.members[r]);
  impl->prefix = concat(I.prefix, "/split", id, "/g", mine);
  impl->make_routes(impl->size > 1 ? create_subgroups(I.c10d->groups(), id, mine, impl->rank, impl->size, I.world,
                                                      impl->options)
                                    : ProcessGroups{});
  impl->c10d->caps(false).bf16 = I.c10d->caps(false).bf16;
  impl->c10d->caps(true).bf16 = I.c10d->caps(true).bf16;
  std::shared_ptr<Communicator> sub(new Communicator(std::move(impl)));
  sub->attach_shared_memory();
  return sub;
}

}  // namespace tessera::distributed
