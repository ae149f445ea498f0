// What the Communicator's front (communicator.cpp) and its c10d routes (c10d_routes.h)
// share: how a collective is named in its errors (GroupPlace), and the arithmetic of
// dim-0 pieces and of Avg. Internal to the distributed layer.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <exception>
#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"
#include "tessera/distributed/types.h"

namespace tessera::distributed {

// Where a group sits in the world, for error messages.
struct GroupPlace {
  int world_rank = 0, world_size = 1;  // this process in the world
  int rank = 0, size = 1;              // this process in the group

  // "all_gather (Float [4, 2]) on rank 1 (group rank 0 of 2) of world size 4".
  std::string where(const char* what, const at::Tensor& t) const {
    return concat(what, " (", t.scalar_type(), " ", t.sizes(), ") on rank ", world_rank,
                  size != world_size ? concat(" (group rank ", rank, " of ", size, ")") : std::string(),
                  " of world size ", world_size);
  }

  // Runs `f`, turning any exception into a CommError that names the collective.
  template <typename F>
  auto guarded(const char* what, const at::Tensor& t, F&& f) const -> decltype(f()) {
    try {
      return f();
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      std::string msg = e.what();
      auto nl = msg.find("\nException raised from");
      if (nl != std::string::npos) msg = msg.substr(0, nl);
      throw CommError(concat(where(what, t), " failed: ", msg));
    }
  }
};

// The shape of `t` with dim 0 set to `dim0`.
inline std::vector<int64_t> rest_shape(const at::Tensor& t, int64_t dim0) {
  std::vector<int64_t> s = t.sizes().vec();
  s[0] = dim0;
  return s;
}

// How per-rank dim-0 pieces of `sizes` rows lie end to end.
struct Pieces {
  explicit Pieces(const std::vector<int64_t>& sizes)
      : off(core::exclusive_offsets(sizes)),
        maxs(sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end())),
        even(std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == maxs; })) {}
  std::vector<int64_t> off;  // where each piece starts, the total at the back
  int64_t maxs;              // the largest piece
  bool even;                 // all pieces of one size
};

// Per-rank element counts of dim-0 pieces whose rows hold `row` elements each.
inline std::vector<int64_t> element_counts(const std::vector<int64_t>& sizes, int64_t row) {
  std::vector<int64_t> counts(sizes.size());
  for (size_t r = 0; r < sizes.size(); ++r) counts[r] = sizes[r] * row;
  return counts;
}

// Avg is reduced as Sum on every transport; this divides the sum by the group size
// (floor division for integer tensors). Other ops: nothing to do.
inline void finish_avg(at::Tensor& t, ReduceOp op, int n) {
  if (op != ReduceOp::Avg || n == 1) return;
  if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
    t.div_(n);
  } else {
    t.copy_(at::div(t, n, "floor"));
  }
}

}  // namespace tessera::distributed
