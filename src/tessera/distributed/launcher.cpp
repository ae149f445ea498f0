#include "tessera/distributed/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#if __has_include(<linux/close_range.h>)
#include <linux/close_range.h>
#endif

#include "tessera/core/error.h"
#include "tessera/distributed/launch_guard.h"
#include "tessera/distributed/launch_rounds.h"
#include "tessera/distributed/rendezvous.h"  // find_free_port

extern char** environ;

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};
std::atomic<int> g_last_signal{0};

void on_signal(int sig) {
  g_last_signal = sig;
  if (g_signal_pipe[1] >= 0) {
    char c = static_cast<char>(sig);
    ssize_t ignored = ::write(g_signal_pipe[1], &c, 1);
    (void)ignored;
  }
}

// Output of a rank not yet written is bounded: a line longer than kMaxPending bytes is
// written in pieces of that size (the first with the "[rank R] " prefix, the rest
// continuing it), so a rank that never ends its line costs the launcher at most this much.
constexpr size_t kMaxPending = 64 * 1024;

// One of a rank's two output streams.
struct Stream {
  int fd = -1;
  std::string buf;         // text read but not yet written: no '\n' in it, at most kMaxPending bytes
  bool open = false;       // a piece of the current line was written (prefix included), its end not yet
  bool after_cr = false;   // the last text written or delivered ended with '\r'
};

struct Child {
  RankStatus status;
  Stream out, err;
  bool running = true;
};

void set_nonblock(int fd) {
  int fl = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
}

// Builds "KEY=VALUE" strings: this process's environment with `overrides` applied.
std::vector<std::string> make_env(const std::map<std::string, std::string>& overrides) {
  std::vector<std::string> out;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos && overrides.count(kv.substr(0, eq))) continue;
    out.push_back(kv);
  }
  for (const auto& [k, v] : overrides) out.push_back(k + "=" + v);
  return out;
}

// A rank's live line. When the launcher writes the ranks' output itself and its stderr
// is a terminal, text a rank redraws with '\r' on stderr (the Trainer's progress bar,
// told by TESSERA_TTY_COLUMNS that a terminal shows it) is shown as it comes, as one
// "[rank R] ..." line redrawn in place at the bottom: other output clears it, is
// written, and the line is drawn again below; the rank's '\n' makes it a normal line.
// Elsewhere (output to a file or a pipe, or handed to on_line) a '\r' ends a line like
// '\n' for prefixing: each redraw is written as "[rank R] text\r", so a file keeps every
// state and a terminal showing it later still shows one prefixed line; "\r\n" is one end.
struct LiveLine {
  bool enabled = false, on = false;
  int rank = -1;
  std::string shown;  // what the terminal line holds now
};
LiveLine g_live;

// The stream whose line was left unfinished on the output (a piece of a long line), if
// any. Anything else written first ends that line with '\n' (its rest comes later with
// a fresh prefix), so that every line of the output starts with its rank's prefix; the
// live line is not shown while a line is unfinished.
Stream* g_open = nullptr;
FILE* g_open_file = nullptr;

std::string rank_prefix(int rank) { return "[rank " + std::to_string(rank) + "] "; }

void live_write(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stderr);
  std::fflush(stderr);
}
// "\r" + text, padded over what the line showed before.
std::string live_redraw(const std::string& text) {
  std::string s = "\r" + text;
  if (text.size() < g_live.shown.size()) s.append(g_live.shown.size() - text.size(), ' ');
  return s;
}
void live_clear() {
  if (g_live.on && !g_open) live_write(live_redraw("") + "\r");
}
void live_restore() {
  if (g_live.on && !g_open) live_write("\r" + g_live.shown);
}
// Ends the unfinished line (g_open), and shows the live line again below it.
void end_open_line() {
  if (!g_open) return;
  std::fputc('\n', g_open_file);
  std::fflush(g_open_file);
  g_open->open = false;
  g_open = nullptr;
  g_open_file = nullptr;
  live_restore();
}
// Ends the live line where it is (before the launcher's own messages and at the end).
void live_end() {
  end_open_line();
  if (g_live.on) live_write("\n");
  g_live.on = false;
  g_live.shown.clear();
}

// Appends to `w` what the launcher writes for `text` of rank `rank` ended by `term`
// ('\n', '\r', or 0 for a piece of a longer line). Sets ends_live when this ends the
// live line (its final state becomes a normal line).
void render(std::string& w, int rank, bool is_err, Stream& s, const std::string& text, char term, bool& ends_live) {
  if (term == '\n' && text.empty() && s.after_cr && !s.open) {  // "\r\n": the line ended at the '\r'
    w += '\n';
    s.after_cr = false;
    return;
  }
  size_t from = 0;
  if (g_live.enabled) {  // on a terminal, text before a '\r' is overwritten: only the last state shows
    const size_t r = text.rfind('\r');
    if (r != std::string::npos) {
      from = r + 1;
      if (term == '\n' && g_live.on && is_err && rank == g_live.rank) ends_live = true;
    }
  }
  if (!s.open) w += rank_prefix(rank);
  w.append(text, from, std::string::npos);
  if (term) w += term;
  s.open = term == 0;
  s.after_cr = term == '\r';
}

// The unfinished tail of a rank's stderr: when it redraws with '\r', shows its newest
// state as the live line (one live line at a time; the first rank to draw keeps it).
void live_update(const LaunchOptions& o, Child& c, std::string& buf) {
  if (!g_live.enabled || o.on_line) return;
  const size_t r = buf.rfind('\r');
  if (r == std::string::npos || (g_live.on && g_live.rank != c.status.rank)) return;
  buf.erase(0, r);  // earlier states are overwritten anyway
  if (buf.size() == 1) return;  // "\r" alone: the text follows
  end_open_line();
  const std::string text = rank_prefix(c.status.rank) + buf.substr(1);
  live_write(live_redraw(text));
  g_live.on = true;
  g_live.rank = c.status.rank;
  g_live.shown = text;
}

// Writes (or hands to on_line) what a stream's buffer holds up to its last line end,
// a line longer than kMaxPending in pieces of that size (the last one may be its end),
// and at end of file (eof) the rest.
void process(const LaunchOptions& o, Child& c, bool is_err, bool eof) {
  Stream& s = is_err ? c.err : c.out;
  std::string& buf = s.buf;
  const int rank = c.status.rank;
  std::string w;  // what this call writes (one write for all of it)
  bool ends_live = false;
  auto deliver = [&](size_t from, size_t len, char term) {
    if (!o.on_line) {
      render(w, rank, is_err, s, buf.substr(from, len), term, ends_live);
      return;
    }
    if (!(term == '\n' && len == 0 && s.after_cr)) o.on_line(rank, is_err, buf.substr(from, len));
    s.after_cr = term == '\r';
  };
  const char* ends = g_live.enabled ? "\n" : "\r\n";
  size_t start = 0;
  for (;;) {
    const size_t p = buf.find_first_of(ends, start);
    if (p == std::string::npos && g_live.enabled) {  // only the last state of a redrawn line will show
      const size_t r = buf.rfind('\r');
      if (r != std::string::npos && r > start) start = r;
    }
    const size_t len = (p == std::string::npos ? buf.size() : p) - start;
    if (p != std::string::npos && len <= kMaxPending) {
      deliver(start, len, buf[p]);
      start = p + 1;
    } else if (len >= kMaxPending) {
      deliver(start, kMaxPending, 0);
      start += kMaxPending;
    } else {
      break;
    }
  }
  if (eof && (start < buf.size() || (!o.on_line && (s.open || s.after_cr)))) {
    deliver(start, buf.size() - start, '\n');
    start = buf.size();
  }
  buf.erase(0, start);
  if (!w.empty()) {
    FILE* f = is_err ? stderr : stdout;
    if (g_open && g_open != &s) end_open_line();
    live_clear();
    if (ends_live) {
      g_live.on = false;
      g_live.shown.clear();
    }
    std::fflush(stdout);
    std::fwrite(w.data(), 1, w.size(), f);
    std::fflush(f);
    if (s.open) {
      g_open = &s;
      g_open_file = f;
    } else {
      if (g_open == &s) g_open = nullptr;
      live_restore();
    }
  }
  if (is_err && !eof) live_update(o, c, buf);
}

// Reads what is available from the stream; returns false at EOF or error.
bool pump(const LaunchOptions& o, Child& c, bool is_err) {
  Stream& s = is_err ? c.err : c.out;
  char tmp[65536];
  for (;;) {
    ssize_t n = ::read(s.fd, tmp, sizeof(tmp));
    if (n > 0) {
      s.buf.append(tmp, static_cast<size_t>(n));
      process(o, c, is_err, false);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n < 0 && errno == EINTR) continue;
    process(o, c, is_err, true);
    ::close(s.fd);
    s.fd = -1;
    return false;
  }
}

// ---- Signals received by the launcher, forwarded to the ranks for the whole launch.
class SignalForwarder {
 public:
  explicit SignalForwarder(bool on) : on_(on) {
    if (!on_) return;
    TESSERA_CHECK(::pipe(g_signal_pipe) == 0, "launch: pipe() failed");
    set_nonblock(g_signal_pipe[0]);
    set_nonblock(g_signal_pipe[1]);
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGHUP, &sa, &old_hup_);
  }
  ~SignalForwarder() {
    if (!on_) return;
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGHUP, &old_hup_, nullptr);
    ::close(g_signal_pipe[0]);
    ::close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  int fd() const { return on_ ? g_signal_pipe[0] : -1; }
  // The signals received since the last call.
  std::vector<int> take() {
    std::vector<int> sigs;
    char c;
    while (on_ && ::read(g_signal_pipe[0], &c, 1) == 1) sigs.push_back(static_cast<unsigned char>(c));
    return sigs;
  }

 private:
  bool on_;
  struct sigaction old_int_ {}, old_term_ {}, old_hup_ {};
};

// What one generation of ranks is started with.
struct RoundSetup {
  int round = 0;              // restart count: 0 for the first start
  int port = 0;               // MASTER_PORT
  bool agent_store = false;   // the launchers host the store (TORCHELASTIC_USE_AGENT_STORE)
  int live_columns = 0;       // > 0: the ranks' stderr is shown on this terminal width
};

// ---- One generation of this node's ranks, as torch elastic's PContext keeps them:
// start (fork + exec each), poll (output, exits), signal, close.
class RankGroup {
 public:
  RankGroup(const LaunchOptions& o, LaunchGuard& guard) : o_(o), guard_(guard), children_(o.nproc_per_node) {}
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;
  ~RankGroup() { close(); }

  // Starts every rank; on a failure ("" else: why, naming the rank) the ranks already
  // started are killed and exec_failed_rank() names the rank whose program did not run.
  std::string start(const RoundSetup& s);
  int exec_failed_rank() const { return exec_failed_rank_; }

  // Waits up to `ms` for output (and for `extra_fd`, whose readiness is returned), writes
  // it, and reaps the ranks that exited. Returns those reaped by this call.
  std::vector<const RankStatus*> poll(int ms, int extra_fd, bool* extra_ready);
  // Sends `sig` to the process group of every rank still running.
  void signal(int sig);
  // Marks the ranks still running as stopped by the launcher (after another's failure).
  void mark_stopped();
  bool any_running() const {
    return std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.running; });
  }
  bool any_open() const {
    return std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.out.fd >= 0 || c.err.fd >= 0; });
  }
  // Ends the ranks' unfinished lines and closes their pipes; returns their statuses.
  std::vector<RankStatus> close();

 private:
  const LaunchOptions& o_;
  LaunchGuard& guard_;
  std::vector<Child> children_;
  int exec_failed_rank_ = -1;
  bool closed_ = false;
};

std::string RankGroup::start(const RoundSetup& s) {
  const int world = o_.nproc_per_node * o_.nnodes;
  const bool shared_machine = o_.nproc_per_node > 1;
  const pid_t launcher_pid = ::getpid();
  const int guard_fd = guard_.fd();
  std::string error;
  for (int i = 0; i < o_.nproc_per_node; ++i) {
    const int rank = o_.node_rank * o_.nproc_per_node + i;
    std::map<std::string, std::string> env = o_.env;
    env["RANK"] = std::to_string(rank);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_RANK"] = std::to_string(i);
    env["LOCAL_WORLD_SIZE"] = std::to_string(o_.nproc_per_node);
    env["GROUP_RANK"] = std::to_string(o_.node_rank);
    env["NODE_RANK"] = std::to_string(o_.node_rank);
    env["MASTER_ADDR"] = o_.master_addr;
    env["MASTER_PORT"] = std::to_string(s.port);
    env["TESSERA_LAUNCHED"] = "1";
    // torchrun's names: how often the job was restarted, and how often it may be.
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(s.round);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o_.max_restarts);
    env["TESSERA_RESTART_COUNT"] = std::to_string(s.round);
    if (s.agent_store) env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    // The columns left after the "[rank R] " prefix.
    if (s.live_columns > 0) env["TESSERA_TTY_COLUMNS"] = std::to_string(s.live_columns - 8 - std::to_string(rank).size());
    if (o_.threads_per_rank > 0) {
      env["OMP_NUM_THREADS"] = std::to_string(o_.threads_per_rank);
    } else if (shared_machine && std::getenv("OMP_NUM_THREADS") == nullptr && !o_.env.count("OMP_NUM_THREADS")) {
      env["OMP_NUM_THREADS"] = "1";
    }
    // Everything the child needs is prepared before fork: only async-signal-safe
    // calls run between fork and exec.
    std::vector<std::string> envs = make_env(env);
    std::vector<char*> envp, argv;
    for (auto& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = o_.command;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    int out_p[2], err_p[2], exec_p[2];
    if (::pipe(out_p) != 0 || ::pipe(err_p) != 0 || ::pipe2(exec_p, O_CLOEXEC) != 0) {
      error = std::string("pipe() failed: ") + std::strerror(errno);
      break;
    }
    // Signals stay blocked across fork until the child has reset the launcher's
    // handlers, so a TERM sent to a rank that has not exec'd yet takes the default
    // action instead of running the launcher's handler in the child.
    sigset_t all, old_mask;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old_mask);
    pid_t pid = ::fork();
    if (pid != 0) pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    if (pid < 0) {
      error = std::string("fork() failed: ") + std::strerror(errno);
      ::close(out_p[0]); ::close(out_p[1]); ::close(err_p[0]); ::close(err_p[1]);
      ::close(exec_p[0]); ::close(exec_p[1]);
      break;
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher_pid) ::_exit(127);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      sigaction(SIGINT, &dfl, nullptr);
      sigaction(SIGTERM, &dfl, nullptr);
      sigaction(SIGHUP, &dfl, nullptr);
      if (g_signal_pipe[0] >= 0) ::close(g_signal_pipe[0]);
      if (g_signal_pipe[1] >= 0) ::close(g_signal_pipe[1]);
      if (guard_fd >= 0) ::close(guard_fd);  // only the launcher may hold the guard's socket
      ::close(exec_p[0]);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      ::dup2(out_p[1], 1);
      ::dup2(err_p[1], 2);
      ::close(out_p[0]); ::close(out_p[1]); ::close(err_p[0]); ::close(err_p[1]);
      // Nothing else of the launcher's reaches the program: the other ranks' pipes, and
      // the launchers' store's sockets (which would keep node 0's port taken by a rank).
#if defined(SYS_close_range) && defined(CLOSE_RANGE_CLOEXEC)
      ::syscall(SYS_close_range, 3u, ~0u, CLOSE_RANGE_CLOEXEC);
#endif
      ::execvpe(argv[0], argv.data(), envp.data());
      // Tell the launcher why (it names the program and the error); a successful exec
      // closes this pipe instead (O_CLOEXEC).
      const int err = errno;
      ssize_t ignored = ::write(exec_p[1], &err, sizeof err);
      (void)ignored;
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also from the parent, so kill(-pid) works at once
    guard_.add(pid);
    ::close(out_p[1]);
    ::close(err_p[1]);
    ::close(exec_p[1]);
    // Wait for the exec: end of file when it succeeded, the child's errno when it failed.
    int exec_errno = 0;
    ssize_t got;
    while ((got = ::read(exec_p[0], &exec_errno, sizeof exec_errno)) < 0 && errno == EINTR) {
    }
    ::close(exec_p[0]);
    set_nonblock(out_p[0]);
    set_nonblock(err_p[0]);
    Child& c = children_[static_cast<size_t>(i)];
    c.status.rank = rank;
    c.status.pid = pid;
    c.out.fd = out_p[0];
    c.err.fd = err_p[0];
    if (got == static_cast<ssize_t>(sizeof exec_errno)) {
      exec_failed_rank_ = rank;
      error = concat("cannot execute the program '", o_.command[0], "' for rank ", rank, ": ",
                     std::strerror(exec_errno), " (errno ", exec_errno, ")");
      break;
    }
  }
  if (!error.empty()) {
    signal(SIGKILL);
    for (auto& c : children_)
      if (c.status.pid <= 0) c.running = false;
  }
  return error;
}

std::vector<const RankStatus*> RankGroup::poll(int ms, int extra_fd, bool* extra_ready) {
  std::vector<pollfd> fds;
  std::vector<std::pair<size_t, bool>> owners;
  for (size_t i = 0; i < children_.size(); ++i) {
    if (children_[i].out.fd >= 0) { fds.push_back({children_[i].out.fd, POLLIN, 0}); owners.push_back({i, false}); }
    if (children_[i].err.fd >= 0) { fds.push_back({children_[i].err.fd, POLLIN, 0}); owners.push_back({i, true}); }
  }
  if (extra_fd >= 0) fds.push_back({extra_fd, POLLIN, 0});
  ::poll(fds.data(), fds.size(), ms);
  for (size_t k = 0; k < owners.size(); ++k) {
    if (fds[k].revents & (POLLIN | POLLHUP | POLLERR)) pump(o_, children_[owners[k].first], owners[k].second);
  }
  if (extra_ready) *extra_ready = extra_fd >= 0 && (fds.back().revents & POLLIN);
  std::vector<const RankStatus*> reaped;
  for (auto& c : children_) {
    if (!c.running) continue;
    int st = 0;
    if (::waitpid(c.status.pid, &st, WNOHANG) != c.status.pid) continue;
    c.running = false;
    if (WIFEXITED(st)) c.status.exit_code = WEXITSTATUS(st);
    if (WIFSIGNALED(st)) c.status.signal = WTERMSIG(st);
    // Kill whatever the rank left behind in its process group.
    ::kill(-c.status.pid, SIGKILL);
    guard_.remove(c.status.pid);
    reaped.push_back(&c.status);
  }
  return reaped;
}

void RankGroup::signal(int sig) {
  for (auto& c : children_) {
    if (c.running && c.status.pid > 0) ::kill(-c.status.pid, sig);  // the rank's process group
  }
}

void RankGroup::mark_stopped() {
  for (auto& c : children_)
    if (c.running) c.status.stopped_by_launcher = true;
}

std::vector<RankStatus> RankGroup::close() {
  std::vector<RankStatus> out;
  if (closed_) return out;
  closed_ = true;
  end_open_line();  // a rank whose pipe stayed open past the drain: end its line
  // A rank never reaped here (the launcher failed itself) is killed and reaped, so that
  // no generation outlives its group.
  for (auto& c : children_) {
    if (c.running && c.status.pid > 0) {
      ::kill(-c.status.pid, SIGKILL);
      int st = 0;
      while (::waitpid(c.status.pid, &st, 0) < 0 && errno == EINTR) {
      }
      guard_.remove(c.status.pid);
      c.running = false;
    }
    if (c.out.fd >= 0) ::close(c.out.fd);
    if (c.err.fd >= 0) ::close(c.err.fd);
    c.out.fd = c.err.fd = -1;
    out.push_back(c.status);
  }
  return out;
}

// How one generation ended.
struct RoundEnd {
  int exit_code = 0;      // as LaunchResult::exit_code
  int failed_rank = -1;
  std::string message;
  bool restartable = false;  // a rank failed (or another node's did): a new round may help
  bool remote = false;       // ended because another node reported a failure
  std::vector<RankStatus> ranks;
};

// Everything a launch keeps across its rounds.
struct LaunchState {
  const LaunchOptions& o;
  Clock::time_point start;
  SignalForwarder& signals;
  LaunchGuard& guard;
  LaunchRounds* rounds = nullptr;  // with --max-restarts: the launchers' rendezvous
  int forwarded_signal = 0;
};

void say(const std::string& what) {
  live_end();
  std::fprintf(stderr, "tessera run: %s\n", what.c_str());
}

// Watches one generation until every rank has exited (and its output is drained):
// forwards signals, stops everything at the first failure (TERM, then KILL after the
// grace period), at the deadline, or when another node reports a failure.
RoundEnd supervise(LaunchState& L, RankGroup& g, int round, const std::string& spawn_error, int exec_failed_rank) {
  const LaunchOptions& o = L.o;
  RoundEnd end;
  std::optional<Clock::time_point> kill_at, drain_until;
  auto stop_all = [&](Clock::time_point now) {
    g.signal(SIGTERM);
    // A stopped rank (SIGSTOP, a debugger's or the terminal's stop) would hold its TERM
    // pending until the KILL a grace period later: continued, it takes the TERM now (as a
    // shell does for a stopped job). Running ranks ignore the CONT. bench/faults: a
    // SIGSTOPped rank's teardown took the whole 5 s grace before this.
    g.signal(SIGCONT);
    kill_at = now + o.grace;
  };
  if (!spawn_error.empty()) {
    end.exit_code = exec_failed_rank >= 0 ? 127 : 1;
    end.failed_rank = exec_failed_rank;
    end.message = spawn_error;
    say(end.message);
    kill_at = Clock::now();
  }
  auto next_remote_check = Clock::now();
  while (g.any_running() || (g.any_open() && (!drain_until || Clock::now() < *drain_until))) {
    bool signalled = false;
    const auto reaped = g.poll(50, L.signals.fd(), &signalled);
    if (signalled) {
      for (int sig : L.signals.take()) {
        if (!L.forwarded_signal) L.forwarded_signal = sig;
        say(concat("received signal ", sig, " (", strsignal(sig), "); forwarding it to the ranks"));
        g.signal(sig);
        if (!kill_at) kill_at = Clock::now() + o.grace;
      }
    }
    for (const RankStatus* st : reaped) {
      const bool failed = st->signal != 0 || st->exit_code != 0;
      if (!failed || end.failed_rank >= 0 || kill_at) continue;
      end.failed_rank = st->rank;
      end.exit_code = st->signal ? 128 + st->signal : st->exit_code;
      end.restartable = true;
      end.message = st->signal ? concat("rank ", st->rank, " (pid ", st->pid, ") was killed by signal ", st->signal,
                                        " (", strsignal(st->signal), ")")
                               : concat("rank ", st->rank, " (pid ", st->pid, ") exited with code ", st->exit_code);
      if (L.rounds) L.rounds->report_failure(round, end.message);
      if (g.any_running()) {
        end.message += "; stopping the other ranks";
        g.mark_stopped();
        stop_all(Clock::now());
      }
      say(end.message);
    }
    const auto now = Clock::now();
    if (L.rounds && !kill_at && g.any_running() && now >= next_remote_check) {
      next_remote_check = now + std::chrono::milliseconds(200);
      if (auto other = L.rounds->failure(round)) {
        end.exit_code = 1;
        end.restartable = true;
        end.remote = true;
        end.message = concat(*other, "; stopping this node's ranks");
        say(end.message);
        g.mark_stopped();
        stop_all(now);
      }
    }
    if (o.deadline && now - L.start > *o.deadline && g.any_running() && end.failed_rank < 0 && !kill_at) {
      end.exit_code = 124;
      end.restartable = false;
      end.message = concat("deadline of ", o.deadline->count(), " ms passed; stopping every rank");
      say(end.message);
      stop_all(now);
    }
    if (kill_at && now >= *kill_at) g.signal(SIGKILL);
    if (!g.any_running() && !drain_until) drain_until = Clock::now() + std::chrono::seconds(2);
  }
  end.ranks = g.close();
  if (L.forwarded_signal || !spawn_error.empty()) end.restartable = false;
  return end;
}

}  // namespace

LaunchResult launch(const LaunchOptions& o) {
  TESSERA_CHECK(!o.command.empty(), "launch: no program given");
  TESSERA_CHECK(o.nproc_per_node >= 1, "launch: --nproc-per-node must be at least 1, got ", o.nproc_per_node);
  TESSERA_CHECK(o.nnodes >= 1, "launch: --nnodes must be at least 1, got ", o.nnodes);
  TESSERA_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, "launch: --node-rank ", o.node_rank,
                " must be in [0, ", o.nnodes, ")");
  TESSERA_CHECK(o.master_port >= 0 && o.master_port <= 65535, "launch: --master-port ", o.master_port,
                " is not a port number");
  TESSERA_CHECK(o.max_restarts >= 0, "launch: --max-restarts must be at least 0, got ", o.max_restarts);
  TESSERA_CHECK(o.master_port != 0 || o.nnodes == 1, "launch: --master-port is required with --nnodes ", o.nnodes,
                " (every node must agree on it)");
  LaunchResult result;
  SignalForwarder signals(o.forward_signals);
  LaunchGuard guard(o.nproc_per_node);
  if (!guard.start()) {
    std::fprintf(stderr, "tessera run: warning: cannot start the guard process (%s); if this launcher is "
                 "killed, processes started by the ranks may outlive it\n", std::strerror(errno));
  }
  LaunchState L{o, Clock::now(), signals, guard};
  RoundSetup setup;
  const bool live = !o.on_line && ::isatty(2);
  if (live) {
    g_live = LiveLine{};
    g_live.enabled = true;
    struct winsize ws {};
    setup.live_columns = ::ioctl(2, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20 ? ws.ws_col : 80;
  }
  // With restarts, the launchers host the ranks' store and meet in it at every round;
  // without, the ranks meet at MASTER_PORT by themselves (rank 0 hosts the store).
  std::unique_ptr<LaunchRounds> rounds;
  if (o.max_restarts > 0) {
    try {
      rounds = std::make_unique<LaunchRounds>(o.master_addr, o.master_port, o.nnodes, o.node_rank, o.rdzv_timeout);
    } catch (const std::exception& e) {
      result.exit_code = 1;
      result.message = e.what();
      say(result.message);
    }
    L.rounds = rounds.get();
    setup.agent_store = true;
  }
  for (int round = 0; rounds || o.max_restarts == 0; ++round) {
    setup.round = round;
    setup.port = rounds ? rounds->port() : (o.master_port ? o.master_port : find_free_port());
    if (rounds) {
      const std::string joined = rounds->join(round);
      if (!joined.empty()) {
        result.exit_code = result.exit_code ? result.exit_code : 1;
        result.message = result.message.empty() ? joined : concat(result.message, "; then ", joined);
        say(joined);
        break;
      }
    }
    RankGroup group(o, guard);
    const std::string spawn_error = group.start(setup);
    RoundEnd end = supervise(L, group, round, spawn_error, group.exec_failed_rank());
    result.ranks = std::move(end.ranks);
    result.exit_code = end.exit_code;
    result.failed_rank = end.failed_rank;
    result.message = end.message;
    if (end.exit_code == 0 && !L.forwarded_signal) {
      if (rounds) rounds->finish(round);
      break;
    }
    if (!end.restartable || round >= o.max_restarts) {
      if (end.restartable && o.max_restarts > 0)
        say(concat("giving up: the job failed ", round + 1, " time(s) and --max-restarts is ", o.max_restarts));
      break;
    }
    result.failures.push_back(end.message);
    ++result.restarts;
    say(concat("restart ", round + 1, " of at most ", o.max_restarts, ": starting every rank again"));
  }
  if (live) {
    live_end();
    g_live = LiveLine{};
  }
  guard.finish();
  if (L.forwarded_signal && result.failed_rank < 0 && result.exit_code == 0) {
    result.exit_code = 128 + L.forwarded_signal;
    result.message = concat("stopped by signal ", L.forwarded_signal);
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - L.start);
  return result;
}

}  // namespace tessera::distributed
