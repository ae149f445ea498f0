// SyncQueue: many written files made durable together. A writer of many small files
// (a reshard to 1,024 ranks writes 1,024 data files of under a MB) hands each file over
// still open; a few threads fsync and close them while the writer goes on with the next.
// Journalling filesystems (ext4, XFS) commit fsyncs that wait at the same time in one
// journal commit and one cache flush, so the files are not a thousand commits one after
// another. Each file is fsynced through the descriptor that wrote it, so its write errors
// are reported as a direct fsync would report them.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "tessera/checkpoint/storage/file.h"

namespace tessera::checkpoint {

class SyncQueue {
 public:
  // `threads` fsyncs in flight at most; add() waits while `max_waiting` files are queued
  // (each holds its descriptor until it is synced).
  explicit SyncQueue(int threads = 8, size_t max_waiting = 64);
  // Waits for the files handed over; never throws (call wait() to see errors).
  ~SyncQueue();
  SyncQueue(const SyncQueue&) = delete;
  SyncQueue& operator=(const SyncQueue&) = delete;
  // Hands over an open file whose data is written: fsynced, then closed.
  void add(File f);
  // Returns once every file added so far is fsynced and closed; throws the first error
  // (tessera::Error naming the file) if any fsync or close failed.
  void wait();

 private:
  void work();
  std::mutex mu_;
  std::condition_variable ready_, done_;
  std::deque<File> queue_;
  size_t busy_ = 0, max_waiting_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
};

}  // namespace tessera::checkpoint
