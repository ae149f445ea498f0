// Sharding specs and ShardedTensor: validation errors, single-process behaviour, and
// round trips with real rank processes at world sizes 1..4.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <limits>
#include <optional>
#include <random>
#include <utility>

#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/sharding/sharded_tensor.h"

using namespace tessera;
using namespace tessera::sharding;
using tessera::testing::run_ranks;

using namespace tessera::testing;

namespace {

std::shared_ptr<distributed::Communicator> solo() { return distributed::Communicator::create(distributed::World{}); }

ShardMetadata shard(std::vector<int64_t> off, std::vector<int64_t> size, int rank = 0) {
  return ShardMetadata{Box{std::move(off), std::move(size)}, Placement{rank}};
}


bool bits_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  auto as = c10::elementSize(a.scalar_type()) == 2 ? at::kShort : at::kInt;
  return at::equal(a.contiguous().view(as), b.contiguous().view(as));
}


}  // namespace

TEST(ShardingSpec, ChunkOverRanksFollowsTorchChunk) {
  auto shards = build_shards(ChunkSpec::over_ranks(0, 4), {6, 3});
  ASSERT_EQ(shards.size(), 4u);
  std::vector<int64_t> rows;
  for (auto& s : shards) rows.push_back(s.box.sizes[0]);
  EXPECT_EQ(rows, (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(shards[3].box.offsets[0], 6);
  EXPECT_EQ(shards[2].placement.rank, 2);
  auto cols = build_shards(ChunkSpec::over_ranks(-1, 2), {6, 3});
  EXPECT_EQ(cols[1].box, (Box{{0, 2}, {6, 1}}));
  EXPECT_EQ(to_string(ShardingSpec(ChunkSpec::over_ranks(1, 2))), "chunk(dim=1, [rank:0/cpu, rank:1/cpu])");
  EXPECT_EQ(Placement{3}.to_string(), "rank:3/cpu");
}

TEST(ShardingSpec, ValidationErrorsNameTheShard) {
  EXPECT_CONTAINS(error_of([] { build_shards(ChunkSpec::over_ranks(2, 2), {4, 4}); }), "dimension 2");
  EXPECT_CONTAINS(error_of([] { build_shards(ChunkSpec{0, {}}, {4}); }), "no placements");
  EXPECT_THROW(ChunkSpec::over_ranks(0, 0), Error);
  // Wrong rank.
  EXPECT_CONTAINS(error_of([] { validate_shards({shard({0, 0}, {2, 4}), shard({2}, {2})}, {4, 4}); }),
                  "shard 1 [2:4] on rank:0/cpu has 1 dimensions");
  // Outside.
  EXPECT_CONTAINS(error_of([] { validate_shards({shard({0, 0}, {2, 4}), shard({2, 1}, {2, 4})}, {4, 4}); }),
                  "shard 1 [2:4, 1:5] on rank:0/cpu lies outside");
  // Overlap.
  EXPECT_CONTAINS(
      error_of([] { validate_shards({shard({0, 0}, {2, 4}), shard({2, 0}, {2, 2}), shard({1, 2}, {3, 2}, 1)}, {4, 4}); }),
      "shard 2 [1:4, 2:4] on rank:1/cpu overlaps shard 0 [0:2, 0:4] on rank:0/cpu in [1:2, 2:4]");
  // Gap.
  EXPECT_CONTAINS(error_of([] { validate_shards({shard({0, 0}, {2, 4}), shard({2, 0}, {2, 3})}, {4, 4}); }),
                  "shards cover 14 of the 16 elements");
  // Overlaps found whatever the dimension the shards split: the sweep runs along the one
  // whose offsets differ most, comparing a shard only with those still open there.
  EXPECT_CONTAINS(error_of([] { validate_shards({shard({0, 0}, {4, 2}), shard({0, 2}, {4, 2}), shard({3, 1}, {1, 2}, 2)},
                                                {4, 4}); }),
                  "shard 2 [3:4, 1:3] on rank:2/cpu overlaps shard 0 [0:4, 0:2] on rank:0/cpu in [3:4, 1:2]");
  EXPECT_CONTAINS(error_of([] { validate_shards({shard({}, {}), shard({}, {}, 1)}, {}); }), "shard 1 [] on rank:1/cpu overlaps");
  // Negative.
  EXPECT_CONTAINS(error_of([] { validate_shards({shard({-1, 0}, {2, 4})}, {4, 4}); }), "shard 0 [-1:1, 0:4]");
  // Empty shards anywhere are fine, also on a zero-size tensor.
  EXPECT_NO_THROW(validate_shards({shard({0, 0}, {4, 4}), shard({4, 0}, {0, 4}, 1), shard({0, 0}, {0, 0}, 2)}, {4, 4}));
  EXPECT_NO_THROW(build_shards(ChunkSpec::over_ranks(0, 3), {0, 5}));
  EXPECT_EQ(to_string(ShardingSpec(EnumerableSpec{{shard({0}, {2}), shard({2}, {1}, 1)}})),
            "enumerable([[0:2]@rank:0/cpu, [2:3]@rank:1/cpu])");
}

TEST(ShardedTensor, SeveralShardsOnOneRankRoundTripBitExact) {
  auto c = solo();
  EnumerableSpec grid{{shard({0, 0}, {2, 3}), shard({0, 3}, {2, 2}), shard({2, 0}, {3, 5}), shard({5, 0}, {0, 5})}};
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    at::Generator g = at::detail::createCPUGenerator(3);
    at::Tensor full = at::randn({5, 5}, g).to(dt);
    full[0][0] = -0.0;
    ShardedTensor st = ShardedTensor::scatter(full, grid, 0, c);
    ASSERT_EQ(st.local_shards().size(), 4u);
    EXPECT_EQ(st.local_numel(), 25);
    EXPECT_THROW(st.local_tensor(), Error);
    EXPECT_TRUE(at::equal(st.gather(0), full));
    at::Tensor back = st.reshard(ChunkSpec::over_ranks(1, 1)).reshard(grid).full_tensor();
    EXPECT_TRUE(bits_equal(back, full)) << "bit-exact, -0.0 included";
    EXPECT_TRUE(at::equal(back, full));
    ShardedTensor copy = ShardedTensor::zeros(grid, {5, 5}, at::TensorOptions().dtype(dt), c);
    copy.copy_from(st.reshard(ChunkSpec::over_ranks(0, 1)));
    EXPECT_TRUE(at::equal(copy.full_tensor(), full));
    EXPECT_TRUE(copy.same_layout(st));
    EXPECT_FALSE(copy.same_layout(st.reshard(ChunkSpec::over_ranks(0, 1))));
  }
}

TEST(ShardedTensor, RandIsTheSliceOfOneFullDraw) {
  auto c = solo();
  at::Generator g = at::detail::createCPUGenerator(9);
  at::Tensor want = at::rand({4, 6}, g);
  for (ShardingSpec spec : {ShardingSpec(ChunkSpec::over_ranks(0, 1)),
                            ShardingSpec(EnumerableSpec{{shard({0, 0}, {4, 1}), shard({0, 1}, {4, 5})}})}) {
    auto st = ShardedTensor::rand(spec, {4, 6}, 9, at::kFloat, c);
    EXPECT_TRUE(at::equal(st.full_tensor(), want)) << to_string(spec);
  }
  auto other = ShardedTensor::rand(ChunkSpec::over_ranks(0, 1), {4, 6}, 10, at::kFloat, c);
  EXPECT_FALSE(at::equal(other.full_tensor(), want));
}

TEST(ShardedTensor, ConstructorsAndLocalHelpers) {
  auto c = solo();
  auto z = ShardedTensor::zeros(ChunkSpec::over_ranks(0, 1), {3, 2}, at::kDouble, c);
  EXPECT_EQ(z.dtype(), at::kDouble);
  EXPECT_EQ(z.numel(), 6);
  EXPECT_TRUE(at::equal(z.local_tensor(), at::zeros({3, 2}, at::kDouble)));
  auto o = ShardedTensor::ones(ChunkSpec::over_ranks(0, 1), {3, 2}, at::kFloat, c);
  auto twice = o.clone().apply_([](at::Tensor& t) { t.mul_(2); });
  EXPECT_TRUE(at::equal(o.full_tensor(), at::ones({3, 2})));
  EXPECT_TRUE(at::equal(twice.full_tensor(), at::full({3, 2}, 2.0)));
  EXPECT_EQ(o.to(at::kBFloat16).local_tensor().scalar_type(), at::kBFloat16);
  EXPECT_THROW(o.apply_([](at::Tensor& t) { t = t.flatten(); }), Error);
  EXPECT_CONTAINS(error_of([&] { z.copy_from(o); }), "dtype");
  EXPECT_CONTAINS(error_of([&] { ShardedTensor::empty(ChunkSpec::over_ranks(0, 2), {4}, at::kFloat, c); }),
                  "shard 1 [2:4] is placed on rank:1/cpu but the communicator has 1 ranks");
  EXPECT_CONTAINS(error_of([&] { z.gather(1); }), "destination rank 1");
  EXPECT_FALSE(ShardedTensor().defined());
  // Zero-size tensors.
  auto e = ShardedTensor::rand(ChunkSpec::over_ranks(0, 1), {0, 4}, 1, at::kFloat, c);
  EXPECT_EQ(e.full_tensor().sizes(), at::IntArrayRef({0, 4}));
  EXPECT_EQ(e.describe(), "ShardedTensor(shape=[0, 4], dtype=Float, shards=[[0:0, 0:4]@rank:0/cpu])");
}

TEST(ShardedTensor, FromPartsAndFromLocalShardsValidate) {
  auto c = solo();
  std::vector<ShardMetadata> all{shard({0}, {2}), shard({2}, {2})};
  EXPECT_NO_THROW(ShardedTensor::from_parts({Shard{at::ones({2}), all[0]}, Shard{at::ones({2}), all[1]}}, all, {4},
                                            at::kFloat, c));
  EXPECT_CONTAINS(error_of([&] { ShardedTensor::from_parts({Shard{at::ones({2}), all[0]}}, all, {4}, at::kFloat, c); }),
                  "lacks the data of shard 1 [2:4]");
  EXPECT_CONTAINS(error_of([&] {
                    ShardedTensor::from_parts({Shard{at::ones({2}), all[0]}, Shard{at::ones({3}), all[1]}}, all, {4},
                                              at::kFloat, c);
                  }),
                  "shard 1 [2:4] holds a tensor of shape [3]");
  EXPECT_CONTAINS(error_of([&] {
                    ShardedTensor::from_local_shards({Shard{at::ones({2}), all[0]}, Shard{at::ones({2}), all[0]}},
                                                     {4}, c);
                  }),
                  "overlaps");
  EXPECT_CONTAINS(error_of([&] { ShardedTensor::from_local_shards({Shard{at::ones({2}), shard({0}, {2}, 1)}}, {2}, c); }),
                  "is placed on rank:1/cpu but was passed by rank 0");
  auto st = ShardedTensor::from_local_shards({Shard{at::arange(2.0), all[0]}, Shard{at::arange(2.0) + 2, all[1]}}, {4}, c);
  EXPECT_TRUE(at::equal(st.full_tensor(), at::arange(4.0)));
}

class ShardedRanks : public ::testing::TestWithParam<int> {};

TEST_P(ShardedRanks, GatherFullTensorReshardRoundTripsBitExact) {
  const int n = GetParam();
  auto res = run_ranks(n, {"sharded_roundtrip"}, 240);
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < n; ++r) {
    ASSERT_FALSE(res.out[r].empty()) << res.all_output();
    EXPECT_EQ(res.out[r].back(), "sharded roundtrip ok rank " + std::to_string(r) + " checks 288");
  }
}

TEST_P(ShardedRanks, FromRuleHoldsNoListUntilOneIsNeeded) {
  const int n = GetParam();
  auto res = run_ranks(n, {"from_rule"}, 120);
  ASSERT_EQ(res.launch.exit_code, 0) << res.all_output();
  for (int r = 0; r < n; ++r)
    EXPECT_NE(res.all_output().find("from_rule ok rank " + std::to_string(r)), std::string::npos) << res.all_output();
}

TEST_P(ShardedRanks, FromLocalShardsRejectsBadShardsOnEveryRank) {
  const int n = GetParam();
  std::vector<std::pair<std::string, std::string>> modes{{"overlap", n > 1 ? "overlaps shard" : "negative offset"},
                                                         {"shape", concat("rank ", n - 1, ": local shard 0")}};
  if (n > 1) modes.emplace_back("dtype", concat("rank ", n - 1, " holds dtype Double but an earlier rank Float"));
  for (auto& [mode, part] : modes) {
    auto res = run_ranks(n, {"from_local_shards", mode});
    EXPECT_RANKS_OK(res);
    for (int r = 0; r < n; ++r) {
      ASSERT_FALSE(res.out[r].empty()) << res.all_output();
      EXPECT_CONTAINS(res.out[r].back(), part);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShardedRanks, ::testing::Values(1, 2, 3, 4));

// 16,384 shards of one tensor (a FULL_SHARD layout at 16,384 ranks) along dimension 1: valid,
// and one shard moved by a column overlaps exactly its neighbour, which the check names.
// (A check of every pair would compare 134 million of them per tensor.)
TEST(ShardingSpec, ValidatesSixteenThousandShardsAlongAnyDimension) {
  const int64_t n = 16384;
  std::vector<ShardMetadata> cols, rows;
  for (int64_t i = 0; i < n; ++i) {
    cols.push_back(shard({0, 2 * i}, {8, 2}, static_cast<int>(i)));
    rows.push_back(shard({2 * i, 0}, {2, 8}, static_cast<int>(i)));
  }
  EXPECT_NO_THROW(validate_shards(cols, {8, 2 * n}));
  EXPECT_NO_THROW(validate_shards(rows, {2 * n, 8}));
  cols[9000].box.offsets[1] -= 1;
  EXPECT_CONTAINS(error_of([&] { validate_shards(cols, {8, 2 * n}); }),
                  "shard 9000 [0:8, 17999:18001] on rank:9000/cpu overlaps shard 8999 [0:8, 17998:18000]");
}

namespace {

// The first overlapping pair as a box-by-box check meets it: every pair, the smallest later
// box first.
std::optional<std::pair<size_t, size_t>> every_pair(const std::vector<Box>& v) {
  for (size_t j = 0; j < v.size(); ++j)
    for (size_t i = 0; i < j; ++i)
      if (!v[i].empty() && !v[j].empty() && intersect(v[i], v[j])) return std::make_pair(i, j);
  return std::nullopt;
}

std::optional<std::pair<size_t, size_t>> swept(const std::vector<Box>& v) {
  return first_overlap(v.size(), [&](size_t i) -> const Box& { return v[i]; });
}

}  // namespace

// first_overlap (the overlap check of validate_shards, list layouts and version-1 chunk lists)
// names the pair a check of every pair names, on boxes of 0 to 4 dimensions: random boxes, and
// random tilings (a box cut again and again along random dimensions, shuffled), some moved
// by one or with a box added.
TEST(ShardingSpec, FirstOverlapNamesThePairEveryPairWouldName) {
  std::mt19937_64 rng(29);
  auto R = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int trial = 0; trial < 4000; ++trial) {
    const size_t nd = static_cast<size_t>(std::vector<int64_t>{0, 1, 1, 2, 2, 2, 3, 3, 4}[R(0, 8)]);
    const int64_t ext = std::vector<int64_t>{3, 6, 20, 60}[R(0, 3)];
    std::vector<Box> v;
    if (nd > 0 && R(0, 1)) {
      v.push_back(Box{std::vector<int64_t>(nd, 0), std::vector<int64_t>(nd, ext)});
      for (int64_t s = R(0, 120); s > 0; --s) {
        const size_t k = static_cast<size_t>(R(0, static_cast<int64_t>(v.size()) - 1));
        const size_t d = static_cast<size_t>(R(0, static_cast<int64_t>(nd) - 1));
        if (v[k].sizes[d] < 2) continue;
        Box rest = v[k];
        const int64_t cut = R(1, v[k].sizes[d] - 1);
        v[k].sizes[d] = cut;
        rest.offsets[d] += cut;
        rest.sizes[d] -= cut;
        v.push_back(rest);
      }
      std::shuffle(v.begin(), v.end(), rng);
      for (int64_t m = R(0, 2); m > 0; --m) {
        Box& b = v[static_cast<size_t>(R(0, static_cast<int64_t>(v.size()) - 1))];
        const size_t d = static_cast<size_t>(R(0, static_cast<int64_t>(nd) - 1));
        b.offsets[d] = std::max<int64_t>(0, b.offsets[d] + (R(0, 1) ? 1 : -1));
      }
      if (R(0, 3) == 0) {
        Box b;
        for (size_t d = 0; d < nd; ++d) b.offsets.push_back(R(0, ext - 1)), b.sizes.push_back(R(0, 2));
        v.insert(v.begin() + R(0, static_cast<int64_t>(v.size())), b);
      }
    } else {
      for (int64_t k = R(0, 14); k > 0; --k) {
        Box b;
        for (size_t d = 0; d < nd; ++d) b.offsets.push_back(R(0, ext - 1)), b.sizes.push_back(R(0, ext / 2));
        v.push_back(b);
      }
    }
    ASSERT_EQ(swept(v), every_pair(v)) << "trial " << trial;
  }
  // Ends past 2^63 - 1 do not wrap.
  const int64_t top = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(swept({Box{{top - 4}, {4}}, Box{{top - 2}, {2}}}), std::make_optional(std::make_pair(size_t{0}, size_t{1})));
  EXPECT_EQ(swept({Box{{0, top - 1}, {1, 1}}, Box{{0, top - 2}, {1, 1}}}), std::nullopt);
  EXPECT_EQ(swept({Box{{top}, {top}}, Box{{0}, {top}}}), std::nullopt);
  // Boxes it cannot compare are an error, not a guess.
  EXPECT_CONTAINS(error_of([] { swept({Box{{0}, {2}}, Box{{0, 0}, {2, 2}}}); }), "does not have the rank 1");
  EXPECT_CONTAINS(error_of([] { swept({Box{{0}, {2}}, Box{{-1}, {2}}}); }), "negative offset or size");
}

// A 3-dimensional grid of 64,000 shards (40 x 40 x 40) and 100,000 shards along one
// dimension listed in reverse: valid, quickly; the first overlapping pair in the list named
// (not the first the sweep meets: in reverse, shards 89 and 90 come before 49 and 50).
TEST(ShardingSpec, ValidatesGridsOfShardsAndNamesTheFirstOverlap) {
  std::vector<ShardMetadata> grid, rows;
  for (int64_t a = 0; a < 40; ++a)
    for (int64_t b = 0; b < 40; ++b)
      for (int64_t c = 0; c < 40; ++c) grid.push_back(shard({a, 2 * b, 3 * c}, {1, 2, 3}, static_cast<int>(grid.size())));
  for (int64_t i = 99999; i >= 0; --i) rows.push_back(shard({3 * i, 0}, {3, 2}, static_cast<int>(rows.size())));
  EXPECT_NO_THROW(validate_shards(grid, {40, 80, 120}));
  EXPECT_NO_THROW(validate_shards(rows, {300000, 2}));
  rows[50].box.offsets[0] += 1;
  rows[90].box.offsets[0] += 2;
  EXPECT_CONTAINS(error_of([&] { validate_shards(rows, {300000, 2}); }),
                  "shard 50 [299848:299851, 0:2] on rank:50/cpu overlaps shard 49 [299850:299853, 0:2] on rank:49/cpu "
                  "in [299850:299851, 0:2]");
  grid[63999].box = grid[1].box;
  grid[40000].box.offsets[2] += 1;
  EXPECT_CONTAINS(error_of([&] { validate_shards(grid, {40, 80, 120}); }),
                  "shard 40001 [25:26, 0:2, 3:6] on rank:40001/cpu overlaps shard 40000 [25:26, 0:2, 1:4] on "
                  "rank:40000/cpu in [25:26, 0:2, 3:4]");
}
