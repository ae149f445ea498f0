#include "tessera/core/cpu_allocator.h"

#include <c10/core/Allocator.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "tessera/core/compat.h"
#include "tessera/core/env.h"
#include "tessera/core/error.h"

namespace tessera::core {

namespace {

// Every block starts with a header of one alignment unit that records its size class (0:
// a small block, straight from malloc); the caller's pointer follows it. So the pointer
// alone identifies the block, as c10's raw_allocate / raw_deleter require.
constexpr size_t kAlign = 64;
constexpr size_t kHeader = kAlign;
constexpr size_t kSmall = size_t{64} << 10;  // below: malloc's arenas serve it well
constexpr size_t kDefaultCapMiB = 1024;

// Four classes per power of two: n rounded up to a multiple of a quarter of its
// highest power of two (slack under 25%).
size_t size_class(size_t n) {
  int k = 63 - __builtin_clzll(static_cast<unsigned long long>(n));
  const size_t step = size_t{1} << (k - 2);
  return (n + step - 1) & ~(step - 1);
}

struct Cache {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<void*>> idle;  // class bytes -> blocks (base pointers)
  size_t idle_bytes = 0;
  size_t cap = kDefaultCapMiB << 20;
  size_t in_use = 0, peak_in_use = 0;
  int64_t allocations = 0, reuses = 0;

  // With the lock held: idle blocks off the lists until they fit under the cap, largest
  // classes first; the caller frees them outside the lock.
  std::vector<void*> trim() {
    std::vector<void*> out;
    while (idle_bytes > cap) {
      auto victim = idle.end();
      for (auto it = idle.begin(); it != idle.end(); ++it)
        if (!it->second.empty() && (victim == idle.end() || it->first > victim->first)) victim = it;
      if (victim == idle.end()) break;
      out.push_back(victim->second.back());
      victim->second.pop_back();
      idle_bytes -= victim->first;
    }
    return out;
  }
};

Cache& cache() {
  // Never destroyed: tensors may be freed during static teardown or by late threads.
  static Cache* c = new Cache();
  return *c;
}

size_t header_class(void* base) { return *static_cast<size_t*>(base); }

void* new_block(size_t bytes_with_header, size_t cls) {
  void* base = std::aligned_alloc(kAlign, (bytes_with_header + kAlign - 1) / kAlign * kAlign);
  if (base == nullptr) {
    release_idle_cpu_memory();  // idle blocks may be what stands in the way
    base = std::aligned_alloc(kAlign, (bytes_with_header + kAlign - 1) / kAlign * kAlign);
  }
  if (base == nullptr) throw std::bad_alloc();
  *static_cast<size_t*>(base) = cls;
  return base;
}

void release(void* ptr) {
  if (ptr == nullptr) return;
  void* base = static_cast<char*>(ptr) - kHeader;
  const size_t cls = header_class(base);
  if (cls == 0) {
    std::free(base);
    return;
  }
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lk(c.mu);
    c.in_use -= cls;
    if (c.idle_bytes + cls <= c.cap) {
      c.idle[cls].push_back(base);
      c.idle_bytes += cls;
      return;
    }
  }
  std::free(base);
}

void* allocate_block(size_t n) {
  if (n < kSmall) return static_cast<char*>(new_block(n + kHeader, 0)) + kHeader;
  const size_t cls = size_class(n);
  Cache& c = cache();
  void* base = nullptr;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    ++c.allocations;
    c.in_use += cls;
    c.peak_in_use = std::max(c.peak_in_use, c.in_use);
    auto it = c.idle.find(cls);
    if (it != c.idle.end() && !it->second.empty()) {
      base = it->second.back();
      it->second.pop_back();
      c.idle_bytes -= cls;
      ++c.reuses;
    }
  }
  if (base == nullptr) {
    try {
      base = new_block(cls + kHeader, cls);
    } catch (...) {
      std::lock_guard<std::mutex> lk(c.mu);
      c.in_use -= cls;
      throw;
    }
  }
  return static_cast<char*>(base) + kHeader;
}

// The allocator c10 calls. `allocate` is const on libtorch 1.13 and not on 2.x
// (compat::kAllocatorAllocateIsConst): the partial specializations stay templates, so
// only the one this libtorch needs is checked against c10::Allocator.
template <bool AllocateIsConst, typename Base = c10::Allocator>
class CachingAllocatorFor;

c10::DataPtr allocate_data(size_t n) {
  void* p = n == 0 ? nullptr : allocate_block(n);
  return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
}

template <typename Base>
class CachingAllocatorFor<true, Base> final : public Base {
 public:
  c10::DataPtr allocate(size_t n) const override { return allocate_data(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
};

template <typename Base>
class CachingAllocatorFor<false, Base> final : public Base {
 public:
  c10::DataPtr allocate(size_t n) override { return allocate_data(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  // Pure virtual where it exists (2.x); without `override`, as releases differ in it.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count > 0) std::memcpy(dest, src, count);
  }
};

using CachingCpuAllocator = CachingAllocatorFor<compat::kAllocatorAllocateIsConst>;

struct Installed {
  std::mutex mu;
  bool decided = false;
  CpuAllocatorPolicy policy = CpuAllocatorPolicy::System;
  c10::Allocator* system = nullptr;  // c10's allocator before the first switch
};

Installed& installed() {
  static Installed* i = new Installed();
  return *i;
}

CachingCpuAllocator& caching_allocator() {
  static CachingCpuAllocator* a = new CachingCpuAllocator();
  return *a;
}

// c10 replaces an allocator only at the same or a higher priority; both of ours use one.
constexpr uint8_t kPriority = 1;

void apply(Installed& st, CpuAllocatorPolicy policy) {
  if (st.system == nullptr) st.system = c10::GetAllocator(c10::DeviceType::CPU);
  c10::SetAllocator(c10::DeviceType::CPU,
                    policy == CpuAllocatorPolicy::Caching ? &caching_allocator() : st.system, kPriority);
  st.policy = policy;
  st.decided = true;
}

}  // namespace

const char* to_string(CpuAllocatorPolicy p) { return p == CpuAllocatorPolicy::Caching ? "caching" : "system"; }

CpuAllocatorPolicy install_cpu_allocator() {
  Installed& st = installed();
  std::lock_guard<std::mutex> lk(st.mu);
  if (st.decided) return st.policy;
  // Under AddressSanitizer blocks reused from a free list would hide use-after-free of
  // tensor memory, so sanitized builds default to c10's allocator (malloc, which ASan
  // checks); TESSERA_CPU_ALLOCATOR=caching still selects the cache there.
#if defined(__SANITIZE_ADDRESS__)
  CpuAllocatorPolicy policy = CpuAllocatorPolicy::System;
#else
  CpuAllocatorPolicy policy = CpuAllocatorPolicy::Caching;
#endif
  if (auto v = env::get("TESSERA_CPU_ALLOCATOR")) {
    TESSERA_CHECK(*v == "caching" || *v == "system", "TESSERA_CPU_ALLOCATOR='", *v,
                  "' is not one of: caching, system");
    policy = *v == "caching" ? CpuAllocatorPolicy::Caching : CpuAllocatorPolicy::System;
  }
  if (auto mib = env::get("TESSERA_CPU_CACHE_MIB")) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long m = std::strtoull(mib->c_str(), &end, 10);
    TESSERA_CHECK(!mib->empty() && end != nullptr && *end == '\0' && errno == 0 && (*mib)[0] != '-' &&
                      m <= (size_t{1} << 24),
                  "TESSERA_CPU_CACHE_MIB='", *mib, "' is not a number of MiB from 0 to 16777216");
    std::lock_guard<std::mutex> clk(cache().mu);
    cache().cap = static_cast<size_t>(m) << 20;
  }
  apply(st, policy);
  return policy;
}

void install_cpu_allocator(CpuAllocatorPolicy policy) {
  Installed& st = installed();
  std::lock_guard<std::mutex> lk(st.mu);
  apply(st, policy);
}

CpuAllocatorPolicy cpu_allocator_policy() {
  Installed& st = installed();
  std::lock_guard<std::mutex> lk(st.mu);
  return c10::GetAllocator(c10::DeviceType::CPU) == &caching_allocator() ? CpuAllocatorPolicy::Caching
                                                                           : CpuAllocatorPolicy::System;
}

CpuAllocatorStats cpu_allocator_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lk(c.mu);
  CpuAllocatorStats s;
  s.allocations = c.allocations;
  s.reuses = c.reuses;
  s.in_use_bytes = c.in_use;
  s.peak_in_use_bytes = c.peak_in_use;
  s.idle_bytes = c.idle_bytes;
  s.cap_bytes = c.cap;
  return s;
}

void release_idle_cpu_memory() {
  Cache& c = cache();
  std::unordered_map<size_t, std::vector<void*>> idle;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    idle.swap(c.idle);
    c.idle_bytes = 0;
  }
  for (auto& kv : idle)
    for (void* b : kv.second) std::free(b);
}

void set_cpu_cache_cap(size_t bytes) {
  Cache& c = cache();
  std::vector<void*> drop;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    c.cap = bytes;
    drop = c.trim();
  }
  for (void* b : drop) std::free(b);
}

}  // namespace tessera::core
