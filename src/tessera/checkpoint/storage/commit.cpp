#include "tessera/checkpoint/storage/commit.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace {
std::string err() { return std::strerror(errno); }
}  // namespace

std::string temp_sibling(const std::string& dest) { return temp_sibling(CheckedPath::check(dest)).str(); }

CheckedPath temp_sibling(const CheckedPath& dest) {
  static std::atomic<int> counter{0};
  const std::string& d = dest;
  std::string tmp = join_path(parent_dir(d), concat(".", base_name(d), ".tessera-tmp-", ::getpid(), "-", counter++));
  return CheckedPath::check(std::move(tmp), "temporary path");
}

namespace {
bool rename_exchange(const std::string& a, const std::string& b) {
#ifdef SYS_renameat2
  long rc = ::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), 1 /* RENAME_EXCHANGE */);
  return rc == 0;
#else
  (void)a;
  (void)b;
  errno = ENOSYS;
  return false;
#endif
}
bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
}  // namespace

void commit_rename(const std::string& tmp, const std::string& dest) {
  const CheckedPath checked_tmp = CheckedPath::check(tmp, "temporary path");
  commit_rename(checked_tmp, CheckedPath::check(dest));
}

void commit_rename(const CheckedPath& checked_tmp, const CheckedPath& checked_dest) {
  const std::string& tmp = checked_tmp;
  const std::string& dest = checked_dest;
  const std::string parent = parent_dir(dest);
  if (!path_exists(dest) || (is_directory(dest) && list_dir(dest).empty())) {
    if (path_exists(dest)) TESSERA_CHECK(::rmdir(dest.c_str()) == 0, "cannot remove empty '", dest, "': ", err());
    TESSERA_CHECK(::rename(tmp.c_str(), dest.c_str()) == 0, "cannot rename '", tmp, "' to '", dest, "': ", err());
  } else if (!is_directory(dest) && !is_directory(tmp)) {
    TESSERA_CHECK(::rename(tmp.c_str(), dest.c_str()) == 0, "cannot rename '", tmp, "' to '", dest, "': ", err());
  } else if (rename_exchange(tmp, dest)) {
    fsync_dir(parent);
    remove_all(tmp);  // now the old checkpoint
  } else {
    static std::atomic<int> counter{0};
    const std::string aside = join_path(parent, concat(".", base_name(dest), ".tessera-old-", ::getpid(), "-", counter++));
    TESSERA_CHECK(::rename(dest.c_str(), aside.c_str()) == 0, "cannot move '", dest, "' aside: ", err());
    TESSERA_CHECK(::rename(tmp.c_str(), dest.c_str()) == 0, "cannot rename '", tmp, "' to '", dest, "': ", err());
    fsync_dir(parent);
    remove_all(aside);
  }
  fsync_dir(parent);
}

std::string aside_sibling(const std::string& dest) {
  const std::string parent = parent_dir(dest);
  if (!is_directory(parent)) return "";
  const std::string prefix = "." + base_name(dest) + ".tessera-old-";
  for (const auto& n : list_dir(parent)) {
    const std::string p = join_path(parent, n);
    if (starts_with(n, prefix) && path_exists(join_path(p, "tessera-checkpoint.json"))) return p;
  }
  return "";
}

void remove_dead_temporaries(const std::string& dest) {
  remove_dead_temporaries(CheckedPath::check(dest, "output path"));
}

void remove_dead_temporaries(const CheckedPath& checked_dest) {
  const std::string& dest = checked_dest;
  const std::string parent = parent_dir(dest);
  if (!is_directory(parent)) return;
  const std::string prefix = "." + base_name(dest) + ".tessera-tmp-";
  for (const auto& n : list_dir(parent)) {
    if (!starts_with(n, prefix)) continue;
    // "<pid>-<n>": a name that does not parse is not ours to judge and stays.
    const std::string rest = n.substr(prefix.size());
    const size_t dash = rest.find('-');
    if (dash == 0 || dash == std::string::npos || rest.find_first_not_of("0123456789") != dash) continue;
    const long long pid = std::strtoll(rest.substr(0, dash).c_str(), nullptr, 10);
    if (pid <= 0 || pid > INT32_MAX || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to signal)
    try {
      remove_all(join_path(parent, n));
    } catch (const Error&) {
      // Another run may be removing it too; a leftover is harmless.
    }
  }
}

void recover_siblings(const std::string& dest) { recover_siblings(CheckedPath::check(dest)); }

void recover_siblings(const CheckedPath& checked_dest) {
  const std::string& dest = checked_dest;
  const std::string parent = parent_dir(dest);
  if (!is_directory(parent)) return;
  if (!path_exists(dest)) {
    std::string aside = aside_sibling(dest);
    if (!aside.empty()) TESSERA_CHECK(::rename(aside.c_str(), dest.c_str()) == 0, "cannot restore '", aside, "': ", err());
  }
  const std::string tmp_prefix = "." + base_name(dest) + ".tessera-tmp-";
  const std::string old_prefix = "." + base_name(dest) + ".tessera-old-";
  for (const auto& n : list_dir(parent)) {
    if (starts_with(n, tmp_prefix) || (path_exists(dest) && starts_with(n, old_prefix))) {
      try {
        remove_all(join_path(parent, n));
      } catch (const Error&) {
        // Another process may be removing it too; leftovers are harmless.
      }
    }
  }
}

}  // namespace tessera::checkpoint
