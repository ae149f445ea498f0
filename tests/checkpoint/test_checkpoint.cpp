// Checkpoints in one process: round trips, strict/non-strict loading, commit safety,
// and corruption of every kind detected with an error naming the file and key.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <fstream>

#include "checkpoint/checkpoint_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/error.h"

using namespace tessera;
namespace ck = tessera::checkpoint;

using namespace tessera::testing;

namespace {


// solo(): checkpoint/checkpoint_test_util.h

// A sharded tensor over the single-process communicator, split into `pieces` pieces
// along dim 0 (all on rank 0, as an EnumerableSpec).
sharding::ShardedTensor sharded_of(const at::Tensor& full, int pieces) {
  std::vector<sharding::ShardMetadata> shards;
  std::vector<sharding::Shard> local;
  for (int i = 0; i < pieces; ++i) {
    sharding::ShardMetadata m{sharding::chunk_box(full.sizes().vec(), 0, pieces, i), {0, c10::kCPU}};
    shards.push_back(m);
    local.push_back({sharding::narrow_to(full, sharding::full_box(full.sizes().vec()), m.box).clone(), m});
  }
  return sharding::ShardedTensor::from_parts(local, shards, full.sizes().vec(), full.scalar_type(), solo());
}

state::StateDict sample(bool zeros) {
  auto f = [&](at::Tensor t) { return zeros ? at::zeros_like(t) : t; };
  state::StateDict sd;
  auto model = std::make_shared<state::StateDict>();
  model->set("w", f(at::arange(35, at::kFloat).reshape({7, 5}) * 0.5));
  model->set("bf", f((at::arange(9, at::kFloat) - 4).to(at::kBFloat16)));
  model->set("empty", at::empty({0, 3}));
  model->set("sh", sharded_of(f(at::arange(22, at::kDouble).reshape({11, 2})), 3));
  sd.set("model", model);
  sd.set("step", int64_t(zeros ? 0 : 42));
  sd.set("lr", zeros ? 0.0 : -0.0);
  sd.set("tag", std::string(zeros ? "" : "hello"));
  return sd;
}

void expect_sample(const state::StateDict& sd) {
  const auto& m = sd.dict("model");
  EXPECT_TRUE(at::equal(m.tensor("w"), at::arange(35, at::kFloat).reshape({7, 5}) * 0.5));
  EXPECT_TRUE(at::equal(m.tensor("bf"), (at::arange(9, at::kFloat) - 4).to(at::kBFloat16)));
  EXPECT_EQ(m.tensor("empty").sizes(), at::IntArrayRef({0, 3}));
  at::Tensor full = at::arange(22, at::kDouble).reshape({11, 2});
  for (const auto& s : m.sharded("sh").local_shards())
    EXPECT_TRUE(at::equal(s.tensor, sharding::narrow_to(full, sharding::full_box({11, 2}), s.meta.box)));
  EXPECT_EQ(sd.integer("step"), 42);
  EXPECT_TRUE(std::signbit(sd.number("lr")));
  EXPECT_EQ(sd.string("tag"), "hello");
}

// Path of the single data file of a 1-rank sharded checkpoint.
std::string data_file(const std::string& dir) { return dir + "/data-rank00000.safetensors"; }

}  // namespace

TEST(Checkpoint, ShardedAndFullRoundTripsBitExact) {
  const std::string dir = temp_dir();
  for (auto mode : {ck::SaveMode::Sharded, ck::SaveMode::Full}) {
    const std::string path = dir + (mode == ck::SaveMode::Full ? "/full.safetensors" : "/ckpt");
    ck::save(sample(false), path, *solo(), {mode});
    auto target = sample(true);
    ck::LoadResult r = ck::load(target, path, *solo());
    expect_sample(target);
    EXPECT_TRUE(r.missing.empty() && r.unexpected.empty() && r.mismatched.empty());
    EXPECT_EQ(r.loaded.size(), 7u);
    EXPECT_TRUE(ck::verify(path).ok);
  }
  // A differently sharded target (one piece instead of three, and a plain tensor).
  auto t2 = sample(true);
  t2.dict("model").set("sh", sharded_of(at::zeros({11, 2}, at::kDouble), 1));
  ck::load_local(t2, dir + "/ckpt");
  expect_sample(t2);
  auto t3 = sample(true);
  t3.dict("model").set("sh", at::zeros({11, 2}, at::kDouble));
  ck::load_local(t3, dir + "/full.safetensors");
  EXPECT_TRUE(at::equal(t3.dict("model").tensor("sh"), at::arange(22, at::kDouble).reshape({11, 2})));
}

TEST(Checkpoint, LoadsIntoParametersInPlace) {
  const std::string dir = temp_dir();
  ck::save(sample(false), dir + "/c", *solo());
  at::Tensor p = at::zeros({7, 5}).requires_grad_(true);
  const void* before = p.data_ptr();
  state::StateDict t;
  auto model = std::make_shared<state::StateDict>();
  model->set("w", p);
  t.set("model", model);
  ck::LoadResult r = ck::load_local(t, dir + "/c", {false});
  EXPECT_EQ(p.data_ptr(), before);
  EXPECT_TRUE(at::equal(p.detach(), at::arange(35, at::kFloat).reshape({7, 5}) * 0.5));
  EXPECT_TRUE(p.requires_grad());
  // Non-strict: tensors the target lacks are "unexpected", plain values come back as leftovers.
  EXPECT_EQ(r.loaded, std::vector<std::string>{"model.w"});
  EXPECT_EQ(r.unexpected, (std::vector<std::string>{"model.bf", "model.empty", "model.sh"}));
  EXPECT_EQ(r.leftovers.integer("step"), 42);
  EXPECT_EQ(r.leftovers.string("tag"), "hello");
}

TEST(Checkpoint, StrictLoadNamesEveryProblemAndModifiesNothing) {
  const std::string dir = temp_dir();
  ck::save(sample(false), dir + "/c", *solo());
  auto target = sample(true);
  auto& m = target.dict("model");
  m.erase("bf");                                  // unexpected in the checkpoint
  m.set("extra", at::zeros({2}));                 // missing from the checkpoint
  m.set("w", at::full({5, 7}, 3.0));              // shape mismatch
  target.set("step", at::zeros({1}));             // kind mismatch
  auto sh = sharded_of(at::zeros({11, 2}, at::kFloat), 2);  // dtype mismatch
  m.set("sh", sh);
  const std::string err = error_of([&] { ck::load_local(target, dir + "/c"); });
  for (const char* want : {"Missing keys: model.extra", "Unexpected keys: model.bf", "model.w: shape [7, 5] in the checkpoint, [5, 7] in the target",
                           "model.sh: dtype Double in the checkpoint, Float", "step: the checkpoint holds a int, the target a tensor",
                           "nothing was loaded"})
    EXPECT_NE(err.find(want), std::string::npos) << "want '" << want << "' in: " << err;
  EXPECT_TRUE(at::equal(m.tensor("w"), at::full({5, 7}, 3.0)));
  EXPECT_EQ(target.string("tag"), "");  // plain values untouched too
  // Non-strict loads the rest and reports the same problems.
  ck::LoadResult r = ck::load_local(target, dir + "/c", {false});
  EXPECT_EQ(r.missing, std::vector<std::string>{"model.extra"});
  EXPECT_EQ(r.unexpected, std::vector<std::string>{"model.bf"});
  EXPECT_EQ(r.mismatched.size(), 3u);
  EXPECT_EQ(target.string("tag"), "hello");
}

TEST(Checkpoint, SavingOverExistingPaths) {
  const std::string dir = temp_dir();
  // A plain file and a foreign non-empty directory are refused, untouched.
  write_bytes(dir + "/file", "precious");
  EXPECT_NE(error_of([&] { ck::save(sample(false), dir + "/file", *solo()); }).find("is not a Tessera checkpoint"),
            std::string::npos);
  EXPECT_EQ(read_bytes(dir + "/file"), "precious");
  ck::make_dir(dir + "/foreign");
  write_bytes(dir + "/foreign/x", "mine");
  const std::string err = error_of([&] { ck::save(sample(false), dir + "/foreign", *solo(), {ck::SaveMode::Full}); });
  EXPECT_NE(err.find("refusing to save to '" + dir + "/foreign'"), std::string::npos) << err;
  EXPECT_EQ(read_bytes(dir + "/foreign/x"), "mine");
  EXPECT_EQ(ck::list_dir(dir).size(), 2u);  // no temporary left behind
  // An empty directory is fine; re-saving over a Tessera checkpoint replaces it.
  ck::make_dir(dir + "/empty");
  ck::save(sample(false), dir + "/empty", *solo());
  auto sd = sample(false);
  sd.set("step", int64_t(43));
  ck::save(sd, dir + "/empty", *solo());
  auto t = sample(true);
  ck::load_local(t, dir + "/empty");
  EXPECT_EQ(t.integer("step"), 43);
  // Sharded over consolidated and back.
  ck::save(sample(false), dir + "/x", *solo(), {ck::SaveMode::Full});
  ck::save(sample(false), dir + "/x", *solo(), {ck::SaveMode::Sharded});
  EXPECT_TRUE(ck::is_directory(dir + "/x"));
  ck::save(sample(false), dir + "/x", *solo(), {ck::SaveMode::Full});
  EXPECT_TRUE(ck::is_regular_file(dir + "/x"));
  EXPECT_EQ(ck::list_dir(dir).size(), 4u) << "leftover temporaries";
}

TEST(CheckpointCorruption, EachKindIsDetectedWithTheRightError) {
  const std::string dir = temp_dir();
  const std::string good = dir + "/good";
  ck::save(sample(false), good, *solo());
  auto fresh = [&](const std::string& name) {
    const std::string p = dir + "/" + name;
    ck::make_dir(p);
    for (const auto& f : ck::list_dir(good)) write_bytes(p + "/" + f, read_bytes(good + "/" + f));
    return p;
  };
  auto load_err = [&](const std::string& p) {
    auto t = sample(true);
    return error_of([&] { ck::load_local(t, p); });
  };
  auto expect_both = [&](const std::string& p, const std::string& want) {
    const std::string e = load_err(p);
    EXPECT_NE(e.find(want), std::string::npos) << "load: want '" << want << "' in: " << e;
    ck::VerifyReport v = ck::verify(p);
    EXPECT_FALSE(v.ok) << p;
    std::string all;
    for (auto& s : v.problems) all += s + "\n";
    EXPECT_NE(all.find(want), std::string::npos) << "verify: want '" << want << "' in: " << all;
  };
  downgrade_to_v1(good);  // the version-1 reader's defences (format 2's: test_format_v2.cpp)
  nlohmann::json meta = nlohmann::json::parse(read_bytes(good + "/tessera-checkpoint.json"));
  const auto& chunk = meta["entries"]["model.w"]["chunks"][0];
  const uint64_t w_begin = chunk["byte_range"][0];

  // Flipped byte inside model.w's data.
  std::string p = fresh("flip");
  std::string bytes = read_bytes(data_file(p));
  bytes[w_begin + 5] ^= 0x10;
  write_bytes(data_file(p), bytes);
  expect_both(p, "key 'model.w' chunk [0:7, 0:5]: checksum mismatch");
  expect_both(p, data_file(p));

  // Truncated data file.
  p = fresh("trunc");
  bytes = read_bytes(data_file(p));
  write_bytes(data_file(p), bytes.substr(0, bytes.size() - 7));
  expect_both(p, "data file 'data-rank00000.safetensors' is " + std::to_string(bytes.size() - 7) + " bytes");

  // Missing data file.
  p = fresh("missing");
  ::unlink(data_file(p).c_str());
  expect_both(p, "data file 'data-rank00000.safetensors' is missing");

  // Missing metadata: an incomplete checkpoint.
  p = fresh("nometa");
  ::unlink((p + "/tessera-checkpoint.json").c_str());
  expect_both(p, "is not a Tessera checkpoint");

  // Bad metadata JSON.
  p = fresh("badjson");
  write_bytes(p + "/tessera-checkpoint.json", read_bytes(p + "/tessera-checkpoint.json").substr(0, 100));
  expect_both(p, "metadata is not valid JSON");

  // Path traversal in a chunk's file and in the file list.
  for (const char* evil : {"../good/data-rank00000.safetensors", "/etc/passwd", ".."}) {
    p = fresh("traversal");
    nlohmann::json m = meta;
    m["entries"]["model.w"]["chunks"][0]["file"] = evil;
    write_bytes(p + "/tessera-checkpoint.json", m.dump());
    expect_both(p, "is not a plain name inside the checkpoint directory");
    m = meta;
    m["files"][0]["name"] = evil;
    write_bytes(p + "/tessera-checkpoint.json", m.dump());
    expect_both(p, "is not a plain name inside the checkpoint directory");
    ck::remove_all(p);
  }

  // Metadata that lies: a chunk missing (incomplete tiling), a byte range moved.
  p = fresh("lies");
  nlohmann::json m = meta;
  m["entries"]["model.sh"]["chunks"].erase(1);
  write_bytes(p + "/tessera-checkpoint.json", m.dump());
  expect_both(p, "key 'model.sh': the chunks cover");
  m = meta;
  m["entries"]["model.w"]["chunks"][0]["byte_range"] = {w_begin + 4, w_begin + 4 + 140};
  // Re-serialized by the library, so its metadata_crc32c is valid: the data checks must catch the lie.
  write_bytes(p + "/tessera-checkpoint.json", ck::to_json(ck::parse_metadata(m.dump(), p)));
  expect_both(p, "disagrees with the metadata");
  // A hand-edited metadata file (a value changed, checksum not updated) is refused.
  m = meta;
  m["entries"]["step"]["value"] = 8;
  write_bytes(p + "/tessera-checkpoint.json", m.dump(1));
  expect_both(p, "metadata_crc32c");
  m = meta;
  m["version"] = 99;
  write_bytes(p + "/tessera-checkpoint.json", m.dump());
  expect_both(p, "format version 99 is not supported");

  // Damaged data-file header.
  p = fresh("header");
  bytes = read_bytes(data_file(p));
  bytes[8] = '!';  // the opening brace of the header JSON
  write_bytes(data_file(p), bytes);
  expect_both(p, "safetensors header is not valid JSON");

  // A consolidated file with a flipped byte.
  const std::string full = dir + "/full.safetensors";
  ck::save(sample(false), full, *solo(), {ck::SaveMode::Full});
  bytes = read_bytes(full);
  bytes[bytes.size() - 3] ^= 0x40;
  write_bytes(full, bytes);
  expect_both(full, "checksum mismatch");
  EXPECT_TRUE(ck::verify(good).ok);
}

TEST(CheckpointCorruption, LargeTensorChecksBlocksOnlyWhereItReads) {
  // 6 MiB tensor: two checksum blocks. Corrupt the second; a target wanting rows from the
  // first block loads, one touching the second fails.
  const std::string dir = temp_dir();
  const int64_t rows = 6 * 1024, cols = 256;  // 6 MiB of float
  at::Tensor big = at::arange(rows * cols, at::kFloat).reshape({rows, cols});
  state::StateDict sd;
  sd.set("big", big);
  ck::save(sd, dir + "/c", *solo(), {ck::SaveMode::Full});
  std::string bytes = read_bytes(dir + "/c");
  bytes[bytes.size() - 1000] ^= 1;
  write_bytes(dir + "/c", bytes);
  // A reader of the first quarter of the rows (what rank 0 of 4 loads) touches block 0 only.
  ck::CheckpointMetadata meta = ck::open_checkpoint(dir + "/c");
  ck::ChunkReader reader(meta);
  const auto& e = meta.entries.at("big");
  sharding::Box quarter = sharding::chunk_box({rows, cols}, 0, 4, 0);
  at::Tensor q = at::zeros(quarter.sizes);
  EXPECT_EQ(reader.copy_into("big", e, e.chunks[0], q, quarter), quarter.numel());
  EXPECT_TRUE(at::equal(q, big.narrow(0, 0, rows / 4)));
  sharding::Box last = sharding::chunk_box({rows, cols}, 0, 4, 3);
  at::Tensor l = at::zeros(last.sizes);
  EXPECT_NE(error_of([&] { reader.copy_into("big", e, e.chunks[0], l, last); }).find("checksum mismatch in block 1"),
            std::string::npos);
  state::StateDict t2;
  t2.set("big", at::zeros({rows, cols}));
  EXPECT_NE(error_of([&] { ck::load_local(t2, dir + "/c"); }).find("checksum mismatch in block 1"), std::string::npos);
}

// `verify` reads a large chunk in windows of whole blocks (direct I/O, into one reused
// buffer): a flipped byte in the last block of the second window, and one in a short
// last block, are each reported with their block, and an intact file verifies.
TEST(CheckpointCorruption, VerifyFindsDamageInEveryWindowOfALargeChunk) {
  const std::string dir = temp_dir();
  const int64_t rows = 43 * 1024 + 5, cols = 256;  // 43 MiB and 5 KiB of float: blocks 0..10
  state::StateDict sd;
  sd.set("big", at::arange(rows * cols, at::kFloat).reshape({rows, cols}));
  ck::save(sd, dir + "/c", *solo(), {ck::SaveMode::Full});
  EXPECT_TRUE(ck::verify(dir + "/c").ok);
  const std::string good = read_bytes(dir + "/c");
  const uint64_t data_start = good.size() - static_cast<uint64_t>(rows * cols * 4);
  for (auto [at, block] : std::vector<std::pair<uint64_t, int>>{{(39u << 20) + 17, 9}, {(43u << 20) + 100, 10}}) {
    std::string bad = good;
    bad[data_start + at] ^= 4;
    write_bytes(dir + "/c", bad);
    ck::VerifyReport v = ck::verify(dir + "/c");
    EXPECT_FALSE(v.ok);
    std::string all;
    for (auto& s : v.problems) all += s + "\n";
    EXPECT_NE(all.find("checksum mismatch in block " + std::to_string(block)), std::string::npos) << all;
  }
}
