#include "tessera/distributed/arrivals.h"

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <thread>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"
#include "tessera/distributed/rendezvous.h"

namespace tessera::distributed {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string format_rank_list(const std::vector<int>& ranks, size_t cap, size_t total) {
  total = std::max(total, ranks.size());
  if (total == 0) return "no rank";
  const size_t named = std::min({ranks.size(), std::max<size_t>(cap, 1), total});
  std::string out = total == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < named; ++i) {
    if (i > 0) out += (i + 1 == named && named == total) ? " and " : ", ";
    out += std::to_string(ranks[i]);
  }
  if (named < total) out += concat(" and ", total - named, " more");
  return out;
}

std::string format_bytes(int64_t bytes) {
  static const char* const units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return concat(bytes, bytes == 1 ? " byte" : " bytes");
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024 && u < 3) v /= 1024, ++u;
  char buf[32];
  if (v == static_cast<double>(static_cast<int64_t>(v))) {
    std::snprintf(buf, sizeof buf, "%lld %s", static_cast<long long>(v), units[u]);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  }
  return buf;
}

std::string format_duration(milliseconds ms) {
  if (ms.count() < 1000) return concat(ms.count(), " ms");
  char buf[32];
  if (ms.count() % 1000 == 0) {
    std::snprintf(buf, sizeof buf, "%lld s", static_cast<long long>(ms.count() / 1000));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  }
  return buf;
}

namespace {

const std::string kRoot = "tessera-arrivals/";
std::string wait_key(int rank) { return concat(kRoot, "wait/", rank); }
std::string late_key(int64_t seq, const char* what) { return concat(kRoot, "late/", seq, "/", what); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

milliseconds announce_after_for(milliseconds timeout) {
  return std::max(milliseconds(1), std::min(timeout / 4, milliseconds(60000)));
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

struct ArrivalBoard::State {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0, size = 1;
  milliseconds after{1};
  std::atomic<int64_t> issued{0};
  std::atomic<int64_t> waiting_since{0};  // steady-clock ns; 0: not waiting
  std::mutex publish_mu;                  // one writer of this rank's key at a time
  int64_t published = 0;                  // under publish_mu

  // Records "issued up to #k" (k = issued now) in this rank's key, once per k. The key is
  // a counter (Store::add), so reading it never blocks and never needs it to exist.
  void publish() {
    std::lock_guard<std::mutex> lock(publish_mu);
    const int64_t k = issued.load();
    if (!store || k <= published) return;
    store->add(wait_key(rank), k - published);
    published = k;
  }
};

namespace {

// The process-wide thread that records long waits (ArrivalBoard::State::publish): it holds
// the boards weakly and sleeps between checks, so a board costs nothing while no collective
// waits long, and a store that hangs holds up this thread, never a collective.
class Announcer {
 public:
  static Announcer& get() {
    static Announcer* a = new Announcer();  // never destroyed: its thread may outlive main
    return *a;
  }
  void watch(const std::shared_ptr<ArrivalBoard::State>& s) {
    std::lock_guard<std::mutex> lock(mu_);
    boards_.push_back(s);
    tick_ = std::min(tick_, std::max(milliseconds(10), s->after / 4));
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    for (;;) {
      std::vector<std::shared_ptr<ArrivalBoard::State>> due;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, tick_);
        const int64_t now = now_ns();
        auto it = boards_.begin();
        while (it != boards_.end()) {
          auto s = it->lock();
          if (!s) {
            it = boards_.erase(it);
            continue;
          }
          const int64_t since = s->waiting_since.load();
          if (since != 0 && now - since >= std::chrono::nanoseconds(s->after).count()) due.push_back(std::move(s));
          ++it;
        }
      }
      for (auto& s : due) {
        try {
          s->publish();
        } catch (const std::exception&) {
          // The store is gone or slow: the diagnosis will say so if it comes to that.
        }
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<ArrivalBoard::State>> boards_;
  milliseconds tick_{1000};
  bool started_ = false;
};

// What the failing rank learned about the others.
struct Finding {
  bool known = false;          // the store answered
  std::string problem;         // why not, when not known
  std::vector<int> missing;    // at most kListed, ascending
  int64_t missing_total = 0;   // all the ranks found missing
  int64_t checked = 0;         // ranks whose key was read (the scanner's count)
  int64_t size = 0;
};

constexpr size_t kListed = 64;  // ranks kept by name in the store's answer

std::string encode(const Finding& f) {
  std::string s = concat(f.checked, " ", f.missing_total);
  for (int r : f.missing) s += concat(" ", r);
  return s;
}

Finding decode(const std::vector<uint8_t>& v, int64_t size) {
  Finding f;
  std::istringstream in(std::string(v.begin(), v.end()));
  in >> f.checked >> f.missing_total;
  int r;
  while (in >> r) f.missing.push_back(r);
  f.known = static_cast<bool>(in.eof());
  f.size = size;
  if (!f.known) f.problem = "the store's answer was unreadable";
  return f;
}

// Shared between the failing thread and the thread that talks to the store for it, which
// may outlive the wait (a store that does not answer).
struct Diagnosis {
  std::mutex mu;
  std::condition_variable cv;
  bool found = false, lingered = false;
  Finding finding;
};

// The first rank to get here for #seq reads every rank's key and leaves the answer in the
// store; the others read the answer (or, when it does not come in time, read the keys
// themselves). Then each counts itself done; the store's host waits (up to `budget`) until
// every rank that had arrived has done so, since the store ends with its process.
void diagnose(const std::shared_ptr<ArrivalBoard::State>& st, int64_t seq, milliseconds budget, bool hosts,
              const std::shared_ptr<Diagnosis>& out) {
  const auto t0 = Clock::now();
  const auto deadline = t0 + budget;
  Finding f;
  f.size = st->size;
  auto report = [&](Finding r) {
    std::lock_guard<std::mutex> lock(out->mu);
    out->finding = std::move(r);
    out->found = true;
    out->cv.notify_all();
  };
  auto scan = [&](Clock::time_point until) {
    Finding s;
    s.size = st->size;
    s.known = true;
    for (int r = 0; r < st->size; ++r) {
      if (Clock::now() >= until) break;
      const int64_t v = r == st->rank ? seq : st->store->add(wait_key(r), 0);
      ++s.checked;
      if (v < seq) {
        ++s.missing_total;
        if (s.missing.size() < kListed) s.missing.push_back(r);
      }
    }
    return s;
  };
  try {
    st->publish();  // this rank has arrived, whatever the announcing thread managed
    auto& store = *st->store;
    const std::string answer = late_key(seq, "missing");
    if (store.add(late_key(seq, "claim"), 1) == 1) {
      f = scan(deadline);
      store.set(answer, bytes_of(encode(f)));
    } else {
      // Another rank is reading the keys: wait for its answer (most of the budget).
      const auto give_up = t0 + budget * 3 / 5;
      bool there = false;
      while (!(there = store.check({answer})) && Clock::now() < give_up)
        std::this_thread::sleep_for(milliseconds(10));
      f = there ? decode(store.get(answer), st->size) : scan(deadline);
    }
    store.add(late_key(seq, "done"), 1);
  } catch (const std::exception& e) {
    f = Finding{};
    f.size = st->size;
    f.problem = concat("the store could not be read (", short_error(e), ")");
  }
  report(f);
  if (hosts && f.known) {
    const int64_t arrived = f.size - f.missing_total;
    try {
      while (Clock::now() < t0 + 2 * budget && st->store->add(late_key(seq, "done"), 0) < arrived)
        std::this_thread::sleep_for(milliseconds(20));
    } catch (const std::exception&) {
    }
  }
  std::lock_guard<std::mutex> lock(out->mu);
  out->lingered = true;
  out->cv.notify_all();
}

bool mentions_timeout(const std::string& m) {
  std::string l = m;
  for (auto& c : l) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return l.find("timed out") != std::string::npos || l.find("timeout") != std::string::npos;
}

std::string clause(const Finding& f, milliseconds budget) {
  if (!f.known) return concat("which ranks had not arrived is unknown: ", f.problem);
  std::string s;
  if (f.missing_total == 0) {
    s = "every rank had arrived (each was waiting in it or a later collective)";
  } else {
    s = concat(format_rank_list(f.missing, 8, static_cast<size_t>(f.missing_total)), " had not arrived");
    const int64_t arrived = f.checked - f.missing_total;
    if (arrived > 0) s += concat(" (", arrived, " of ", f.size, " ranks were waiting in it)");
  }
  if (f.checked < f.size) s += concat("; only ", f.checked, " of ", f.size, " ranks read within ", format_duration(budget));
  return s;
}

}  // namespace

ArrivalBoard::ArrivalBoard(c10::intrusive_ptr<c10d::Store> store, const GroupPlace& place, milliseconds timeout,
                           bool hosts_store)
    : state_(std::make_shared<State>()), place_(place), timeout_(timeout), hosts_store_(hosts_store) {
  state_->store = std::move(store);
  state_->rank = place.rank;
  state_->size = place.size;
  state_->after = announce_after_for(timeout);
  if (state_->store && place.size > 1) Announcer::get().watch(state_);
}

ArrivalBoard::~ArrivalBoard() = default;

int64_t ArrivalBoard::issue() { return ++state_->issued; }
int64_t ArrivalBoard::issued() const { return state_->issued.load(); }
milliseconds ArrivalBoard::announce_after() const { return state_->after; }
milliseconds ArrivalBoard::diagnosis_budget() const {
  return std::max(milliseconds(500), std::min(state_->after, milliseconds(10000)));
}

ArrivalBoard::Waiting::Waiting(ArrivalBoard& board) : board_(board), t0_(Clock::now()) {
  int64_t expected = 0;
  owner_ = board_.state_->waiting_since.compare_exchange_strong(expected, now_ns());
}

ArrivalBoard::Waiting::~Waiting() {
  if (owner_) board_.state_->waiting_since.store(0);
}

milliseconds ArrivalBoard::Waiting::elapsed() const {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t0_);
}

std::string ArrivalBoard::first_line(const std::exception& e) { return short_error(e); }

void ArrivalBoard::fail(const char* what, const at::Tensor& t, int64_t seq, milliseconds waited,
                        const std::string& cause) const {
  const bool timed_out = mentions_timeout(cause);
  if (!state_->store || place_.size == 1 || (waited < announce_after() && !timed_out)) {
    throw CommError(concat(place_.where(what, t), " failed: ", cause));
  }
  const milliseconds budget = diagnosis_budget();
  auto d = std::make_shared<Diagnosis>();
  std::thread([st = state_, seq, budget, hosts = hosts_store_, d] { diagnose(st, seq, budget, hosts, d); }).detach();
  Finding f;
  {
    std::unique_lock<std::mutex> lock(d->mu);
    if (d->cv.wait_for(lock, budget + milliseconds(200), [&] { return d->found; })) {
      f = d->finding;
      if (hosts_store_) d->cv.wait_for(lock, budget + milliseconds(200), [&] { return d->lingered; });
    } else {
      f.size = place_.size;
      f.problem = concat("the store did not answer within ", format_duration(budget));
    }
  }
  const int64_t bytes = t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  const std::string head =
      concat(what, " #", seq, " (", t.scalar_type(), " ", t.sizes(), ", ", t.numel(), " elements, ", format_bytes(bytes),
             ") in a group of ", place_.size, " on rank ", place_.world_rank,
             place_.size != place_.world_size ? concat(" (group rank ", place_.rank, ")") : std::string());
  const std::string how = timed_out ? concat(" timed out after ", format_duration(timeout_))
                                    : concat(" failed after waiting ", format_duration(waited), " (timeout ",
                                             format_duration(timeout_), ")");
  throw CommError(concat(head, how, ": ", clause(f, budget), " [", cause, "]"));
}

}  // namespace tessera::distributed
