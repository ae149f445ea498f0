// Collectives between the ranks of one host through one shared-memory segment, for
// CPU tensors. Gloo moves every byte through the loopback TCP stack (two kernel copies,
// a syscall per message and its event loop); here a rank copies its data into its own
// slot of the segment and its peers read it from there.
//
// Layout: a header, one control block per rank (posted / consumed round counters and
// the descriptor of the collective in flight: operation, dtype, size, per-rank split) and two data slots of `chunk_bytes` per
// rank. A collective runs as rounds of at most one chunk per rank: write into slot
// (round % 2), post the round, wait until every peer has posted it, read the peers'
// slots, mark the round consumed. A slot is written again only after every peer has
// consumed the round before, so a rank may run one round ahead of the others.
//
// Waiting spins briefly, then sleeps on a futex. While it waits it checks the
// collective's deadline and whether every peer process still lives, so a dead or silent
// peer is an error, not a hang. Each round carries a descriptor (operation, dtype,
// element count); ranks that disagree fail with an error naming both sides.
//
// Reductions run in rank order on every rank, so results are deterministic and
// identical on all ranks. Ops of one channel are serialized by a mutex. After a failure
// the channel refuses further use (the ranks may be rounds apart).
#pragma once
#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/distributed/types.h"

namespace tessera::distributed {

// Identity of this process's host as far as shared memory goes: boot id, hostname and
// the mount, network and pid namespaces. Ranks with equal keys can map one segment and
// see each other's pids. Empty when it cannot be determined.
std::string shm_host_key();

class ShmChannel {
 public:
  // Creates a segment under a fresh name (group rank 0), first removing names that
  // creators which died before unlinking left behind; throws tessera::Error when the
  // system refuses (no /dev/shm, too little space).
  static std::unique_ptr<ShmChannel> create(int size, size_t chunk_bytes);
  // Maps the segment `name` made by create() as group rank `rank`.
  static std::unique_ptr<ShmChannel> open(const std::string& name, int rank, int size, size_t chunk_bytes);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  const std::string& name() const { return name_; }
  // Removes the name once every rank has mapped the segment: the memory lives on while
  // mapped, and nothing is left in /dev/shm when the processes end, however they end.
  void unlink();
  size_t chunk_bytes() const { return chunk_; }
  // Deadline of each collective.
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // All tensors are contiguous CPU tensors of one dtype, addressed as flat element
  // ranges; `counts` are per-rank element counts. Avg is computed as Sum (the caller divides).
  void all_reduce(const at::Tensor& t, ReduceOp op);
  // `out` holds every rank's `local` in rank order (out may not overlap local).
  void all_gather(const at::Tensor& local, const std::vector<int64_t>& counts, const at::Tensor& out);
  // `out` (counts[rank] elements, not overlapping `in`) receives this rank's range of `in`
  // reduced over ranks.
  void reduce_scatter(const at::Tensor& in, const std::vector<int64_t>& counts, ReduceOp op,
                      const at::Tensor& out);
  void broadcast(const at::Tensor& t, int src);

  struct Desc;  // what one round belongs to (checked across ranks)

 private:
  ShmChannel() = default;
  // The channel over a mapping of segment_size(size, chunk) bytes (unmapped by ~ShmChannel).
  static std::unique_ptr<ShmChannel> adopt(const std::string& name, int rank, int size, size_t chunk,
                                           void* mapping);
  template <typename Write, typename Read>
  void round(const Desc& d, Write&& write, Read&& read);
  // Waits until `word` (of `peer`'s control block) reaches `target`; `joining` names the
  // collective when waiting for the peer to post a round.
  void wait_until(std::atomic<uint32_t>& word, uint32_t target, int peer, const Desc* joining);
  void post(std::atomic<uint32_t>& word, uint32_t value);
  char* slot(int rank, int which) const;
  void fail_if_broken() const;
  template <typename F>
  void run_op(F&& f);

  std::string name_;
  bool owner_ = false;  // created the name and has not unlinked it yet
  int rank_ = 0, size_ = 1;
  size_t chunk_ = 0, bytes_ = 0;
  char* base_ = nullptr;
  uint32_t seq_ = 0;      // rounds started (same sequence on every rank)
  uint64_t rounds_ = 0;   // rounds completed (the slot-reuse wait starts at the third)
  std::chrono::milliseconds timeout_{60000};
  std::chrono::steady_clock::time_point op_start_;
  std::string broken_;
  std::mutex mu_;
};

}  // namespace tessera::distributed
