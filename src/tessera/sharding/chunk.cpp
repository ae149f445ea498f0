#include "tessera/sharding/chunk.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <sstream>

#include "tessera/core/error.h"

namespace tessera::sharding {

namespace {

// Box arithmetic is done in 128 bits: offset + size of any two int64 values fits, so an
// offset near 2^63 - 1 (a tampered checkpoint) cannot wrap into a box that seems to lie
// inside a tensor.
using Wide = __int128;
constexpr Wide kInt64Max = std::numeric_limits<int64_t>::max();

Wide end_of(const Box& b, size_t d) { return static_cast<Wide>(b.offsets[d]) + b.sizes[d]; }

// As many offsets as sizes, none of them negative.
bool well_formed(const Box& b) {
  if (b.offsets.size() != b.sizes.size()) return false;
  for (size_t d = 0; d < b.sizes.size(); ++d)
    if (b.offsets[d] < 0 || b.sizes[d] < 0) return false;
  return true;
}

}  // namespace

int64_t chunk_split(int64_t n, int pieces) {
  TESSERA_CHECK(pieces >= 1, "cannot split into ", pieces, " pieces");
  TESSERA_CHECK(n >= 0, "cannot split a negative size ", n);
  return n / pieces + (n % pieces != 0 ? 1 : 0);  // ceil(n / pieces), without n + pieces - 1 wrapping
}

Range chunk_range(int64_t n, int pieces, int index) {
  TESSERA_CHECK(index >= 0 && index < pieces, "piece ", index, " is outside [0, ", pieces, ")");
  const Wide split = chunk_split(n, pieces);  // wide: split * (index + 1) may pass 2^63 - 1
  const int64_t begin = static_cast<int64_t>(std::min<Wide>(n, split * index));
  const int64_t end = static_cast<int64_t>(std::min<Wide>(n, split * (index + 1)));
  return {begin, end - begin};
}

std::vector<int64_t> chunk_sizes(int64_t n, int pieces) {
  std::vector<int64_t> s(pieces);
  for (int i = 0; i < pieces; ++i) s[i] = chunk_range(n, pieces, i).size;
  return s;
}

int64_t Box::numel() const {
  for (auto s : sizes)
    if (s == 0) return 0;
  Wide n = 1;
  for (auto s : sizes) {
    TESSERA_CHECK(s > 0, "box ", to_string(), " has a negative size");
    n *= s;  // |n| <= 2^63 * 2^63 before the check below stops the loop
    TESSERA_CHECK(n <= kInt64Max, "box ", to_string(), " has more than 2^63 - 1 elements");
  }
  return static_cast<int64_t>(n);
}

std::string Box::to_string() const {
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < sizes.size() && d < offsets.size(); ++d) {
    if (d) os << ", ";
    const Wide end = static_cast<Wide>(offsets[d]) + sizes[d];
    os << offsets[d] << ":";
    if (end >= std::numeric_limits<int64_t>::min() && end <= kInt64Max) {
      os << static_cast<int64_t>(end);
    } else {
      os << offsets[d] << "+" << sizes[d];  // past the int64 range: the parts as given
    }
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
  if (outer.dim() != inner.dim() || !well_formed(outer) || !well_formed(inner)) return false;
  if (inner.empty()) return true;
  for (size_t d = 0; d < outer.dim(); ++d) {
    if (inner.offsets[d] < outer.offsets[d]) return false;
    if (end_of(inner, d) > end_of(outer, d)) return false;
  }
  return true;
}

bool inside_shape(const std::vector<int64_t>& shape, const Box& b) {
  if (b.dim() != shape.size() || !well_formed(b)) return false;
  for (size_t d = 0; d < b.dim(); ++d)
    if (b.offsets[d] < 0 || end_of(b, d) > shape[d]) return false;
  return true;
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  TESSERA_CHECK(a.dim() == b.dim(), "intersect: boxes of rank ", a.dim(), " and ", b.dim());
  TESSERA_CHECK(well_formed(a) && well_formed(b), "intersect: malformed box ", well_formed(a) ? b.to_string() : a.to_string());
  Box r;
  for (size_t d = 0; d < a.dim(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const Wide hi = std::min(end_of(a, d), end_of(b, d));
    if (hi <= lo) return std::nullopt;
    TESSERA_CHECK(hi <= kInt64Max, "intersect: boxes ", a.to_string(), " and ", b.to_string(),
                  " overlap past index 2^63 - 1");
    r.offsets.push_back(lo);
    r.sizes.push_back(static_cast<int64_t>(hi - lo));
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
