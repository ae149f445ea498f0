#include "tessera/core/cpu_allocator.h"

#include <c10/core/Allocator.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <utility>

#include "tessera/core/compat.h"
#include "tessera/core/env.h"
#include "tessera/core/error.h"

namespace tessera::core {

namespace {

// Every block starts with a header of one alignment unit that records its size (0: a
// small block, straight from malloc); the caller's pointer follows it. So the pointer
// alone identifies the block, as c10's raw_allocate / raw_deleter require.
constexpr size_t kAlign = 64;
constexpr size_t kHeader = kAlign;
constexpr size_t kSmall = size_t{64} << 10;  // below: malloc's arenas serve it well
constexpr size_t kPage = 4096;
// Address space is mapped this much at a time (more for a larger block); a page of it
// becomes resident only when first written.
constexpr size_t kSegment = size_t{256} << 20;
constexpr size_t kDefaultCapMiB = 1024;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A free range of a segment. `released`: its pages were given back to the kernel
// (madvise), so none is resident; a range made by joining a released range with one
// that is not counts as not released (idle_bytes may then over-count; a later trim
// corrects it).
struct Range {
  size_t bytes = 0;
  bool released = false;
};

struct Segment {
  size_t bytes = 0;
  size_t high_water = 0;  // offset below which blocks were ever handed out (pages touched)
  uint64_t seq = 0;       // order of creation
};

// Free ranges are ordered by their segment's age, then by address: first fit prefers
// the oldest segments, whose pages are resident, to newer ones (which the kernel may
// well map at lower addresses).
using FreeKey = std::pair<uint64_t, char*>;

// Blocks are carved out of large anonymous mappings (segments), first fit (see FreeKey),
// and a freed block is joined with its free neighbours, so freed memory serves the next
// request of any size, and the pages stay resident for it (no page faults). Memory goes
// back to the kernel only beyond the cap on idle resident bytes.
struct Arena {
  std::mutex mu;
  std::map<char*, Segment> segments;  // base -> segment
  std::map<FreeKey, Range> free;      // never spans two segments
  uint64_t next_seq = 0;
  size_t idle = 0;                    // resident bytes in free ranges (see Range)
  size_t cap = kDefaultCapMiB << 20;
  size_t in_use = 0, peak_in_use = 0, mapped = 0;
  int64_t allocations = 0, reuses = 0;

  std::map<char*, Segment>::iterator segment_of(char* p) { return std::prev(segments.upper_bound(p)); }

  // Bytes of the range at `p` that may be resident: below its segment's high water mark.
  size_t resident_part(const FreeKey& k, const Range& r) {
    if (r.released) return 0;
    char* p = k.second;
    auto seg = segment_of(p);
    char* hw = seg->first + seg->second.high_water;
    return p >= hw ? 0 : static_cast<size_t>(std::min(p + r.bytes, hw) - p);
  }
  void add_free(const FreeKey& k, Range r) {
    idle += resident_part(k, r);
    free.emplace(k, r);
  }
  std::map<FreeKey, Range>::iterator erase_free(std::map<FreeKey, Range>::iterator it) {
    idle -= resident_part(it->first, it->second);
    return free.erase(it);
  }

  // First fit in FreeKey order: the first free range that holds `bytes`; nullptr if none.
  char* take(size_t bytes) {
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->second.bytes < bytes) continue;
      const FreeKey k = it->first;
      char* p = k.second;
      const Range r = it->second;
      const bool reused = resident_part(k, r) >= bytes;
      erase_free(it);
      auto seg = segment_of(p);
      seg->second.high_water = std::max(seg->second.high_water, static_cast<size_t>(p + bytes - seg->first));
      if (r.bytes > bytes) add_free({k.first, p + bytes}, Range{r.bytes - bytes, r.released});
      if (reused) ++reuses;
      return p;
    }
    return nullptr;
  }

  // Returns a block's range to the free map, joined with free neighbours in its segment.
  void give_back(char* p, size_t bytes) {
    const uint64_t seq = segment_of(p)->second.seq;
    Range r{bytes, false};
    auto next = free.lower_bound({seq, p});
    if (next != free.end() && next->first == FreeKey{seq, p + bytes}) {
      r.bytes += next->second.bytes;
      next = erase_free(next);
    }
    if (next != free.begin()) {
      auto prev = std::prev(next);
      if (prev->first.first == seq && prev->first.second + prev->second.bytes == p) {
        p = prev->first.second;
        r.bytes += prev->second.bytes;
        erase_free(prev);
      }
    }
    add_free({seq, p}, r);
  }

  // Gives idle pages back to the kernel until at most `limit` resident bytes stay idle:
  // whole free segments are unmapped, other ranges released from their top down.
  void trim(size_t limit) {
    for (auto it = free.begin(); it != free.end() && idle > limit;) {
      auto seg = segment_of(it->first.second);
      if (it->first.second == seg->first && it->second.bytes == seg->second.bytes) {
        char* base = seg->first;
        const size_t bytes = seg->second.bytes;
        it = erase_free(it);
        segments.erase(seg);
        ::munmap(base, bytes);
        mapped -= bytes;
      } else {
        ++it;
      }
    }
    while (idle > limit) {
      auto victim = free.end();
      size_t most = 0;
      for (auto it = free.begin(); it != free.end(); ++it) {
        const size_t part = resident_part(it->first, it->second);
        if (part > most) most = part, victim = it;
      }
      if (victim == free.end()) break;
      const FreeKey k = victim->first;
      char* p = k.second;
      const Range r = victim->second;
      const size_t excess = round_up(idle - limit, kPage);
      // [cut, resident end) goes back; the range splits at cut.
      char* resident_end = p + most;
      char* cut = p + (most > excess ? most - excess : 0);
      erase_free(victim);
      ::madvise(cut, static_cast<size_t>(resident_end - cut), MADV_DONTNEED);
      if (cut > p) add_free(k, Range{static_cast<size_t>(cut - p), false});
      add_free({k.first, cut}, Range{r.bytes - static_cast<size_t>(cut - p), true});
    }
  }

  // Maps a new segment holding at least `bytes` and adds it to the free map.
  bool grow(size_t bytes) {
    const size_t need = round_up(bytes, size_t{2} << 20);
    size_t size = std::max(kSegment, need);
    void* m = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED && size > need) {
      // Strict overcommit accounting (vm.overcommit_memory=2) counts address space: ask
      // for no more than this block needs.
      size = need;
      m = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    }
    if (m == MAP_FAILED) return false;
    char* base = static_cast<char*>(m);
    const uint64_t seq = next_seq++;
    segments.emplace(base, Segment{size, 0, seq});
    mapped += size;
    add_free({seq, base}, Range{size, true});
    return true;
  }
};

Arena& arena() {
  // Never destroyed: tensors may be freed during static teardown or by late threads.
  static Arena* a = new Arena();
  return *a;
}

size_t header_size(void* base) { return *static_cast<size_t*>(base); }

void release(void* ptr) {
  if (ptr == nullptr) return;
  char* base = static_cast<char*>(ptr) - kHeader;
  const size_t bytes = header_size(base);
  if (bytes == 0) {
    std::free(base);
    return;
  }
  Arena& a = arena();
  std::lock_guard<std::mutex> lk(a.mu);
  a.in_use -= bytes;
  a.give_back(base, bytes);
  if (a.idle > a.cap) a.trim(a.cap);
}

void* allocate_block(size_t n) {
  if (n < kSmall) {
    void* base = std::aligned_alloc(kAlign, round_up(n + kHeader, kAlign));
    if (base == nullptr) throw std::bad_alloc();
    *static_cast<size_t*>(base) = 0;
    return static_cast<char*>(base) + kHeader;
  }
  const size_t bytes = round_up(n + kHeader, kPage);
  Arena& a = arena();
  std::lock_guard<std::mutex> lk(a.mu);
  char* base = a.take(bytes);
  if (base == nullptr) {
    if (!a.grow(bytes)) {
      a.trim(0);  // unmapping idle segments may make room
      if (!a.grow(bytes)) throw std::bad_alloc();
    }
    base = a.take(bytes);
    if (base == nullptr) throw std::bad_alloc();
  }
  ++a.allocations;
  a.in_use += bytes;
  a.peak_in_use = std::max(a.peak_in_use, a.in_use);
  *reinterpret_cast<size_t*>(base) = bytes;
  return base + kHeader;
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
    std::lock_guard<std::mutex> alk(arena().mu);
    arena().cap = static_cast<size_t>(m) << 20;
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
  Arena& a = arena();
  std::lock_guard<std::mutex> lk(a.mu);
  CpuAllocatorStats s;
  s.allocations = a.allocations;
  s.reuses = a.reuses;
  s.in_use_bytes = a.in_use;
  s.peak_in_use_bytes = a.peak_in_use;
  s.idle_bytes = a.idle;
  s.cap_bytes = a.cap;
  s.mapped_bytes = a.mapped;
  return s;
}

void release_idle_cpu_memory() {
  Arena& a = arena();
  std::lock_guard<std::mutex> lk(a.mu);
  a.trim(0);
}

void set_cpu_cache_cap(size_t bytes) {
  Arena& a = arena();
  std::lock_guard<std::mutex> lk(a.mu);
  a.cap = bytes;
  if (a.idle > a.cap) a.trim(a.cap);
}

}  // namespace tessera::core
