#include "tessera/core/buffer_cache.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <vector>
#include <new>

namespace tessera::core {

namespace {

constexpr size_t kAlign = 64;

struct State {
  std::mutex mu;
  std::multimap<size_t, void*> idle;  // exact size -> memory
  size_t idle_bytes = 0;
  std::multiset<size_t> reservations;
  size_t limit = 0;  // the largest reservation
  int64_t reuses = 0;

  // With the lock held: takes idle blocks off until they fit under the limit; the
  // caller frees what is returned (outside the lock).
  std::vector<void*> trim() {
    std::vector<void*> out;
    while (idle_bytes > limit && !idle.empty()) {
      auto it = std::prev(idle.end());  // largest first
      idle_bytes -= it->first;
      out.push_back(it->second);
      idle.erase(it);
    }
    return out;
  }
};

State& state() {
  // Never destroyed: blocks may come back from threads that outlive static teardown.
  static State* s = new State();
  return *s;
}

struct Block {
  void* mem;
  size_t bytes;
};

// The DataPtr's deleter: keep the block for reuse if the idle blocks stay under the
// limit, free it otherwise.
void release(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  void* mem = b->mem;
  const size_t bytes = b->bytes;
  delete b;
  if (mem == nullptr) return;
  auto& s = state();
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.idle_bytes + bytes <= s.limit) {
      s.idle.emplace(bytes, mem);
      s.idle_bytes += bytes;
      return;
    }
  }
  std::free(mem);
}

}  // namespace

BufferCache& BufferCache::instance() {
  static BufferCache c;
  return c;
}

at::DataPtr BufferCache::allocate(size_t nbytes) {
  auto& s = state();
  void* mem = nullptr;
  if (nbytes > 0) {
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.idle.find(nbytes);
    if (it != s.idle.end()) {
      mem = it->second;
      s.idle.erase(it);
      s.idle_bytes -= nbytes;
      ++s.reuses;
    }
  }
  if (mem == nullptr && nbytes > 0) {
    mem = std::aligned_alloc(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
    if (mem == nullptr) throw std::bad_alloc();
  }
  return at::DataPtr(mem, new Block{mem, nbytes}, &release, c10::Device(c10::kCPU));
}

at::Tensor BufferCache::empty(int64_t numel, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) return at::empty({numel}, options);
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, allocate(nbytes), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

BufferCache::Reservation BufferCache::reserve(size_t bytes) {
  auto& s = state();
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.reservations.insert(bytes);
    s.limit = *s.reservations.rbegin();
  }
  return Reservation(static_cast<void*>(nullptr), [bytes](void*) {
    auto& st = state();
    std::vector<void*> drop;
    {
      std::lock_guard<std::mutex> lk(st.mu);
      st.reservations.erase(st.reservations.find(bytes));
      st.limit = st.reservations.empty() ? 0 : *st.reservations.rbegin();
      drop = st.trim();
    }
    for (void* m : drop) std::free(m);
  });
}

void BufferCache::release_idle() {
  auto& s = state();
  std::multimap<size_t, void*> idle;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    idle.swap(s.idle);
    s.idle_bytes = 0;
  }
  for (auto& kv : idle) std::free(kv.second);
}

size_t BufferCache::limit() const {
  auto& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.limit;
}

size_t BufferCache::idle_bytes() const {
  auto& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.idle_bytes;
}

int64_t BufferCache::reuses() const {
  auto& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.reuses;
}

}  // namespace tessera::core
