#include "tessera/distributed/launch/rounds.h"

#include <c10/util/Logging.h>
#include <pthread.h>
#include <signal.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "tessera/core/error.h"
#include "tessera/distributed/rendezvous.h"  // find_free_port, short_error
#include "tessera/distributed/store_gate.h"
#include "tessera/distributed/store_listen.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

// How often the launcher's thread asks Stop while it waits, and polls the store.
constexpr std::chrono::milliseconds kTick{20};

std::string as_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> as_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// libtorch 2.x logs every failed connection attempt with a backtrace; failures are
// reported here in one line instead.
struct QuietC10Log {
  int saved = FLAGS_caffe2_log_level;
  QuietC10Log() { FLAGS_caffe2_log_level = std::max(saved, 3); }
  ~QuietC10Log() { FLAGS_caffe2_log_level = saved; }
};

// A list of node indices, "1, 4 and 7" (at most 16 named).
std::string node_list(const std::vector<int>& nodes) {
  std::string s;
  const size_t shown = std::min<size_t>(nodes.size(), 16);
  for (size_t i = 0; i < shown; ++i) {
    if (i) s += i + 1 == nodes.size() ? " and " : ", ";
    s += std::to_string(nodes[i]);
  }
  if (shown < nodes.size()) s += concat(" and ", nodes.size() - shown, " more");
  return s;
}

std::string round_name(int round) { return round == 0 ? std::string("the job") : concat("restart round ", round); }

// Seconds, to a tenth.
double seconds(Clock::duration d) {
  return std::round(std::chrono::duration_cast<std::chrono::milliseconds>(d).count() / 100.0) / 10.0;
}

// The failure reported under `key`, if any.
std::optional<std::string> reported(c10d::Store& s, const std::string& key) {
  if (!s.check({key})) return std::nullopt;
  return as_string(s.get(key));
}

}  // namespace

// One store call, posted by the launcher's thread and made by the store thread.
struct LaunchRounds::Call {
  Run run;
  Clock::time_point posted;
  // Written by the store thread, read by the launcher's thread once `done`: under Shared::mu.
  bool done = false;
  Answer answer;
  std::string error;  // the store's error, or why there is no store; "" when answered
};

struct LaunchRounds::Shared {
  std::mutex mu;
  std::condition_variable cv;               // a call posted or answered, quit, the thread's end
  std::deque<std::shared_ptr<Call>> queue;  // in order; the first one is being made
  bool quit = false;                        // answer what is queued, then end
  bool exited = false;
  // With a rendezvous token (store_gate.h): node 0's gate in front of the store, or another
  // node's relay to it; they serve as long as the store is used.
  std::shared_ptr<StoreGate> gate;
  std::shared_ptr<StoreRelay> relay;
};

LaunchRounds::LaunchRounds(const std::string& addr, int port, int nnodes, int node_rank,
                           std::chrono::milliseconds timeout)
    : port_(port), nnodes_(nnodes), node_rank_(node_rank), addr_(addr), timeout_(timeout) {
  if (port_ == 0) {
    TESSERA_CHECK(nnodes == 1, "launch: --master-port is required with --nnodes ", nnodes);
    port_ = find_free_port();
  }
  // The store thread holds everything it uses (never `this`): the launcher may end while
  // it still waits for a node 0 that does not answer.
  shared_ = std::make_shared<Shared>();
  const std::optional<std::string> token = rendezvous_token();
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port_);
  so.waitWorkers = false;
  so.timeout = timeout;
  std::string store_host = addr;
  if (token) {
    // Behind a token the store answers on loopback only, at a port of its own; every client,
    // node 0's ranks included, comes through the gate on --master-port (store_gate.h).
    store_host = "127.0.0.1";
    if (node_rank == 0) {
      so.port = static_cast<uint16_t>(find_free_port());
    } else {
      shared_->relay = std::make_shared<StoreRelay>(addr, port_, *token, timeout);
      so.port = static_cast<uint16_t>(shared_->relay->port());
    }
  }
  if (node_rank == 0) {
    so.isServer = true;
    QuietC10Log quiet;
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(token ? store_host : std::string("0.0.0.0"), so);
    } catch (const std::exception& e) {
      throw Error(concat("node 0 cannot start the launchers' store on port ", so.port,
                         token ? " (the store behind the token gate)" : " (--master-port; is another job using it?)",
                         ": ", short_error(e)));
    }
    if (token) {
      const std::string warning = confine_store_listener("127.0.0.1", so.port);
      if (!warning.empty())
        throw Error(concat("node 0 cannot keep the launchers' store to loopback behind the rendezvous token's gate "
                           "(without that the token would protect nothing): ", warning));
      shared_->gate = std::make_shared<StoreGate>(port_, so.port, *token);
    } else if (nnodes == 1) {
      // One node: its launcher and ranks are all on this host, so the store is kept to the
      // interface of --master-addr (loopback by default) and refuses other machines.
      const std::string warning = confine_store_listener(addr, port_);
      if (!warning.empty()) std::fprintf(stderr, "tessera run: warning: %s\n", warning.c_str());
    }
  }
  if (nnodes == 1) return;  // no other node to wait for: the store only hosts the ranks'
  const std::string where = concat("the launchers' store at ", addr, ":", port_);
  const std::string unreachable = concat("node ", node_rank, " cannot reach node 0's launcher at ", addr, ":", port_,
                                         " (--master-addr:--master-port) within ", timeout.count() / 1000.0, " s: ");
  // The launcher's handlers of INT/TERM/HUP (launcher.cpp) are to run on its own thread,
  // which stops waiting here when they do: the store thread starts with them blocked.
  sigset_t launcher_signals, mask;
  sigemptyset(&launcher_signals);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&launcher_signals, sig);
  pthread_sigmask(SIG_BLOCK, &launcher_signals, &mask);
  thread_ = std::thread([shared = shared_, store = store_, so, store_host, where, unreachable]() mutable {
    std::string no_store;
    if (!store) {
      QuietC10Log quiet;
      try {
        auto make = [store_host, so]() -> c10::intrusive_ptr<c10d::Store> {
          return c10::make_intrusive<c10d::TCPStore>(store_host, so);
        };
        store = shared->relay ? shared->relay->connect(make) : make();
      } catch (const std::exception& e) {
        const std::string relay_error = shared->relay ? shared->relay->last_error() : "";
        no_store = unreachable + (relay_error.empty() ? short_error(e) : relay_error);
      }
    }
    std::unique_lock<std::mutex> lock(shared->mu);
    for (;;) {
      shared->cv.wait(lock, [&] { return shared->quit || !shared->queue.empty(); });
      if (shared->queue.empty()) break;  // told to quit, and every call answered
      const std::shared_ptr<Call> call = shared->queue.front();
      lock.unlock();
      Answer answer;
      std::string error = no_store;
      if (store) {
        try {
          call->run(*store, answer);
        } catch (const std::exception& e) {
          // Through a relay whose token the gate refused (libtorch 1.13's client connects
          // without a request, so the refusal shows at the first call), say that instead.
          error = shared->relay && shared->relay->refused()
                      ? concat("node 0's launcher refused this node: ", shared->relay->last_error())
                      : concat(where, " no longer answers (node 0's launcher is gone?): ", short_error(e));
        }
      }
      lock.lock();
      call->answer = std::move(answer);
      call->error = std::move(error);
      call->done = true;
      shared->queue.pop_front();
      shared->cv.notify_all();
    }
    shared->exited = true;
    shared->cv.notify_all();
  });
  pthread_sigmask(SIG_SETMASK, &mask, nullptr);
}

LaunchRounds::~LaunchRounds() {
  if (!thread_.joinable()) return;
  bool exited = false;
  {
    std::unique_lock<std::mutex> lock(shared_->mu);
    shared_->quit = true;
    shared_->cv.notify_all();
    exited = shared_->cv.wait_for(lock, std::chrono::seconds(2), [&] { return shared_->exited; });
  }
  if (exited)
    thread_.join();
  else
    thread_.detach();  // waiting for node 0 (Shared and its store client live as long as it)
}

std::string LaunchRounds::key(int round, const std::string& what) const {
  return concat("tessera/launch/", round, "/", what);
}

std::shared_ptr<LaunchRounds::Call> LaunchRounds::post(Run run) {
  auto call = std::make_shared<Call>();
  call->run = std::move(run);
  call->posted = Clock::now();
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->queue.push_back(call);
  shared_->cv.notify_all();
  return call;
}

std::optional<LaunchRounds::Outcome> LaunchRounds::ask(Run run, Clock::time_point until, const Stop& stop,
                                                       Answer& answer) {
  const std::shared_ptr<Call> call = post(std::move(run));
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(shared_->mu);
      if (shared_->cv.wait_until(lock, std::min(until, Clock::now() + kTick), [&] { return call->done; })) {
        if (!call->error.empty()) return Outcome{Outcome::kError, call->error};
        answer = call->answer;
        return std::nullopt;
      }
    }
    if (stop && stop()) return Outcome{Outcome::kStopped, ""};
    if (Clock::now() >= until) return Outcome{Outcome::kError, silent(until - call->posted)};
  }
}

std::string LaunchRounds::silent(Clock::duration waited) const {
  return concat("node 0's launcher (the launchers' store at ", addr_, ":", port_, ") has not answered for ",
                seconds(waited), " s (--rdzv-timeout): node 0 is unreachable or stalled");
}

LaunchRounds::Outcome LaunchRounds::join(int round, const Stop& stop) {
  if (nnodes_ == 1) return {};
  const std::string joined_key = key(round, "joined"), mine = key(round, concat("node", node_rank_));
  Answer a;
  // The first call of nodes 1.. waits for their connection to node 0 as well (the store
  // thread gives up on that after the timeout, with its own message).
  const auto first_until = Clock::now() + (round == 0 && node_rank_ != 0 ? 2 : 1) * timeout_;
  const auto join_round = [=](c10d::Store& s, Answer& r) {
    s.set(mine, as_bytes("1"));
    r.number = s.add(joined_key, 1);
  };
  if (auto out = ask(join_round, first_until, stop, a)) return *out;
  const auto until = Clock::now() + timeout_;
  while (a.number < nnodes_) {
    if (stop && stop()) return {Outcome::kStopped, ""};
    if (Clock::now() >= until) {
      const int64_t joined = a.number;
      const int nnodes = nnodes_;
      const std::string node_key = key(round, "node");
      const auto missing = [=](c10d::Store& s, Answer& r) {
        for (int n = 0; n < nnodes; ++n)
          if (!s.check({node_key + std::to_string(n)})) r.nodes.push_back(n);
      };
      if (auto out = ask(missing, Clock::now() + timeout_, stop, a)) return *out;
      return {Outcome::kError,
              concat(a.nodes.size() == 1 ? "node " : "nodes ", node_list(a.nodes), " did not join ", round_name(round),
                     " within ", timeout_.count() / 1000.0, " s (--rdzv-timeout): ", joined, " of ", nnodes_,
                     " nodes joined")};
    }
    std::this_thread::sleep_for(kTick);
    const auto count = [=](c10d::Store& s, Answer& r) { r.number = s.add(joined_key, 0); };
    if (auto out = ask(count, Clock::now() + timeout_, stop, a)) return *out;
  }
  return {};
}

std::optional<LaunchRounds::Outcome> LaunchRounds::news(int round) {
  if (nnodes_ == 1) return std::nullopt;
  if (lookup_) {
    std::unique_lock<std::mutex> lock(shared_->mu);
    if (!lookup_->done) {
      if (Clock::now() - lookup_->posted < timeout_) return std::nullopt;  // no answer yet: no news
      return Outcome{Outcome::kError, silent(timeout_)};
    }
    const std::shared_ptr<Call> done = std::move(lookup_);
    lock.unlock();  // an answered call is no longer written
    if (!done->error.empty()) return Outcome{Outcome::kError, done->error};
    if (lookup_round_ == round && done->answer.text) return Outcome{Outcome::kFailed, *done->answer.text};
  }
  const std::string failed = key(round, "failed");
  lookup_round_ = round;
  lookup_ = post([failed](c10d::Store& s, Answer& r) { r.text = reported(s, failed); });
  return std::nullopt;
}

void LaunchRounds::report_failure(int round, const std::string& message) {
  if (nnodes_ == 1) return;
  const std::string failed = key(round, "failed"), report = concat("node ", node_rank_, ": ", message);
  // compareSet keeps the first report: "" expected means "set only if absent". With node 0
  // gone it fails: the others learn of the failure from their ranks.
  post([failed, report](c10d::Store& s, Answer&) { s.compareSet(failed, {}, as_bytes(report)); });
}

LaunchRounds::Outcome LaunchRounds::finish(int round, const Stop& stop) {
  if (nnodes_ == 1) return {};
  const std::string done_key = key(round, "done"), failed = key(round, "failed");
  // Counts this node as done (add 1) or looks again (add 0), and for a failure of the round.
  const auto look = [=](int64_t add) -> Run {
    return [=](c10d::Store& s, Answer& r) {
      r.number = s.add(done_key, add);
      r.text = reported(s, failed);
    };
  };
  Answer a;
  if (auto out = ask(look(1), Clock::now() + timeout_, stop, a)) return *out;
  const auto until = Clock::now() + timeout_;
  while (!a.text && a.number < nnodes_) {
    if (stop && stop()) return {Outcome::kStopped, ""};
    if (Clock::now() >= until)
      return {Outcome::kReady, concat(nnodes_ - a.number, " of ", nnodes_, " nodes did not report the end of ",
                                      round_name(round), " within ", timeout_.count() / 1000.0,
                                      " s (--rdzv-timeout); this node's ranks all exited 0")};
    std::this_thread::sleep_for(kTick);
    if (auto out = ask(look(0), Clock::now() + timeout_, stop, a)) return *out;
  }
  if (a.text) return {Outcome::kFailed, *a.text};
  // Every node's ranks exited 0. The others say they saw it; node 0 keeps the store until
  // then (bounded), so that none of them finds it gone in its last lookup.
  const std::string left = key(round, "left");
  const auto leave = [=](int64_t add) -> Run {
    return [=](c10d::Store& s, Answer& r) { r.number = s.add(left, add); };
  };
  if (node_rank_ != 0) {
    const auto out = ask(leave(1), Clock::now() + timeout_, stop, a);
    return out && out->kind == Outcome::kStopped ? *out : Outcome{};  // node 0 gone now: the job is done anyway
  }
  const auto left_until = Clock::now() + timeout_;
  for (a.number = 0; a.number < nnodes_ - 1 && Clock::now() < left_until;) {
    if (stop && stop()) return {Outcome::kStopped, ""};
    if (auto out = ask(leave(0), Clock::now() + timeout_, stop, a)) return *out;
    if (a.number < nnodes_ - 1) std::this_thread::sleep_for(kTick);
  }
  return {};
}

}  // namespace tessera::distributed
