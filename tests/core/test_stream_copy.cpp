// core/stream_copy.h: the streaming copy gives exactly memcpy's bytes for every alignment
// of source and destination and every length around its thresholds and line sizes, and
// leaves the bytes around the destination alone.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "tessera/core/stream_copy.h"

TEST(StreamCopy, SameBytesAsMemcpyForAnyAlignmentAndLength) {
  const size_t mib = size_t{1} << 20;
  std::vector<uint8_t> src(3 * mib + 512);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  for (size_t len : {size_t{0}, size_t{1}, size_t{63}, size_t{4096}, mib - 1, mib, mib + 1, mib + 63, mib + 64,
                     2 * mib + 37, 3 * mib}) {
    for (size_t src_off : {0, 1, 7, 32, 63}) {
      for (size_t dst_off : {0, 3, 16, 33, 64}) {
        std::vector<uint8_t> dst(len + 256, 0xAB);
        tessera::core::copy_streaming(dst.data() + dst_off, src.data() + src_off, len);
        ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_off, len), 0)
            << "len " << len << " src+" << src_off << " dst+" << dst_off;
        for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0xAB) << "byte before the copy changed";
        for (size_t i = dst_off + len; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xAB) << "byte after the copy changed";
      }
    }
  }
}
