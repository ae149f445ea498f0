#include "tessera/checkpoint/storage/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "tessera/core/env.h"
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
    if (const auto v = env::get("TESSERA_TEST_IO_PAGE_SIZE")) {
      n = std::strtoull(v->c_str(), nullptr, 0);
      TESSERA_CHECK(n >= kDirectAlign && (n & (n - 1)) == 0, "TESSERA_TEST_IO_PAGE_SIZE='", *v,
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

CheckedPath CheckedPath::check(std::string path, const char* what) {
  check_path_chars(path, what);
  return CheckedPath(std::move(path));
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
  if (const auto v = env::get("TESSERA_TEST_FS_TYPE")) {  // tests only: replaces statfs's f_type
    type = std::strtoull(v->c_str(), nullptr, 0);
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

File open_direct(const std::string& path, bool write) {
#if defined(O_DIRECT)
  if (!env::get_bool("TESSERA_NO_DIRECT_IO").value_or(false)) {
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

}  // namespace tessera::checkpoint
