#include "tessera/sharding/spec.h"

#include <algorithm>
#include <sstream>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::sharding {

std::string Placement::to_string() const { return concat("rank:", rank, "/", device.str()); }

ChunkSpec ChunkSpec::over_ranks(int64_t dim, int world, c10::Device device) {
  TESSERA_CHECK(world >= 1, "ChunkSpec::over_ranks: world size ", world, " must be at least 1");
  ChunkSpec s;
  s.dim = dim;
  for (int r = 0; r < world; ++r) s.placements.push_back(Placement{r, device});
  return s;
}

namespace {

std::string shard_name(size_t i, const ShardMetadata& s) {
  return concat("shard ", i, " ", s.box.to_string(), " on ", s.placement.to_string());
}

// No two non-empty shards overlap. A sweep along the dimension where the shards' offsets
// differ most (the sharded one, for chunked and FSDP layouts): shards sorted by their start
// there, each compared only with the shards still open at its start, so P shards of one
// sharded dimension cost O(P log P) instead of the P^2/2 pairs (134 million for a tensor of
// 16,384 shards).
void check_no_overlap(const std::vector<ShardMetadata>& shards) {
  std::vector<size_t> order;
  for (size_t i = 0; i < shards.size(); ++i)
    if (!shards[i].box.empty()) order.push_back(i);
  if (order.size() < 2) return;
  const size_t nd = shards[order[0]].box.dim();
  auto report = [&](size_t a, size_t b) {
    const size_t i = std::min(a, b), j = std::max(a, b);
    auto ov = intersect(shards[i].box, shards[j].box);
    throw Error(concat(shard_name(j, shards[j]), " overlaps ", shard_name(i, shards[i]), " in ",
                       ov ? ov->to_string() : std::string()));
  };
  if (nd == 0) report(order[0], order[1]);  // two non-empty pieces of a scalar
  size_t dim = 0, most = 0;
  for (size_t d = 0; d < nd; ++d) {
    std::vector<int64_t> starts;
    starts.reserve(order.size());
    for (size_t i : order) starts.push_back(shards[i].box.offsets[d]);
    std::sort(starts.begin(), starts.end());
    const size_t distinct = static_cast<size_t>(std::unique(starts.begin(), starts.end()) - starts.begin());
    if (distinct > most) most = distinct, dim = d;
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return shards[a].box.offsets[dim] < shards[b].box.offsets[dim];
  });
  std::vector<size_t> open;
  for (size_t i : order) {
    const int64_t start = shards[i].box.offsets[dim];
    open.erase(std::remove_if(open.begin(), open.end(),
                              [&](size_t k) { return shards[k].box.offsets[dim] + shards[k].box.sizes[dim] <= start; }),
               open.end());
    for (size_t k : open)
      if (intersect(shards[k].box, shards[i].box)) report(k, i);
    open.push_back(i);
  }
}

}  // namespace

void validate_shards(const std::vector<ShardMetadata>& shards, const std::vector<int64_t>& shape) {
  const std::string tensor = concat("a tensor of shape ", core::shape_string(shape));
  for (auto s : shape) TESSERA_CHECK(s >= 0, "negative dimension in shape ", core::shape_string(shape));
  int64_t want = 1;
  for (auto s : shape) want *= s;
  int64_t total = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardMetadata& s = shards[i];
    TESSERA_CHECK(s.box.offsets.size() == s.box.sizes.size(), shard_name(i, s), " has ", s.box.offsets.size(),
                  " offsets but ", s.box.sizes.size(), " sizes");
    TESSERA_CHECK(s.box.dim() == shape.size(), shard_name(i, s), " has ", s.box.dim(), " dimensions but ", tensor,
                  " has ", shape.size());
    TESSERA_CHECK(s.placement.rank >= 0, shard_name(i, s), " is placed on a negative rank");
    for (size_t d = 0; d < shape.size(); ++d) {
      TESSERA_CHECK(s.box.sizes[d] >= 0 && s.box.offsets[d] >= 0, shard_name(i, s),
                    " has a negative offset or size in dimension ", d);
      TESSERA_CHECK(s.box.offsets[d] + s.box.sizes[d] <= shape[d], shard_name(i, s), " lies outside ", tensor,
                    " in dimension ", d);
    }
    total += s.box.numel();
  }
  check_no_overlap(shards);
  // No overlap, every shard inside: the volumes add up exactly iff the shards cover everything.
  TESSERA_CHECK(total == want, "shards cover ", total, " of the ", want, " elements of ", tensor,
                " (", shards.size(), " shards; the last is ",
                shards.empty() ? std::string("none") : shard_name(shards.size() - 1, shards.back()), ")");
}

std::vector<ShardMetadata> build_shards(const ShardingSpec& spec, const std::vector<int64_t>& shape) {
  std::vector<ShardMetadata> out;
  if (auto* c = std::get_if<ChunkSpec>(&spec)) {
    const int64_t nd = static_cast<int64_t>(shape.size());
    int64_t dim = c->dim < 0 ? c->dim + nd : c->dim;
    TESSERA_CHECK(dim >= 0 && dim < nd, "chunk spec dimension ", c->dim, " is outside a tensor of shape ",
                  core::shape_string(shape));
    TESSERA_CHECK(!c->placements.empty(), "chunk spec has no placements");
    const int pieces = static_cast<int>(c->placements.size());
    for (int i = 0; i < pieces; ++i) out.push_back(ShardMetadata{chunk_box(shape, dim, pieces, i), c->placements[i]});
  } else {
    out = std::get<EnumerableSpec>(spec).shards;
  }
  validate_shards(out, shape);
  return out;
}

std::string to_string(const ShardingSpec& spec) {
  std::ostringstream os;
  if (auto* c = std::get_if<ChunkSpec>(&spec)) {
    os << "chunk(dim=" << c->dim << ", [";
    for (size_t i = 0; i < c->placements.size(); ++i) os << (i ? ", " : "") << c->placements[i].to_string();
    os << "])";
  } else {
    const auto& e = std::get<EnumerableSpec>(spec);
    os << "enumerable([";
    for (size_t i = 0; i < e.shards.size(); ++i)
      os << (i ? ", " : "") << e.shards[i].box.to_string() << "@" << e.shards[i].placement.to_string();
    os << "])";
  }
  return os.str();
}

}  // namespace tessera::sharding
