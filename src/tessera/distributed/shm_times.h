// How long this process has spent in shared-memory collectives (shm_channel.h: the CPU
// collectives of ranks on one host), and how much of that it spent waiting for the other
// ranks to arrive. Those collectives run inside the calling thread (DDP's all-reduces in
// its gradient hooks, FSDP's gathers and reduce-scatters), so the waiting is time the
// caller stood still: a rank that reaches a collective first waits there for the last.
// Summed over every channel of the process (one per group of ranks on this host) since it
// started; take differences around the code to measure. For diagnostics and benchmarks
// (`gpt train` prints them for its timed steps).
#pragma once
#include <cstdint>

namespace tessera::distributed {

struct SharedMemoryTimes {
  uint64_t collectives = 0;    // collectives completed
  double seconds = 0;          // wall time inside them
  double waiting_seconds = 0;  // of that, waiting for peers (to post a round or to free a slot)
};

// Thread-safe; all zero in a process that has no shared-memory channel.
SharedMemoryTimes shared_memory_times();

}  // namespace tessera::distributed
