#include "tessera/distributed/communicator.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <set>

#include "tessera/core/cpu_allocator.h"
#include "tessera/core/compat.h"
#include "tessera/core/env.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/distributed/rendezvous.h"
#include "tessera/distributed/shm_channel.h"

namespace tessera::distributed {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

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
  c10::intrusive_ptr<c10d::Store> store;  // null for a single process
  compat::BackendPtr gloo;                // null when size == 1
  compat::BackendPtr nccl;                // null unless built with NCCL and CUDA is present
  std::unique_ptr<ShmChannel> shm;        // CPU collectives of a one-host group
  int rank = 0;
  int size = 1;
  std::vector<int> members;
  std::string prefix = "tessera";
  int split_counter = 0;
  uint32_t p2p_seq = 0;  // tags of point-to-point exchanges (same sequence on every rank)

  int next_p2p_tag() { return static_cast<int>(p2p_seq++ % (1u << 30)); }
  Capabilities caps_cpu, caps_cuda;
  // Communicator::counts(); atomic because an async save's thread may read them.
  std::atomic<int64_t> n_all_reduce{0}, n_all_gather{0}, n_reduce_scatter{0}, n_broadcast{0}, n_all_to_all{0};

  bool is_cuda(const at::Tensor& t) const { return t.is_cuda(); }

  compat::BackendBase& backend(const at::Tensor& t) {
    if (t.is_cuda()) {
      TESSERA_CHECK(nccl, "a CUDA tensor was given to a collective but ",
                    TESSERA_HAS_NCCL ? "no NCCL process group was created (CUDA unavailable at init?)"
                                     : "this Tessera build has no NCCL support");
      return *nccl;
    }
    TESSERA_CHECK(t.device().is_cpu(), "collectives take CPU or CUDA tensors, got ", t.device());
    TESSERA_CHECK(gloo, "no Gloo process group");
    return *gloo;
  }
  Capabilities& caps(const at::Tensor& t) { return t.is_cuda() ? caps_cuda : caps_cpu; }
  // Whether CPU all-gather / reduce-scatter of even pieces try Gloo's native forms
  // (options.gloo_native, TESSERA_GLOO_NATIVE applied once when the group is made).
  bool gloo_native() const { return options.gloo_native; }
  ShmChannel* shm_for(const at::Tensor& t) const { return t.is_cpu() ? shm.get() : nullptr; }

  std::string where(const char* what, const at::Tensor& t) const {
    return concat(what, " (", t.scalar_type(), " ", t.sizes(), ") on rank ", world.rank,
               size != world.world_size ? concat(" (group rank ", rank, " of ", size, ")") : std::string(),
               " of world size ", world.world_size);
  }

  // Runs `f`, turning any exception into a CommError that names the collective.
  template <typename F>
  auto guarded(const char* what, const at::Tensor& t, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      std::string msg = e.what();
      auto nl = msg.find("\nException raised from");
      if (nl != std::string::npos) msg = msg.substr(0, nl);
      throw CommError(concat(where(what, t), " failed: ", msg));
    }
  }

  // Waits on a c10d work item inside the guard. For CUDA tensors this is a stream wait:
  // the caller's current stream waits for NCCL's stream, the host goes on (so a
  // prefetched all-gather overlaps the compute queued after it). Passing a timeout to
  // NCCL's wait() would instead block the host until the collective finished; NCCL's
  // watchdog enforces the process group's timeout (set at creation) either way.
  void wait_work(const c10::intrusive_ptr<compat::Work>& work, const char* what, const at::Tensor& t) {
    guarded(what, t, [&] {
      if (t.is_cuda())
        work->wait();
      else
        work->wait(options.timeout);
      return 0;
    });
  }
};

namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    default: return c10d::ReduceOp::SUM;  // Avg = sum, then divide locally.
  }
}


std::vector<int64_t> rest_shape(const at::Tensor& t, int64_t dim0) {
  std::vector<int64_t> s = t.sizes().vec();
  s[0] = dim0;
  return s;
}

void finish_avg(at::Tensor& t, ReduceOp op, int n) {
  if (op != ReduceOp::Avg || n == 1) return;
  if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
    t.div_(n);
  } else {
    t.copy_(at::div(t, n, "floor"));
  }
}

bool is_unsupported(const std::exception& e) {
  std::string m = e.what();
  return m.find("no support") != std::string::npos || m.find("not supported") != std::string::npos ||
         m.find("does not support") != std::string::npos || m.find("not implemented") != std::string::npos ||
         m.find("Unsupported") != std::string::npos || m.find("Invalid scalar type") != std::string::npos;
}

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const World& world) {
  if (auto ifname = env::get("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
  }
  const std::string& a = world.master_addr;
  if (a == "localhost" || a.rfind("127.", 0) == 0 || a == "::1") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

compat::BackendPtr make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             const World& world, const CommOptions& o) {
  auto opts = c10d::ProcessGroupGloo::Options::create(o.timeout);
  opts->devices.push_back(make_gloo_device(world));
  opts->threads = std::max(1, o.gloo_threads);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

compat::BackendPtr make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             const CommOptions& o) {
#if TESSERA_HAS_NCCL
  if (!at::hasCUDA()) return {};
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = o.timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
#else
  (void)store; (void)rank; (void)size; (void)o;
  return {};
#endif
}

// Some Gloo builds have no bfloat16 kernels; they fail inside the collective rather
// than when it is issued. One tiny bf16 all-reduce at creation tells (the outcome is
// the same on every rank, so every rank takes the same path afterwards).
void probe_capabilities(Communicator::Impl& I) {
  if (!I.gloo) return;
  std::vector<at::Tensor> v{at::ones({1}, at::kBFloat16)};
  try {
    I.gloo->allreduce(v)->wait(I.options.timeout);
    I.caps_cpu.bf16 = 1;
    log::debug("gloo bf16 probe: supported");
  } catch (const std::exception& e) {
    if (!is_unsupported(e)) {
      throw CommError(concat("first collective of rank ", I.world.rank, " failed: ", short_error(e)));
    }
    I.caps_cpu.bf16 = 0;
    log::debug("gloo bf16 probe: unsupported (", e.what(), "); bf16 collectives run in fp32");
  }
}

}  // namespace

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

std::shared_ptr<Communicator> Communicator::create(const World& world, const CommOptions& options) {
  TESSERA_CHECK(options.backend == "auto" || options.backend == "gloo" || options.backend == "nccl",
                "backend '", options.backend, "' is not one of auto, gloo, nccl");
  TESSERA_CHECK(options.timeout.count() > 0, "communicator timeout must be positive");
  log::set_rank(world.is_distributed() ? world.rank : -1);
  core::install_cpu_allocator();  // Tessera's CPU memory policy (core/cpu_allocator.h)
  auto impl = std::make_unique<Impl>();
  impl->world = world;
  impl->options = options;
  impl->options.gloo_native = env::get_bool("TESSERA_GLOO_NATIVE").value_or(options.gloo_native);
  impl->rank = world.rank;
  impl->size = world.world_size;
  impl->members.resize(world.world_size);
  std::iota(impl->members.begin(), impl->members.end(), 0);
  if (options.backend == "nccl" && !TESSERA_HAS_NCCL) {
    throw Error("backend 'nccl' requested but this Tessera build has no NCCL (libtorch without CUDA/NCCL)");
  }
  if (world.is_distributed()) {
    TESSERA_CHECK(world.master_port > 0, "rendezvous needs MASTER_PORT (rank ", world.rank, ")");
    impl->store = connect_store(world, options.timeout);
    auto base = c10::make_intrusive<c10d::PrefixStore>(impl->prefix, impl->store);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      if (options.backend != "nccl") {
        impl->gloo = make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", base), world.rank,
                               world.world_size, world, options);
      }
      if (options.backend != "gloo") {
        impl->nccl = make_nccl(c10::make_intrusive<c10d::PrefixStore>("nccl", base), world.rank,
                               world.world_size, options);
      }
    } catch (const std::exception& e) {
      throw_join_failure(world, *impl->store, options.timeout,
                         std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0),
                         e);
    }
    impl->store = base;
    probe_capabilities(*impl);
  }
  std::shared_ptr<Communicator> comm(new Communicator(std::move(impl)));
  comm->attach_shared_memory();
  return comm;
}

void Communicator::attach_shared_memory() {
  Impl& I = *impl_;
  if (I.size == 1 || !I.gloo) return;
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
  return cuda ? impl_->caps_cuda : impl_->caps_cpu;
}
Communicator::Counts Communicator::counts() const {
  const Impl& I = *impl_;
  return {I.n_all_reduce.load(), I.n_all_gather.load(), I.n_reduce_scatter.load(), I.n_broadcast.load(),
          I.n_all_to_all.load()};
}

// ---------------------------------------------------------------- all_reduce
Pending Communicator::all_reduce_async(at::Tensor tensor, ReduceOp op) {
  Impl& I = *impl_;
  ++I.n_all_reduce;
  const int n = I.size;
  if (n == 1 || tensor.numel() == 0) return Pending([tensor] { return tensor; });
  at::Tensor work_t = tensor.is_contiguous() ? tensor : tensor.contiguous();
  if (ShmChannel* shm = I.shm_for(tensor)) {
    // Done when this returns: the data is in shared memory, not in flight.
    I.guarded("all_reduce", tensor, [&] { shm->all_reduce(work_t, op); return 0; });
    finish_avg(work_t, op, n);
    if (!work_t.is_same(tensor)) tensor.copy_(work_t);
    return Pending([tensor] { return tensor; });
  }
  bool upcast = false;
  auto& caps = I.caps(tensor);
  if (tensor.scalar_type() == at::kBFloat16 && caps.bf16 == 0) {
    work_t = work_t.to(at::kFloat);
    upcast = true;
  }
  c10::intrusive_ptr<compat::Work> work;
  std::vector<at::Tensor> v{work_t};
  c10d::AllreduceOptions o;
  o.reduceOp = to_c10d(op);
  o.timeout = I.options.timeout;
  try {
    work = I.backend(tensor).allreduce(v, o);
    if (tensor.scalar_type() == at::kBFloat16 && !upcast) caps.bf16 = 1;
  } catch (const std::exception& e) {
    if (tensor.scalar_type() == at::kBFloat16 && !upcast && is_unsupported(e)) {
      caps.bf16 = 0;
      --I.n_all_reduce;  // the retry counts it
      return all_reduce_async(tensor, op);
    }
    throw CommError(concat(I.where("all_reduce", tensor), " failed: ", e.what()));
  }
  return Pending([&I, work, work_t, tensor, op, n]() mutable {
    I.wait_work(work, "all_reduce", tensor);
    finish_avg(work_t, op, n);
    if (!work_t.is_same(tensor)) tensor.copy_(work_t);
    return tensor;
  });
}

void Communicator::all_reduce(at::Tensor& tensor, ReduceOp op) { all_reduce_async(tensor, op).wait(); }

// ---------------------------------------------------------------- all_gather
namespace {
using WorkList = std::vector<c10::intrusive_ptr<compat::Work>>;

// Per-rank element counts of dim-0 pieces whose rows hold `row` elements each.
std::vector<int64_t> element_counts(const std::vector<int64_t>& sizes, int64_t row) {
  std::vector<int64_t> counts(sizes.size());
  for (size_t r = 0; r < sizes.size(); ++r) counts[r] = sizes[r] * row;
  return counts;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t r = 0; r < sizes.size(); ++r) off[r + 1] = off[r] + sizes[r];
  return off;
}

// Gloo point to point under one tag: send_to(peer) goes to every other rank and
// recv_from(peer) is filled from it. Empty tensors are skipped on both sides (the
// ranks agree on every piece's size).
WorkList exchange(compat::BackendBase& be, int me, int n, int tag,
                  const std::function<at::Tensor(int)>& send_to, const std::function<at::Tensor(int)>& recv_from) {
  WorkList works;
  for (int k = 1; k < n; ++k) {
    const int to = (me + k) % n, from = (me + n - k) % n;
    std::vector<at::Tensor> s{send_to(to)}, r{recv_from(from)};
    if (s[0].numel() > 0) works.push_back(be.send(s, to, tag));
    if (r[0].numel() > 0) works.push_back(be.recv(r, from, tag));
  }
  return works;
}
}  // namespace

Pending Communicator::all_gather_async(const at::Tensor& local, const std::vector<int64_t>& sizes, at::Tensor out) {
  Impl& I = *impl_;
  ++I.n_all_gather;
  const int n = I.size, me = I.rank;
  TESSERA_CHECK(local.dim() >= 1, "all_gather needs a tensor of at least one dimension, got a scalar");
  TESSERA_CHECK(static_cast<int>(sizes.size()) == n, "all_gather: ", sizes.size(),
                " dim-0 sizes given for a group of ", n, " ranks");
  TESSERA_CHECK(local.size(0) == sizes[me], "all_gather: rank ", me, " holds ", local.size(0),
                " rows but dim0_sizes says ", sizes[me]);
  const int64_t maxs = *std::max_element(sizes.begin(), sizes.end());
  const auto off = offsets_of(sizes);
  const int64_t total = off[n];
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
  const bool even = std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == maxs; });
  at::Tensor send = local.contiguous();
  if (ShmChannel* shm = I.shm_for(local)) {
    const auto counts = element_counts(sizes, total > 0 ? out.numel() / total : 0);
    I.guarded("all_gather", local, [&] { shm->all_gather(send, counts, out); return 0; });
    return Pending([out] { return out; });
  }
  auto& caps = I.caps(local);
  auto& be = I.backend(local);
  // All-gather moves bits: a backend without bf16 kernels carries them as 16-bit halves.
  const bool as_half = send.scalar_type() == at::kBFloat16 && caps.bf16 == 0;
  at::Tensor send_w = as_half ? send.view(at::kHalf) : send;
  at::Tensor out_w = as_half ? out.view(at::kHalf) : out;
  WorkList works;
  at::Tensor buf;  // the padded path's landing buffer
  try {
    if (even && caps.allgather_base != 0 && (!local.is_cpu() || I.gloo_native())) {
      // NCCL (or Gloo when asked): the native all-gather into one tensor, straight into `out`.
      try {
        works.push_back(be._allgather_base(out_w, send_w));
        caps.allgather_base = 1;
      } catch (const std::exception& e) {
        if (!is_unsupported(e)) throw;
        caps.allgather_base = 0;
      }
    }
    if (works.empty() && local.is_cpu()) {
      // Gloo: this rank's tensor goes to every peer and each peer's arrives at its exact
      // offset in `out` (point to point: the bytes a ring all-gather moves, with no
      // padding of uneven pieces and no staging buffer on either side).
      works = exchange(
          be, me, n, I.next_p2p_tag(), [&](int) { return send_w; },
          [&](int from) { return out_w.narrow(0, off[from], sizes[from]); });
      if (sizes[me] > 0) out_w.narrow(0, off[me], sizes[me]).copy_(send_w);
    } else if (works.empty()) {
      // Uneven pieces on a device backend: the list form into equal, padded pieces.
      at::Tensor padded = send_w;
      if (!even) {
        padded = at::zeros(rest_shape(send_w, maxs), send_w.options());
        if (sizes[me] > 0) padded.narrow(0, 0, sizes[me]).copy_(send_w);
      }
      buf = at::empty(rest_shape(send_w, maxs * n), send_w.options());
      std::vector<std::vector<at::Tensor>> outs(1);
      for (int r = 0; r < n; ++r) outs[0].push_back(buf.narrow(0, r * maxs, maxs));
      std::vector<at::Tensor> ins{padded};
      works.push_back(be.allgather(outs, ins));
      send_w = padded;
    }
    if (local.scalar_type() == at::kBFloat16 && !as_half && !local.is_cpu()) caps.bf16 = 1;
  } catch (const std::exception& e) {
    if (local.scalar_type() == at::kBFloat16 && !as_half && is_unsupported(e)) {
      caps.bf16 = 0;
      --I.n_all_gather;  // the retry counts it
      return all_gather_async(local, sizes, out);
    }
    throw CommError(concat(I.where("all_gather", local), " failed: ", e.what()));
  }
  return Pending([&I, works, send_w, buf, out_w, out, sizes, off, maxs, local, n]() {
    for (auto& w : works) I.wait_work(w, "all_gather", local);
    if (buf.defined()) {
      for (int r = 0; r < n; ++r)
        if (sizes[r] > 0) out_w.narrow(0, off[r], sizes[r]).copy_(buf.narrow(0, r * maxs, sizes[r]));
    }
    return out;
  });
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
  const int n = I.size, me = I.rank;
  TESSERA_CHECK(full.dim() >= 1, "reduce_scatter needs a tensor of at least one dimension");
  TESSERA_CHECK(static_cast<int>(sizes.size()) == n, "reduce_scatter: ", sizes.size(),
                " dim-0 sizes given for a group of ", n, " ranks");
  const auto off = offsets_of(sizes);
  const int64_t total = off[n];
  TESSERA_CHECK(full.size(0) == total, "reduce_scatter: the tensor has ", full.size(0),
                " rows but the pieces add up to ", total);
  if (n == 1) return Pending([full] { return full; });
  const int64_t mine = sizes[me];
  const int64_t maxs = *std::max_element(sizes.begin(), sizes.end());
  if (maxs == 0) return Pending([full] { return at::empty(rest_shape(full, 0), full.options()); });
  if (ShmChannel* shm = I.shm_for(full)) {
    const at::Tensor in = full.contiguous();
    const auto counts = element_counts(sizes, total > 0 ? in.numel() / total : 0);
    at::Tensor r = at::empty(rest_shape(in, mine), in.options());
    I.guarded("reduce_scatter", full, [&] { shm->reduce_scatter(in, counts, op, r); return 0; });
    finish_avg(r, op, n);
    return Pending([r] { return r; });
  }
  auto& caps = I.caps(full);
  auto& be = I.backend(full);
  at::Tensor in = full.contiguous();
  const bool upcast = in.scalar_type() == at::kBFloat16 && caps.bf16 == 0;
  if (upcast) in = in.to(at::kFloat);
  const bool even = std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == maxs; });

  WorkList works;
  at::Tensor out;
  bool emulated = false;
  try {
    if (caps.reduce_scatter_base != 0 && (!full.is_cpu() || (even && I.gloo_native()))) {
      at::Tensor src = in;
      if (!even) {
        src = at::zeros(rest_shape(in, maxs * n), in.options());
        for (int r = 0; r < n; ++r)
          if (sizes[r] > 0) src.narrow(0, r * maxs, sizes[r]).copy_(in.narrow(0, off[r], sizes[r]));
      }
      out = at::empty(rest_shape(in, maxs), in.options());
      c10d::ReduceScatterOptions o;
      o.reduceOp = to_c10d(op);
      o.timeout = I.options.timeout;
      try {
        works.push_back(be._reduce_scatter_base(out, src, o));
        caps.reduce_scatter_base = 1;
      } catch (const std::exception& e) {
        if (!is_unsupported(e)) throw;
        caps.reduce_scatter_base = 0;
      }
    }
    if (works.empty()) {
      // Emulation: every rank's copy of piece r goes to rank r (the bytes a ring
      // reduce-scatter moves), which reduces them locally in rank order, so the result
      // is deterministic. Slot k of `out` holds rank k's copy (this rank's own is read
      // from `in`). Gloo: point to point straight from `in`; otherwise one all-to-all.
      emulated = true;
      out = at::empty(rest_shape(in, mine * n), in.options());
      if (full.is_cpu()) {
        works = exchange(
            be, me, n, I.next_p2p_tag(), [&](int to) { return in.narrow(0, off[to], sizes[to]); },
            [&](int from) { return out.narrow(0, from * mine, mine); });
      } else {
        std::vector<int64_t> out_splits(n, mine);
        std::vector<int64_t> in_splits(sizes.begin(), sizes.end());
        c10d::AllToAllOptions o;
        o.timeout = I.options.timeout;
        works.push_back(be.alltoall_base(out, in, out_splits, in_splits, o));
      }
    }
    if (full.scalar_type() == at::kBFloat16 && !upcast && !full.is_cpu()) caps.bf16 = 1;
  } catch (const std::exception& e) {
    if (full.scalar_type() == at::kBFloat16 && !upcast && is_unsupported(e)) {
      caps.bf16 = 0;
      --I.n_reduce_scatter;  // the retry counts it
      return reduce_scatter_async(full, sizes, op);
    }
    throw CommError(concat(I.where("reduce_scatter", full), " failed: ", e.what()));
  }
  return Pending([&I, works, in, out, off, emulated, mine, me, n, op, full, upcast]() {
    for (auto& w : works) I.wait_work(w, "reduce_scatter", full);
    at::Tensor r;
    if (emulated) {
      auto part = [&](int k) {
        return full.is_cpu() && k == me ? in.narrow(0, off[me], mine) : out.narrow(0, k * mine, mine);
      };
      r = at::empty(rest_shape(in, mine), in.options());
      for (int k = 1; k < n; ++k) {
        const at::Tensor acc = k == 1 ? part(0) : r;  // the first step also fills r
        switch (op) {
          case ReduceOp::Min: at::minimum_out(r, acc, part(k)); break;
          case ReduceOp::Max: at::maximum_out(r, acc, part(k)); break;
          default: at::add_out(r, acc, part(k));
        }
      }
    } else {
      r = out.narrow(0, 0, mine);
      if (mine != out.size(0)) r = r.clone();
    }
    finish_avg(r, op, n);
    if (upcast) r = r.to(at::kBFloat16);
    return r;
  });
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
  TESSERA_CHECK(src >= 0 && src < I.size, "broadcast source rank ", src, " is outside the group of ",
                I.size);
  if (I.size == 1 || tensor.numel() == 0) return Pending([tensor] { return tensor; });
  at::Tensor work_t = tensor.is_contiguous() ? tensor : tensor.contiguous();
  if (ShmChannel* shm = I.shm_for(tensor)) {
    I.guarded("broadcast", tensor, [&] { shm->broadcast(work_t, src); return 0; });
    if (!work_t.is_same(tensor)) tensor.copy_(work_t);
    return Pending([tensor] { return tensor; });
  }
  at::Tensor wire = work_t;
  // Broadcast moves bits: a backend without bf16 kernels carries them as 16-bit halves (copied, never computed on).
  if (tensor.scalar_type() == at::kBFloat16 && I.caps(tensor).bf16 == 0) wire = work_t.view(at::kHalf);
  std::vector<at::Tensor> v{wire};
  c10d::BroadcastOptions o;
  o.rootRank = src;
  o.timeout = I.options.timeout;
  auto work = I.guarded("broadcast", tensor, [&] { return I.backend(tensor).broadcast(v, o); });
  return Pending([&I, work, work_t, tensor]() mutable {
    I.wait_work(work, "broadcast", tensor);
    if (!work_t.is_same(tensor)) tensor.copy_(work_t);
    return tensor;
  });
}

void Communicator::broadcast(at::Tensor& tensor, int src) { broadcast_async(tensor, src).wait(); }

at::Tensor Communicator::all_to_all(const at::Tensor& send, const std::vector<int64_t>& send_sizes,
                                    const std::vector<int64_t>& recv_sizes) {
  Impl& I = *impl_;
  ++I.n_all_to_all;
  const int n = I.size;
  TESSERA_CHECK(send.dim() >= 1, "all_to_all needs a tensor of at least one dimension");
  TESSERA_CHECK(static_cast<int>(send_sizes.size()) == n && static_cast<int>(recv_sizes.size()) == n,
                "all_to_all: ", send_sizes.size(), " send and ", recv_sizes.size(), " receive sizes for a group of ",
                n, " ranks");
  const int64_t total_send = std::accumulate(send_sizes.begin(), send_sizes.end(), int64_t{0});
  const int64_t total_recv = std::accumulate(recv_sizes.begin(), recv_sizes.end(), int64_t{0});
  TESSERA_CHECK(send.size(0) == total_send, "all_to_all: the tensor has ", send.size(0),
                " rows but the send sizes add up to ", total_send);
  if (n == 1) return send;
  at::Tensor in = send.contiguous();
  at::Tensor out = at::empty(rest_shape(in, total_recv), in.options());
  // A backend without bf16 kernels still moves the bits: carry them as 16-bit halves.
  const bool as_half = in.scalar_type() == at::kBFloat16 && I.caps(send).bf16 == 0;
  at::Tensor in_w = as_half ? in.view(at::kHalf) : in;
  at::Tensor out_w = as_half ? out.view(at::kHalf) : out;
  std::vector<int64_t> ss(send_sizes.begin(), send_sizes.end()), rs(recv_sizes.begin(), recv_sizes.end());
  c10d::AllToAllOptions o;
  o.timeout = I.options.timeout;
  auto work = I.guarded("all_to_all", send, [&] { return I.backend(send).alltoall_base(out_w, in_w, rs, ss, o); });
  I.wait_work(work, "all_to_all", send);
  return out;
}

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
  impl->options = options.value_or(I.options);
  impl->options.gloo_native = env::get_bool("TESSERA_GLOO_NATIVE").value_or(impl->options.gloo_native);
  impl->size = static_cast<int>(grp.size());
  impl->rank = static_cast<int>(std::find(grp.begin(), grp.end(), I.rank) - grp.begin());
  for (int r : grp) impl->members.push_back(I.members[r]);
  impl->prefix = concat(I.prefix, "/split", id, "/g", mine);
  impl->caps_cpu.bf16 = I.caps_cpu.bf16;
  impl->caps_cuda.bf16 = I.caps_cuda.bf16;
  if (impl->size > 1) {
    impl->store = c10::make_intrusive<c10d::PrefixStore>(concat("split", id, "/g", mine), I.store);
    try {
      if (I.gloo) {
        impl->gloo = make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", impl->store), impl->rank,
                               impl->size, I.world, impl->options);
      }
      if (I.nccl) {
        impl->nccl = make_nccl(c10::make_intrusive<c10d::PrefixStore>("nccl", impl->store), impl->rank,
                               impl->size, impl->options);
      }
    } catch (const std::exception& e) {
      throw CommError(concat("creating subgroup ", mine, " (split ", id, ") on rank ", I.world.rank,
                          " failed: ", e.what()));
    }
  }
  std::shared_ptr<Communicator> sub(new Communicator(std::move(impl)));
  sub->attach_shared_memory();
  return sub;
}

int find_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TESSERA_CHECK(fd >= 0, "socket() failed while looking for a free port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    throw Error("bind() to a free loopback port failed");
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

}  // namespace tessera::distributed
