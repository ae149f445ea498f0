// The launcher's guard process (guard.h): started before the ranks, it kills their
// process groups if the launcher disappears without saying goodbye.
#include "tessera/distributed/launch/guard.h"

#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace tessera::distributed {

bool LaunchGuard::start() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return false;
  sigset_t all, old_mask;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old_mask);
  pid_t pid = ::fork();
  if (pid == 0) run(sv[1]);  // never returns
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  ::close(sv[1]);
  if (pid < 0) {
    ::close(sv[0]);
    return false;
  }
  pid_ = pid;
  fd_ = sv[0];
  return true;
}

void LaunchGuard::finish() {
  if (fd_ < 0) return;
  send(0);
  ::close(fd_);
  fd_ = -1;
  // The ranks' groups are all killed by now: the guard has nothing left to do, and waiting
  // for it to read the 0 would wait forever for a guard someone stopped (SIGSTOP). It is
  // this launcher's own child, not reaped yet, so the pid is still the guard's.
  ::kill(pid_, SIGKILL);
  int st = 0;
  while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

void LaunchGuard::send(int32_t v) {
  if (fd_ < 0) return;
  // MSG_NOSIGNAL: a guard that was killed must not take the launcher down with SIGPIPE.
  while (::send(fd_, &v, sizeof v, MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

void LaunchGuard::run(int fd) {
  ::setpgid(0, 0);  // not stopped by a signal sent to the launcher's process group
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU}) sigaction(sig, &ign, nullptr);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // Hold nothing of the launcher's open: a pipe reader waiting for end of file on the
  // launcher's output must not wait for the guard.
  if (fd != 0) {
    ::dup2(fd, 0);
    fd = 0;
  }
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, 1u, ~0u, 0u) != 0)
#endif
    for (int i = 1; i < 65536; ++i) ::close(i);
  size_t n = 0;
  unsigned char buf[256];
  size_t have = 0;
  for (;;) {
    ssize_t k = ::read(fd, buf + have, sizeof buf - have);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;  // the launcher is gone
    have += static_cast<size_t>(k);
    size_t off = 0;
    for (; off + sizeof(int32_t) <= have; off += sizeof(int32_t)) {
      int32_t v;
      std::memcpy(&v, buf + off, sizeof v);
      if (v == 0) ::_exit(0);
      if (v > 0 && n < slots_.size()) {
        slots_[n++] = v;
      } else if (v < 0) {
        for (size_t i = 0; i < n; ++i) {
          if (slots_[i] != -v) continue;
          slots_[i] = slots_[--n];
          break;
        }
      }
    }
    std::memmove(buf, buf + off, have - off);
    have -= off;
  }
  for (size_t i = 0; i < n; ++i) ::kill(-slots_[i], SIGKILL);
  ::_exit(0);
}

}  // namespace tessera::distributed
