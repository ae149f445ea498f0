// Vocabulary shared by the Communicator (communicator.h) and the transports beneath it
// (the shared-memory channel, the c10d process groups): the reduction operations and
// the options a communicator is created with.
#pragma once
#include <chrono>
#include <cstddef>
#include <string>

namespace tessera::distributed {

enum class ReduceOp { Sum, Avg, Min, Max };

inline const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

struct CommOptions {
  // Deadline for rendezvous and for every collective.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // "auto" (Gloo for CPU tensors, plus NCCL for CUDA tensors when available), "gloo", "nccl".
  std::string backend = "auto";
  // Gloo worker threads per process group.
  int gloo_threads = 2;
  // When every rank of a group is on one host, CPU all-reduce, all-gather, reduce-scatter,
  // broadcast and barrier go through a shared-memory segment instead of Gloo's TCP
  // loopback (see shm_channel.h); Gloo still carries the rest. TESSERA_SHM=0 or 1
  // overrides this. Falls back to Gloo, with a warning, when the segment cannot be made.
  bool shared_memory = true;
  // Bytes each rank moves per round of a shared-memory collective; the segment holds
  // two such slots per rank (capped so that it stays under 64 MiB).
  size_t shm_chunk_bytes = size_t{1} << 20;
  // Gloo (CPU, no shared-memory channel) all-gather and reduce-scatter of even pieces:
  // false sends each piece point to point (no padding, no staging buffer); true uses
  // Gloo's own single-tensor collectives where this libtorch has them (torch 2.x:
  // all_gather_single / reduce_scatter_single; 1.13 has neither and falls back to point
  // to point). Uneven pieces always go point to point. TESSERA_GLOO_NATIVE=0 or 1
  // overrides this. bench_collectives measures both (docs/benchmarks.md).
  bool gloo_native = false;
};

}  // namespace tessera::distributed
