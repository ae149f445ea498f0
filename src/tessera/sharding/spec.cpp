#include "tessera/sharding/spec.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <queue>
#include <set>
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

using Wide = __int128;

Wide end_at(const Box& b, size_t d) { return static_cast<Wide>(b.offsets[d]) + b.sizes[d]; }

// Two well-formed boxes of the same rank share an element (a 0-dimensional box is one element).
bool overlaps(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.dim(); ++d)
    if (std::max(a.offsets[d], b.offsets[d]) >= std::min(end_at(a, d), end_at(b, d))) return false;
  return true;
}

using BoxAt = std::function<const Box&(size_t)>;
using Pair = std::pair<size_t, size_t>;

// first_overlap's sweep along `dim` over `items` (the non-empty boxes sorted by their offset
// along `dim`, then index). The open boxes (started at or before the current start along
// `dim`, not yet ended) all contain that start, so no two of them overlap elsewhere (else the
// sweep would have stopped). They are kept in `open` by their offset along `dim2`, and a box is
// compared with those starting before its end there, the last first, down to the ones that
// must end before its start (starting `longest2`, the largest size along `dim2`, or more before
// it). Of two dimensions the open boxes are disjoint along `dim2`, so only the last of them
// can overlap it; of one, dim2 == dim and at most one box is open.
struct Sweep {
  struct Item {
    int64_t start, start2;  // offsets along dim and dim2
    Wide end, end2;
    size_t index;
  };
  explicit Sweep(const BoxAt& at) : box(at) {}
  const BoxAt& box;
  std::vector<Item> items;
  size_t nd = 0, dim = 0, dim2 = 0;
  int64_t longest2 = 0;

  // Some pair of the boxes below `limit` that overlaps (by index, the earlier first), or nullopt.
  std::optional<Pair> run(size_t limit) const {
    using Closing = std::pair<Wide, size_t>;  // (end along dim, position in items)
    std::priority_queue<Closing, std::vector<Closing>, std::greater<Closing>> closing;
    std::set<std::pair<int64_t, size_t>> open;  // (offset along dim2, position in items)
    for (size_t p = 0; p < items.size(); ++p) {
      const Item& b = items[p];
      if (b.index >= limit) continue;
      while (!closing.empty() && closing.top().first <= b.start) {
        const size_t k = closing.top().second;
        closing.pop();
        open.erase({items[k].start2, k});
      }
      auto it = b.end2 > std::numeric_limits<int64_t>::max()
                    ? open.end()
                    : open.lower_bound({static_cast<int64_t>(b.end2), size_t{0}});
      while (it != open.begin()) {
        --it;
        const Item& o = items[it->second];
        if (static_cast<Wide>(o.start2) + longest2 <= b.start2) break;
        // Both contain b.start along dim: of two dimensions, overlapping along dim2 is overlapping.
        if (o.end2 > b.start2 && (nd <= 2 || overlaps(box(o.index), box(b.index))))
          return Pair{std::min(o.index, b.index), std::max(o.index, b.index)};
        if (nd <= 2) break;
      }
      open.emplace(b.start2, p);
      closing.emplace(b.end, p);
    }
    return std::nullopt;
  }
};

}  // namespace

std::optional<std::pair<size_t, size_t>> first_overlap(size_t count, const BoxAt& box) {
  if (count == 0) return std::nullopt;
  Sweep sweep(box);
  const size_t nd = sweep.nd = box(0).dim();
  std::vector<size_t> order;  // the non-empty boxes
  for (size_t i = 0; i < count; ++i) {
    const Box& b = box(i);
    TESSERA_CHECK(b.offsets.size() == nd && b.sizes.size() == nd, "first_overlap: box ", i, " ", b.to_string(),
                  " does not have the rank ", nd, " of box 0");
    for (size_t d = 0; d < nd; ++d)
      TESSERA_CHECK(b.offsets[d] >= 0 && b.sizes[d] >= 0, "first_overlap: box ", i, " ", b.to_string(),
                    " has a negative offset or size");
    if (!b.empty()) order.push_back(i);
  }
  if (order.size() < 2) return std::nullopt;
  if (nd == 0) return Pair{order[0], order[1]};  // two non-empty pieces of a scalar
  // The dimensions with the most distinct offsets: the sweep's, and the open boxes' order.
  std::vector<size_t> distinct(nd);
  for (size_t d = 0; d < nd; ++d) {
    std::vector<int64_t> starts;
    starts.reserve(order.size());
    for (size_t i : order) starts.push_back(box(i).offsets[d]);
    std::sort(starts.begin(), starts.end());
    distinct[d] = static_cast<size_t>(std::unique(starts.begin(), starts.end()) - starts.begin());
  }
  size_t dim = 0;
  for (size_t d = 1; d < nd; ++d)
    if (distinct[d] > distinct[dim]) dim = d;
  size_t dim2 = dim;
  for (size_t d = 0; d < nd; ++d)
    if (d != dim && (dim2 == dim || distinct[d] > distinct[dim2])) dim2 = d;
  sweep.dim = dim;
  sweep.dim2 = dim2;
  sweep.items.reserve(order.size());
  for (size_t i : order) {
    const Box& b = box(i);
    sweep.items.push_back({b.offsets[dim], b.offsets[dim2], end_at(b, dim), end_at(b, dim2), i});
    sweep.longest2 = std::max(sweep.longest2, b.sizes[dim2]);
  }
  std::sort(sweep.items.begin(), sweep.items.end(), [](const Sweep::Item& a, const Sweep::Item& b) {
    return a.start != b.start ? a.start < b.start : a.index < b.index;
  });
  const std::optional<Pair> any = sweep.run(count);
  if (!any) return std::nullopt;
  // The smallest `bad` such that boxes below it overlap: boxes below `good` do not, boxes
  // below `bad` do. Sweeps over growing prefixes, then bisection; a sweep that finds a pair
  // lowers `bad` to just past that pair's later box.
  size_t good = 1, bad = any->second + 1;
  auto probe = [&](size_t limit) {
    const std::optional<Pair> p = sweep.run(limit);
    if (p) bad = p->second + 1;
    else good = limit;
    return p.has_value();
  };
  while (good * 2 < bad && !probe(good * 2)) {
  }
  while (good + 1 < bad) probe(good + (bad - good) / 2);
  const size_t j = bad - 1;  // overlaps an earlier box; no two boxes before it overlap
  const Box& bj = box(j);
  for (size_t i = 0; i < j; ++i)
    if (!box(i).empty() && overlaps(box(i), bj)) return Pair{i, j};
  throw Error(concat("first_overlap: box ", j, " ", bj.to_string(), " overlaps no earlier box (internal error)"));
}

namespace {

// No two non-empty shards overlap (first_overlap), else the error names the first two.
void check_no_overlap(const std::vector<ShardMetadata>& shards) {
  const auto p = first_overlap(shards.size(), [&](size_t i) -> const Box& { return shards[i].box; });
  if (!p) return;
  const auto [i, j] = *p;
  auto ov = intersect(shards[i].box, shards[j].box);
  throw Error(concat(shard_name(j, shards[j]), " overlaps ", shard_name(i, shards[i]), " in ",
                     ov ? ov->to_string() : std::string()));
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
      // offset + size <= dim, without the sum (which could wrap).
      TESSERA_CHECK(s.box.offsets[d] <= shape[d] && s.box.sizes[d] <= shape[d] - s.box.offsets[d], shard_name(i, s),
                    " lies outside ", tensor, " in dimension ", d);
    }
  }
  check_no_overlap(shards);
  // Disjoint boxes inside the shape: their volumes add up to at most the shape's.
  for (const auto& s : shards) total += s.box.numel();
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
