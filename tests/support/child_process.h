// Child processes for the tests that start programs themselves (reliability kills,
// external-launcher environments): a program in its own process group with its output on
// a pipe, bounded waits, and a port that was free a moment ago.
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "support/build_paths.h"

extern char** environ;

namespace tessera::testing {

inline int64_t steady_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A child process in a new process group (pgid == pid) with stdout+stderr on a pipe.
struct Child {
  pid_t pid = -1;
  int out = -1;  // read end
  std::string text;
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  Child(Child&& o) noexcept : pid(o.pid), out(o.out), text(std::move(o.text)) { o.out = -1; }
  // Reads what is available within `ms` milliseconds; false at EOF.
  bool pump(int ms) {
    pollfd p{out, POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) return true;
    char b[4096];
    ssize_t k = ::read(out, b, sizeof b);
    if (k <= 0) return false;
    text.append(b, static_cast<size_t>(k));
    return true;
  }
  // Pumps until `needle` appears in the output (true) or the deadline passes / EOF (false).
  bool wait_for(const std::string& needle, int timeout_ms) {
    const int64_t end = steady_ms() + timeout_ms;
    while (text.find(needle) == std::string::npos && steady_ms() < end)
      if (!pump(50)) return text.find(needle) != std::string::npos;
    return text.find(needle) != std::string::npos;
  }
  // Waits for exit (bounded); returns the wait status, or -1 on timeout (the process is left running).
  int wait_exit(int timeout_ms) {
    const int64_t end = steady_ms() + timeout_ms;
    while (true) {
      int st = 0;
      pid_t r = ::waitpid(pid, &st, WNOHANG);
      if (r == pid) {
        while (pump(0)) {
          pollfd p{out, POLLIN, 0};
          if (::poll(&p, 1, 0) <= 0) break;
        }
        return st;
      }
      if (steady_ms() >= end) return -1;
      if (!pump(20)) ::usleep(20000);
    }
  }
  ~Child() {
    if (out >= 0) ::close(out);
  }
};

// Spawns argv[0] with `env` added to this process's environment, in its own process group;
// variables of this process for which `drop(name)` is true are not passed on.
inline Child spawn(const std::vector<std::string>& argv_s, const std::map<std::string, std::string>& env = {},
                   const std::function<bool(const std::string&)>& drop = nullptr) {
  Child c;
  int fds[2];
  if (::pipe(fds) != 0) return c;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&at, 0);
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (!env.count(name) && !(drop && drop(name))) env_s.push_back(kv);
  }
  for (auto& [k, v] : env) env_s.push_back(k + "=" + v);
  std::vector<std::string> args = argv_s;
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  if (::posix_spawn(&c.pid, argv[0], &fa, &at, argv.data(), envp.data()) != 0) c.pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&at);
  ::close(fds[1]);
  c.out = fds[0];
  return c;
}

// Runs `argv` to its end with stdout to the file `out` and stderr to `err` (the same file
// when equal): its exit status (128 + signal when killed; -1 when it could not be run) and
// its own peak resident set in KiB (wait4's rusage of that child alone).
struct Measured {
  int status = -1;
  int wait_status = 0;  // as waitpid gives it (for WIFEXITED and WTERMSIG)
  long maxrss_kb = 0;
};
inline Measured run_measured(const std::vector<std::string>& argv_s, const std::string& out, const std::string& err) {
  std::vector<std::string> copy = argv_s;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (err == out)
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  else
    posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Measured m;
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return m;
  int st = 0;
  struct rusage ru {};
  if (::wait4(pid, &st, 0, &ru) != pid) return m;
  m.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  m.wait_status = st;
  m.maxrss_kb = ru.ru_maxrss;
  return m;
}

// Whether any process is left in process group `pgid`.
inline bool group_alive(pid_t pgid) { return ::kill(-pgid, 0) == 0; }

// A port that was free a moment ago (bound to 0, read back, closed).
// The CLI run with `args` (no shell) to its end or for at most `timeout_ms`; when time runs
// out its whole process group is killed and `finished` stays false.
struct CliRun {
  bool finished = false;  // within the deadline
  int code = -1;          // exit status, 128 + signal when a signal ended it
  std::string out;        // stdout and stderr
};
inline CliRun run_cli(const std::vector<std::string>& args, int timeout_ms = 300000) {
  std::vector<std::string> argv{TESSERA_CLI};
  argv.insert(argv.end(), args.begin(), args.end());
  Child c = spawn(argv);
  CliRun r;
  if (c.pid <= 0) {
    r.out = "spawn of " + argv[0] + " failed";
    return r;
  }
  const int st = c.wait_exit(timeout_ms);
  r.out = c.text;
  if (st == -1) {
    ::kill(-c.pid, SIGKILL);
    int ignored = 0;
    ::waitpid(c.pid, &ignored, 0);
    return r;
  }
  r.finished = true;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

inline int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

}  // namespace tessera::testing
