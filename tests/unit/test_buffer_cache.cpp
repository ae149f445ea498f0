// core::BufferCache: released blocks are kept for reuse only under the largest live
// reservation, reused at their exact size, freed when the last reservation goes, and
// may come back from another thread.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <thread>

#include "tessera/core/buffer_cache.h"

using tessera::core::BufferCache;

namespace {
struct IdleFreed {
  IdleFreed() { BufferCache::instance().release_idle(); }
  ~IdleFreed() { BufferCache::instance().release_idle(); }
};
}  // namespace

TEST(BufferCache, WithoutAReservationNothingIsKept) {
  IdleFreed guard;
  auto& c = BufferCache::instance();
  ASSERT_EQ(c.limit(), 0u);
  const int64_t before = c.reuses();
  { at::Tensor t = c.empty(1 << 16, at::kFloat); }
  EXPECT_EQ(c.idle_bytes(), 0u);
  { at::Tensor t = c.empty(1 << 16, at::kFloat); }
  EXPECT_EQ(c.reuses(), before);
}

TEST(BufferCache, ReusesExactSizesUnderTheLargestReservation) {
  IdleFreed guard;
  auto& c = BufferCache::instance();
  auto big = c.reserve(3 << 20);
  auto small = c.reserve(1 << 20);
  EXPECT_EQ(c.limit(), size_t{3} << 20);
  void* first = nullptr;
  {
    at::Tensor t = c.empty(1 << 18, at::kFloat);  // 1 MiB
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(t.numel(), 1 << 18);
    t.fill_(2.0);
    EXPECT_EQ(t.sum().item<double>(), double(1 << 19));
    first = t.data_ptr();
  }
  EXPECT_EQ(c.idle_bytes(), size_t{1} << 20);
  const int64_t reuses = c.reuses();
  {
    at::Tensor again = c.empty(1 << 18, at::kFloat);
    EXPECT_EQ(again.data_ptr(), first);
    EXPECT_EQ(c.reuses(), reuses + 1);
    EXPECT_EQ(c.idle_bytes(), 0u);
    at::Tensor other = c.empty(1 << 17, at::kFloat);  // another size: a new block
    EXPECT_NE(other.data_ptr(), first);
    EXPECT_EQ(c.reuses(), reuses + 1);
  }
  EXPECT_EQ(c.idle_bytes(), (size_t{1} << 20) + (size_t{1} << 19));
  {
    // Three 1 MiB blocks come back; only what fits under 3 MiB stays idle.
    at::Tensor a = c.empty(1 << 18, at::kFloat), b = c.empty(1 << 18, at::kFloat),
               d = c.empty(1 << 18, at::kFloat);
  }
  EXPECT_LE(c.idle_bytes(), size_t{3} << 20);
  EXPECT_GE(c.idle_bytes(), size_t{2} << 20);
  // The larger reservation goes: the limit falls to 1 MiB and the idle blocks with it.
  big.reset();
  EXPECT_EQ(c.limit(), size_t{1} << 20);
  EXPECT_LE(c.idle_bytes(), size_t{1} << 20);
  small.reset();
  EXPECT_EQ(c.limit(), 0u);
  EXPECT_EQ(c.idle_bytes(), 0u);
}

TEST(BufferCache, BlocksComeBackFromOtherThreadsAndViewsKeepThemAlive) {
  IdleFreed guard;
  auto& c = BufferCache::instance();
  auto keep = c.reserve(1 << 20);
  at::Tensor t = c.empty(1024, at::kDouble).view({32, 32});
  at::Tensor row = t[3];
  t = at::Tensor();
  EXPECT_EQ(c.idle_bytes(), 0u);  // the view still holds the block
  row.fill_(1.0);
  std::thread([r = std::move(row)]() mutable { r = at::Tensor(); }).join();
  EXPECT_EQ(c.idle_bytes(), 8192u);
}
