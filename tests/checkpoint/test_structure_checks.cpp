// Issue 44 item 2: every reader of a checkpoint checks what `tessera ckpt verify` checks of
// its structure before it reads a byte (every data file present, holding exactly the pieces
// the layouts place there, each at its place), so a checkpoint verify refuses never comes
// out of consolidate, reshard or export as a clean one and is never loaded:
//  - a metadata edit that shrinks a tensor to no elements ([0, 4]): its pieces stay in the
//    data files, unread; the outputs verified clean with the tensor's bytes dropped;
//  - world_size raised to 3 with no data-rank00002: consolidate succeeded, and a 2-rank
//    load (gpt train --resume last) read it and later saved over it;
//  - two equal-shaped pieces swapped between data files (a writer's or a copy's mix-up):
//    nothing recorded a piece's place, so it loaded swapped. Data files now record each
//    piece's offsets (tessera.offsets), which every reader checks.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/offline/hf_export.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/sharding/sharded_tensor.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

// A 2-file format-2 checkpoint at `dir`: "w" F32 [8, 4] (0, 1, 2, ...) and "rng" U8 [2, 16]
// (row r = 16 r, 16 r + 1, ...) cut along dim 0 over the two files, and "step" = 5.
// Written by one process, then resharded to 2 (what a 2-rank save writes).
void two_file_checkpoint(const std::string& dir, bool with_w = true) {
  const std::string one = dir + ".one";
  state::StateDict sd;
  auto spec = sharding::ChunkSpec::over_ranks(0, 1);
  if (with_w) sd.set("w", sharding::ShardedTensor::scatter(at::arange(32, at::kFloat).reshape({8, 4}), spec, 0, solo()));
  sd.set("rng", sharding::ShardedTensor::scatter(at::arange(32, at::kByte).reshape({2, 16}), spec, 0, solo()));
  sd.set("step", int64_t(5));
  ck::save(sd, one, *solo(), {ck::SaveMode::Sharded});
  ck::reshard(one, 2, dir, false);
  fs::remove_all(one);
  ASSERT_TRUE(ck::verify(dir).ok);
}

// Every C++ reader of the checkpoint at `dir` refuses it, each with a message holding every
// string of `want`, and writes no output; so do the Python package's load and (unless the
// problem is a missing data file, which `python -m tessera_ckpt verify` reports as an error
// of its own rather than CORRUPT) its verify.
void expect_every_reader_refuses(const std::string& dir, const std::vector<std::string>& want,
                                 bool python_verify = true) {
  const std::string out = fs::path(dir).parent_path().string() + "/out";
  fs::remove_all(out);
  fs::create_directory(out);
  const ck::CheckpointMetadata m = ck::open_checkpoint(dir);
  auto target = [&] {
    state::StateDict t;
    for (const auto& k : m.keys) {
      const auto& e = m.entries.at(k);
      if (e.is_tensor()) t.set(k, at::zeros(e.shape, at::TensorOptions().dtype(e.dtype)));
      else t.set(k, e.value);
    }
    return t;
  };
  std::vector<std::pair<std::string, std::string>> errors = {
      {"load_local", error_of([&] {
         state::StateDict t = target();
         ck::load_local(t, dir);
       })},
      {"load", error_of([&] {
         state::StateDict t = target();
         ck::load(t, dir, *solo());
       })},
      {"consolidate", error_of([&] { ck::consolidate(dir, out + "/c.safetensors", false); })},
      {"reshard", error_of([&] { ck::reshard(dir, 3, out + "/r3", false); })},
      {"export safetensors", error_of([&] { ck::export_checkpoint(dir, ck::ExportFormat::Safetensors, out + "/e.st", false); })},
      {"export torch", error_of([&] { ck::export_checkpoint(dir, ck::ExportFormat::Torch, out + "/e.pt", false); })},
      {"export hf", error_of([&] { ck::export_hf(dir, out + "/hf", {}, false); })},
  };
  const ck::VerifyReport v = ck::verify(dir);
  EXPECT_FALSE(v.ok) << dir << ": verify said OK";
  std::string problems;
  for (const auto& p : v.problems) problems += p + "\n";
  errors.push_back({"verify", problems.empty() ? "(no problem)" : problems});
  for (const auto& [what, msg] : errors)
    for (const auto& w : want) EXPECT_NE(msg.find(w), std::string::npos) << what << ": '" << w << "' not in: " << msg;
  EXPECT_TRUE(fs::is_empty(out)) << "an output was written from " << dir;
  // The Python package's load and verify (and `python -m tessera_ckpt verify`) alike.
  std::string cmd = std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                    "/tests/python/tessera_ckpt_expect_error.py \"" + dir + "\"" +
                    (python_verify ? " --also-verify" : "");
  for (const auto& w : want) cmd += " \"" + w + "\"";
  auto [rc, py_out] = run_command(cmd);
  EXPECT_EQ(rc, 0) << py_out;
}

}  // namespace

TEST(StructureChecks, ATensorShrunkToNothingInTheMetadataIsRefusedByEveryReader) {
  const std::string root = temp_dir("tessera-structure"), dir = root + "/ckpt";
  two_file_checkpoint(dir);
  tamper_v2_metadata(dir, [](ojson& j) { j["entries"]["w"]["shape"] = {0, 4}; });
  // The metadata itself is valid (a zero-row tensor has no piece); the data files hold "w".
  EXPECT_NO_THROW(ck::open_checkpoint(dir));
  expect_every_reader_refuses(dir, {"data-rank00000.safetensors': tensor 'w' is no piece of any layout in the metadata"});
}

TEST(StructureChecks, AWorldSizeWithoutItsDataFilesIsRefusedByEveryReader) {
  const std::string root = temp_dir("tessera-structure"), dir = root + "/ckpt";
  two_file_checkpoint(dir);
  tamper_v2_metadata(dir, [](ojson& j) { j["world_size"] = 3; });
  EXPECT_NO_THROW(ck::open_checkpoint(dir));  // every layout's files lie in [0, 3)
  expect_every_reader_refuses(dir, {"data-rank00002.safetensors"}, false);
}

// Real ranks: a 2-rank load reads data files 0 and 1 only, yet refuses a checkpoint whose
// world size names a third that is missing, on every rank, before it touches the target
// (each rank checks every second data file, and they agree before reading).
TEST(StructureChecks, ATwoRankLoadRefusesAMissingDataFileItDoesNotRead) {
  const std::string root = temp_dir("tessera-structure"), dir = root + "/ckpt";
  auto s = run_ranks(2, {"ckpt_save", dir, "sharded", "sharded"}, 120);
  ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
  auto good = run_ranks(2, {"ckpt_load", dir, "sharded"}, 120);
  ASSERT_EQ(good.launch.exit_code, 0) << good.all_output();
  tamper_v2_metadata(dir, [](ojson& j) { j["world_size"] = 3; });
  auto bad = run_ranks(2, {"ckpt_load_error", dir}, 120);
  ASSERT_EQ(bad.launch.exit_code, 0) << bad.all_output();
  // Rank 0 checks data files 0 and 2 and finds 2 missing; rank 1 (file 1 fine) hears it.
  bool rank0 = false, rank1 = false;
  for (const auto& l : bad.out[0])
    rank0 |= l.rfind("load error rank 0: ", 0) == 0 && l.find("data-rank00002.safetensors") != std::string::npos;
  for (const auto& l : bad.out[1])
    rank1 |= l.rfind("load error rank 1: ", 0) == 0 && l.find("failed on rank 0: ") != std::string::npos &&
             l.find("data-rank00002.safetensors") != std::string::npos && l.find("(nothing was loaded)") != std::string::npos;
  EXPECT_TRUE(rank0 && rank1) << bad.all_output();
}

TEST(StructureChecks, PiecesSwappedBetweenDataFilesAreRefusedByTheirRecordedPlace) {
  const std::string root = temp_dir("tessera-structure"), dir = root + "/ckpt";
  two_file_checkpoint(dir, false);  // "rng" only: each data file holds one [1, 16] row of it
  const std::string f0 = dir + "/data-rank00000.safetensors", f1 = dir + "/data-rank00001.safetensors";
  // Each file's header records the place of its piece.
  for (const auto& [f, row] : std::vector<std::pair<std::string, int>>{{f0, 0}, {f1, 1}}) {
    const ck::SafetensorsReader r(f);
    EXPECT_EQ(nlohmann::json::parse(r.meta(ck::kPieceOffsetsKey)), (nlohmann::json{{"rng", {row, 0}}})) << f;
  }
  // Swap the two rows whole: bytes, block checksums and recorded places, each file keeping
  // its own save id and rank (a mix-up the names, shapes and checksums cannot show).
  auto header_of = [](const std::string& f) {
    const std::string b = read_bytes(f);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(b[i]);
    return std::make_pair(ojson::parse(b.substr(8, n)), b.substr(8 + n));
  };
  auto [h0, d0] = header_of(f0);
  auto [h1, d1] = header_of(f1);
  ASSERT_EQ(d0.size(), 16u);
  ASSERT_EQ(d1.size(), 16u);
  std::swap(d0, d1);
  auto swap_from = [](const ojson& other) {
    return [other](ojson& h) {
      for (const char* k : {"tessera.crc32c", "tessera.offsets"}) h["__metadata__"][k] = other["__metadata__"][k];
    };
  };
  auto write_data = [](const std::string& f, const std::string& data) {
    const std::string b = read_bytes(f);
    write_bytes(f, b.substr(0, b.size() - data.size()) + data);
  };
  tamper_header(f0, swap_from(h1));
  write_data(f0, d0);
  tamper_header(f1, swap_from(h0));
  write_data(f1, d1);
  expect_every_reader_refuses(dir, {"key 'rng': tensor 'rng' holds the piece at offsets [1, 0], the layout places the "
                                    "piece at [0, 0] in this file (pieces swapped or mixed up)"});
}
