// Where the pieces of a sharded tensor live. A ShardMetadata is one piece: its box
// in the global tensor and its placement (rank + device). A sharding spec produces
// the list of pieces for a global shape:
//  - ChunkSpec: one dimension split by torch.chunk's rule over an ordered list of
//    placements (trailing placements may receive empty pieces);
//  - EnumerableSpec: an explicit list of pieces, validated (same rank as the tensor,
//    inside it, no overlap, volumes adding up exactly).
#pragma once
#include <c10/core/Device.h>

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "tessera/sharding/chunk.h"

namespace tessera::sharding {

struct Placement {
  int rank = 0;                  // rank in the communicator the tensor lives on
  c10::Device device = c10::kCPU;
  bool operator==(const Placement& o) const { return rank == o.rank && device == o.device; }
  std::string to_string() const;  // "rank:1/cpu"
};

struct ShardMetadata {
  Box box;  // offsets and sizes in the global tensor
  Placement placement;
  bool operator==(const ShardMetadata& o) const { return box == o.box && placement == o.placement; }
};

struct ChunkSpec {
  int64_t dim = 0;
  std::vector<Placement> placements;  // piece i goes to placements[i]
  // Chunk along `dim` over ranks 0..world-1 on `device`.
  static ChunkSpec over_ranks(int64_t dim, int world, c10::Device device = c10::kCPU);
};

struct EnumerableSpec {
  std::vector<ShardMetadata> shards;
};

using ShardingSpec = std::variant<ChunkSpec, EnumerableSpec>;

// The pieces `spec` makes of a tensor of `shape`, validated. Throws tessera::Error
// naming the offending shard (by index and box) when the spec does not tile `shape`.
std::vector<ShardMetadata> build_shards(const ShardingSpec& spec, const std::vector<int64_t>& shape);

// Validates that `shards` tile `shape` exactly (rank, bounds, overlap, volume).
void validate_shards(const std::vector<ShardMetadata>& shards, const std::vector<int64_t>& shape);

// The first two non-empty boxes among box(0) … box(count - 1) that overlap, as (i, j) with
// i < j, in the order a box-by-box check meets them (the smallest j that overlaps an earlier
// box, then the smallest such i); nullopt when no two overlap. Every box must be well formed
// (as many offsets as sizes, none negative) and of the rank of the others (throws otherwise);
// ends are computed in 128 bits, so no offset + size wraps. The one overlap check of
// validate_shards, Layout::validate (list layouts) and the checkpoint metadata's chunks.
// A sweep along the dimension whose offsets differ most: each box is compared only with the
// boxes still open at its start there, kept ordered along a second dimension, so boxes of one
// or two dimensions (any split, grids included) cost O(P log P), not P^2/2 pairs (134 million
// at 16,384 pieces). Naming the first pair when there is one takes O(log P) more sweeps.
std::optional<std::pair<size_t, size_t>> first_overlap(size_t count, const std::function<const Box&(size_t)>& box);

std::string to_string(const ShardingSpec& spec);

}  // namespace tessera::sharding
