// Files for the checkpoint layer: an owned descriptor with exact reads and writes
// (pread / pwrite), writeback control and fsync; O_DIRECT opens and aligned buffers; the
// page size; path checks (control characters, filesystems that are not coherent between
// writers) and small path and directory helpers. Errors name the path.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera::checkpoint {

// An open file descriptor, closed on destruction.
class File {
 public:
  File() = default;
  // mode: "r" read-only, "w" create/truncate for writing (0644), "u" write into an
  // existing file (neither created nor truncated).
  File(const std::string& path, const char* mode);
  ~File();
  File(File&& o) noexcept;
  File& operator=(File&& o) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  uint64_t size() const;
  // Exactly n bytes at `offset`, or an error naming the file (short file = truncated).
  void pread_exact(uint64_t offset, void* dst, uint64_t n) const;
  void pwrite_exact(uint64_t offset, const void* src, uint64_t n);
  // Asks the kernel to start reading [offset, offset+n) into the page cache now, all of
  // it at once (posix_fadvise WILLNEED), so a following large read finds the disk busy
  // with a deep queue instead of readahead-window-sized synchronous steps. Advisory.
  void will_need(uint64_t offset, uint64_t n) const;
  // Appends at the current position.
  void write_all(const void* src, uint64_t n);
  // Asks the kernel to start writing [offset, offset+n) to disk now, without waiting
  // (Linux sync_file_range; a no-op elsewhere). Advisory: fsync() still decides.
  void start_writeback(uint64_t offset, uint64_t n);
  // Waits until the writeback of [offset, offset+n) started earlier is done, which
  // bounds the dirty pages a large save leaves for the final fsync. Advisory too.
  void wait_writeback(uint64_t offset, uint64_t n);
  // Sets the file's size (ftruncate): a file that several writers fill at offsets is
  // given its final size first.
  void resize(uint64_t n);
  // Reserves disk blocks for [0, n) (Linux fallocate; advisory: false where the
  // filesystem cannot, and nothing is written). On ext4, direct writes into reserved
  // blocks of one file by several writers run side by side; into a hole each takes the
  // file's lock alone.
  bool reserve(uint64_t n);
  void fsync();
  void close();
  int fd() const { return fd_; }
  // Takes an already open descriptor (closed on destruction).
  static File adopt(int fd, const std::string& path);

 private:
  int fd_ = -1;
  std::string path_;
};

// O_DIRECT needs the buffer address, the file offset and the length aligned to this.
constexpr uint64_t kDirectAlign = 4096;

// The unit in which the kernel's page cache reads and writes a file: the system's page
// size (sysconf(_SC_PAGESIZE): 4 KiB on x86-64, 16 or 64 KiB on some arm64 and ppc64
// kernels), never less than kDirectAlign and a multiple of it. A writer that shares a
// file with others keeps the pages it shares with them out of its direct writes in
// these units (StreamWriter).
uint64_t io_page_size();

// Refuses (tessera::Error) a checkpoint or output path holding a control character
// (a byte below 0x20, or 0x7f): such a name cannot be shown, typed or passed through
// line-based tools safely (issue 35). The message names the path with its control
// characters escaped ("\n", "\x01"). `what`: e.g. "checkpoint path", "output path".
void check_path_chars(const std::string& path, const char* what = "checkpoint path");
// `s` with control characters and backslashes escaped C-style ("\n", "\x7f"; for messages).
std::string escape_path(const std::string& s);

// A path that check_path_chars accepted. Made only by check(), where a path enters (a
// save, a load, an offline command's output), so that a function taking one knows it
// was checked and does not check it again; it reads as the string it holds.
class CheckedPath {
 public:
  // `path`, or check_path_chars(path, what)'s error.
  static CheckedPath check(std::string path, const char* what = "checkpoint path");
  const std::string& str() const { return path_; }
  operator const std::string&() const { return path_; }

 private:
  explicit CheckedPath(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Why several clients must not write disjoint byte ranges of one file at once on the
// filesystem holding `path` ("" when they may): on NFS, SMB/CIFS, FUSE mounts (object
// stores, sshfs, virtiofs), 9p and AFS, a client writes a partial page back whole from
// its own cache, which may predate another client's bytes in that page, and nothing
// orders the two. Local filesystems, tmpfs and coherent cluster filesystems (Lustre,
// GPFS, CephFS, BeeGFS) are fine. Uses statfs(2).
std::string shared_writes_refusal(const std::string& path);
// The name of an incoherent filesystem type (statfs f_type), or nullptr when it is not one.
const char* incoherent_fs_name(uint64_t f_type);

// `path` opened with O_DIRECT for reading or writing (an existing file), or a File that
// is not open where that is refused (tmpfs, some network filesystems, no O_DIRECT on
// this system) or TESSERA_NO_DIRECT_IO is set: the caller then uses the page cache.
File open_direct(const std::string& path, bool write);

// Memory aligned for O_DIRECT, grown on demand (contents are not kept when it grows).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(uint64_t n) { ensure(n); }
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  // At least n bytes.
  char* ensure(uint64_t n);
  char* data() const { return p_; }
  uint64_t size() const { return cap_; }

 private:
  char* p_ = nullptr;
  uint64_t cap_ = 0;
};

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
bool is_regular_file(const std::string& path);
// Why `path` cannot be read as a regular file (symlinks followed): "" when it can, else
// "does not exist", "is not a regular file (a directory)", "... (a FIFO)", and so on.
std::string not_regular_file_reason(const std::string& path);
std::vector<std::string> list_dir(const std::string& dir);  // names, without . and ..
void make_dir(const std::string& path);
void fsync_dir(const std::string& dir);
// rm -rf; quiet when the path is absent.
void remove_all(const std::string& path);
std::string parent_dir(const std::string& path);  // "." for a bare name
std::string base_name(const std::string& path);
std::string join_path(const std::string& dir, const std::string& name);
// Whole small file (metadata); refuses files larger than `max_bytes`.
std::string read_small_file(const std::string& path, uint64_t max_bytes);

}  // namespace tessera::checkpoint
