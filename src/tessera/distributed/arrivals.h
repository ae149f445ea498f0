// Which ranks had not arrived at a collective that timed out. Every collective of a
// Communicator gets a number (#1, #2, ... in the order the ranks issue them, the same on
// every rank). A rank that has waited in one longer than announce_after() (a quarter of the
// timeout, at most 60 s) records in the group's c10d store "rank r has issued up to #k and
// is waiting" (one key per rank, written by a background thread, so a store that does not
// answer never delays a collective). When the collective fails after such a wait, the rank
// finds out which ranks had no record at #seq or later: those had not arrived (dead,
// stopped, or busy elsewhere), and names them in its error.
//
// Cost when nothing fails: two atomic stores per wait, and one process-wide thread that
// wakes every announce_after()/4 (at most once a second at the default timeout). Store
// traffic: one key update per rank per slow collective; at a failure the first rank to
// time out reads every rank's key once (bounded by diagnosis_budget(); a partial read is
// said so) and leaves the answer in the store, where the others read it (O(1) each). The
// rank hosting the store waits up to diagnosis_budget() for the ranks it saw waiting to
// finish reading before it fails, since the store ends with its process.
// Internal to the distributed layer (communicator.cpp, c10d_routes.cpp).
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tessera/distributed/collective_common.h"

namespace tessera::distributed {

// "rank 3", "ranks 3 and 7", "ranks 3, 7, 9 and 120 more": at most `cap` ranks named, in
// the order given, the rest counted; `total` (>= ranks.size()) counts ranks not in the list
// as well (a list capped before it got here).
std::string format_rank_list(const std::vector<int>& ranks, size_t cap = 8, size_t total = 0);

// "8 MiB", "1.5 KiB", "12 bytes".
std::string format_bytes(int64_t bytes);

// "5 s", "1.2 s", "250 ms".
std::string format_duration(std::chrono::milliseconds ms);

class ArrivalBoard {
 public:
  // `store`: the group's store (null for a group of one: nothing is published). `hosts_store`:
  // the store's server lives in this process (world rank 0 without torchrun's agent).
  ArrivalBoard(c10::intrusive_ptr<c10d::Store> store, const GroupPlace& place, std::chrono::milliseconds timeout,
               bool hosts_store);
  ~ArrivalBoard();
  ArrivalBoard(const ArrivalBoard&) = delete;
  ArrivalBoard& operator=(const ArrivalBoard&) = delete;

  // Numbers the next collective this rank issues: 1, 2, ...
  int64_t issue();
  // The number of the last collective issued.
  int64_t issued() const;
  std::chrono::milliseconds timeout() const { return timeout_; }
  // How long a rank waits in a collective before it records that in the store.
  std::chrono::milliseconds announce_after() const;
  // How long a failing rank spends finding out who had not arrived (and the store's host
  // waiting for the others to do so).
  std::chrono::milliseconds diagnosis_budget() const;

  // While alive, this rank waits in a collective (for the announcing thread).
  class Waiting {
   public:
    explicit Waiting(ArrivalBoard& board);
    ~Waiting();
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;
    std::chrono::milliseconds elapsed() const;

   private:
    ArrivalBoard& board_;
    std::chrono::steady_clock::time_point t0_;
    bool owner_ = false;  // set the board's waiting mark (an outer wait may hold it)
  };

  // The CommError for collective `what` #seq on `t` that failed with `cause` after this rank
  // waited `waited` in it: with the ranks that had not arrived when the wait was long (at
  // least announce_after()) or the cause a timeout; otherwise "<where> failed: <cause>".
  [[noreturn]] void fail(const char* what, const at::Tensor& t, int64_t seq, std::chrono::milliseconds waited,
                         const std::string& cause) const;

  // Runs `f` (a collective this rank waits in) as collective #seq: failures become
  // fail()'s CommError.
  template <typename F>
  auto waited(const char* what, const at::Tensor& t, int64_t seq, F&& f) -> decltype(f()) {
    Waiting w(*this);
    try {
      return f();
    } catch (const CommError& e) {
      fail(what, t, seq, w.elapsed(), e.what());
    } catch (const std::exception& e) {
      fail(what, t, seq, w.elapsed(), first_line(e));
    }
  }

  struct State;  // shared with the announcing thread

 private:
  static std::string first_line(const std::exception& e);
  std::shared_ptr<State> state_;
  GroupPlace place_;
  std::chrono::milliseconds timeout_;
  bool hosts_store_;
};

}  // namespace tessera::distributed
