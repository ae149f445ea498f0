// One `gpt train` per run directory: OUT/run.lock, an fcntl write lock held for the
// life of the process that takes it. The kernel drops it when that process ends, however
// it ends, so a crashed run never leaves a stale lock; the empty file stays. A second
// run sees the holder's pid through F_GETLK.
#pragma once
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

namespace gpt {

class RunDirLock {
 public:
  RunDirLock() = default;
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  ~RunDirLock() {
    if (fd_ >= 0) ::close(fd_);
  }

  static std::string lock_path(const std::string& dir) { return (std::filesystem::path(dir) / "run.lock").string(); }

  // Takes the lock of `dir` (created when missing). Returns "" on success, else why not
  // ("run directory X is in use by pid N ...").
  std::string acquire(const std::string& dir) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return "cannot create the run directory '" + dir + "': " + ec.message();
    const std::string path = lock_path(dir);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return "cannot open the lock file '" + path + "': " + std::strerror(errno);
    for (int attempt = 0; attempt < 3; ++attempt) {
      struct flock fl {};
      fl.l_type = F_WRLCK;
      fl.l_whence = SEEK_SET;
      if (::fcntl(fd, F_SETLK, &fl) == 0) {
        fd_ = fd;
        return "";
      }
      if (errno != EACCES && errno != EAGAIN) {
        const std::string err = std::strerror(errno);
        ::close(fd);
        return "cannot lock '" + path + "': " + err;
      }
      struct flock who {};
      who.l_type = F_WRLCK;
      who.l_whence = SEEK_SET;
      if (::fcntl(fd, F_GETLK, &who) == 0 && who.l_type != F_UNLCK) {
        ::close(fd);
        return "run directory '" + dir + "' is in use by pid " + std::to_string(who.l_pid) + " (it holds " + path +
               "); wait for that run to end or choose another --out";
      }
      // Released between the two calls: try again.
    }
    ::close(fd);
    return "run directory '" + dir + "' is in use by another process (" + path + " is locked)";
  }

 private:
  int fd_ = -1;
};

}  // namespace gpt
