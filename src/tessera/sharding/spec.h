// Where the pieces of a sharded tensor live. A ShardMetadata is one piece: its box
// in the global tensor and its placement (rank + device). A sharding spec produces
// the list of pieces for a global shape:
//  - ChunkSpec: one dimension split by torch.chunk's rule over an ordered list of
//    placements (trailing placements may receive empty pieces);
//  - EnumerableSpec: an explicit list of pieces, validated (same rank as the tensor,
//    inside it, no overlap, volumes adding up exactly).
#pragma once
#include <c10/core/Device.h>

#include <string>
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

std::string to_string(const ShardingSpec& spec);

}  // namespace tessera::sharding
