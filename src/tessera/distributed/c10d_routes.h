// The c10d routes of a Communicator: each collective run through a c10d process group
// (process_group.h), natively where the backend has the op and emulated where it does
// not (Gloo point to point, NCCL's padded list form or all-to-all), with what each
// backend can do learned on first use and remembered. A backend without bfloat16
// kernels gets bf16 tensors in another form: fp32 for reductions, 16-bit halves (bits
// only) for all-gather, broadcast and all-to-all. Internal to the distributed layer:
// communicator.cpp checks the arguments and decides when to come here.
#pragma once
#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "tessera/core/compat.h"
#include "tessera/distributed/arrivals.h"
#include "tessera/distributed/collective_common.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/process_group.h"

namespace tessera::distributed {

class C10dRoutes {
 public:
  using Capabilities = Communicator::Capabilities;

  // `board` numbers the collectives and explains the ones that time out (arrivals.h); it
  // outlives the routes. The front numbers each collective (board.issue()) before it
  // comes here, so the number a route captures is board.issued().
  C10dRoutes(ProcessGroups groups, const CommOptions& options, const GroupPlace& place, ArrivalBoard& board);
  C10dRoutes(const C10dRoutes&) = delete;
  C10dRoutes& operator=(const C10dRoutes&) = delete;

  const ProcessGroups& groups() const { return groups_; }
  Capabilities& caps(bool cuda) { return cuda ? caps_cuda_ : caps_cpu_; }
  const Capabilities& caps(bool cuda) const { return cuda ? caps_cuda_ : caps_cpu_; }

  // Some Gloo builds have no bfloat16 kernels; they fail inside the collective rather
  // than when it is issued. One tiny bf16 all-reduce (at creation) tells; the outcome is
  // the same on every rank, so every rank takes the same path afterwards.
  void probe_bf16();

  // The collectives, for arguments the front has checked, in a group of more than one
  // rank and with something to move. The Pending results capture this object.
  Pending all_reduce(const at::Tensor& tensor, ReduceOp op);
  // `out` is defined, contiguous and sized for every piece.
  Pending all_gather(const at::Tensor& local, const std::vector<int64_t>& sizes, const at::Tensor& out);
  Pending reduce_scatter(const at::Tensor& full, const std::vector<int64_t>& sizes, ReduceOp op);
  Pending broadcast(const at::Tensor& tensor, int src);
  // Synchronous.
  at::Tensor all_to_all(const at::Tensor& send, const std::vector<int64_t>& send_sizes,
                        const std::vector<int64_t>& recv_sizes);

 private:
  compat::BackendBase& backend(const at::Tensor& t);
  Capabilities& caps(const at::Tensor& t) { return caps(t.is_cuda()); }
  // Waits on the c10d work items of collective #seq; failures named like the collective,
  // with the ranks that had not arrived when it timed out (see the .cpp).
  void wait_works(const std::vector<c10::intrusive_ptr<compat::Work>>& works, const char* what, const at::Tensor& t,
                  int64_t seq);
  int next_p2p_tag() { return static_cast<int>(p2p_seq_++ % (1u << 30)); }
  // Issues a collective on `t` through `issue(no_bf16)`, with no_bf16 true when `t` is
  // bf16 and the backend is known to lack bf16 kernels. A bf16 collective refused as
  // unsupported marks the backend so and is issued again with no_bf16; any other
  // failure throws CommError naming the collective.
  Pending with_bf16_retry(const char* what, const at::Tensor& t, const std::function<Pending(bool no_bf16)>& issue);

  ProcessGroups groups_;
  std::chrono::milliseconds timeout_;
  // Whether CPU all-gather / reduce-scatter of even pieces try Gloo's native forms
  // (CommOptions::gloo_native after TESSERA_GLOO_NATIVE).
  bool gloo_native_;
  GroupPlace place_;
  ArrivalBoard& board_;
  Capabilities caps_cpu_, caps_cuda_;
  uint32_t p2p_seq_ = 0;  // tags of point-to-point exchanges (same sequence on every rank)
};

}  // namespace tessera::distributed
