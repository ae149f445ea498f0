// StreamWriter: large checkpoint data written through two staging buffers (one filled
// while the other goes to disk), with O_DIRECT where the filesystem allows and the pages
// shared with other writers of the same file kept out of direct writes.
#pragma once
#include <cstdint>
#include <future>
#include <string>

#include "tessera/checkpoint/storage/file.h"

namespace tessera::checkpoint {

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
  // Writes what is buffered, fsyncs and closes. With `unsynced`, the fsync is the
  // caller's: the file is moved there open, its bytes written but not yet fsynced (a
  // SyncQueue syncs many files together).
  void finish(File* unsynced = nullptr);
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

}  // namespace tessera::checkpoint
