// What a format-2 sharded save records and writes, computed by every rank alone from
// what it already knows (docs/checkpoint-format.md §3): the layout of each sharded tensor
// with its pieces mapped to data files, and the pieces this rank stores. No list of
// chunks crosses the network; the ranks only compare a digest of the result (save.cpp).
// Pure functions over plain descriptions, so the scale harness (bench/scale) runs the
// same planning for any number of virtual ranks.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/sharding/layout.h"
#include "tessera/sharding/spec.h"

namespace tessera::checkpoint {

// Where the ranks of a tensor's communicator sit among the saving ranks: group `group`
// of `replicas` blocks of `size` consecutive saving ranks (one block, replicas 1, when the
// tensor lives on the saving communicator itself; HYBRID_SHARD's shard groups otherwise),
// or, `interleaved`, group `group` of `replicas` strided groups whose rank q is saving rank
// group + q·replicas (the data-parallel groups of a (dp, tp) mesh: one per tp rank, each
// holding the replicated parameters). The groups hold the same tensor: one of them stores
// each piece.
struct GroupPlacement {
  int64_t size = 1, group = 0, replicas = 1;
  bool interleaved = false;
  // The saving rank of rank q of group g, and a saving rank's q in its group.
  int64_t saving_rank(int64_t g, int64_t q) const { return interleaved ? g + q * replicas : g * size + q; }
  int64_t index_of(int64_t rank) const { return interleaved ? rank / replicas : rank % size; }
};
// From the saving rank of each rank of the tensor's communicator (in its rank order).
// Throws tessera::Error naming `fqn` when they are neither kind of group.
GroupPlacement group_placement(const std::vector<int64_t>& saving_ranks, int64_t world, const std::string& fqn);

// Replica groups (HYBRID_SHARD): which group stores piece i of the entry at `key_index` is
// (i + shift) mod replicas, shift = key_index mod min(kHybridSpread, replicas). A rank
// resuming at the same layout (shard position p) thus reads its pieces from at most
// kHybridSpread data files whatever the world size, and up to kHybridSpread * size ranks
// share the writing (every rank of small worlds; 512 ranks with 8-rank shard groups). A
// shift of key_index mod replicas spread the writing over every rank but sent a resuming
// rank to 816 files at 16,384 ranks (Llama-3-70B, bench/scale).
constexpr int64_t kHybridSpread = 64;
int64_t hybrid_shift(int64_t key_index, const GroupPlacement& group);

struct SavedLayout {
  sharding::Layout layout;    // files are saving ranks
  std::vector<int64_t> mine;  // the non-empty pieces saving rank `rank` stores
};
// The layout recorded for a sharded tensor of `shape` whose shards (in the tensor's
// communicator's ranks) are `shards`, following `hint` when given (holder q = rank q
// holds its pieces, as ShardedTensor::from_parts and from_rule check); else torch.chunk's rule when the shards
// follow it, else an explicit list. With several replica groups, group
// (i + hybrid_shift(key_index)) mod replicas stores piece i. O(1) with a hint and a
// step-1 map, O(shards) otherwise.
SavedLayout plan_saved_layout(const std::string& fqn, const std::vector<int64_t>& shape,
                              const std::vector<sharding::ShardMetadata>& shards,
                              const std::optional<sharding::Layout>& hint, const GroupPlacement& group, int64_t world,
                              int64_t rank, int64_t key_index);

}  // namespace tessera::checkpoint
