#include "tessera/checkpoint/storage/direct_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "tessera/core/env.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

struct DirectReader::Batch {
  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;
  std::exception_ptr error;
};


DirectReader::DirectReader(int workers, uint64_t segment_bytes)
    : segment_(std::max<uint64_t>(kDirectAlign, segment_bytes)), workers_(std::max(1, workers)) {}

DirectReader::~DirectReader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

namespace {

// An O_DIRECT descriptor of the very file `file` has open (`st`: its fstat), never of a
// file that has since taken its path: reopened through /proc/self/fd/N, else by path with
// device and inode compared. Not open where O_DIRECT is refused, disabled
// (TESSERA_NO_DIRECT_IO) or the same file cannot be had: the caller reads through `file`.
File open_same_direct(const File& file, const struct stat& st) {
#if defined(O_DIRECT)
  if (env::get_bool("TESSERA_NO_DIRECT_IO").value_or(false)) return File();
  const std::string proc = concat("/proc/self/fd/", file.fd());
  int fd = ::open(proc.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0 && (errno == ENOENT || errno == ENOTDIR || errno == EACCES || errno == ELOOP))  // no /proc
    fd = ::open(file.path().c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return File();
  File d = File::adopt(fd, file.path());
  struct stat ds;
  if (::fstat(fd, &ds) != 0 || ds.st_dev != st.st_dev || ds.st_ino != st.st_ino) return File();
  return d;
#else
  (void)file;
  (void)st;
  return File();
#endif
}

}  // namespace

const File* DirectReader::direct_file(const File& file) {
  struct stat st;
  TESSERA_CHECK(::fstat(file.fd(), &st) == 0, "cannot stat '", file.path(), "': ", std::strerror(errno));
  std::lock_guard<std::mutex> lock(files_mu_);
  auto it = direct_files_.find(file.path());
  if (it != direct_files_.end() && it->second.dev == static_cast<uint64_t>(st.st_dev) &&
      it->second.ino == static_cast<uint64_t>(st.st_ino))
    return it->second.file.get();
  Direct d;
  d.dev = static_cast<uint64_t>(st.st_dev);
  d.ino = static_cast<uint64_t>(st.st_ino);
  if (File f = open_same_direct(file, st); f.is_open()) d.file = std::make_unique<File>(std::move(f));
  Direct& slot = direct_files_[file.path()];
  slot = std::move(d);
  return slot.file.get();
}

bool DirectReader::direct(const File& file) { return direct_file(file) != nullptr; }

void DirectReader::forget(const std::string& path) {
  std::lock_guard<std::mutex> lock(files_mu_);
  direct_files_.erase(path);
}

void DirectReader::run(Job& job) {
  thread_local AlignedBuffer bounce;  // one per worker
  bool done = false;
  if (job.direct != nullptr) {
    // The aligned superset of the segment, read into the bounce buffer; a read may end
    // early only at the end of the file, after the segment's last byte.
    const uint64_t a0 = job.offset / kDirectAlign * kDirectAlign;
    const uint64_t a1 = (job.offset + job.n + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    char* buf = bounce.ensure(a1 - a0);
    uint64_t got_all = 0;
    bool refused = false;
    while (a0 + got_all < job.offset + job.n) {
      const ssize_t got = ::pread(job.direct->fd(), buf + got_all, static_cast<size_t>(a1 - a0 - got_all),
                                  static_cast<off_t>(a0 + got_all));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno == EINVAL) {  // the filesystem refuses this direct read: plain pread below
        refused = true;
        break;
      }
      TESSERA_CHECK(got >= 0, "cannot read '", job.direct->path(), "' at byte ", a0 + got_all, ": ",
                    std::strerror(errno));
      TESSERA_CHECK(got > 0, "'", job.direct->path(), "' is truncated: wanted bytes up to ", job.offset + job.n,
                    ", the file ends at ", a0 + got_all);
      got_all += static_cast<uint64_t>(got);
    }
    if (!refused) {
      std::memcpy(job.dst, buf + (job.offset - a0), static_cast<size_t>(job.n));
      done = true;
    }
  }
  if (!done) job.buffered->pread_exact(job.offset, job.dst, job.n);
  if (*job.check) (*job.check)(job.at, job.dst, job.n);
}

void DirectReader::work() {
  while (true) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      run(job);
    } catch (...) {
      error = std::current_exception();
    }
    Batch& b = *job.batch;
    std::lock_guard<std::mutex> lock(b.mu);
    if (error && !b.error) b.error = error;
    if (--b.pending == 0) b.cv.notify_all();
  }
}

void DirectReader::read(const File& file, uint64_t offset, void* dst, uint64_t n, uint64_t segment_multiple,
                        const Check& check) {
  if (n == 0) return;
  const uint64_t mult = std::max<uint64_t>(1, segment_multiple);
  const uint64_t seg = segment_ >= mult ? segment_ / mult * mult : mult;
  const File* d = direct_file(file);
  Batch batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (threads_.empty())
      for (int i = 0; i < workers_; ++i) threads_.emplace_back([this] { work(); });
    for (uint64_t at = 0; at < n; at += seg) {
      queue_.push_back(Job{&file, d, offset + at, static_cast<char*>(dst) + at, std::min(seg, n - at), at, &check,
                           &batch});
      ++batch.pending;
    }
  }
  cv_.notify_all();
  std::unique_lock<std::mutex> lock(batch.mu);
  batch.cv.wait(lock, [&] { return batch.pending == 0; });
  if (batch.error) std::rethrow_exception(batch.error);
}

}  // namespace tessera::checkpoint
