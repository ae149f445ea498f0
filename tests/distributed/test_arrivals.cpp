// The ranks that had not arrived at a collective that timed out (distributed/arrivals.h):
// the capped rank lists of the message, and the diagnosis through a store, with the
// ranks of one group as boards in one process over a c10d HashStore.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <stdexcept>
#include <thread>

#include "tessera/core/error.h"
#include "tessera/distributed/arrivals.h"

using namespace tessera::distributed;
using std::chrono::milliseconds;

TEST(Arrivals, RankListsAreCapped) {
  EXPECT_EQ(format_rank_list({}), "no rank");
  EXPECT_EQ(format_rank_list({3}), "rank 3");
  EXPECT_EQ(format_rank_list({3, 7}), "ranks 3 and 7");
  EXPECT_EQ(format_rank_list({3, 7, 9}), "ranks 3, 7 and 9");
  EXPECT_EQ(format_rank_list({3, 7, 9, 11}, 2), "ranks 3, 7 and 2 more");
  // A list already capped before it got here: `total` counts the ranks left out of it.
  EXPECT_EQ(format_rank_list({3, 7}, 8, 122), "ranks 3, 7 and 120 more");
  EXPECT_EQ(format_rank_list({5}, 8, 1), "rank 5");
}

TEST(Arrivals, SizesAndDurations) {
  EXPECT_EQ(format_bytes(1), "1 byte");
  EXPECT_EQ(format_bytes(12), "12 bytes");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(int64_t{8} << 20), "8 MiB");
  EXPECT_EQ(format_duration(milliseconds(250)), "250 ms");
  EXPECT_EQ(format_duration(milliseconds(5000)), "5 s");
  EXPECT_EQ(format_duration(milliseconds(1250)), "1.2 s");
}

namespace {

// Ranks `waiting` of a group of `size` wait in collective #1 for `wait` and fail with a
// timeout; the others never arrive. Returns each waiting rank's error.
std::vector<std::string> time_out(int size, const std::vector<int>& waiting, milliseconds timeout, milliseconds wait) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::unique_ptr<ArrivalBoard>> boards;
  for (int r = 0; r < size; ++r)
    boards.push_back(std::make_unique<ArrivalBoard>(store, GroupPlace{r, size, r, size}, timeout, r == 0));
  std::vector<std::string> errors(waiting.size());
  std::vector<std::thread> threads;
  const at::Tensor t = at::zeros({4, 2});
  for (size_t i = 0; i < waiting.size(); ++i) {
    threads.emplace_back([&, i] {
      ArrivalBoard& b = *boards[waiting[i]];
      const int64_t seq = b.issue();
      try {
        b.waited("all_reduce", t, seq, [&] {
          std::this_thread::sleep_for(wait);
          throw std::runtime_error("Operation timed out!");
          return 0;
        });
      } catch (const tessera::CommError& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  return errors;
}

}  // namespace

TEST(Arrivals, TheTimeoutNamesTheRanksThatHadNotArrived) {
  const auto errors = time_out(3, {0, 2}, milliseconds(400), milliseconds(300));
  for (const auto& e : errors) {
    EXPECT_NE(e.find("all_reduce #1 (Float [4, 2], 8 elements, 32 bytes) in a group of 3 on rank "),
              std::string::npos) << e;
    EXPECT_NE(e.find("timed out after 400 ms: rank 1 had not arrived (2 of 3 ranks were waiting in it)"),
              std::string::npos) << e;
    EXPECT_NE(e.find("[Operation timed out!]"), std::string::npos) << e;
  }
}

TEST(Arrivals, ManyMissingRanksAreCountedNotListed) {
  const auto errors = time_out(12, {0, 1}, milliseconds(400), milliseconds(300));
  for (const auto& e : errors)
    EXPECT_NE(e.find(": ranks 2, 3, 4, 5, 6, 7, 8, 9 and 2 more had not arrived (2 of 12 ranks"), std::string::npos)
        << e;
}

TEST(Arrivals, AShortWaitThatFailsForAnotherReasonIsNotDiagnosed) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  ArrivalBoard b(store, GroupPlace{0, 2, 0, 2}, milliseconds(60000), true);
  try {
    b.waited("broadcast", at::zeros({3}), b.issue(), [&]() -> int { throw std::runtime_error("Connection reset"); });
    FAIL() << "no error";
  } catch (const tessera::CommError& e) {
    EXPECT_EQ(std::string(e.what()), "broadcast (Float [3]) on rank 0 of world size 2 failed: Connection reset");
  }
}
