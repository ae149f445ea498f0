// The collectives through c10d process groups (c10d_routes.h): the native forms, the
// point-to-point and padded fallbacks, and the bfloat16 fallback written once.
#include "tessera/distributed/c10d_routes.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/strings.h"
#include "tessera/distributed/rendezvous.h"

namespace tessera::distributed {
namespace {

using WorkList = std::vector<c10::intrusive_ptr<compat::Work>>;

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    default: return c10d::ReduceOp::SUM;  // Avg = sum, then divide locally.
  }
}

bool is_unsupported(const std::exception& e) {
  std::string m = e.what();
  return m.find("no support") != std::string::npos || m.find("not supported") != std::string::npos ||
         m.find("does not support") != std::string::npos || m.find("not implemented") != std::string::npos ||
         m.find("Unsupported") != std::string::npos || m.find("Invalid scalar type") != std::string::npos;
}

// Collectives that move bits without computing on them carry bf16 as 16-bit halves
// when the backend has no bf16 kernels.
at::Tensor bits(const at::Tensor& t, bool as_half) { return as_half ? t.view(at::kHalf) : t; }

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

C10dRoutes::C10dRoutes(ProcessGroups groups, const CommOptions& options, const GroupPlace& place,
                       ArrivalBoard& board)
    : groups_(std::move(groups)),
      timeout_(options.timeout),
      gloo_native_(options.gloo_native),
      place_(place),
      board_(board) {}

compat::BackendBase& C10dRoutes::backend(const at::Tensor& t) {
  if (t.is_cuda()) {
    TESSERA_CHECK(groups_.nccl, "a CUDA tensor was given to a collective but ",
                  TESSERA_HAS_NCCL ? "no NCCL process group was created (CUDA unavailable at init?)"
                                   : "this Tessera build has no NCCL support");
    return *groups_.nccl;
  }
  TESSERA_CHECK(t.device().is_cpu(), "collectives take CPU or CUDA tensors, got ", t.device());
  TESSERA_CHECK(groups_.gloo, "no Gloo process group");
  return *groups_.gloo;
}

// For CUDA tensors this is a stream wait: the caller's current stream waits for NCCL's
// stream, the host goes on (so a prefetched all-gather overlaps the compute queued after
// it). Passing a timeout to NCCL's wait() would instead block the host until the
// collective finished; NCCL's watchdog enforces the process group's timeout (set at
// creation) either way. On the CPU each work is waited for with the timeout, in one
// piece: Gloo's send and recv works end themselves (with the timeout as their error)
// when a wait with a timeout runs out, so a wait in slices could not be resumed; the
// board's thread records the long wait meanwhile (arrivals.h).
void C10dRoutes::wait_works(const WorkList& works, const char* what, const at::Tensor& t, int64_t seq) {
  if (t.is_cuda()) {
    place_.guarded(what, t, [&] {
      for (auto& w : works) w->wait();
      return 0;
    });
    return;
  }
  board_.waited(what, t, seq, [&] {
    for (auto& w : works) w->wait(timeout_);
    return 0;
  });
}

void C10dRoutes::probe_bf16() {
  if (!groups_.gloo) return;
  std::vector<at::Tensor> v{at::ones({1}, at::kBFloat16)};
  try {
    groups_.gloo->allreduce(v)->wait(timeout_);
    caps_cpu_.bf16 = 1;
    log::debug("gloo bf16 probe: supported");
  } catch (const std::exception& e) {
    if (!is_unsupported(e)) {
      throw CommError(concat("first collective of rank ", place_.world_rank, " failed: ", short_error(e)));
    }
    caps_cpu_.bf16 = 0;
    log::debug("gloo bf16 probe: unsupported (", e.what(), "); bf16 collectives run in fp32");
  }
}

Pending C10dRoutes::with_bf16_retry(const char* what, const at::Tensor& t,
                                    const std::function<Pending(bool no_bf16)>& issue) {
  Capabilities& c = caps(t);
  const bool bf16 = t.scalar_type() == at::kBFloat16;
  const bool no_bf16 = bf16 && c.bf16 == 0;
  try {
    Pending p = issue(no_bf16);
    // Issued as bf16, so the backend takes it (on the CPU the creation probe already said so).
    if (bf16 && !no_bf16) c.bf16 = 1;
    return p;
  } catch (const std::exception& e) {
    if (!bf16 || no_bf16 || !is_unsupported(e)) throw CommError(concat(place_.where(what, t), " failed: ", e.what()));
  }
  c.bf16 = 0;
  try {
    return issue(true);
  } catch (const std::exception& e) {
    throw CommError(concat(place_.where(what, t), " failed: ", e.what()));
  }
}

// ---------------------------------------------------------------- all_reduce
Pending C10dRoutes::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  const int n = place_.size;
  return with_bf16_retry("all_reduce", tensor, [&](bool upcast) {
    at::Tensor work_t = tensor.is_contiguous() ? tensor : tensor.contiguous();
    if (upcast) work_t = work_t.to(at::kFloat);  // reduced in fp32, rounded once
    std::vector<at::Tensor> v{work_t};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = timeout_;
    auto work = backend(tensor).allreduce(v, o);
    return Pending([this, work, work_t, tensor, op, n, seq = board_.issued()]() mutable {
      wait_works({work}, "all_reduce", tensor, seq);
      finish_avg(work_t, op, n);
      if (!work_t.is_same(tensor)) tensor.copy_(work_t);
      return tensor;
    });
  });
}

// ---------------------------------------------------------------- all_gather
Pending C10dRoutes::all_gather(const at::Tensor& local, const std::vector<int64_t>& sizes, const at::Tensor& out) {
  const int n = place_.size, me = place_.rank;
  const Pieces p(sizes);
  auto& c = caps(local);
  auto& be = backend(local);
  return with_bf16_retry("all_gather", local, [&](bool as_half) {
    at::Tensor send_w = bits(local.contiguous(), as_half);
    at::Tensor out_w = bits(out, as_half);
    WorkList works;
    at::Tensor buf;  // the padded path's landing buffer
    if (p.even && c.allgather_base != 0 && (!local.is_cpu() || gloo_native_)) {
      // NCCL (or Gloo when asked): the native all-gather into one tensor, straight into `out`.
      try {
        works.push_back(be._allgather_base(out_w, send_w));
        c.allgather_base = 1;
      } catch (const std::exception& e) {
        if (!is_unsupported(e)) throw;
        c.allgather_base = 0;
      }
    }
    if (works.empty() && local.is_cpu()) {
      // Gloo: this rank's tensor goes to every peer and each peer's arrives at its exact
      // offset in `out` (point to point: the bytes a ring all-gather moves, with no
      // padding of uneven pieces and no staging buffer on either side).
      works = exchange(
          be, me, n, next_p2p_tag(), [&](int) { return send_w; },
          [&](int from) { return out_w.narrow(0, p.off[from], sizes[from]); });
      if (sizes[me] > 0) out_w.narrow(0, p.off[me], sizes[me]).copy_(send_w);
    } else if (works.empty()) {
      // Uneven pieces on a device backend: the list form into equal, padded pieces.
      at::Tensor padded = send_w;
      if (!p.even) {
        padded = at::zeros(rest_shape(send_w, p.maxs), send_w.options());
        if (sizes[me] > 0) padded.narrow(0, 0, sizes[me]).copy_(send_w);
      }
      buf = at::empty(rest_shape(send_w, p.maxs * n), send_w.options());
      std::vector<std::vector<at::Tensor>> outs(1);
      for (int r = 0; r < n; ++r) outs[0].push_back(buf.narrow(0, r * p.maxs, p.maxs));
      std::vector<at::Tensor> ins{padded};
      works.push_back(be.allgather(outs, ins));
      send_w = padded;
    }
    return Pending([this, works, send_w, buf, out_w, out, sizes, p, local, n, seq = board_.issued()]() {
      wait_works(works, "all_gather", local, seq);
      if (buf.defined()) {
        for (int r = 0; r < n; ++r)
          if (sizes[r] > 0) out_w.narrow(0, p.off[r], sizes[r]).copy_(buf.narrow(0, r * p.maxs, sizes[r]));
      }
      return out;
    });
  });
}

// ------------------------------------------------------------ reduce_scatter
Pending C10dRoutes::reduce_scatter(const at::Tensor& full, const std::vector<int64_t>& sizes, ReduceOp op) {
  const int n = place_.size, me = place_.rank;
  const int64_t mine = sizes[me];
  const Pieces p(sizes);
  auto& c = caps(full);
  auto& be = backend(full);
  return with_bf16_retry("reduce_scatter", full, [&](bool upcast) {
    at::Tensor in = full.contiguous();
    if (upcast) in = in.to(at::kFloat);  // reduced in fp32, rounded once
    WorkList works;
    at::Tensor out;
    bool emulated = false;
    if (c.reduce_scatter_base != 0 && (!full.is_cpu() || (p.even && gloo_native_))) {
      at::Tensor src = in;
      if (!p.even) {
        src = at::zeros(rest_shape(in, p.maxs * n), in.options());
        for (int r = 0; r < n; ++r)
          if (sizes[r] > 0) src.narrow(0, r * p.maxs, sizes[r]).copy_(in.narrow(0, p.off[r], sizes[r]));
      }
      out = at::empty(rest_shape(in, p.maxs), in.options());
      c10d::ReduceScatterOptions o;
      o.reduceOp = to_c10d(op);
      o.timeout = timeout_;
      try {
        works.push_back(be._reduce_scatter_base(out, src, o));
        c.reduce_scatter_base = 1;
      } catch (const std::exception& e) {
        if (!is_unsupported(e)) throw;
        c.reduce_scatter_base = 0;
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
            be, me, n, next_p2p_tag(), [&](int to) { return in.narrow(0, p.off[to], sizes[to]); },
            [&](int from) { return out.narrow(0, from * mine, mine); });
      } else {
        std::vector<int64_t> out_splits(n, mine);
        std::vector<int64_t> in_splits(sizes.begin(), sizes.end());
        c10d::AllToAllOptions o;
        o.timeout = timeout_;
        works.push_back(be.alltoall_base(out, in, out_splits, in_splits, o));
      }
    }
    return Pending([this, works, in, out, p, emulated, mine, me, n, op, full, upcast, seq = board_.issued()]() {
      wait_works(works, "reduce_scatter", full, seq);
      at::Tensor r;
      if (emulated) {
        auto part = [&](int k) {
          return full.is_cpu() && k == me ? in.narrow(0, p.off[me], mine) : out.narrow(0, k * mine, mine);
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
  });
}

// ---------------------------------------------------------------- broadcast
Pending C10dRoutes::broadcast(const at::Tensor& tensor, int src) {
  at::Tensor work_t = tensor.is_contiguous() ? tensor : tensor.contiguous();
  // Broadcast moves bits: no bf16 kernels needed, halves carry them.
  std::vector<at::Tensor> v{bits(work_t, tensor.scalar_type() == at::kBFloat16 && caps(tensor).bf16 == 0)};
  c10d::BroadcastOptions o;
  o.rootRank = src;
  o.timeout = timeout_;
  auto work = place_.guarded("broadcast", tensor, [&] { return backend(tensor).broadcast(v, o); });
  return Pending([this, work, work_t, tensor, seq = board_.issued()]() mutable {
    wait_works({work}, "broadcast", tensor, seq);
    if (!work_t.is_same(tensor)) tensor.copy_(work_t);
    return tensor;
  });
}

// ---------------------------------------------------------------- all_to_all
at::Tensor C10dRoutes::all_to_all(const at::Tensor& send, const std::vector<int64_t>& send_sizes,
                                  const std::vector<int64_t>& recv_sizes) {
  const int64_t total_recv = std::accumulate(recv_sizes.begin(), recv_sizes.end(), int64_t{0});
  at::Tensor in = send.contiguous();
  at::Tensor out = at::empty(rest_shape(in, total_recv), in.options());
  // All-to-all moves bits too.
  const bool as_half = in.scalar_type() == at::kBFloat16 && caps(send).bf16 == 0;
  at::Tensor in_w = bits(in, as_half), out_w = bits(out, as_half);
  std::vector<int64_t> ss(send_sizes.begin(), send_sizes.end()), rs(recv_sizes.begin(), recv_sizes.end());
  c10d::AllToAllOptions o;
  o.timeout = timeout_;
  auto work = place_.guarded("all_to_all", send, [&] { return backend(send).alltoall_base(out_w, in_w, rs, ss, o); });
  wait_works({work}, "all_to_all", send, board_.issued());
  return out;
}

}  // namespace tessera::distributed
