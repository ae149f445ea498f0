#include "tessera/sharding/spec.h"

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
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].box.empty()) continue;
    for (size_t j = i + 1; j < shards.size(); ++j) {
      if (shards[j].box.empty()) continue;
      auto ov = intersect(shards[i].box, shards[j].box);
      TESSERA_CHECK(!ov, shard_name(j, shards[j]), " overlaps ", shard_name(i, shards[i]), " in ",
                    ov ? ov->to_string() : std::string());
    }
  }
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
