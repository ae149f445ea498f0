// Chunk arithmetic shared by ShardedTensor, FSDP and checkpoint resharding: how a
// dimension is split across ranks, boxes (offsets + sizes) in a global tensor, and
// copying the overlap of two boxes. Zero-size pieces are ordinary values here.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessera::sharding {

// torch.chunk's rule: every piece has ceil(n / pieces) elements except the last
// non-empty one; trailing pieces may be empty (6 over 4: 2, 2, 2, 0).
int64_t chunk_split(int64_t n, int pieces);
std::vector<int64_t> chunk_sizes(int64_t n, int pieces);
// [begin, begin + size) of piece `index` (size may be 0; begin is then clamped to n).
struct Range {
  int64_t begin = 0;
  int64_t size = 0;
};
Range chunk_range(int64_t n, int pieces, int index);

// A box in a tensor of some global shape: one (offset, size) per dimension.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  // The product of the sizes; throws when it does not fit in int64 (or a size is negative).
  int64_t numel() const;
  // Some size is 0 (never throws).
  bool empty() const {
    for (auto s : sizes)
      if (s == 0) return true;
    return false;
  }
  size_t dim() const { return sizes.size(); }
  bool operator==(const Box& o) const { return offsets == o.offsets && sizes == o.sizes; }
  bool operator!=(const Box& o) const { return !(*this == o); }
  std::string to_string() const;  // "[0:2, 4:8]"
};

Box full_box(const std::vector<int64_t>& shape);
// The box of piece `index` when `shape` is chunked along `dim` into `pieces`.
Box chunk_box(const std::vector<int64_t>& shape, int64_t dim, int pieces, int index);
// Whether `inner` lies inside `outer` (an empty box lies inside anything of its rank).
// Boxes with negative offsets or sizes lie inside nothing. No arithmetic wraps.
bool contains(const Box& outer, const Box& inner);
// Whether `b` lies inside a tensor of `shape`: same rank, and 0 <= offset and
// offset + size <= shape in every dimension, empty boxes included. No arithmetic wraps.
bool inside_shape(const std::vector<int64_t>& shape, const Box& b);
// The overlap of two boxes of the same rank; nullopt when it is empty. Throws for a
// malformed box (negative offsets or sizes) or an overlap that reaches past 2^63 - 1.
std::optional<Box> intersect(const Box& a, const Box& b);

// The part of `t` (which holds the elements of box `holder`) that covers `sub`
// (which must lie inside `holder`): a view, no copy.
at::Tensor narrow_to(const at::Tensor& t, const Box& holder, const Box& sub);
// Copies the overlap of `src` (holding box `src_box`) into `dst` (holding `dst_box`).
// Returns the number of elements copied.
int64_t copy_overlap(at::Tensor& dst, const Box& dst_box, const at::Tensor& src, const Box& src_box);

}  // namespace tessera::sharding
