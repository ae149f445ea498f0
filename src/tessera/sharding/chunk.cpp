#include "tessera/sharding/chunk.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

#include "tessera/core/error.h"

namespace tessera::sharding {

int64_t chunk_split(int64_t n, int pieces) {
  TESSERA_CHECK(pieces >= 1, "cannot split into ", pieces, " pieces");
  TESSERA_CHECK(n >= 0, "cannot split a negative size ", n);
  return (n + pieces - 1) / pieces;
}

Range chunk_range(int64_t n, int pieces, int index) {
  TESSERA_CHECK(index >= 0 && index < pieces, "piece ", index, " is outside [0, ", pieces, ")");
  const int64_t split = chunk_split(n, pieces);
  const int64_t begin = std::min(n, split * index);
  const int64_t end = std::min(n, split * (index + 1));
  return {begin, end - begin};
}

std::vector<int64_t> chunk_sizes(int64_t n, int pieces) {
  std::vector<int64_t> s(pieces);
  for (int i = 0; i < pieces; ++i) s[i] = chunk_range(n, pieces, i).size;
  return s;
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (auto s : sizes) n *= s;
  return n;
}

std::string Box::to_string() const {
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (d) os << ", ";
    os << offsets[d] << ":" << offsets[d] + sizes[d];
  }
  os << "]";
  return os.str();
}

Box full_box(const std::vector<int64_t>& shape) { return Box{std::vector<int64_t>(shape.size(), 0), shape}; }

Box chunk_box(const std::vector<int64_t>& shape, int64_t dim, int pieces, int index) {
  TESSERA_CHECK(dim >= 0 && dim < static_cast<int64_t>(shape.size()), "chunk dimension ", dim,
                " is outside a tensor of ", shape.size(), " dimensions");
  Box b = full_box(shape);
  Range r = chunk_range(shape[dim], pieces, index);
  b.offsets[dim] = r.begin;
  b.sizes[dim] = r.size;
  return b;
}

bool contains(const Box& outer, const Box& inner) {
  if (outer.dim() != inner.dim()) return false;
  if (inner.empty()) return true;
  for (size_t d = 0; d < outer.dim(); ++d) {
    if (inner.offsets[d] < outer.offsets[d]) return false;
    if (inner.offsets[d] + inner.sizes[d] > outer.offsets[d] + outer.sizes[d]) return false;
  }
  return true;
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  TESSERA_CHECK(a.dim() == b.dim(), "intersect: boxes of rank ", a.dim(), " and ", b.dim());
  Box r;
  for (size_t d = 0; d < a.dim(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (hi <= lo) return std::nullopt;
    r.offsets.push_back(lo);
    r.sizes.push_back(hi - lo);
  }
  if (a.dim() == 0 && (a.empty() || b.empty())) return std::nullopt;
  return r;
}

at::Tensor narrow_to(const at::Tensor& t, const Box& holder, const Box& sub) {
  TESSERA_CHECK(static_cast<size_t>(t.dim()) == holder.dim(), "narrow_to: tensor of rank ", t.dim(),
                " holds a box of rank ", holder.dim());
  TESSERA_CHECK(contains(holder, sub), "narrow_to: box ", sub.to_string(), " is not inside ",
                holder.to_string());
  at::Tensor v = t;
  for (size_t d = 0; d < sub.dim(); ++d) {
    v = v.narrow(static_cast<int64_t>(d), sub.offsets[d] - holder.offsets[d], sub.sizes[d]);
  }
  return v;
}

int64_t copy_overlap(at::Tensor& dst, const Box& dst_box, const at::Tensor& src, const Box& src_box) {
  auto ov = intersect(dst_box, src_box);
  if (!ov) return 0;
  narrow_to(dst, dst_box, *ov).copy_(narrow_to(src, src_box, *ov));
  return ov->numel();
}

}  // namespace tessera::sharding
