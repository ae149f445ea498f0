#include "tessera/checkpoint/save_plan.h"

#include <algorithm>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

GroupPlacement group_placement(const std::vector<int64_t>& saving_ranks, int64_t world, const std::string& fqn) {
  const int64_t S = static_cast<int64_t>(saving_ranks.size());
  bool block = S >= 1 && world % S == 0 && saving_ranks[0] % S == 0;
  for (int64_t p = 0; block && p < S; ++p) block = saving_ranks[static_cast<size_t>(p)] == saving_ranks[0] + p;
  if (block) return {S, saving_ranks[0] / S, world / S, false};
  // Strided: rank q at base + q·(world / S), base below the stride.
  const int64_t stride = S >= 1 && world % S == 0 ? world / S : 0;
  bool strided = stride > 1 && saving_ranks[0] < stride;
  for (int64_t p = 0; strided && p < S; ++p)
    strided = saving_ranks[static_cast<size_t>(p)] == saving_ranks[0] + p * stride;
  if (!strided) {
    std::string ranks;
    for (int64_t p = 0; p < S && p < 8; ++p) ranks += concat(p ? ", " : "", saving_ranks[static_cast<size_t>(p)]);
    if (S > 8) ranks += ", ...";
    throw Error(concat("cannot save key '", fqn, "' sharded: it lives on ranks [", ranks, "] of the ", world,
                       " saving ranks, which are not one of ", S > 0 ? world / S : 0,
                       " aligned blocks of consecutive ranks, nor one of that many strided groups (the ",
                       "layouts a sharded checkpoint can record); save it with SaveMode::Full"));
  }
  return {S, saving_ranks[0], stride, true};
}

namespace {

// torch.chunk's rule along some dimension, shard i on rank i, when the shards follow it.
std::optional<sharding::Layout> infer_chunk(const std::vector<int64_t>& shape,
                                            const std::vector<sharding::ShardMetadata>& shards) {
  const int64_t P = static_cast<int64_t>(shards.size());
  if (P < 1 || P > sharding::kMaxPieces) return std::nullopt;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    bool ok = true;
    for (int64_t i = 0; ok && i < P; ++i) {
      const auto& s = shards[static_cast<size_t>(i)];
      ok = s.placement.rank == i && s.box == sharding::chunk_box(shape, d, static_cast<int>(P), static_cast<int>(i));
    }
    if (ok) return sharding::Layout::chunk(d, P);
  }
  return std::nullopt;
}

}  // namespace

int64_t hybrid_shift(int64_t key_index, const GroupPlacement& group) {
  if (group.replicas <= 1) return 0;
  return key_index % std::min(kHybridSpread, group.replicas);
}

SavedLayout plan_saved_layout(const std::string& fqn, const std::vector<int64_t>& shape,
                              const std::vector<sharding::ShardMetadata>& shards,
                              const std::optional<sharding::Layout>& hint, const GroupPlacement& group, int64_t world,
                              int64_t rank, int64_t key_index) {
  SavedLayout out;
  std::optional<sharding::Layout> rule = hint ? hint : infer_chunk(shape, shards);
  const int64_t R = group.replicas, S = group.size;
  if (rule) {
    sharding::Layout L = *rule;
    L.files = sharding::FileMap{};
    if (R > 1) {
      L.files.replicas = R;
      if (group.interleaved) {  // the groups' ranks interleave: holder q of group g is g + q·R
        L.files.step = R;
        L.files.replica_step = 1;
      } else {
        L.files.replica_step = S;
      }
      L.files.shift = hybrid_shift(key_index, group);
    }
    L.validate(shape, world, concat("key '", fqn, "'"));
    // The pieces stored in this rank's file: its holder's (a Tp layout's holder holds one
    // per stripe), if its group stores them.
    const int64_t q = group.index_of(rank), per = L.pieces_per_holder();
    if (q < L.holders() && L.files.file(q) == rank) {
      for (int64_t i = q * per; i < (q + 1) * per; ++i)
        if (!L.box(shape, i).empty()) out.mine.push_back(i);
    }
    out.layout = std::move(L);
    return out;
  }
  sharding::Layout L;
  L.rule = sharding::Layout::Rule::List;
  for (size_t i = 0; i < shards.size(); ++i) {
    const int64_t p = shards[i].placement.rank;
    TESSERA_CHECK(p >= 0 && p < S, "key '", fqn, "': shard ", i, " is on rank ", p, " of a communicator of ", S);
    // A list names only stored pieces: an empty shard is in no data file.
    if (shards[i].box.empty()) continue;
    const int64_t g = R > 1 ? (static_cast<int64_t>(i) + hybrid_shift(key_index, group)) % R : group.group;
    if (group.saving_rank(g, p) == rank) out.mine.push_back(static_cast<int64_t>(L.list.size()));
    L.list.push_back({group.saving_rank(g, p), shards[i].box});
  }
  L.validate(shape, world, concat("key '", fqn, "'"));
  out.layout = std::move(L);
  return out;
}

}  // namespace tessera::checkpoint
