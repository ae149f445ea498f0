// core::cpu_allocator: Tessera's caching CPU allocator, installed as c10's CPU allocator.
// A freed block comes back for the next request of its size class, the idle blocks stay
// under the cap, small requests go to malloc, and the environment chooses the policy in
// the real programs (the test worker and the tessera CLI).
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <thread>

#include "harness.h"
#include "test_util.h"
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

TEST(CpuAllocator, FreedBlocksAreReusedWithinTheirSizeClass) {
  CachingInstalled guard;
  ASSERT_EQ(cpu_allocator_policy(), CpuAllocatorPolicy::Caching);
  const auto s0 = cpu_allocator_stats();
  void* first = nullptr;
  {
    at::Tensor t = at::empty({250000}, at::kFloat);  // 1,000,000 bytes: class 1 MiB
    first = t.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    t.fill_(3);
    EXPECT_EQ(cpu_allocator_stats().in_use_bytes, s0.in_use_bytes + (size_t{1} << 20));
  }
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, s0.idle_bytes + (size_t{1} << 20));
  {
    at::Tensor t = at::empty({260000}, at::kFloat);  // 1,040,000 bytes: the same class
    EXPECT_EQ(t.data_ptr(), first);
    t.fill_(2);
    EXPECT_EQ(t.sum().item<double>(), 520000.0);
  }
  {
    at::Tensor t = at::empty({300000}, at::kFloat);  // 1,200,000 bytes: the next class
    EXPECT_NE(t.data_ptr(), first);
  }
  const auto s1 = cpu_allocator_stats();
  EXPECT_EQ(s1.allocations - s0.allocations, 3);
  EXPECT_EQ(s1.reuses - s0.reuses, 1);
  EXPECT_EQ(s1.in_use_bytes, s0.in_use_bytes);
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

TEST(CpuAllocator, IdleBlocksStayUnderTheCap) {
  CachingInstalled guard;
  set_cpu_cache_cap(size_t{3} << 20);
  {
    std::vector<at::Tensor> ts;
    for (int i = 0; i < 5; ++i) ts.push_back(at::empty({1 << 18}, at::kFloat));  // 1 MiB each
  }
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, size_t{3} << 20);
  set_cpu_cache_cap(size_t{1} << 20);  // trims at once
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, size_t{1} << 20);
  set_cpu_cache_cap(0);
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, 0u);
  { at::Tensor t = at::empty({1 << 18}, at::kFloat); }
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, 0u);
}

// The point of it: a step that allocates and frees the same large tensors does not
// fault their pages in again. 20 rounds of an 8 MiB tensor written in full: the first
// faults its 2048 pages in, the others reuse them.
TEST(CpuAllocator, RepeatedLargeTensorsDoNotFaultAgain) {
  CachingInstalled guard;
  { at::empty({1 << 21}, at::kFloat).fill_(1); }  // first touch
  const long before = minor_faults();
  for (int i = 0; i < 20; ++i) {
    at::Tensor t = at::empty({1 << 21}, at::kFloat);
    t.fill_(static_cast<float>(i));
  }
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
  const auto idle0 = cpu_allocator_stats().idle_bytes;
  std::thread([&] { a->raw_deleter()(p); }).join();
  EXPECT_EQ(cpu_allocator_stats().idle_bytes, idle0 + (size_t{2} << 20));
  at::Tensor t = at::empty({1 << 19}, at::kFloat);  // the same class: that block again
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
