#include "tessera/distributed/launch/launcher.h"

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
#include "tessera/distributed/launch/guard.h"
#include "tessera/distributed/launch/output.h"
#include "tessera/distributed/launch/rounds.h"
#include "tessera/distributed/rendezvous.h"  // find_free_port

extern char** environ;

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using launch_output::Stream;

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

// One rank of a generation: how it ended, and its output streams.
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
  // The environment of local rank `i` (global `rank`): the launcher's, torchrun's variables,
  // and one OpenMP thread per rank on a shared machine unless told otherwise.
  std::map<std::string, std::string> rank_env(const RoundSetup& s, int i, int rank) const;
  // Forks and execs local rank `i` with `env`; "" or why it did not start.
  std::string spawn(int i, int rank, const std::map<std::string, std::string>& env);

  const LaunchOptions& o_;
  LaunchGuard& guard_;
  std::vector<Child> children_;
  int exec_failed_rank_ = -1;
  bool closed_ = false;
};

std::map<std::string, std::string> RankGroup::rank_env(const RoundSetup& s, int i, int rank) const {
  std::map<std::string, std::string> env = o_.env;
  env["RANK"] = std::to_string(rank);
  env["WORLD_SIZE"] = std::to_string(o_.nproc_per_node * o_.nnodes);
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
  } else if (o_.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr && !o_.env.count("OMP_NUM_THREADS")) {
    env["OMP_NUM_THREADS"] = "1";
  }
  return env;
}

namespace {

// The child's side of spawn, between fork and exec: only async-signal-safe calls. Joins its
// own process group, dies with the launcher, takes the default signal actions, keeps only
// its stdout/stderr pipes, and execs; on failure it writes errno to `exec_fd` for the launcher.
[[noreturn]] void exec_rank(pid_t launcher_pid, int guard_fd, const int out_p[2], const int err_p[2],
                            const int exec_p[2], char* const argv[], char* const envp[]) {
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
  ::execvpe(argv[0], argv, envp);
  // Tell the launcher why (it names the program and the error); a successful exec
  // closes this pipe instead (O_CLOEXEC).
  const int err = errno;
  ssize_t ignored = ::write(exec_p[1], &err, sizeof err);
  (void)ignored;
  ::_exit(127);
}

}  // namespace

std::string RankGroup::spawn(int i, int rank, const std::map<std::string, std::string>& env) {
  // Everything the child needs is prepared before fork: only async-signal-safe
  // calls run between fork and exec.
  std::vector<std::string> envs = make_env(env);
  std::vector<char*> envp, argv;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = o_.command;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t launcher_pid = ::getpid();
  const int guard_fd = guard_.fd();

  int out_p[2], err_p[2], exec_p[2];
  if (::pipe(out_p) != 0 || ::pipe(err_p) != 0 || ::pipe2(exec_p, O_CLOEXEC) != 0)
    return std::string("pipe() failed: ") + std::strerror(errno);
  // Signals stay blocked across fork until the child has reset the launcher's
  // handlers, so a TERM sent to a rank that has not exec'd yet takes the default
  // action instead of running the launcher's handler in the child.
  sigset_t all, old_mask;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old_mask);
  pid_t pid = ::fork();
  if (pid != 0) pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  if (pid < 0) {
    const std::string error = std::string("fork() failed: ") + std::strerror(errno);
    ::close(out_p[0]); ::close(out_p[1]); ::close(err_p[0]); ::close(err_p[1]);
    ::close(exec_p[0]); ::close(exec_p[1]);
    return error;
  }
  if (pid == 0) exec_rank(launcher_pid, guard_fd, out_p, err_p, exec_p, argv.data(), envp.data());
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
    return concat("cannot execute the program '", o_.command[0], "' for rank ", rank, ": ", std::strerror(exec_errno),
                  " (errno ", exec_errno, ")");
  }
  return "";
}

std::string RankGroup::start(const RoundSetup& s) {
  std::string error;
  for (int i = 0; i < o_.nproc_per_node && error.empty(); ++i) {
    const int rank = o_.node_rank * o_.nproc_per_node + i;
    error = spawn(i, rank, rank_env(s, i, rank));
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
    if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    Child& c = children_[owners[k].first];
    launch_output::pump(o_, c.status.rank, owners[k].second, owners[k].second ? c.err : c.out);
  }
  if (extra_ready) *extra_ready = extra_fd >= 0 && (fds.back().revents & POLLIN);
  std::vector<const RankStatus*> reaped;
  for (auto& c : children_) {
    if (!c.running) continue;
    // Seen to have ended, but not reaped yet (WNOWAIT): while the rank is a zombie its pid,
    // which is its process group's id, belongs to no other process, so the KILL reaches
    // only what the rank left behind in its group. Reaped after that, never before.
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(c.status.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
        info.si_pid != c.status.pid)
      continue;
    ::kill(-c.status.pid, SIGKILL);
    guard_.remove(c.status.pid);
    int st = 0;
    while (::waitpid(c.status.pid, &st, 0) < 0 && errno == EINTR) {
    }
    c.running = false;
    if (WIFEXITED(st)) c.status.exit_code = WEXITSTATUS(st);
    if (WIFSIGNALED(st)) c.status.signal = WTERMSIG(st);
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
  launch_output::end_open_line();  // a rank whose pipe stayed open past the drain: end its line
  // A rank never reaped here (the launcher failed itself) is killed and reaped, so that
  // no generation outlives its group.
  for (auto& c : children_) {
    if (c.running && c.status.pid > 0) {
      ::kill(-c.status.pid, SIGKILL);  // the rank is not reaped yet: its group id is still its own
      guard_.remove(c.status.pid);
      int st = 0;
      while (::waitpid(c.status.pid, &st, 0) < 0 && errno == EINTR) {
      }
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
  std::vector<RankStatus> ranks;
};

// Everything a launch keeps across its rounds.
struct LaunchState {
  const LaunchOptions& o;
  Clock::time_point start;
  SignalForwarder& signals;
  LaunchGuard& guard;
  LaunchRounds* rounds = nullptr;  // with --max-restarts: the launchers' rendezvous
  int received_signal = 0;         // the first one: forwarded to the ranks, or ending the launch between rounds
};

void say(const std::string& what) {
  launch_output::live_end();
  std::fprintf(stderr, "tessera run: %s\n", what.c_str());
}

// Between rounds no rank runs to forward a signal to: one that arrives while the
// launchers wait for each other, or before a round starts, ends the launch there
// (LaunchRounds asks this every 20 ms while it waits).
bool stop_requested(LaunchState& L) {
  for (int sig : L.signals.take()) {
    if (!L.received_signal) L.received_signal = sig;
    say(concat("received signal ", sig, " (", strsignal(sig), ") while no rank runs; stopping"));
  }
  return L.received_signal != 0;
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
        if (!L.received_signal) L.received_signal = sig;
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
      // Never waits on node 0 (a lookup is under way or not): output and exits go on.
      if (auto news = L.rounds->news(round)) {
        end.exit_code = 1;
        // Another node's failure: a new round may help. Node 0's store lost: none can start.
        end.restartable = news->kind == LaunchRounds::Outcome::kFailed;
        end.message = concat(news->message, "; stopping this node's ranks");
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
  if (L.received_signal || !spawn_error.empty()) end.restartable = false;
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
    launch_output::live_start();
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
  const LaunchRounds::Stop stop = [&L] { return stop_requested(L); };
  bool idle_stop = false;  // ended by a signal while no rank ran
  for (int round = 0; rounds || o.max_restarts == 0; ++round) {
    setup.round = round;
    setup.port = rounds ? rounds->port() : (o.master_port ? o.master_port : find_free_port());
    if (rounds) {
      const LaunchRounds::Outcome joined = rounds->join(round, stop);
      if (joined.kind == LaunchRounds::Outcome::kError) {
        result.exit_code = result.exit_code ? result.exit_code : 1;
        result.message = result.message.empty() ? joined.message : concat(result.message, "; then ", joined.message);
        say(joined.message);
        break;
      }
    }
    idle_stop = stop();
    if (idle_stop) break;  // no rank of this round started
    RankGroup group(o, guard);
    const std::string spawn_error = group.start(setup);
    RoundEnd end = supervise(L, group, round, spawn_error, group.exec_failed_rank());
    if (rounds && end.exit_code == 0 && !L.received_signal) {
      // This node's ranks all exited 0: the round is over when every node's did, and failed
      // when another node's failed meanwhile (then the next round starts on every node).
      const LaunchRounds::Outcome fin = rounds->finish(round, stop);
      if (fin.kind == LaunchRounds::Outcome::kFailed || fin.kind == LaunchRounds::Outcome::kError) {
        end.exit_code = 1;
        end.restartable = fin.kind == LaunchRounds::Outcome::kFailed;
        end.message = end.restartable ? concat(fin.message, "; this node's ranks had all exited 0") : fin.message;
      }
      if (!fin.message.empty()) say(fin.kind == LaunchRounds::Outcome::kReady ? fin.message : end.message);
    }
    result.ranks = std::move(end.ranks);
    result.exit_code = end.exit_code;
    result.failed_rank = end.failed_rank;
    result.message = end.message;
    if (end.exit_code == 0 && !L.received_signal) break;
    if (!end.restartable || round >= o.max_restarts) {
      if (end.restartable && o.max_restarts > 0)
        say(concat("giving up: the job failed ", round + 1, " time(s) and --max-restarts is ", o.max_restarts));
      break;
    }
    // A signal that came after the round's last look at the signals (its ranks had all
    // exited) ends the launch here, before a restart is announced that would not happen.
    idle_stop = stop();
    if (idle_stop) break;
    result.failures.push_back(end.message);
    ++result.restarts;
    say(concat("restart ", round + 1, " of at most ", o.max_restarts, ": starting every rank again"));
  }
  if (live) launch_output::live_stop();
  guard.finish();
  if (idle_stop) {  // after a failed round, too: the signal is why the launch ends
    result.exit_code = 128 + L.received_signal;
    result.failed_rank = -1;
    result.message = concat("stopped by signal ", L.received_signal, " while no rank ran");
  } else if (L.received_signal) {
    // The signal is why the launch ends, also when it came while a failed round was being
    // stopped: 128+signal as for any launch a signal ended (the failure stays in the message).
    result.exit_code = 128 + L.received_signal;
    result.message = result.message.empty() ? concat("stopped by signal ", L.received_signal)
                                            : concat(result.message, "; stopped by signal ", L.received_signal);
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - L.start);
  return result;
}

}  // namespace tessera::distributed
