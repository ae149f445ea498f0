// DirectReader: large reads with O_DIRECT through bounce buffers, two segments in flight,
// each segment checked as it lands (checkpoint/storage/direct_reader.h).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "support/test_util.h"
#include "tessera/checkpoint/storage/direct_reader.h"
#include "tessera/checkpoint/storage/file.h"

using namespace tessera;
namespace ck = tessera::checkpoint;
using namespace tessera::testing;

namespace {

std::string random_file(const std::string& path, size_t n) {
  std::string bytes(n, '\0');
  std::mt19937 gen(7);
  for (auto& b : bytes) b = static_cast<char>(gen() & 0xff);
  ck::File f(path, "w");
  f.pwrite_exact(0, bytes.data(), bytes.size());
  f.fsync();
  return bytes;
}

struct Seen {
  std::mutex mu;
  std::vector<std::pair<uint64_t, uint64_t>> segments;  // (at, n) in arrival order
};

// Reads [off, off + n) with `r` and checks the bytes and the segments the check saw.
void expect_reads(ck::DirectReader& r, const ck::File& f, const std::string& bytes, uint64_t off, uint64_t n,
                  uint64_t multiple, uint64_t segment) {
  std::vector<char> dst(n + 2, '\x5a');  // one guard byte on each side
  Seen seen;
  r.read(f, off, dst.data() + 1, n, multiple, [&](uint64_t at, const char* data, uint64_t len) {
    // The check sees the bytes already in place.
    ASSERT_EQ(std::memcmp(data, bytes.data() + off + at, len), 0) << "segment at " << at;
    std::lock_guard<std::mutex> lock(seen.mu);
    seen.segments.emplace_back(at, len);
  });
  EXPECT_EQ(std::memcmp(dst.data() + 1, bytes.data() + off, n), 0) << "range " << off << "+" << n;
  EXPECT_EQ(dst.front(), '\x5a') << "wrote before the destination";
  EXPECT_EQ(dst.back(), '\x5a') << "wrote past the destination";
  std::sort(seen.segments.begin(), seen.segments.end());
  uint64_t next = 0;
  for (size_t i = 0; i < seen.segments.size(); ++i) {
    const auto [at, len] = seen.segments[i];
    EXPECT_EQ(at, next) << "segments must tile the range once";
    EXPECT_EQ(at % multiple, 0u) << "a segment starts inside a checksum block";
    EXPECT_LE(len, std::max(segment / multiple * multiple, multiple));
    next = at + len;
  }
  EXPECT_EQ(next, n);
}

}  // namespace

TEST(DirectReader, ReadsUnalignedRangesInWholeBlockSegments) {
  const std::string dir = temp_dir();
  const size_t size = (5u << 20) + 123;  // not a multiple of the 4 KiB direct-I/O unit
  const std::string bytes = random_file(dir + "/data", size);
  ck::File f(dir + "/data", "r");
  const uint64_t segment = 3 * 4096 + 100;  // small: many segments, several in flight
  ck::DirectReader r(2, segment);
  // (offset, length, segment multiple): aligned and unaligned starts, the file's tail
  // (the last direct read ends early, at the end of the file), one byte, and a multiple
  // that does not divide the segment size.
  const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> cases = {
      {0, size, 4096}, {1, (1u << 20) + 7, 4096}, {4095, 2u << 20, 1}, {size - 5000, 5000, 1000},
      {size - 1, 1, 1}, {12345, 3 * 12288 + 17, 5000},
  };
  for (const auto& [off, n, mult] : cases) expect_reads(r, f, bytes, off, n, mult, segment);
  std::cout << "direct I/O under " << dir << ": " << (r.direct(f) ? "yes" : "refused, plain pread") << "\n";
}

TEST(DirectReader, WithoutDirectIoReadsThroughThePageCache) {
  const std::string dir = temp_dir();
  const std::string bytes = random_file(dir + "/data", (2u << 20) + 9);
  ck::File f(dir + "/data", "r");
  ::setenv("TESSERA_NO_DIRECT_IO", "1", 1);
  ck::DirectReader r(2, 64 * 1024);
  const bool direct = r.direct(f);
  ::unsetenv("TESSERA_NO_DIRECT_IO");
  EXPECT_FALSE(direct);
  expect_reads(r, f, bytes, 3, bytes.size() - 3, 4096, 64 * 1024);
}

// TESSERA_NO_DIRECT_IO is a bool: 0 leaves direct I/O as it is without the variable (on,
// where this filesystem takes O_DIRECT).
TEST(DirectReader, NoDirectIoZeroLeavesDirectIoOn) {
  const std::string dir = temp_dir();
  random_file(dir + "/data", 1u << 20);
  ck::File f(dir + "/data", "r");
  ck::DirectReader r(2, 64 * 1024);
  const bool unset = r.direct(f);
  ::setenv("TESSERA_NO_DIRECT_IO", "0", 1);
  const bool zero = ck::DirectReader(2, 64 * 1024).direct(f);
  ::setenv("TESSERA_NO_DIRECT_IO", "1", 1);
  const bool one = ck::DirectReader(2, 64 * 1024).direct(f);
  ::unsetenv("TESSERA_NO_DIRECT_IO");
  EXPECT_EQ(zero, unset);
  EXPECT_FALSE(one);
}

TEST(DirectReader, ACheckErrorOrATruncatedFileIsRaisedAfterEverySegmentLanded) {
  const std::string dir = temp_dir();
  const std::string bytes = random_file(dir + "/data", 1u << 20);
  ck::File f(dir + "/data", "r");
  ck::DirectReader r(2, 64 * 1024);
  std::vector<char> dst(bytes.size());
  std::mutex mu;
  size_t checked = 0;
  const std::string err = error_of([&] {
    r.read(f, 0, dst.data(), dst.size(), 4096, [&](uint64_t at, const char*, uint64_t) {
      {
        std::lock_guard<std::mutex> lock(mu);
        ++checked;
      }
      if (at == 5 * 64 * 1024) throw Error("block at " + std::to_string(at) + " is bad");
    });
  });
  EXPECT_NE(err.find("block at 327680 is bad"), std::string::npos) << err;
  EXPECT_EQ(checked, 16u) << "read() returned before every segment was checked";
  // Past the end of the file: an error naming the file.
  const std::string trunc = error_of([&] { r.read(f, bytes.size() - 100, dst.data(), 200, 1, {}); });
  EXPECT_NE(trunc.find(dir + "/data"), std::string::npos) << trunc;
  EXPECT_NE(trunc.find("truncated"), std::string::npos) << trunc;
  // The reader still works after errors.
  expect_reads(r, f, bytes, 100, 300000, 1, 64 * 1024);
}
