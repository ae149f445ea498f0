#include "tessera/checkpoint/storage/stream_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "tessera/core/error.h"

namespace tessera::checkpoint {

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

void StreamWriter::finish(File* unsynced) {
  TESSERA_CHECK(!closed_, "'", buffered_.path(), "': finish() called twice");
  flush();
  if (unsynced != nullptr) {
    direct_fd_.close();
    *unsynced = std::move(buffered_);
    closed_ = true;
    return;
  }
  buffered_.fsync();
  direct_fd_.close();
  buffered_.close();
  closed_ = true;
}

}  // namespace tessera::checkpoint
