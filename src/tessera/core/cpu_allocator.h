// Tessera's CPU memory policy: a caching allocator for c10's CPU tensors.
//
// Why. A training step allocates and frees the same large tensors (activations,
// gradients, optimizer temporaries) every step. glibc serves blocks above its mmap
// threshold with mmap and returns them with munmap (and trims the heap top above its
// trim threshold), so every step faults in and zeroes the same pages again. Measured on
// the GPT example (L4 d256 T128, one process, 2 cores): the kernel time of those faults
// halved the tokens/s against the same model under Python torch
// (docs/benchmarks-history.md, "gpt", "Memory policy").
//
// What. Requests of at least 64 KiB are carved out of large anonymous mappings
// (segments of 256 MiB of address space; a page becomes resident only when written),
// rounded up to whole pages, lowest address first. A freed block joins its free
// neighbours, so freed memory serves the next request of any size (a step's activations
// reuse what the previous step's gradients or gathered parameters used) and its pages
// stay resident, without page faults, as long as the idle resident bytes stay under a
// cap (default 1 GiB per process, TESSERA_CPU_CACHE_MIB); beyond it pages go back to the
// kernel (madvise, or munmap of a whole free segment). An earlier design kept freed
// blocks on per-size-class free lists: a block could serve only its own class, and FSDP's
// per-rank peak on the 25.5M GPT was about 100 MiB higher (docs/benchmarks.md). Smaller
// requests go to malloc, which serves them from its arenas without mmap. Blocks are
// 64-byte aligned, as c10's own CPU allocator's.
//
// Who gets it. Fabric (so the Trainer), distributed::Communicator::create and the tessera and
// gpt programs install it before their first tensor; a program that uses none of these
// calls install_cpu_allocator() itself. TESSERA_CPU_ALLOCATOR=system (or
// install_cpu_allocator(CpuAllocatorPolicy::System)) keeps c10's default allocator;
// tensors allocated before the switch are freed by the allocator that made them.
// Builds with AddressSanitizer default to `system`, so that ASan sees every tensor's
// memory come and go.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera::core {

enum class CpuAllocatorPolicy {
  Caching,  // the allocator above (the default)
  System,   // c10's default CPU allocator (malloc / posix_memalign)
};

// Installs the policy named by TESSERA_CPU_ALLOCATOR ("caching", the default, or
// "system"; anything else is an error naming the variable). Idempotent; the first call
// decides, later calls return what it chose.
CpuAllocatorPolicy install_cpu_allocator();
// Installs `policy` explicitly (overrides an earlier choice; the environment is not read).
void install_cpu_allocator(CpuAllocatorPolicy policy);
// The policy c10's CPU allocator follows now (System when nothing was installed).
CpuAllocatorPolicy cpu_allocator_policy();
const char* to_string(CpuAllocatorPolicy p);

struct CpuAllocatorStats {
  int64_t allocations = 0;  // requests served by the caching allocator since start
  int64_t reuses = 0;       // of which were served by idle resident pages
  size_t in_use_bytes = 0;  // block bytes (page-rounded) handed out and not yet freed
  size_t peak_in_use_bytes = 0;
  size_t idle_bytes = 0;    // resident pages of free ranges (may over-count after a trim)
  size_t cap_bytes = 0;     // the cap on idle_bytes
  size_t mapped_bytes = 0;  // address space of the segments (mostly not resident)
};
CpuAllocatorStats cpu_allocator_stats();
// Gives every idle page back to the kernel.
void release_idle_cpu_memory();
// Sets the cap on idle bytes (trims at once if the idle blocks exceed it).
void set_cpu_cache_cap(size_t bytes);

}  // namespace tessera::core
