// Format version 2 (docs/checkpoint-format.md §3) and version-1 compatibility: the v1
// checkpoints committed under tests/checkpoint/fixtures/v1 (written by the version-1 writer)
// read exactly as their consolidated copy; a v2 directory's data files are tied to their
// save and rank; the metadata of a regular layout does not grow with the world size; lists of
// 100,000 pieces are checked for overlaps by a sweep; and a writer refuses metadata a reader
// would refuse before it commits anything.
#include <ATen/ATen.h>
#include <gtest/gtest.h>


#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/save_plan.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/error.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;

namespace {

const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/checkpoint/fixtures/v1";

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         (a.numel() == 0 || at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte)));
}

// Every tensor of `m` as one dense tensor.
std::map<std::string, at::Tensor> read_all(const ck::CheckpointMetadata& m) {
  ck::ChunkReader r(m);
  std::map<std::string, at::Tensor> out;
  for (const auto& k : m.keys) {
    const auto& e = m.entries.at(k);
    if (e.is_tensor()) out[k] = r.read_box(k, e, sharding::full_box(e.shape));
  }
  return out;
}

}  // namespace

TEST(FormatV2, Version1FixtureReadsExactlyAsItsConsolidatedCopy) {
  const auto v1 = ck::open_checkpoint(kFixtures + "/fsdp3.ckpt");
  const auto full = ck::open_checkpoint(kFixtures + "/fsdp3-consolidated.safetensors");
  ASSERT_EQ(v1.version, 1);
  ASSERT_EQ(v1.world_size, 3);
  ASSERT_EQ(v1.keys, full.keys);
  const auto a = read_all(v1), b = read_all(full);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 50u);
  for (const auto& [k, t] : a) EXPECT_TRUE(same_bits(t, b.at(k))) << k;
  for (const auto& k : v1.keys)
    if (!v1.entries.at(k).is_tensor())
      EXPECT_EQ(ck::encode_value(v1.entries.at(k).value), ck::encode_value(full.entries.at(k).value)) << k;
  EXPECT_TRUE(ck::verify(kFixtures + "/fsdp3.ckpt").ok);
  // A slice that crosses the 3-rank cut of an embedding reads the same bytes.
  ck::ChunkReader r(v1);
  const auto& e = v1.entries.at("model.tok.weight");
  const sharding::Box rows{{70, 3}, {120, 10}};
  EXPECT_TRUE(same_bits(r.read_box("model.tok.weight", e, rows),
                        b.at("model.tok.weight").narrow(0, 70, 120).narrow(1, 3, 10)));
}

TEST(FormatV2, ReshardOfAVersion1CheckpointWritesVersion2WithTheSameValues) {
  const std::string d = temp_dir();
  const std::string out = d + "/r5.ckpt";
  ck::reshard(kFixtures + "/fsdp3.ckpt", 5, out, false);
  const auto m = ck::open_checkpoint(out);
  EXPECT_EQ(m.version, 2);
  EXPECT_EQ(m.world_size, 5);
  EXPECT_EQ(m.save_id.size(), 16u);
  const std::string text = read_bytes(out + "/tessera-checkpoint.json");
  EXPECT_EQ(text.find('\n'), std::string::npos) << "compact JSON";
  EXPECT_EQ(m.entries.at("model.tok.weight").layout->rule_name(), "chunk");
  const auto a = read_all(m), b = read_all(ck::open_checkpoint(kFixtures + "/fsdp3-consolidated.safetensors"));
  for (const auto& [k, t] : a) EXPECT_TRUE(same_bits(t, b.at(k))) << k;
  EXPECT_TRUE(ck::verify(out).ok);
}

TEST(FormatV2, DataFilesOfAnotherSaveOrRankAreRefusedNamingThem) {
  const std::string d = temp_dir();
  ck::reshard(kFixtures + "/fsdp3.ckpt", 2, d + "/a.ckpt", false);
  ck::reshard(kFixtures + "/fsdp3.ckpt", 2, d + "/b.ckpt", false);
  // b's rank-1 file in a: same shapes, another save.
  write_bytes(d + "/a.ckpt/data-rank00001.safetensors", read_bytes(d + "/b.ckpt/data-rank00001.safetensors"));
  const std::string other = error_of([&] { read_all(ck::open_checkpoint(d + "/a.ckpt")); });
  EXPECT_NE(other.find("data-rank00001.safetensors' belongs to another save"), std::string::npos) << other;
  const auto rep = ck::verify(d + "/a.ckpt");
  EXPECT_FALSE(rep.ok);
  // b's two files swapped: each is of this save, but of the other rank.
  std::rename((d + "/b.ckpt/data-rank00000.safetensors").c_str(), (d + "/b.ckpt/x").c_str());
  std::rename((d + "/b.ckpt/data-rank00001.safetensors").c_str(), (d + "/b.ckpt/data-rank00000.safetensors").c_str());
  std::rename((d + "/b.ckpt/x").c_str(), (d + "/b.ckpt/data-rank00001.safetensors").c_str());
  const std::string swapped = error_of([&] { read_all(ck::open_checkpoint(d + "/b.ckpt")); });
  EXPECT_NE(swapped.find("was written as rank '1'"), std::string::npos) << swapped;
}

TEST(FormatV2, ALoadOpensOnlyTheDataFilesItsPiecesNeed) {
  const std::string d = temp_dir();
  ck::reshard(kFixtures + "/fsdp3.ckpt", 6, d + "/r6.ckpt", false);
  // Rank 4's file gone: reading rows that lie in ranks 0-1 and plain values still works;
  // reading the whole tensor names the missing file.
  ::unlink((d + "/r6.ckpt/data-rank00004.safetensors").c_str());
  const auto m = ck::open_checkpoint(d + "/r6.ckpt");
  ck::ChunkReader r(m);
  const auto& e = m.entries.at("model.tok.weight");  // [256, 16] chunked over 6: 43 rows each
  EXPECT_NO_THROW(r.read_box("model.tok.weight", e, sharding::Box{{0, 0}, {80, 16}}));
  const std::string err = error_of([&] { r.read_box("model.tok.weight", e, sharding::full_box(e.shape)); });
  EXPECT_NE(err.find("data-rank00004.safetensors"), std::string::npos) << err;
}

TEST(FormatV2, MetadataOfAFlatLayoutDoesNotGrowWithTheWorldSize) {
  // The metadata every rank computes for a 3-tensor FSDP unit, at 8 and at 16,384 ranks.
  auto text_at = [](int64_t world) {
    ck::CheckpointMetadata m;
    m.world_size = static_cast<int>(world);
    m.crc_block = 4194304;
    m.save_id = "0123456789abcdef";
    const std::vector<std::vector<int64_t>> shapes{{50257, 768}, {768}, {2304, 768}};
    int64_t T = 0;
    for (const auto& s : shapes) T += s.size() == 1 ? s[0] : s[0] * s[1];
    int64_t off = 0, key = 0;
    for (const auto& s : shapes) {
      const std::string fqn = "w" + std::to_string(key);
      ck::GroupPlacement g{world, 0, 1};
      auto plan = ck::plan_saved_layout(fqn, s, {}, sharding::Layout::flat(T, off, world), g, world, 0, key++);
      ck::EntryInfo e;
      e.kind = "sharded";
      e.shape = s;
      e.layout = plan.layout;
      m.keys.push_back(fqn);
      m.entries.emplace(fqn, e);
      off += s.size() == 1 ? s[0] : s[0] * s[1];
    }
    return ck::to_json(m);
  };
  const std::string small = text_at(8), large = text_at(16384);
  EXPECT_LE(large.size(), small.size() + 4 * 4) << "only the digits of the piece counts and the world size may grow";
  const auto back = ck::parse_metadata(large, "/nowhere");
  EXPECT_EQ(back.entries.at("w0").layout->pieces, 16384);
}

// Irregular layouts of 100,000 pieces (a version-1 chunk list, a version-2 list layout read
// back from its metadata text, as `tessera ckpt inspect` reads it): checked for overlaps by a
// sweep (sharding::first_overlap), not every pair (5 billion), and an overlap among them is
// named by its first pair in the list.
TEST(FormatV2, ListsOfAHundredThousandPiecesAreCheckedBySweep) {
  const int64_t n = 100000;
  ck::EntryInfo e;
  e.kind = "sharded";
  e.shape = {2 * n, 4};
  sharding::Layout L;
  L.rule = sharding::Layout::Rule::List;
  for (int64_t i = 0; i < n; ++i) {
    ck::ChunkInfo c;
    c.box = sharding::Box{{2 * i, 0}, {2, 4}};
    e.chunks.push_back(c);
    L.list.push_back({i % 2048, c.box});  // at most 64 pieces per data file
  }
  auto text_of = [&](const sharding::Layout& layout) {
    ck::CheckpointMetadata m;
    m.world_size = 2048;
    m.crc_block = 4194304;
    m.save_id = "0123456789abcdef";
    ck::EntryInfo v2 = e;
    v2.chunks.clear();
    v2.layout = layout;
    m.keys.push_back("w");
    m.entries.emplace("w", v2);
    return ck::to_json(m);
  };
  const std::string good = text_of(L);
  // Every pair of 100,000 pieces, 5 billion box intersections twice, would not end within the
  // suite's per-test timeout; the sweep takes well under a second (no timing asserted here).
  EXPECT_NO_THROW(ck::check_tiling("w", e));
  EXPECT_EQ(ck::parse_metadata(good, "/nowhere").entries.at("w").layout->list.size(), static_cast<size_t>(n));
  // Piece 70,000 moved up a row overlaps piece 69,999; the last one, at [1:3, 0:4], overlaps
  // pieces 0 and 1 (met first by the sweep, which goes along the rows), later in the list.
  for (sharding::Box* b : {&e.chunks[70000].box, &L.list[70000].box}) b->offsets[0] -= 1;
  for (sharding::Box* b : {&e.chunks[n - 1].box, &L.list[n - 1].box}) *b = sharding::Box{{1, 0}, {2, 4}};
  EXPECT_EQ(error_of([&] { ck::check_tiling("w", e); }),
            "key 'w': chunks [139998:140000, 0:4] and [139999:140001, 0:4] overlap");
  EXPECT_CONTAINS(error_of([&] { ck::parse_metadata(text_of(L), "/nowhere"); }),
                  "pieces [139998:140000, 0:4] and [139999:140001, 0:4] overlap");
  // A chunk outside the shape after an overlap: the overlap, as a chunk-by-chunk check meets it.
  e.chunks[80000].box.offsets[1] = 1;
  EXPECT_EQ(error_of([&] { ck::check_tiling("w", e); }),
            "key 'w': chunks [139998:140000, 0:4] and [139999:140001, 0:4] overlap");
  e.chunks[70000].box.offsets[0] += 1;
  EXPECT_EQ(error_of([&] { ck::check_tiling("w", e); }),
            "key 'w': chunk [160000:160002, 1:5] lies outside the shape [0:200000, 0:4]");
}

TEST(FormatV2, AWriterRefusesMetadataAReaderWouldRefuseAndKeepsThePreviousCheckpoint) {
  const std::string d = temp_dir();
  const std::string path = d + "/ck";
  ck::save(state_of(4, 1.0), path, *solo());
  state::StateDict big = state_of(4, 2.0);
  big.set("notes", std::string(ck::kMaxMetadataBytes, 'x'));
  const std::string err = error_of([&] { ck::save(big, path, *solo()); });
  EXPECT_NE(err.find("more than the 268435456-byte limit every reader enforces"), std::string::npos) << err;
  state::StateDict back = state_of(4, 0.0);
  ck::load_local(back, path);
  EXPECT_EQ(std::get<int64_t>(back.at("step")), 1);
  EXPECT_EQ(ck::list_dir(d).size(), 1u) << "no temporary left behind";
}

TEST(FormatV2, PythonPackageReadsBothVersionsAndRefusesWhatCxxRefuses) {
  // The package's own v2 suite (it writes v2 checkpoints of every layout and damages them),
  // then the v1 fixture and a C++-written v2 reshard of it, each against the consolidated copy.
  const std::string d = temp_dir();
  ck::reshard(kFixtures + "/fsdp3.ckpt", 4, d + "/r4.ckpt", false);
  const std::string script = std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR + "/tests/python/tessera_ckpt_v2_check.py";
  for (const std::string dir : {kFixtures + "/fsdp3.ckpt", d + "/r4.ckpt"}) {
    auto [rc, out] = run_command(script + " --v1 " + dir + " " + kFixtures + "/fsdp3-consolidated.safetensors");
    EXPECT_EQ(rc, 0) << dir << "\n" << out;
    EXPECT_NE(out.find("ok tessera_ckpt_v2_check:"), std::string::npos) << out;
  }
}
