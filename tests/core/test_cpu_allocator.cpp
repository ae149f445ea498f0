// core::cpu_allocator: Tessera's caching CPU allocator, installed as c10's CPU allocator.
// Freed memory comes back for the next request of any size, idle resident bytes stay
// under the cap, small requests go to malloc, and the environment chooses the policy in
// the real programs (the test worker and the tessera CLI).
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <unistd.h>

#include <fstream>
#include <thread>

#include "support/build_paths.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/core/cpu_allocator.h"

using namespace tessera::core;
using tessera::testing::run_command;
using tessera::testing::run_ranks;

namespace {
// Installs the caching allocator with an empty cache and a 64 MiB cap; restores c10's
// own allocator afterwards (tests may share a process when the binary runs them all).
struct CachingInstalled {
  CachingInstalled() {
    install_cpu_allocator(CpuAllocatorPolicy::Caching);
    release_idle_cpu_memory();
    set_cpu_cache_cap(size_t{64} << 20);
  }
  ~CachingInstalled() {
    release_idle_cpu_memory();
    install_cpu_allocator(CpuAllocatorPolicy::System);
  }
};

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}
}  // namespace

// A block's bytes: the request plus the 64-byte header, rounded up to whole pages.
size_t block_bytes(size_t n) { return (n + 64 + 4095) / 4096 * 4096; }

TEST(CpuAllocator, FreedMemoryServesTheNextRequestOfAnySize) {
  CachingInstalled guard;
  ASSERT_EQ(cpu_allocator_policy(), CpuAllocatorPolicy::Caching);
  const auto s0 = cpu_allocator_stats();
  void* first = nullptr;
  {
    at::Tensor t = at::empty({250000}, at::kFloat);  // 1,000,000 bytes
    first = t.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    t.fill_(3);
    EXPECT_EQ(cpu_allocator_stats().in_use_bytes, s0.in_use_bytes + block_bytes(1000000));
  }
  EXPECT_EQ(cpu_allocator_stats().in_use_bytes, s0.in_use_bytes);
  EXPECT_GE(cpu_allocator_stats().idle_bytes, s0.idle_bytes + block_bytes(1000000));
  {
    at::Tensor t = at::empty({200000}, at::kFloat);  // smaller: the same memory
    EXPECT_EQ(t.data_ptr(), first);
  }
  {
    at::Tensor t = at::empty({300000}, at::kFloat);  // larger: the same memory, and more
    EXPECT_EQ(t.data_ptr(), first);
    t.fill_(2);
    EXPECT_EQ(t.sum().item<double>(), 600000.0);
  }
  // Two neighbours freed become one range that serves a request as large as both.
  void* a_ptr = nullptr;
  {
    at::Tensor a = at::empty({1 << 18}, at::kFloat);  // 1 MiB
    at::Tensor b = at::empty({1 << 18}, at::kFloat);
    a_ptr = a.data_ptr();
    EXPECT_EQ(static_cast<char*>(b.data_ptr()) - static_cast<char*>(a_ptr),
              static_cast<ptrdiff_t>(block_bytes(size_t{1} << 20)));
  }
  {
    at::Tensor both = at::empty({(1 << 19) + 1000}, at::kFloat);
    EXPECT_EQ(both.data_ptr(), a_ptr);
  }
  const auto s1 = cpu_allocator_stats();
  EXPECT_EQ(s1.allocations - s0.allocations, 6);
  EXPECT_GE(s1.reuses - s0.reuses, 2);  // the smaller and the same-size requests at least
  EXPECT_EQ(s1.in_use_bytes, s0.in_use_bytes);
  EXPECT_GT(s1.mapped_bytes, 0u);
}

TEST(CpuAllocator, SmallRequestsGoToMallocAndZeroBytesToNothing) {
  CachingInstalled guard;
  const auto s0 = cpu_allocator_stats();
  at::Tensor small = at::ones({1000});  // 4 KB
  at::Tensor none = at::empty({0});
  EXPECT_EQ(cpu_allocator_stats().allocations, s0.allocations);
  EXPECT_EQ(small.sum().item<double>(), 1000.0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data_ptr()) % 64, 0u);
  EXPECT_EQ(none.numel(), 0);
}

TEST(CpuAllocator, IdleResidentBytesStayUnderTheCap) {
  CachingInstalled guard;
  set_cpu_cache_cap(size_t{3} << 20);
  {
    std::vector<at::Tensor> ts;
    for (int i = 0; i < 5; ++i) ts.push_back(at::ones({1 << 18}, at::kFloat));  // 1 MiB each, written
  }
  EXPECT_LE(cpu_allocator_stats().idle_bytes, size_t{3} << 20);
  EXPECT_GE(cpu_allocator_stats().idle_bytes, size_t{2} << 20);  // trimmed to the cap, not below it
  set_cpu_cache_cap(size_t{1} << 20);  // trims at once
  EXPECT_LE(cpu_allocator_stats().idle_bytes, size_t{1} << 20);
  set_cpu_cache_cap(0);
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, 0u);
  { at::Tensor t = at::ones({1 << 18}, at::kFloat); }
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, 0u);
  // Memory given back still serves later requests correctly (fresh zero pages).
  at::Tensor t = at::empty({1 << 18}, at::kFloat);
  t.fill_(5);
  EXPECT_EQ(t.sum().item<double>(), 5.0 * (1 << 18));
}

// Releasing idle memory lowers the resident set: the pages of a freed 64 MiB block go
// back to the kernel.
TEST(CpuAllocator, ReleasedIdleMemoryLeavesTheResidentSet) {
  CachingInstalled guard;
  auto rss_kib = [] {
    std::ifstream f("/proc/self/statm");
    long pages_total = 0, resident = 0;
    f >> pages_total >> resident;
    return resident * (sysconf(_SC_PAGESIZE) / 1024);
  };
  set_cpu_cache_cap(size_t{256} << 20);
  { at::ones({16 << 20}, at::kFloat); }  // 64 MiB written, then freed: idle and resident
  EXPECT_GE(cpu_allocator_stats().idle_bytes, size_t{64} << 20);
  const long held = rss_kib();
  release_idle_cpu_memory();
  const long released = rss_kib();
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, 0u);
  EXPECT_GT(held - released, 48 * 1024) << "resident KiB " << held << " -> " << released;
}

// The point of it: a step that allocates and frees the same large tensors does not
// fault their pages in again. An 8 MiB tensor written in full, round after round: the
// first rounds fault its pages in (more than once when earlier tests left memory given
// back to the kernel next to it, which a freed block joins), the next 20 reuse them.
TEST(CpuAllocator, RepeatedLargeTensorsDoNotFaultAgain) {
  CachingInstalled guard;
  auto round = [](int i) {
    at::Tensor t = at::empty({1 << 21}, at::kFloat);
    t.fill_(static_cast<float>(i));
  };
  for (int i = 0; i < 5; ++i) round(i);  // first touch
  const long before = minor_faults();
  for (int i = 0; i < 20; ++i) round(i);
  const long faults = minor_faults() - before;
  EXPECT_LT(faults, 512) << "20 rounds of an 8 MiB tensor took " << faults << " minor page faults";
}

// c10's raw interface (a pointer without a context) and blocks freed on another thread.
TEST(CpuAllocator, RawAllocationsAndFreesFromOtherThreads) {
  CachingInstalled guard;
  c10::Allocator* a = c10::GetAllocator(c10::DeviceType::CPU);
  void* p = a->raw_allocate(size_t{2} << 20);
  ASSERT_NE(p, nullptr);
  std::memset(p, 7, size_t{2} << 20);
  const auto in_use0 = cpu_allocator_stats().in_use_bytes;
  std::thread([&] { a->raw_deleter()(p); }).join();
  EXPECT_EQ(cpu_allocator_stats().in_use_bytes, in_use0 - block_bytes(size_t{2} << 20));
  at::Tensor t = at::empty({1 << 19}, at::kFloat);  // the same size: that memory again
  EXPECT_EQ(t.data_ptr(), p);
}

// The programs install the policy the environment names: the caching allocator by
// default (c10's own in ASan builds), c10's own with TESSERA_CPU_ALLOCATOR=system.
TEST(CpuAllocator, ProgramsFollowTheEnvironment) {
#if defined(__SANITIZE_ADDRESS__)
  const std::string by_default = "system";  // ASan builds: see core/cpu_allocator.h
#else
  const std::string by_default = "caching";
#endif
  for (const char* policy : {"", "caching", "system"}) {
    std::map<std::string, std::string> env;
    if (*policy) env["TESSERA_CPU_ALLOCATOR"] = policy;
    auto res = run_ranks(2, {"cpu_allocator"}, 60, env);
    EXPECT_RANKS_OK(res);
    for (int r = 0; r < 2; ++r) {
      ASSERT_FALSE(res.out[r].empty()) << res.all_output();
      EXPECT_EQ(res.out[r].back(), "cpu allocator " + (*policy ? std::string(policy) : by_default))
          << res.all_output();
    }
  }
}

TEST(CpuAllocator, ABadPolicyIsAnErrorNamingTheVariable) {
  auto [code, out] = run_command("TESSERA_CPU_ALLOCATOR=tcmalloc " + std::string(TESSERA_CLI) +
                                 " ckpt inspect /nonexistent-checkpoint");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("TESSERA_CPU_ALLOCATOR='tcmalloc' is not one of: caching, system"),
            std::string::npos)
      << out;
  auto [code2, out2] = run_command("TESSERA_CPU_CACHE_MIB=-1 " + std::string(TESSERA_CLI) +
                                   " ckpt inspect /nonexistent-checkpoint");
  EXPECT_EQ(code2, 2) << out2;
  EXPECT_NE(out2.find("TESSERA_CPU_CACHE_MIB='-1'"), std::string::npos) << out2;
}
