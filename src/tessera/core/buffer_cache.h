// A cache of large host buffers for the transient tensors that sharded training makes
// and drops every step at the same sizes (gathered parameters, flat gradients, the
// staging buffers of emulated collectives). glibc serves blocks this large with mmap
// and returns them with munmap, so every step would otherwise fault in and zero the
// same pages again (measured: 10-18 ms of a 180 ms FSDP step on 2 cores).
//
// A released block is kept for reuse while the idle blocks stay under the limit, and
// freed otherwise. The limit is the largest live reservation: whoever knows the working
// set (FSDP, from its units' sizes) reserves it for as long as it trains, and when the
// last reservation goes the limit is 0 again and the idle blocks are freed. Only CPU
// memory is cached: CUDA has its own caching allocator. Thread-safe (blocks come back
// from collective threads).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <memory>

namespace tessera::core {

class BufferCache {
 public:
  static BufferCache& instance();

  // A CPU block of exactly `nbytes` (an idle block of that size when there is one).
  at::DataPtr allocate(size_t nbytes);
  // An uninitialized contiguous 1-D tensor: backed by allocate() on the CPU, by the
  // device's own (caching) allocator elsewhere.
  at::Tensor empty(int64_t numel, const at::TensorOptions& options);
  // Idle blocks may take up to `bytes` (if no other reservation allows more) while the
  // returned handle lives.
  using Reservation = std::shared_ptr<void>;
  Reservation reserve(size_t bytes);
  // Frees every idle block (reservations stay).
  void release_idle();

  size_t limit() const;
  size_t idle_bytes() const;
  int64_t reuses() const;  // allocations served from an idle block, since start

 private:
  BufferCache() = default;
};

}  // namespace tessera::core
