// Replaceable global allocation functions ([new.delete]) that forward to malloc/free and
// count usable bytes (alloc_count.h).
#include "alloc_count.h"

#include <malloc.h>

#include <atomic>
#include <cstdlib>
#include <new>

namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

void note_alloc(void* p) {
  const auto n = static_cast<int64_t>(malloc_usable_size(p));
  const int64_t now = g_live.fetch_add(n, std::memory_order_relaxed) + n;
  int64_t pk = g_peak.load(std::memory_order_relaxed);
  while (now > pk && !g_peak.compare_exchange_weak(pk, now, std::memory_order_relaxed)) {
  }
}

void note_free(void* p) { g_live.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)), std::memory_order_relaxed); }

void* allocate(std::size_t n) {
  void* p = std::malloc(n ? n : 1);
  if (p == nullptr) throw std::bad_alloc();
  note_alloc(p);
  return p;
}

void* allocate_aligned(std::size_t n, std::align_val_t al) {
  const auto a = static_cast<std::size_t>(al);
  void* p = nullptr;
  if (posix_memalign(&p, a < sizeof(void*) ? sizeof(void*) : a, n ? n : 1) != 0) throw std::bad_alloc();
  note_alloc(p);
  return p;
}

void release(void* p) noexcept {
  if (p == nullptr) return;
  note_free(p);
  std::free(p);
}

}  // namespace

namespace scale::alloc {
int64_t live() { return g_live.load(); }
int64_t peak() { return g_peak.load(); }
int64_t reset_peak() {
  const int64_t now = g_live.load();
  g_peak.store(now);
  return now;
}
}  // namespace scale::alloc

void* operator new(std::size_t n) { return allocate(n); }
void* operator new[](std::size_t n) { return allocate(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t n, std::align_val_t a) { return allocate_aligned(n, a); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate_aligned(n, a); }
void operator delete(void* p) noexcept { release(p); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete(void* p, std::size_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t) noexcept { release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { release(p); }
void operator delete(void* p, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { release(p); }
