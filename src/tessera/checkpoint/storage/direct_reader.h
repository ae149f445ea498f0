// Large reads of checkpoint data without the page cache: a byte range is cut into
// segments that two worker threads read at once with O_DIRECT (aligned, through bounce
// buffers) and copy into the caller's memory, running a check (the checksums) on each
// segment as it lands. The mirror image of StreamWriter's direct writes.
//
// Why (issue 21, docs/benchmarks-history.md): on the development VM two ranks reading 1 GiB
// through the page cache took 1.4-1.6 s where direct reads of the same fresh bytes took
// 0.7-1.25 s, and loads stayed at ~0.7x of a direct-I/O dd. A buffered read costs a page
// allocation and a cache insertion per 4 KiB and small readahead requests; a direct read
// goes to the disk in segment-sized requests, and with two in flight per process the
// disk's queue stays busy while a segment is copied and checked.
//
// Segments are 4 MiB (one checksum block) by default. A read() returns only when all of
// its segments are done, so with segments as large as half a piece both workers read,
// then both copy and check, and the disk idles meanwhile; smaller segments keep the two
// workers out of step. On the second development VM (virtio disk, max_sectors_kb 4096),
// 1 GiB at 2 ranks loaded in 0.66-0.68 s with 16 MiB segments, 0.55-0.58 s with 8 MiB,
// 0.43-0.47 s with 4 MiB and about the same with 2 MiB; three or four workers were
// slower on its two cores (docs/benchmarks-history.md, run 8).
//
// Where O_DIRECT is refused (tmpfs, some network filesystems, or TESSERA_NO_DIRECT_IO=1)
// the same workers read with plain pread. Errors name the file and the byte offset.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/stream_writer.h"

namespace tessera::checkpoint {

class DirectReader {
 public:
  // check(at, data, n): runs on a worker after the n bytes at `at` (relative to the
  // range's start; a multiple of `segment_multiple`) landed in the destination, which
  // `data` points to. May throw: read() then rethrows the first error.
  using Check = std::function<void(uint64_t at, const char* data, uint64_t n)>;

  explicit DirectReader(int workers = 2, uint64_t segment_bytes = 4u << 20);
  ~DirectReader();
  DirectReader(const DirectReader&) = delete;
  DirectReader& operator=(const DirectReader&) = delete;

  // Reads [offset, offset + n) of `file` (open for reading) into dst. The O_DIRECT
  // descriptor is opened once per file from `file`'s own descriptor (/proc/self/fd), so it
  // reads the very file `file` has open even when a new file has since been renamed over
  // its path (a checkpoint committed while it is read); where that cannot be ensured the
  // read goes through `file` itself. Segments are multiples of `segment_multiple` bytes (the
  // checksum block, so that no block straddles two segments), except the last. Returns
  // when every segment has landed and been checked.
  void read(const File& file, uint64_t offset, void* dst, uint64_t n, uint64_t segment_multiple, const Check& check);
  // Whether reads of `file` bypass the page cache (false: plain pread, and read-ahead
  // advice still helps them).
  bool direct(const File& file);
  // Closes the O_DIRECT descriptor kept for `path` (its reader closed its own); a later
  // read opens it again. Not while a read of it is in progress.
  void forget(const std::string& path);
  // Ranges shorter than this are better read with one plain pread by the caller.
  static constexpr uint64_t kMinBytes = 1u << 20;

 private:
  struct Batch;
  struct Job {  // one segment
    const File* buffered = nullptr;
    const File* direct = nullptr;  // nullptr: plain pread
    uint64_t offset = 0;           // in the file
    char* dst = nullptr;
    uint64_t n = 0;
    uint64_t at = 0;  // of the segment in the range
    const Check* check = nullptr;
    Batch* batch = nullptr;
  };
  void work();
  static void run(Job& job);
  const File* direct_file(const File& file);

  uint64_t segment_;
  int workers_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  std::mutex files_mu_;
  struct Direct {
    std::unique_ptr<File> file;  // nullptr: O_DIRECT refused, or not the same file
    uint64_t dev = 0, ino = 0;   // of the file it was opened for
  };
  std::map<std::string, Direct> direct_files_;  // by path
};

}  // namespace tessera::checkpoint
