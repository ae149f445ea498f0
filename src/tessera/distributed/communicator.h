// Collectives over c10d process groups: Gloo for CPU tensors, NCCL for CUDA
// tensors where this libtorch has it; between the ranks of one host, CPU all-reduce,
// all-gather, reduce-scatter, broadcast and barrier go through a shared-memory channel
// instead (shm_channel.h; such collectives are complete when the *_async call returns).
// Everything above `distributed` talks to peers through a Communicator.
//
// Semantics every backend provides (emulated where a backend lacks the native op,
// chosen by trying the native op once and remembering the answer):
//  - all_reduce: sum, avg, min, max, in place;
//  - all_gather: each rank's tensor concatenated along dim 0, uneven sizes and
//    empty pieces allowed;
//  - reduce_scatter: a tensor split along dim 0 into per-rank pieces (uneven,
//    possibly empty), each rank receives the reduction of its piece;
//  - broadcast, barrier, and byte-string broadcast / all-gather.
// Failures (timeout, dead peer) raise tessera::CommError naming the collective.
//
// Inside: communicator.cpp is the front (checks the arguments, then sends each call
// down the shared-memory channel or the c10d routes); process_group.h makes the
// Gloo / NCCL groups after the rendezvous (rendezvous.h); c10d_routes.h runs a
// collective through them, natively or emulated.
#pragma once
#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/distributed/types.h"  // ReduceOp, CommOptions
#include "tessera/distributed/world.h"

namespace tessera::distributed {

// An asynchronous collective. wait() blocks, raises CommError on failure, and runs
// the post-processing (unpadding, local reduction) of emulated collectives. The
// result tensor (if any) is valid after wait().
class Pending {
 public:
  Pending() = default;
  explicit Pending(std::function<at::Tensor()> finish) : finish_(std::move(finish)) {}
  at::Tensor wait();
  bool valid() const { return static_cast<bool>(finish_); }

 private:
  std::function<at::Tensor()> finish_;
  at::Tensor result_;
  bool done_ = false;
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  // Rendezvous through a c10d TCPStore at world.master_addr:master_port (rank 0 hosts
  // it unless torchrun's agent does) and create the process group(s). For a
  // single-process world no store is created and collectives are local no-ops.
  static std::shared_ptr<Communicator> create(const World& world, const CommOptions& options = {});

  ~Communicator();

  int rank() const;
  int size() const;
  // Rank of this process in the global world.
  int global_rank() const;
  // Global ranks of the members, in group-rank order.
  const std::vector<int>& members() const;
  const World& world() const;
  const CommOptions& options() const;

  // --- synchronous collectives ---
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  // Concatenation along dim 0 of every rank's `local`; sizes discovered with one
  // extra collective.
  at::Tensor all_gather(const at::Tensor& local);
  // Same when every rank already knows each rank's dim-0 size (no extra collective).
  at::Tensor all_gather(const at::Tensor& local, const std::vector<int64_t>& dim0_sizes);
  // `full` has dim-0 size sum(dim0_sizes); returns this rank's piece reduced over ranks.
  at::Tensor reduce_scatter(const at::Tensor& full, const std::vector<int64_t>& dim0_sizes,
                            ReduceOp op = ReduceOp::Sum);
  // Even split: `full`'s dim 0 must be divisible by size().
  at::Tensor reduce_scatter(const at::Tensor& full, ReduceOp op = ReduceOp::Sum);
  void broadcast(at::Tensor& tensor, int src = 0);
  // Personalized exchange: `send` (dim 0 split into send_sizes[r] rows for rank r) goes
  // out, and the result holds recv_sizes[r] rows from each rank r, in rank order.
  // Every rank's send_sizes[r] must equal rank r's recv_sizes[me]; zeros allowed.
  at::Tensor all_to_all(const at::Tensor& send, const std::vector<int64_t>& send_sizes,
                        const std::vector<int64_t>& recv_sizes);
  void barrier();

  std::string broadcast_bytes(const std::string& bytes, int src = 0);
  std::vector<std::string> all_gather_bytes(const std::string& bytes);
  int64_t all_reduce_int(int64_t value, ReduceOp op = ReduceOp::Sum);
  double all_reduce_double(double value, ReduceOp op = ReduceOp::Sum);

  // --- asynchronous variants; the tensors and this Communicator must stay alive until
  // wait(). On Gloo the work runs on the process group's threads (all-reduce,
  // broadcast) or its transport's (the point-to-point all-gather and reduce-scatter;
  // the latter's local sum runs in wait()), on NCCL on its stream: both overlap the
  // caller. Over the shared-memory channel the call does the whole collective and
  // returns a completed Pending: no overlap. ---
  Pending all_reduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::Sum);
  // With `out` (contiguous, sum(dim0_sizes) rows, local's dtype and device) the
  // result lands there, and the caller can lay it out as it needs.
  Pending all_gather_async(const at::Tensor& local, const std::vector<int64_t>& dim0_sizes,
                           at::Tensor out = at::Tensor());
  Pending reduce_scatter_async(const at::Tensor& full, const std::vector<int64_t>& dim0_sizes,
                               ReduceOp op = ReduceOp::Sum);
  Pending broadcast_async(at::Tensor tensor, int src = 0);

  // --- subgroups ---
  // Collective over this communicator: every member calls it with the same partition
  // of group ranks (each inner list a group, in group-rank order). Returns the
  // communicator of the group that holds this rank (nullptr if none does). The new group
  // has this communicator's options unless `options` is given (every member must pass
  // the same; the backends stay this communicator's), e.g. a Gloo-only group beside a
  // shared-memory one.
  std::shared_ptr<Communicator> split(const std::vector<std::vector<int>>& groups,
                                      const std::optional<CommOptions>& options = std::nullopt);

  // Whether the backend for `device` runs the op natively (false: emulated). For
  // diagnostics and benchmarks; valid after the op has run once.
  struct Capabilities {
    int allgather_base = -1;      // -1 unknown, 0 emulated, 1 native
    int reduce_scatter_base = -1;
    int bf16 = -1;
  };
  Capabilities capabilities(bool cuda = false) const;
  // Whether CPU collectives of this group use the shared-memory channel.
  bool uses_shared_memory() const;

  // Collectives issued through this communicator since it was created, by kind: one per
  // call of an all_reduce, all_gather, reduce_scatter, broadcast or all_to_all entry point,
  // synchronous or asynchronous, in a group of one as well (there barrier() and the
  // byte-string helpers issue nothing; otherwise barrier() counts as an all_reduce, and the
  // size-discovering all_gather and the byte-string and scalar helpers as the collectives
  // they are made of). For tests and diagnostics, e.g. that no_sync()
  // issues no gradient collective.
  // Collectives issued over this communicator, and the bytes of the whole tensor each
  // one makes (all_reduce: the tensor; all_gather: the gathered result; reduce_scatter:
  // the full input): the payload the Megatron and sequence-parallel analyses count.
  struct Counts {
    int64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0, broadcast = 0, all_to_all = 0;
    int64_t all_reduce_bytes = 0, all_gather_bytes = 0, reduce_scatter_bytes = 0;
  };
  Counts counts() const;

  struct Impl;

 private:
  explicit Communicator(std::unique_ptr<Impl> impl);
  // Collective: sets up the shared-memory channel when the options allow it and every
  // member is on this host (with Gloo, before any shared-memory collective runs).
  void attach_shared_memory();
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::distributed
