// Layouts as rules (sharding/layout.h): the pieces every rule makes tile the shape, FSDP's
// row-aligned cut as flat_rows gives it equals the unit-wide cut FSDP computes, and
// overlapping() finds exactly the pieces a brute-force scan finds, in O(log P) steps; a
// list of 100,000 pieces is checked for overlaps by a sweep, not every pair.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "tessera/core/error.h"
#include "tessera/sharding/chunk.h"
#include "tessera/sharding/layout.h"

using namespace tessera::sharding;

namespace {

// FSDP's cut as fsdp_param_group.cpp computed it before flat_rows existed: the unit-wide
// cuts, each moved to a row boundary of the first parameter holding it, then clamped.
std::vector<std::vector<int64_t>> unit_cut(const std::vector<std::vector<int64_t>>& shapes, int S) {
  std::vector<int64_t> off, rows, rn;
  int64_t T = 0;
  for (const auto& s : shapes) {
    int64_t n = 1;
    for (auto d : s) n *= d;
    off.push_back(T);
    rows.push_back(s[0]);
    rn.push_back(s[0] == 0 ? 0 : n / s[0]);
    T += n;
  }
  std::vector<int64_t> cut(S + 1, 0);
  cut[S] = T;
  for (int k = 1; k < S; ++k) {
    int64_t c = T / S * k + T % S * k / S;
    for (size_t p = 0; p < shapes.size(); ++p) {
      const int64_t n = rows[p] * rn[p];
      if (n == 0 || c < off[p] || c >= off[p] + n) continue;
      c = off[p] + (c - off[p] + rn[p] / 2) / rn[p] * rn[p];
      break;
    }
    cut[k] = std::max(cut[k - 1], c);
  }
  std::vector<std::vector<int64_t>> out(shapes.size(), std::vector<int64_t>(S, 0));
  for (size_t p = 0; p < shapes.size(); ++p) {
    const int64_t n = rows[p] * rn[p];
    if (rn[p] == 0) {
      out[p][0] = rows[p];
      continue;
    }
    for (int r = 0; r < S; ++r)
      out[p][r] = (std::clamp(cut[r + 1], off[p], off[p] + n) - std::clamp(cut[r], off[p], off[p] + n)) / rn[p];
  }
  return out;
}

std::vector<int64_t> brute_overlap(const Layout& L, const std::vector<int64_t>& shape, const Box& region) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < L.count(); ++i) {
    const Box b = L.box(shape, i);
    if (!b.empty() && !region.empty() && intersect(b, region)) out.push_back(i);
  }
  return out;
}

}  // namespace

TEST(Layout, FlatRowsEqualFsdpsUnitWideCut) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int nparams = 1 + static_cast<int>(rng() % 5);
    std::vector<std::vector<int64_t>> shapes;
    for (int p = 0; p < nparams; ++p) {
      std::vector<int64_t> s{static_cast<int64_t>(rng() % 9)};
      if (rng() % 2) s.push_back(static_cast<int64_t>(rng() % 7));
      if (rng() % 4 == 0) s.push_back(static_cast<int64_t>(1 + rng() % 3));
      shapes.push_back(s);
    }
    const int S = 1 + static_cast<int>(rng() % 12);
    const auto want = unit_cut(shapes, S);
    int64_t T = 0;
    std::vector<int64_t> offs;
    for (const auto& s : shapes) {
      int64_t n = 1;
      for (auto d : s) n *= d;
      offs.push_back(T);
      T += n;
    }
    for (size_t p = 0; p < shapes.size(); ++p) {
      int64_t row = 0;
      for (int r = 0; r < S; ++r) {
        const Range got = flat_rows(T, offs[p], shapes[p], S, r);
        ASSERT_EQ(got.size, want[p][static_cast<size_t>(r)]) << "trial " << trial << " param " << p << " rank " << r;
        if (got.size > 0) ASSERT_EQ(got.begin, row);
        row += got.size;
      }
      ASSERT_EQ(row, shapes[p][0]);
    }
  }
}

TEST(Layout, OverlappingEqualsBruteForceForEveryRule) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 400; ++trial) {
    std::vector<int64_t> shape{static_cast<int64_t>(rng() % 20), static_cast<int64_t>(1 + rng() % 5)};
    const int64_t P = 1 + static_cast<int64_t>(rng() % 40);
    Layout L;
    switch (trial % 3) {
      case 0: L = Layout::chunk(static_cast<int64_t>(rng() % 2), P); break;
      case 1: {
        const int64_t n = shape[0] * shape[1], before = static_cast<int64_t>(rng() % 50);
        L = Layout::flat(before + n + static_cast<int64_t>(rng() % 50), before, P);
        break;
      }
      default: L = Layout::whole(0);
    }
    L.validate(shape, 1 << 20, "test");
    int64_t covered = 0;
    for (int64_t i = 0; i < L.count(); ++i) covered += L.box(shape, i).numel();
    ASSERT_EQ(covered, shape[0] * shape[1]) << "trial " << trial;
    for (int q = 0; q < 10; ++q) {
      Box region = full_box(shape);
      for (size_t d = 0; d < 2; ++d) {
        const int64_t a = shape[d] == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(shape[d]));
        region.offsets[d] = a;
        region.sizes[d] = shape[d] == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(shape[d] - a + 1));
      }
      ASSERT_EQ(L.overlapping(shape, region), brute_overlap(L, shape, region)) << "trial " << trial << " " << region.to_string();
    }
  }
}

TEST(Layout, SixteenThousandPiecesOfAWideTensorAreFoundWithoutAWalk) {
  // 2 rows of 10^8 elements cut over 16,384 ranks: all but two pieces are empty.
  const std::vector<int64_t> shape{2, 100000000};
  const Layout L = Layout::flat(200000000, 0, 16384);
  const auto all = L.overlapping(shape, full_box(shape));
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(L.box(shape, all[0]).sizes[0] + L.box(shape, all[1]).sizes[0], 2);
}

TEST(Layout, ValidateNamesWhatIsWrong) {
  const std::vector<int64_t> shape{8, 4};
  auto msg = [&](const Layout& L, int64_t world) {
    try {
      L.validate(shape, world, "key 'w'");
    } catch (const tessera::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg(Layout::chunk(2, 4), 4).find("dimension 2"), std::string::npos);
  EXPECT_NE(msg(Layout::chunk(0, 4), 3).find("layout.files reach data file 3, outside [0, 2]"), std::string::npos);
  EXPECT_NE(msg(Layout::flat(20, 0, 2), 2).find("unit of 20"), std::string::npos);
  FileMap two_groups{0, 1, 2, 3, 0};  // replica step 3 < 4 pieces: groups would share files
  EXPECT_NE(msg(Layout::chunk(0, 4, two_groups), 8).find("(two pieces would share a file)"), std::string::npos);
  Layout list;
  list.rule = Layout::Rule::List;
  list.list = {{0, Box{{0, 0}, {5, 4}}}, {1, Box{{4, 0}, {4, 4}}}};
  EXPECT_NE(msg(list, 2).find("overlap"), std::string::npos);
  list.list[1].box = Box{{5, 0}, {2, 4}};
  EXPECT_NE(msg(list, 2).find("cover 28 of 32"), std::string::npos);
  EXPECT_EQ(msg(Layout::chunk(0, 4, FileMap{0, 1, 2, 4, 1}), 8), "");
}

TEST(Layout, HybridFileMapSpreadsPiecesOverTheReplicaGroups) {
  // 2 groups of 4 ranks; group (i + shift) mod 2 stores piece i.
  const FileMap f{0, 1, 2, 4, 1};
  EXPECT_EQ(f.file(0), 4);
  EXPECT_EQ(f.file(1), 1);
  EXPECT_EQ(f.file(2), 6);
  EXPECT_EQ(f.file(3), 3);
}

// pieces_in_file inverts file_of (what every reader uses to list the pieces a data file must
// hold): for every rule, random valid file maps (hybrid ones included) and every file of the
// world, exactly the pieces a scan of file_of finds.
TEST(Layout, PiecesInFileInvertsFileOfForEveryRule) {
  std::mt19937 rng(44);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int round = 0; round < 400; ++round) {
    const int64_t P = pick(1, 9), step = pick(1, 3), R = pick(1, 4), first = pick(0, 3);
    const int64_t G = R > 1 ? P * step + pick(0, 3) : 0, shift = pick(0, 7);
    const FileMap fm{first, step, R, G, shift};
    const int64_t world = first + (P - 1) * step + (R - 1) * G + 1 + pick(0, 2);
    std::vector<Layout> layouts = {Layout::chunk(0, P, fm), Layout::flat(100, 0, P, fm), Layout::whole(pick(0, world - 1))};
    Layout list;
    list.rule = Layout::Rule::List;
    for (int64_t i = 0; i < P; ++i) list.list.push_back({pick(0, world - 1), Box{{i}, {1}}});
    layouts.push_back(list);
    for (const Layout& L : layouts) {
      const std::vector<int64_t> shape = L.rule == Layout::Rule::List ? std::vector<int64_t>{P} : std::vector<int64_t>{10, 10};
      ASSERT_NO_THROW(L.validate(shape, world, "layout")) << round;
      for (int64_t f = -1; f <= world; ++f) {
        std::vector<int64_t> want;
        for (int64_t i = 0; i < L.count(); ++i)
          if (L.file_of(i) == f) want.push_back(i);
        EXPECT_EQ(L.pieces_in_file(f), want) << "round " << round << " rule " << L.rule_name() << " file " << f;
      }
    }
  }
}

namespace {

std::string validate_error(const Layout& L, const std::vector<int64_t>& shape, int64_t world, const std::string& what) {
  try {
    L.validate(shape, world, what);
  } catch (const tessera::Error& e) {
    return e.what();
  }
  return std::string();
}

}  // namespace

// A list layout (an irregular one: DCP's, say) of 100,000 pieces, cut along one dimension or
// a 250 x 400 grid listed in random order: validated by first_overlap's sweep, not by
// comparing every pair (5 billion of them), and an overlap among the pieces is named by its
// first pair as a piece-by-piece check meets it (not the pair the sweep happens to meet first).
TEST(Layout, ListOfAHundredThousandPiecesIsCheckedBySweep) {
  const int64_t n = 100000;
  const std::vector<int64_t> rows_shape{2 * n, 4}, grid_shape{500, 1200};
  Layout rows, grid;
  rows.rule = grid.rule = Layout::Rule::List;
  // 2,048 files: at most 64 pieces in each (kMaxListPiecesPerFile).
  for (int64_t i = 0; i < n; ++i) rows.list.push_back({i % 2048, Box{{2 * i, 0}, {2, 4}}});
  for (int64_t r = 0; r < 250; ++r)
    for (int64_t c = 0; c < 400; ++c) grid.list.push_back({(r + c) % 2048, Box{{2 * r, 3 * c}, {2, 3}}});
  std::mt19937_64 rng(5);
  std::shuffle(grid.list.begin(), grid.list.end(), rng);
  // (No timing here: comparing every pair, 10 billion box intersections, would not end
  // within the suite's per-test timeout; the sweep takes well under a second.)
  EXPECT_EQ(validate_error(rows, rows_shape, 2048, "key 'w'"), "");
  EXPECT_EQ(validate_error(grid, grid_shape, 2048, "key 'g'"), "");
  // 64 pieces per file at most: at 1,562 files, 100,000 pieces are too many.
  EXPECT_EQ(validate_error(rows, rows_shape, 1562, "key 'w'"),
            "key 'w': layout.pieces lists 100000 pieces, more than 64 per data file (99968 for world_size 1562)");

  // Piece 70,000 moved up a row overlaps piece 69,999; the last piece, moved to [1:3, 0:4],
  // overlaps pieces 0 and 1, the sweep's first meeting, but later in the list.
  rows.list[70000].box.offsets[0] -= 1;
  rows.list[n - 1].box = Box{{1, 0}, {2, 4}};
  EXPECT_EQ(validate_error(rows, rows_shape, 2048, "key 'w'"),
            "key 'w': pieces [139998:140000, 0:4] and [139999:140001, 0:4] overlap");
  // In the grid: piece 60,000 put on piece 20, and piece 500 on piece 30.
  const Box b20 = grid.list[20].box, b30 = grid.list[30].box;
  grid.list[60000].box = b20;
  grid.list[500].box = b30;
  EXPECT_EQ(validate_error(grid, grid_shape, 2048, "key 'g'"),
            "key 'g': pieces " + b30.to_string() + " and " + b30.to_string() + " overlap");
}

// As the metadata readers report them (C++ and Python alike, issue 44 item 5): each piece's
// own faults (its file, its rank, inside the shape, not empty) in the order of the pieces, then
// the first overlapping pair, then the coverage.
TEST(Layout, ListErrorsComeInTheOrderOfThePieces) {
  const std::vector<int64_t> shape{8};
  Layout L;
  L.rule = Layout::Rule::List;
  L.list = {{0, Box{{0}, {4}}}, {0, Box{{2}, {4}}}, {0, Box{{6}, {4}}}};
  EXPECT_EQ(validate_error(L, shape, 1, "key 'v'"),
            "key 'v': layout.pieces[2] (offsets [6], sizes [4]) lies outside the shape [8]");
  L.list[2].box = Box{{6}, {2}};
  EXPECT_EQ(validate_error(L, shape, 1, "key 'v'"), "key 'v': pieces [0:4] and [2:6] overlap");
  L.list = {{0, Box{{0}, {4}}}, {0, Box{{3}, {1}}}, {3, Box{{4}, {4}}}};
  EXPECT_EQ(validate_error(L, shape, 2, "key 'v'"), "key 'v' layout.pieces[2] file is 3, outside [0, 1]");
  L.list[2].file = 1;
  EXPECT_EQ(validate_error(L, shape, 2, "key 'v'"), "key 'v': pieces [0:4] and [3:4] overlap");
  // Issue 44 item 3: a list names only stored pieces; an empty one is refused.
  L.list = {{0, Box{{0}, {4}}}, {0, Box{{4}, {0}}}, {0, Box{{4}, {4}}}};
  EXPECT_EQ(validate_error(L, shape, 1, "key 'v'"),
            "key 'v': layout.pieces[1] [4:4] is empty (a list layout names only the pieces its data files store)");
}

// The tp rule (format version 3): for random shapes, cut dimensions, stripes, tensor-parallel
// sizes (uneven ones included) and inner rules (whole, chunk along either dimension, FSDP's
// flat cut with each TP piece's own unit), the pieces tile the shape; the stripe pieces of
// holder (p, t), concatenated along the cut dimension in stripe order, are exactly inner piece
// p of TP piece t (the t-th range of every stripe, TpCut's rule); overlapping() is the brute
// force's answer and pieces_in_file inverts file_of.
TEST(Layout, TpRuleComposesTheTensorParallelCutWithAnInnerCut) {
  std::mt19937_64 rng(47);
  auto pick = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1)); };
  for (int trial = 0; trial < 600; ++trial) {
    const int64_t dim = pick(0, 1), stripes = pick(1, 3), T = pick(1, 4), P = pick(1, 5);
    std::vector<int64_t> shape{pick(0, 7), pick(1, 5)};
    shape[static_cast<size_t>(dim)] = stripes * pick(0, 6);
    Layout inner;
    std::vector<int64_t> numel, offset;
    switch (trial % 4) {
      case 0: inner = Layout::whole(0); break;
      case 1: inner = Layout::chunk(pick(0, 1), P); break;
      default: {
        inner = Layout::flat(0, 0, P);
        Layout probe = Layout::tensor_parallel(dim, stripes, T, Layout::whole(0));
        for (int64_t t = 0; t < T; ++t) {
          const auto ls = probe.tp_local_shape(shape, t);
          const int64_t before = pick(0, 30);
          offset.push_back(before);
          numel.push_back(before + ls[0] * ls[1] + pick(0, 30));
        }
      }
    }
    const int64_t holders = T * (inner.rule == Layout::Rule::Whole ? 1 : P);
    const int64_t R = pick(1, 2), step = pick(1, 2);
    const FileMap fm{pick(0, 2), step, R, R > 1 ? holders * step + pick(0, 2) : 0, pick(0, 5)};
    const int64_t world = fm.first + (holders - 1) * step + (R - 1) * fm.replica_step + 1 + pick(0, 2);
    const Layout L = Layout::tensor_parallel(dim, stripes, T, inner, fm, numel, offset);
    ASSERT_NO_THROW(L.validate(shape, world, "tp")) << "trial " << trial;
    ASSERT_EQ(L.count(), holders * stripes);
    const int64_t n = shape[0] * shape[1];
    at::Tensor g = at::arange(n, at::kLong).view(shape), seen = at::zeros({n}, at::kLong);
    for (int64_t i = 0; i < L.count(); ++i) {
      const Box b = L.box(shape, i);
      if (!b.empty()) seen.index_add_(0, narrow_to(g, full_box(shape), b).reshape(-1), at::ones({b.numel()}, at::kLong));
    }
    ASSERT_TRUE(seen.eq(1).all().item<bool>()) << "trial " << trial << ": the pieces do not tile " << shape[0] << "x" << shape[1];
    for (int64_t q = 0; q < holders; ++q) {
      const int64_t t = q % T, p = q / T;
      std::vector<at::Tensor> ranges, parts;
      const int64_t per = shape[static_cast<size_t>(dim)] / stripes;
      for (int64_t s = 0; s < stripes; ++s) {
        const Range r = chunk_range(per, static_cast<int>(T), static_cast<int>(t));
        ranges.push_back(g.narrow(dim, s * per + r.begin, r.size));
        parts.push_back(narrow_to(g, full_box(shape), L.box(shape, q * stripes + s)));
      }
      const at::Tensor local = at::cat(ranges, dim);
      const Layout in = L.tp_inner(t);
      const at::Tensor want = narrow_to(local, full_box(local.sizes().vec()), in.box(local.sizes().vec(), p));
      const at::Tensor got = at::cat(parts, dim);
      ASSERT_TRUE(got.sizes() == want.sizes() && got.equal(want)) << "trial " << trial << " holder " << q;
    }
    for (int k = 0; k < 6; ++k) {
      Box region = full_box(shape);
      for (size_t d = 0; d < 2; ++d) {
        const int64_t a = shape[d] == 0 ? 0 : pick(0, shape[d] - 1);
        region.offsets[d] = a;
        region.sizes[d] = shape[d] == 0 ? 0 : pick(0, shape[d] - a);
      }
      ASSERT_EQ(L.overlapping(shape, region), brute_overlap(L, shape, region)) << "trial " << trial;
    }
    for (int64_t f = -1; f <= world; ++f) {
      std::vector<int64_t> want;
      for (int64_t i = 0; i < L.count(); ++i)
        if (L.file_of(i) == f) want.push_back(i);
      ASSERT_EQ(L.pieces_in_file(f), want) << "trial " << trial << " file " << f;
    }
  }
}

TEST(Layout, TpRuleValidationNamesTheField) {
  const std::vector<int64_t> shape{12, 4};
  const Layout flat = Layout::flat(100, 0, 2);
  EXPECT_NE(validate_error(Layout::tensor_parallel(0, 5, 2, flat), shape, 4, "key 'w'").find("layout.stripes 5 does not divide dimension 0"),
            std::string::npos);
  EXPECT_NE(validate_error(Layout::tensor_parallel(0, 65, 2, flat), {65 * 2, 4}, 4, "key 'w'").find("layout.stripes 65 is outside [1, 64]"),
            std::string::npos);
  EXPECT_NE(validate_error(Layout::tensor_parallel(2, 1, 2, flat), shape, 4, "key 'w'").find("layout.dim 2 is outside [0, 1]"),
            std::string::npos);
  EXPECT_NE(validate_error(Layout::tensor_parallel(0, 3, 4, flat), shape, 4, "key 'w'").find("exceed world_size 4"),
            std::string::npos);
  // TP piece 0 of 12 rows over 2 is 6 x 4 = 24 elements: offset 90 leaves only 10.
  EXPECT_NE(validate_error(Layout::tensor_parallel(0, 1, 2, Layout::flat(100, 90, 2)), shape, 4, "key 'w'")
                .find("layout.inner.offset 90 + the 24 elements of tensor-parallel piece 0 exceed layout.inner.numel 100"),
            std::string::npos);
  EXPECT_NE(validate_error(Layout::tensor_parallel(0, 1, 2, flat, FileMap{1, 1}), shape, 4, "key 'w'")
                .find("layout.files reach data file 4, outside [0, 3]"),
            std::string::npos);
  EXPECT_EQ(validate_error(Layout::tensor_parallel(0, 3, 2, flat), shape, 4, "key 'w'"), "");
}

// Interleaved replica groups (the data-parallel groups of a (dp, tp) mesh: step tp,
// replica_step 1, one group per tp rank): every piece of every group in its own file, and
// pieces_in_file inverts file_of.
TEST(Layout, InterleavedReplicaGroupsShareNoFileAndInvert) {
  std::mt19937 rng(48);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int round = 0; round < 300; ++round) {
    const int64_t step = pick(2, 6), R = pick(2, step), G = pick(1, (step - 1) / (R - 1)), P = pick(1, 6);
    const FileMap fm{pick(0, 2), step, R, G, pick(0, 9)};
    ASSERT_TRUE(fm.interleaved());
    const int64_t world = fm.first + (P - 1) * step + (R - 1) * G + 1 + pick(0, 2);
    for (const Layout& L : {Layout::chunk(0, P, fm), Layout::flat(100, 0, P, fm)}) {
      ASSERT_NO_THROW(L.validate({10, 10}, world, "layout")) << round;
      std::set<int64_t> files;
      for (int64_t i = 0; i < P; ++i)
        for (int64_t g = 0; g < R; ++g) ASSERT_TRUE(files.insert(fm.first + i * step + g * G).second) << round;
      for (int64_t f = -1; f <= world; ++f) {
        std::vector<int64_t> want;
        for (int64_t i = 0; i < L.count(); ++i)
          if (L.file_of(i) == f) want.push_back(i);
        ASSERT_EQ(L.pieces_in_file(f), want) << "round " << round << " file " << f;
      }
    }
  }
  // Groups that collide (replica_step 2 over a step of 3 with 3 groups) are refused.
  EXPECT_NE(validate_error(Layout::chunk(0, 2, FileMap{0, 3, 3, 2, 0}), {10, 10}, 8, "key 'w'")
                .find("(two pieces would share a file)"),
            std::string::npos);
}
