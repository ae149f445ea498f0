// The launcher's guard (launcher.cpp): a small process that kills the ranks' process
// groups when the launcher itself dies without warning. Internal to the distributed layer.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <vector>

namespace tessera::distributed {

// A small process forked before the ranks, in a process group of its own and
// deaf to INT/TERM/HUP, that outlives a launcher killed without warning (SIGKILL, the OOM
// killer, a crash) and then kills the ranks' process groups. The ranks themselves die
// with the launcher (parent-death signal), but what they started would otherwise run on,
// reparented to init. It learns the groups over a socket only the launcher writes:
// +pgid when a rank starts, -pgid once the launcher has reaped it and killed its group,
// 0 when the launch ends normally. End of file without the 0: the launcher is gone.
class LaunchGuard {
 public:
  explicit LaunchGuard(int max_groups) : slots_(static_cast<size_t>(max_groups)) {}
  LaunchGuard(const LaunchGuard&) = delete;
  LaunchGuard& operator=(const LaunchGuard&) = delete;
  ~LaunchGuard() { finish(); }

  // Returns false (and the launch goes on unguarded) when the guard cannot be started.
  bool start();
  int fd() const { return fd_; }
  void add(pid_t pgid) { send(static_cast<int32_t>(pgid)); }
  void remove(pid_t pgid) { send(-static_cast<int32_t>(pgid)); }
  // The launch ended normally (every rank's group killed and reaped): the guard is told so
  // and ended with SIGKILL, without waiting for it (a stopped guard cannot hold the launcher).
  void finish();

 private:
  void send(int32_t v);
  // The guard process: only async-signal-safe calls (the launcher may have threads).
  [[noreturn]] void run(int fd);

  std::vector<pid_t> slots_;  // allocated before fork: the guard does not allocate
  pid_t pid_ = -1;
  int fd_ = -1;
};

}  // namespace tessera::distributed
