// Small POSIX file helpers for the checkpoint layer: full reads/writes with pread /
// pwrite, fsync of files and directories, recursive removal, and the atomic commit
// of a finished checkpoint (see docs/checkpoint-format.md §4). Errors name the path.
#pragma once
#include <cstdint>
#include <future>
#include <memory>
#include <string>
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

// Writes large checkpoint data. append() copies into one of two aligned staging
// buffers; a full buffer is written by a background task while the caller fills the
// other, so checksumming and gathering overlap the disk. A writer starts at offset 0 of
// a new file, or (Existing) at any offset of a file that others may be writing at the
// same time: seek() moves to another offset, and the pages this writer shares with
// another one (the first and last page of each run of bytes) go through the page
// cache, never a direct write, so that neither overwrites the other's bytes.
// Where the filesystem allows, whole pages go out with O_DIRECT (no page cache): on the
// development VM, 1 GiB through the page cache plus fsync took 1.1-2.7 s from one
// minute to the next, the same bytes in 16 MiB O_DIRECT writes 0.6-0.85 s (see
// docs/benchmarks.md). Where O_DIRECT is refused (tmpfs, some network filesystems) the
// buffers are written through the page cache, with writeback started at once and
// awaited two buffers behind so that the final fsync has little left to do.
// Errors name the path. The destructor waits for a write in flight and never throws.
class StreamWriter {
 public:
  enum class Open { Create, Existing };  // create/truncate, or write into an existing file
  explicit StreamWriter(const std::string& path, uint64_t buffer_bytes = 16u << 20, Open open = Open::Create);
  ~StreamWriter();
  StreamWriter(const StreamWriter&) = delete;
  StreamWriter& operator=(const StreamWriter&) = delete;

  void append(const void* src, uint64_t n);
  // The next append() writes at `offset` (what was appended before is kept).
  void seek(uint64_t offset);
  // Overwrites bytes already appended (a header patched at the end). Flushes first.
  void patch(uint64_t offset, const void* src, uint64_t n);
  // Writes what is buffered, fsyncs and closes.
  void finish();
  // The end of the furthest byte appended.
  uint64_t size() const { return end_; }
  const std::string& path() const { return buffered_.path(); }
  bool direct() const { return direct_; }

 private:
  void submit();  // hands the filled staging buffer to the background task
  void wait();    // waits for the task in flight; rethrows its error
  void flush();   // everything appended is in the file
  void rebase(uint64_t offset);  // the current buffer starts over at `offset`
  // Writes [p, p + n) at `offset`; p and offset agree modulo the page size. Runs on the task.
  void write_out(const char* p, uint64_t offset, uint64_t n);
  File buffered_;  // regular descriptor: fallback, shared pages, patches, fsync
  File direct_fd_;  // O_DIRECT descriptor of the same file (not open when refused)
  bool direct_ = false;
  uint64_t page_ = kDirectAlign;  // io_page_size(): the unit of pages shared with other writers
  AlignedBuffer buf_[2];
  int cur_ = 0;
  // The current buffer holds file bytes [base_ + lead_, base_ + fill_): base_ is
  // page-aligned and buffer index i is file offset base_ + i, so whole pages of the
  // buffer are aligned in memory and in the file alike.
  uint64_t base_ = 0;
  uint64_t lead_ = 0;
  uint64_t fill_ = 0;
  uint64_t end_ = 0;     // furthest byte appended
  uint64_t waited_ = 0;  // buffered mode: writeback awaited up to here
  std::future<void> inflight_;
  bool closed_ = false;
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

// A fresh temporary sibling name for `dest`: "<parent>/.<name>.tessera-tmp-<pid>-<n>".
// This and the other sibling helpers below refuse a `dest` with control characters
// (check_path_chars), so every writer that publishes through them refuses it too.
std::string temp_sibling(const std::string& dest);
// Publishes `tmp` (a finished, fsync'ed file or directory) at `dest`: a rename when
// dest is absent or an empty directory; otherwise an atomic exchange (directories,
// RENAME_EXCHANGE, or a two-rename fallback) / rename (files), then removal of the old
// one. The caller has checked that dest may be replaced. fsyncs the parent.
void commit_rename(const std::string& tmp, const std::string& dest);
// Removes temporary siblings of `dest` left by crashed saves ("<parent>/.<name>.tessera-tmp-*"),
// and restores a previous checkpoint left aside by an interrupted fallback commit when
// dest is missing. Called before a save.
void recover_siblings(const std::string& dest);
// Removes temporary siblings of `dest` ("<parent>/.<name>.tessera-tmp-<pid>-<n>") whose
// process <pid> is no longer running on this host; those of live processes are kept. For
// writers that may run next to another writer of the same output (`tessera ckpt`).
void remove_dead_temporaries(const std::string& dest);
// The previous checkpoint left aside by an interrupted commit ("" when none): used by
// readers when `dest` is missing.
std::string aside_sibling(const std::string& dest);

}  // namespace tessera::checkpoint
