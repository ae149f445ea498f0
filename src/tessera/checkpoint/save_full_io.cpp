#include "tessera/checkpoint/save_full_io.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <memory>

#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/storage/direct_reader.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/wire.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

std::string pack_ranges(const std::vector<WrittenRange>& ranges) {
  Packer p;
  p.u64(ranges.size());
  for (const auto& r : ranges) p.u64(r.at).u64(r.len).u64(r.crc);
  return p.bytes();
}

std::vector<WrittenRange> unpack_ranges(const std::string& bytes, const std::string& what) {
  Unpacker in(bytes, what);
  const uint64_t n = in.u64();
  TESSERA_CHECK(n <= bytes.size() / 24, "internal: ", what, " is truncated");
  std::vector<WrittenRange> out(n);
  for (auto& r : out) {
    r.at = in.u64();
    r.len = in.u64();
    r.crc = static_cast<uint32_t>(in.u64());
  }
  return out;
}

RunWriter::RunWriter(const std::string& path, std::vector<std::pair<uint64_t, uint64_t>> tensors)
    : out_(path, 16u << 20, StreamWriter::Open::Existing), tensors_(std::move(tensors)), page_(io_page_size()) {}

void RunWriter::write(size_t ti, uint64_t off, const at::Tensor& t) {
  const at::Tensor c = dense_cpu(t);
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  uint64_t n = static_cast<uint64_t>(c.numel()) * c.element_size();
  TESSERA_CHECK(off + n <= tensors_.at(ti).second, "internal: bytes ", off, "..", off + n, " of tensor ", ti,
                " past its ", tensors_[ti].second);
  out_.seek(tensors_[ti].first + off);
  note_edges(tensors_[ti].first + off, p, n);
  // Checksummed in 256 KiB steps just before each step is copied, while it is in cache.
  CrcPiece cur{static_cast<uint32_t>(ti), off, 0, 0};
  while (n > 0) {
    const uint64_t take = std::min<uint64_t>({n, kCrcBlock - off % kCrcBlock, 256u << 10});
    cur.crc = crc32c_extend(cur.crc, p, static_cast<size_t>(take));
    out_.append(p, take);
    cur.len += take;
    p += take;
    off += take;
    n -= take;
    if (off % kCrcBlock == 0 || n == 0) {
      pieces_.push_back(cur);
      cur = CrcPiece{static_cast<uint32_t>(ti), off, 0, 0};
    }
  }
}

// A run is what this writer writes without a gap; a write elsewhere starts a new one.
void RunWriter::note_edges(uint64_t at, const unsigned char* p, uint64_t n) {
  if (n == 0) return;
  if (!in_run_ || at != run_end_) {
    close_run();
    in_run_ = true;
    run_start_ = run_end_ = at;
    head_ = tail_ = WrittenRange{at, 0, 0};
  }
  const uint64_t end = at + n;
  // The run's bytes in its first page.
  const uint64_t head_limit = (run_start_ / page_ + 1) * page_;
  if (run_end_ < head_limit) {
    const uint64_t take = std::min(end, head_limit) - run_end_;
    head_.crc = crc32c_extend(head_.crc, p, static_cast<size_t>(take));
    head_.len += take;
  }
  // The run's bytes in the page of its last byte: that page began in this write, or
  // (a write shorter than a page) in an earlier one, where tail_ already starts.
  const uint64_t tail_start = std::max(run_start_, (end - 1) / page_ * page_);
  if (tail_start >= at) {
    tail_ = WrittenRange{tail_start, end - tail_start, crc32c(p + (tail_start - at), static_cast<size_t>(end - tail_start))};
  } else {
    tail_.crc = crc32c_extend(tail_.crc, p, static_cast<size_t>(n));
    tail_.len += n;
  }
  run_end_ = end;
}

void RunWriter::close_run() {
  if (!in_run_) return;
  edges_.push_back(head_);
  if (tail_.at != head_.at) edges_.push_back(tail_);
  in_run_ = false;
}

void RunWriter::finish() {
  close_run();
  out_.finish();
}


std::vector<WrittenRange> piece_ranges(const std::vector<CrcPiece>& pieces, const std::vector<uint64_t>& tensor_offsets) {
  std::vector<WrittenRange> out;
  out.reserve(pieces.size());
  for (const auto& p : pieces) {
    TESSERA_CHECK(p.tensor < tensor_offsets.size(), "internal: a piece of tensor ", p.tensor, " of ",
                  tensor_offsets.size());
    out.push_back({tensor_offsets[p.tensor] + p.begin, p.len, p.crc});
  }
  return out;
}

void verify_read_back(const std::string& path, std::vector<WrittenRange> ranges,
                      const std::vector<std::pair<uint64_t, std::string>>& tensors, const std::string& writer) {
  if (ranges.empty()) return;
  std::sort(ranges.begin(), ranges.end(), [](const WrittenRange& x, const WrittenRange& y) { return x.at < y.at; });
  File f(path, "r");
  DirectReader reader;
  // Without O_DIRECT, this host's cached copy goes first (clean pages: all is fsync'ed).
  if (!reader.direct(f)) (void)::posix_fadvise(f.fd(), 0, 0, POSIX_FADV_DONTNEED);
  // Windows of adjacent ranges (a writer's run of rows), at most 32 MiB plus one range.
  constexpr uint64_t kWindow = 32u << 20;
  std::unique_ptr<char[]> buf;
  uint64_t cap = 0;
  for (size_t i = 0; i < ranges.size();) {
    const uint64_t start = ranges[i].at;
    uint64_t end = start + ranges[i].len;
    size_t j = i + 1;
    while (j < ranges.size() && ranges[j].at == end && end - start < kWindow) end += ranges[j++].len;
    const uint64_t n = end - start;
    if (n > cap) {
      buf.reset(new char[n]);
      cap = n;
    }
    reader.read(f, start, buf.get(), n, kDirectAlign, {});
    for (; i < j; ++i) {
      const WrittenRange& r = ranges[i];
      const uint32_t got = crc32c(buf.get() + (r.at - start), static_cast<size_t>(r.len));
      if (got == r.crc) continue;
      // The keys the range touches (tensors lie end to end: one ends where the next starts).
      std::string key;
      auto t = std::upper_bound(tensors.begin(), tensors.end(), r.at,
                                [](uint64_t at, const std::pair<uint64_t, std::string>& x) { return at < x.first; });
      if (t != tensors.begin()) --t;
      for (; t != tensors.end() && t->first < r.at + r.len; ++t) {
        const uint64_t t_end = t + 1 != tensors.end() ? (t + 1)->first : UINT64_MAX;
        if (t_end <= r.at || t_end == t->first) continue;  // before the range, or empty
        const uint64_t b = std::max(r.at, t->first), e = std::min(r.at + r.len, t_end);
        key += concat(key.empty() ? " (" : ", ", "key '", t->second, "' bytes ", b - t->first, "..", e - t->first);
      }
      if (!key.empty()) key += ")";
      throw Error(concat("read-back of '", path, "' before the commit: file bytes ", r.at, "..", r.at + r.len, key,
                         ", written by ", writer, ", read back with checksum ", crc_hex(got), ", not the ",
                         crc_hex(r.crc), " they were written with: the filesystem lost or mixed up a write (writers "
                         "on several hosts of a filesystem that does not keep their byte ranges apart?)"));
    }
  }
}

std::string kernel_identity() {
  std::string id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> id;  // a /proc file has no size to read by
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = 0;
  return id + "@" + host;
}

}  // namespace tessera::checkpoint
