#include "tessera/checkpoint/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace {
std::string err() { return std::strerror(errno); }
}  // namespace

uint64_t io_page_size() {
  static const uint64_t size = [] {
    // TESSERA_TEST_IO_PAGE_SIZE (tests only) replaces the system's value, to exercise 64 KiB
    // pages on a 4 KiB kernel; anything but a power of two of at least 4096 is refused.
    uint64_t n = 0;
    if (const char* v = std::getenv("TESSERA_TEST_IO_PAGE_SIZE")) {
      n = std::strtoull(v, nullptr, 0);
      TESSERA_CHECK(n >= kDirectAlign && (n & (n - 1)) == 0, "TESSERA_TEST_IO_PAGE_SIZE='", v,
                    "' (tests only) is not a power of two of at least 4096");
    }
    if (n == 0) {
      const long ps = ::sysconf(_SC_PAGESIZE);
      n = ps > 0 ? static_cast<uint64_t>(ps) : kDirectAlign;
    }
    // A multiple of kDirectAlign (page sizes are powers of two: the larger of the two).
    return (std::max<uint64_t>(n, kDirectAlign) + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  }();
  return size;
}

std::string escape_path(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7f) out += std::string("\\x") + hex[c >> 4] + hex[c & 15];
    else out += static_cast<char>(c);
  }
  return out;
}

void check_path_chars(const std::string& path, const char* what) {
  for (size_t i = 0; i < path.size(); ++i) {
    const auto c = static_cast<unsigned char>(path[i]);
    if (c < 0x20 || c == 0x7f)
      throw Error(concat("refusing the ", what, " '", escape_path(path), "': it contains a control character ('",
                         escape_path(std::string(1, path[i])), "' at byte ", i, "); choose a name without one"));
  }
}

const char* incoherent_fs_name(uint64_t f_type) {
  switch (f_type) {
    case 0x6969: return "NFS";
    case 0x65735546: return "FUSE";
    case 0x517B: return "SMB";
    case 0xFF534D42: return "CIFS";
    case 0xFE534D42: return "SMB2";
    case 0x01021997: return "9p";
    case 0x5346414F: return "AFS";
    case 0x6B414653: return "kAFS";
    default: return nullptr;
  }
}

std::string shared_writes_refusal(const std::string& path) {
  uint64_t type = 0;
  if (const char* v = std::getenv("TESSERA_TEST_FS_TYPE")) {  // tests only: replaces statfs's f_type
    type = std::strtoull(v, nullptr, 0);
  } else {
    struct statfs st;
    if (::statfs(path.c_str(), &st) != 0) return concat("cannot statfs '", path, "': ", err());
    type = static_cast<uint64_t>(static_cast<unsigned long>(st.f_type)) & 0xFFFFFFFFu;
  }
  const char* name = incoherent_fs_name(type);
  if (name == nullptr) return "";
  char hexbuf[16];
  std::snprintf(hexbuf, sizeof hexbuf, "%llx", static_cast<unsigned long long>(type));
  return concat("'", path, "' is on ", name, " (statfs type 0x", hexbuf,
                "), where writes of several clients into one file are not coherent");
}

File::File(const std::string& path, const char* mode) : path_(path) {
  const std::string m = mode;
  fd_ = m == "w"   ? ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)
        : m == "u" ? ::open(path.c_str(), O_WRONLY | O_CLOEXEC)
                   : ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TESSERA_CHECK(fd_ >= 0, "cannot open '", path, "' for ", m == "r" ? "reading" : "writing", ": ", err());
  if (m == "r") {
    // Opened without blocking (a FIFO's open would wait for a writer forever); only a
    // regular file is read, and then in the ordinary blocking mode (issue 35, dcp).
    struct stat st;
    const bool regular = ::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode);
    if (!regular || ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK) != 0) {
      const std::string why = regular ? concat("cannot be read: ", err()) : not_regular_file_reason(path);
      close();
      throw Error(concat("cannot open '", path, "' for reading: it ", why.empty() ? "is not a regular file" : why));
    }
  }
}
File::~File() { close(); }
File::File(File&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}
void File::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

uint64_t File::size() const {
  struct stat st;
  TESSERA_CHECK(::fstat(fd_, &st) == 0, "cannot stat '", path_, "': ", err());
  return static_cast<uint64_t>(st.st_size);
}

void File::pread_exact(uint64_t offset, void* dst, uint64_t n) const {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(n, 1u << 30));
    ssize_t got = ::pread(fd_, p, want, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    TESSERA_CHECK(got >= 0, "cannot read '", path_, "' at byte ", offset, ": ", err());
    TESSERA_CHECK(got > 0, "'", path_, "' is truncated: wanted ", n, " more bytes at byte ", offset);
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<uint64_t>(got);
  }
}

void File::will_need(uint64_t offset, uint64_t n) const {
  if (n > 0) (void)::posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(n), POSIX_FADV_WILLNEED);
}

void File::pwrite_exact(uint64_t offset, const void* src, uint64_t n) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    ssize_t put = ::pwrite(fd_, p, static_cast<size_t>(std::min<uint64_t>(n, 1u << 30)), static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    TESSERA_CHECK(put > 0, "cannot write '", path_, "' at byte ", offset, ": ", err());
    p += put;
    offset += static_cast<uint64_t>(put);
    n -= static_cast<uint64_t>(put);
  }
}

void File::write_all(const void* src, uint64_t n) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    ssize_t put = ::write(fd_, p, static_cast<size_t>(std::min<uint64_t>(n, 1u << 30)));
    if (put < 0 && errno == EINTR) continue;
    TESSERA_CHECK(put > 0, "cannot write '", path_, "': ", err());
    p += put;
    n -= static_cast<uint64_t>(put);
  }
}

void File::start_writeback(uint64_t offset, uint64_t n) {
#if defined(__linux__)
  if (n > 0) (void)::sync_file_range(fd_, static_cast<off_t>(offset), static_cast<off_t>(n), SYNC_FILE_RANGE_WRITE);
#else
  (void)offset;
  (void)n;
#endif
}

void File::wait_writeback(uint64_t offset, uint64_t n) {
#if defined(__linux__)
  if (n > 0)
    (void)::sync_file_range(fd_, static_cast<off_t>(offset), static_cast<off_t>(n),
                            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
#else
  (void)offset;
  (void)n;
#endif
}

File File::adopt(int fd, const std::string& path) {
  File f;
  f.fd_ = fd;
  f.path_ = path;
  return f;
}

// ------------------------------------------------------------------ StreamWriter

File open_direct(const std::string& path, bool write) {
#if defined(O_DIRECT)
  if (std::getenv("TESSERA_NO_DIRECT_IO") == nullptr) {
    const int fd = ::open(path.c_str(), (write ? O_WRONLY : O_RDONLY) | O_DIRECT | O_CLOEXEC);
    if (fd >= 0) return File::adopt(fd, path);
  }
#endif
  (void)write;
  return File();
}

AlignedBuffer::~AlignedBuffer() { std::free(p_); }

char* AlignedBuffer::ensure(uint64_t n) {
  if (n > cap_) {
    std::free(p_);
    p_ = nullptr;
    cap_ = 0;
    void* q = nullptr;
    TESSERA_CHECK(::posix_memalign(&q, kDirectAlign, n) == 0, "cannot allocate a ", n, "-byte I/O buffer");
    p_ = static_cast<char*>(q);
    cap_ = n;
  }
  return p_;
}

StreamWriter::StreamWriter(const std::string& path, uint64_t buffer_bytes, Open open)
    : buffered_(path, open == Open::Create ? "w" : "u"), page_(io_page_size()) {
  const uint64_t n = std::max<uint64_t>(page_, buffer_bytes / page_ * page_);
  buf_[0].ensure(n);
  buf_[1].ensure(n);
  direct_fd_ = open_direct(path, true);
  direct_ = direct_fd_.is_open();
}

StreamWriter::~StreamWriter() {
  if (inflight_.valid()) {
    try {
      inflight_.get();
    } catch (const std::exception&) {
    }
  }
}

void StreamWriter::write_out(const char* p, uint64_t offset, uint64_t n) {
  if (direct_) {
    // Only whole pages go out directly: a partial first or last page may hold another
    // writer's bytes (or the rest of the file), so it is written through the page cache.
    // Pages of the kernel's size (io_page_size()): the page cache reads and writes back a
    // whole one, so on a 64 KiB-page kernel a 4 KiB direct write into a page another
    // writer holds partly in its cache could be overwritten by that page's writeback.
    const uint64_t head = std::min<uint64_t>(n, (page_ - offset % page_) % page_);
    if (head > 0) {
      buffered_.pwrite_exact(offset, p, head);
      p += head;
      offset += head;
      n -= head;
    }
    // A filesystem may still refuse a direct write (EINVAL from tmpfs or FUSE, others
    // elsewhere): the rest then goes through the page cache, whose own error (a full
    // disk, say) is the one reported.
    uint64_t whole = n / page_ * page_;
    while (whole > 0) {
      ssize_t put = ::pwrite(direct_fd_.fd(), p, static_cast<size_t>(std::min<uint64_t>(whole, 1u << 30)),
                             static_cast<off_t>(offset));
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) {
        direct_ = false;
        direct_fd_.close();
        break;
      }
      p += put;
      offset += static_cast<uint64_t>(put);
      n -= static_cast<uint64_t>(put);
      whole -= static_cast<uint64_t>(put);
      if (whole > 0 && (static_cast<uint64_t>(put) % kDirectAlign) != 0) {
        direct_ = false;  // a short unaligned direct write: finish through the page cache
        direct_fd_.close();
        break;
      }
    }
    if (n == 0) return;
    if (direct_) {  // the partial last page
      buffered_.pwrite_exact(offset, p, n);
      return;
    }
  }
  buffered_.pwrite_exact(offset, p, n);
  buffered_.start_writeback(offset, n);
  const uint64_t behind = 2 * buf_[0].size();
  if (offset + n >= waited_ + behind + buf_[0].size()) {
    buffered_.wait_writeback(waited_, offset + n - behind - waited_);
    waited_ = offset + n - behind;
  }
}

void StreamWriter::wait() {
  if (inflight_.valid()) inflight_.get();
}

void StreamWriter::submit() {
  wait();  // the other buffer is free again (and an earlier failure surfaces here)
  const char* p = buf_[cur_].data() + lead_;
  const uint64_t off = base_ + lead_, n = fill_ - lead_;
  inflight_ = std::async(std::launch::async, [this, p, off, n] { write_out(p, off, n); });
  cur_ ^= 1;
  rebase(base_ + fill_);
}

void StreamWriter::rebase(uint64_t offset) {
  base_ = offset / page_ * page_;
  lead_ = fill_ = offset - base_;
}

void StreamWriter::append(const void* src, uint64_t n) {
  TESSERA_CHECK(!closed_, "'", buffered_.path(), "': append after finish()");
  const auto* p = static_cast<const char*>(src);
  const uint64_t cap = buf_[0].size();
  while (n > 0) {
    const uint64_t take = std::min(n, cap - fill_);
    std::memcpy(buf_[cur_].data() + fill_, p, static_cast<size_t>(take));
    fill_ += take;
    p += take;
    n -= take;
    end_ = std::max(end_, base_ + fill_);
    if (fill_ == cap) submit();
  }
}

void StreamWriter::seek(uint64_t offset) {
  TESSERA_CHECK(!closed_, "'", buffered_.path(), "': seek after finish()");
  if (offset == base_ + fill_) return;
  flush();
  rebase(offset);
  waited_ = base_;
}

void StreamWriter::flush() {
  wait();
  if (fill_ > lead_) {
    write_out(buf_[cur_].data() + lead_, base_ + lead_, fill_ - lead_);
    rebase(base_ + fill_);
  }
}

void StreamWriter::patch(uint64_t offset, const void* src, uint64_t n) {
  TESSERA_CHECK(offset + n <= end_, "'", buffered_.path(), "': patch of bytes ", offset, "..", offset + n,
                " past the ", end_, " written");
  flush();
  buffered_.pwrite_exact(offset, src, n);
}

void StreamWriter::finish() {
  TESSERA_CHECK(!closed_, "'", buffered_.path(), "': finish() called twice");
  flush();
  buffered_.fsync();
  direct_fd_.close();
  buffered_.close();
  closed_ = true;
}

void File::resize(uint64_t n) {
  TESSERA_CHECK(::ftruncate(fd_, static_cast<off_t>(n)) == 0, "cannot set the size of '", path_, "' to ", n,
                " bytes: ", err());
}

bool File::reserve(uint64_t n) {
#if defined(__linux__)
  return n == 0 || ::fallocate(fd_, 0, 0, static_cast<off_t>(n)) == 0;
#else
  (void)n;
  return false;
#endif
}

void File::fsync() { TESSERA_CHECK(::fsync(fd_) == 0, "cannot fsync '", path_, "': ", err()); }

bool path_exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}
bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool is_regular_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string not_regular_file_reason(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return "does not exist";
    return concat("cannot be read: ", err());
  }
  if (S_ISREG(st.st_mode)) return "";
  const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                                            : "not a file";
  return concat("is not a regular file (", what, ")");
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  TESSERA_CHECK(d != nullptr, "cannot list directory '", dir, "': ", err());
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

void make_dir(const std::string& path) {
  TESSERA_CHECK(::mkdir(path.c_str(), 0755) == 0, "cannot create directory '", path, "': ", err());
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "cannot open directory '", dir, "': ", err());
  int rc = ::fsync(fd);
  const std::string e = err();
  ::close(fd);
  TESSERA_CHECK(rc == 0, "cannot fsync directory '", dir, "': ", e);
}

void remove_all(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& n : list_dir(path)) remove_all(join_path(path, n));
    TESSERA_CHECK(::rmdir(path.c_str()) == 0, "cannot remove directory '", path, "': ", err());
  } else {
    TESSERA_CHECK(::unlink(path.c_str()) == 0, "cannot remove '", path, "': ", err());
  }
}

std::string parent_dir(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  auto pos = p.rfind('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return p.substr(0, pos);
}
std::string base_name(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  auto pos = p.rfind('/');
  return pos == std::string::npos ? p : p.substr(pos + 1);
}
std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir == ".") return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string read_small_file(const std::string& path, uint64_t max_bytes) {
  File f(path, "r");
  const uint64_t n = f.size();
  TESSERA_CHECK(n <= max_bytes, "'", path, "' is ", n, " bytes, more than the limit of ", max_bytes);
  std::string s(n, '\0');
  f.pread_exact(0, s.data(), n);
  return s;
}

std::string temp_sibling(const std::string& dest) {
  check_path_chars(dest);
  static std::atomic<int> counter{0};
  return join_path(parent_dir(dest), concat(".", base_name(dest), ".tessera-tmp-", ::getpid(), "-", counter++));
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
  check_path_chars(tmp, "temporary path");
  check_path_chars(dest);
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
  check_path_chars(dest, "output path");
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

void recover_siblings(const std::string& dest) {
  check_path_chars(dest);
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
