#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tessera/core/error.h"
#include "tessera/sharding/chunk.h"

using namespace tessera::sharding;

TEST(Chunk, TorchChunkRuleWithEmptyTrailingPieces) {
  EXPECT_EQ(chunk_sizes(6, 4), (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(chunk_sizes(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(chunk_sizes(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(chunk_sizes(1, 3), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(chunk_sizes(0, 3), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(chunk_sizes(7, 1), (std::vector<int64_t>{7}));
  Range r = chunk_range(6, 4, 3);
  EXPECT_EQ(r.begin, 6);
  EXPECT_EQ(r.size, 0);
  EXPECT_THROW(chunk_range(6, 4, 4), tessera::Error);
  EXPECT_THROW(chunk_split(3, 0), tessera::Error);
}

TEST(Chunk, PiecesTileTheDimensionForManySizes) {
  for (int64_t n = 0; n < 40; ++n) {
    for (int w = 1; w <= 9; ++w) {
      int64_t next = 0;
      for (int i = 0; i < w; ++i) {
        Range r = chunk_range(n, w, i);
        if (r.size > 0) EXPECT_EQ(r.begin, next);
        next = r.begin + r.size;
        EXPECT_LE(r.size, chunk_split(n, w));
      }
      EXPECT_EQ(next, n) << n << " over " << w;
    }
  }
}

TEST(Chunk, IntersectAndContain) {
  Box a{{0, 2}, {4, 4}}, b{{2, 0}, {4, 3}};
  auto i = intersect(a, b);
  ASSERT_TRUE(i.has_value());
  EXPECT_EQ(*i, (Box{{2, 2}, {2, 1}}));
  EXPECT_FALSE(intersect(a, Box{{4, 0}, {2, 8}}).has_value());  // touching edges only
  EXPECT_FALSE(intersect(a, Box{{1, 3}, {0, 1}}).has_value());  // empty box
  EXPECT_TRUE(contains(a, *i));
  EXPECT_FALSE(contains(*i, a));
  EXPECT_EQ(chunk_box({6, 3}, 0, 4, 2), (Box{{4, 0}, {2, 3}}));
  EXPECT_EQ(chunk_box({6, 3}, 1, 2, 1), (Box{{0, 2}, {6, 1}}));
  EXPECT_THROW(chunk_box({6, 3}, 2, 2, 0), tessera::Error);
  EXPECT_EQ(a.to_string(), "[0:4, 2:6]");
}

TEST(Chunk, CopyOverlapReshardsRowsToColumns) {
  at::Tensor full = at::arange(35, at::kFloat).reshape({7, 5});
  std::vector<int64_t> shape{7, 5};
  // 3 row pieces -> 2 column pieces.
  for (int j = 0; j < 2; ++j) {
    Box dst_box = chunk_box(shape, 1, 2, j);
    at::Tensor dst = at::zeros(dst_box.sizes);
    int64_t copied = 0;
    for (int i = 0; i < 3; ++i) {
      Box src_box = chunk_box(shape, 0, 3, i);
      at::Tensor src = narrow_to(full, full_box(shape), src_box).clone();
      copied += copy_overlap(dst, dst_box, src, src_box);
    }
    EXPECT_EQ(copied, dst_box.numel());
    EXPECT_TRUE(at::equal(dst, narrow_to(full, full_box(shape), dst_box)));
  }
}
