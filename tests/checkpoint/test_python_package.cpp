// The tessera_ckpt Python package (python/tessera_ckpt) against Tessera's C++ writer: sharded
// checkpoints written at 1, 2 and 3 ranks (uneven pieces, an empty piece, bf16, plain values),
// one process's checkpoint of every dtype with NaN / -0 / infinity bits, integer extremes and
// tensors of several checksum blocks, consolidated files, and a GPT checkpoint trained with FSDP
// on 2 ranks. Each is loaded by the package in the configured Python (TESSERA_PYTHON: torch 1.13
// in `build`, torch 2.x in `build-torch2`) and compared value for value with an independent
// reader: torch.load of `tessera ckpt export --format torch`, and the safetensors library on the
// consolidated file. Damaged checkpoints (a flipped data or header byte, edited metadata, a
// missing data file) must be refused with the file and key named.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/sharding/sharded_tensor.h"
#include "tessera/state/state_dict.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

const std::string kCli = TESSERA_CLI;
const std::string kGpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";


// solo(): checkpoint/checkpoint_test_util.h

// `full` split into `pieces` pieces along `dim`, every piece on this (single) rank.
sharding::ShardedTensor split(const at::Tensor& full, int64_t dim, int pieces) {
  std::vector<sharding::ShardMetadata> shards;
  std::vector<sharding::Shard> local;
  const auto shape = full.sizes().vec();
  for (int i = 0; i < pieces; ++i) {
    sharding::ShardMetadata m{sharding::chunk_box(shape, dim, pieces, i), {0, c10::kCPU}};
    shards.push_back(m);
    local.push_back({sharding::narrow_to(full, sharding::full_box(shape), m.box).clone(), m});
  }
  return sharding::ShardedTensor::from_parts(local, shards, shape, full.scalar_type(), solo());
}

at::Tensor longs(std::vector<int64_t> v) { return at::tensor(at::ArrayRef<int64_t>(v)).clone(); }

double from_bits(uint64_t b) {
  double d;
  std::memcpy(&d, &b, 8);
  return d;
}

constexpr uint64_t kNanPayload = 0x7FF8000000000123ull;

// Mirrored by special_state() in tests/python/tessera_ckpt_check.py.
state::StateDict special_state() {
  auto m = std::make_shared<state::StateDict>();
  m->set("f16", (at::arange(12, at::kFloat) * 0.5 - 2).reshape({3, 4}).to(at::kHalf));
  m->set("bf16", (at::arange(5, at::kFloat) - 2.5).to(at::kBFloat16));
  m->set("f64", longs({int64_t(kNanPayload), std::numeric_limits<int64_t>::min(), 0x7FF0000000000000ll,
                       -(int64_t(1) << 52), 1, 0x3FD5555555555555ll})
                    .view(at::kDouble));
  m->set("f32", longs({0x7FC00001, -(int64_t(1) << 31), 0x7F800000, 1, 0x40600000, -0x40800000})
                    .to(at::kInt)
                    .view(at::kFloat)
                    .reshape({2, 3}));
  m->set("i8", (at::arange(256, at::kLong) - 128).to(at::kChar));
  m->set("u8", at::arange(256, at::kLong).to(at::kByte));
  m->set("i16", longs({-32768, -1, 0, 1, 32767}).to(at::kShort));
  m->set("i32", longs({std::numeric_limits<int32_t>::min(), -7, 0, std::numeric_limits<int32_t>::max()}).to(at::kInt));
  m->set("i64", longs({std::numeric_limits<int64_t>::min(), -1, 0, std::numeric_limits<int64_t>::max()}));
  m->set("mask", longs({1, 0, 0, 1, 1}).to(at::kBool));
  // Three pieces of 4.4 MB: two checksum blocks each, the second a short one.
  m->set("big", split((at::arange(3000 * 1100, at::kFloat) + 0.25).reshape({3000, 1100}), 0, 3));
  // One 24 MB chunk: five whole 4 MiB blocks and a short one.
  m->set("whole", at::arange(2 * 3000000, at::kFloat).reshape({2, 3000000}));
  // Pieces of columns: not contiguous in the whole tensor.
  m->set("cols", split((at::arange(28, at::kDouble) * 1.5).reshape({4, 7}), 1, 3));
  m->set("empty", split(at::zeros({0, 5}), 0, 2));
  m->set("scalar", at::scalar_tensor(2.5, at::kDouble));
  state::StateDict sd;
  sd.set("model", m);
  sd.set("step", int64_t(42));
  sd.set("int_min", std::numeric_limits<int64_t>::min());
  sd.set("int_max", std::numeric_limits<int64_t>::max());
  sd.set("nan", from_bits(kNanPayload));
  sd.set("negzero", -0.0);
  sd.set("inf", std::numeric_limits<double>::infinity());
  sd.set("neginf", -std::numeric_limits<double>::infinity());
  sd.set("tiny", from_bits(1));
  sd.set("third", 1.0 / 3.0);
  sd.set("flag", true);
  sd.set("off", false);
  sd.set("text", std::string("h\xc3\xa9llo \"q\"\n\t\xe2\x9c\x93"));
  sd.set("blob", state::Bytes{std::string("\x00\xff\x01tessera", 10)});
  sd.set("empty_dict", std::make_shared<state::StateDict>());
  return sd;
}

void flip_byte(const std::string& path, uint64_t at) {
  std::string b = read_bytes(path);
  ASSERT_LT(at, b.size()) << path;
  b[at] = static_cast<char>(b[at] ^ 0x10);
  write_bytes(path, b);
}

// Replaces the first `from` of the metadata by `to`, then (recompute) writes a valid
// metadata_crc32c, as an editor who knows the format would.
void edit_metadata(const std::string& dir, const std::string& from, const std::string& to, bool recompute) {
  const std::string f = dir + "/tessera-checkpoint.json";
  tessera::testing::downgrade_to_v1(dir);  // edits of version 1's indented text
  std::string text = read_bytes(f);
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from << " not in " << text;
  text.replace(at, from.size(), to);
  if (recompute) {
    const std::string marker = "\n \"metadata_crc32c\": \"";
    const size_t m = text.find(marker);
    ASSERT_NE(m, std::string::npos);
    text.replace(m + marker.size(), 8, "00000000");
    text.replace(m + marker.size(), 8, ck::crc_hex(ck::crc32c(text.data(), text.size())));
  }
  write_bytes(f, text);
}

// A chunk of `key` stored in `file` (from the metadata): its first byte in the file.
uint64_t chunk_begin(const std::string& dir, const std::string& key, const std::string& file) {
  tessera::testing::downgrade_to_v1(dir);
  auto j = nlohmann::json::parse(read_bytes(dir + "/tessera-checkpoint.json"));
  for (const auto& c : j["entries"][key]["chunks"])
    if (c["file"] == file) return c["byte_range"][0].get<uint64_t>();
  ADD_FAILURE() << key << " has no chunk in " << file;
  return 0;
}

std::string copy_of(const std::string& src, const std::string& dst) {
  fs::copy(src, dst, fs::copy_options::recursive);
  return dst;
}

}  // namespace

// The worker's known state (tests/checkpoint/checkpoint_scenarios.cpp) saved by 1, 2 and 3
// ranks: at 3 ranks model.w's 7 rows split 3/3/1 and model.e [0, 4] has empty pieces.
TEST(PythonPackage, LoadsShardedCheckpointsWrittenAtOneTwoAndThreeRanks) {
  const std::string dir = temp_dir("tessera-pypkg");
  for (int n = 1; n <= 3; ++n) {
    const std::string ckpt = dir + "/w" + std::to_string(n);
    auto r = run_ranks(n, {"ckpt_save", ckpt, "sharded", "sharded"}, 120);
    ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
    auto [erc, eout] = run_command(kCli + " ckpt export " + ckpt + " --format torch -o " + ckpt + ".pt");
    ASSERT_EQ(erc, 0) << eout;
    auto [crc, cout_] = run_command(kCli + " ckpt consolidate " + ckpt + " -o " + ckpt + ".safetensors");
    ASSERT_EQ(crc, 0) << cout_;
    // 12 keys against the known state, 8 tensors against torch.load, 12 against the
    // safetensors library and the consolidated file's own plain values.
    auto [rc, out] = run_command(py("tessera_ckpt_check.py " + ckpt + " --state worker --kind sharded --world-size " +
                                    std::to_string(n) + " --torch " + ckpt + ".pt --safetensors " + ckpt +
                                    ".safetensors --prefix model. --prefix-count 6"));
    EXPECT_EQ(rc, 0) << "world size " << n << ": " << out;
    EXPECT_NE(out.find("ok 32 "), std::string::npos) << out;
  }
  // Replicated plain tensors (all in rank 0's file), and a consolidated file written by a
  // 2-rank save itself (SaveMode::Full).
  auto r = run_ranks(2, {"ckpt_save", dir + "/plain", "sharded", "plain"}, 120);
  ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
  auto f = run_ranks(2, {"ckpt_save", dir + "/full.safetensors", "full", "sharded"}, 120);
  ASSERT_EQ(f.launch.exit_code, 0) << f.all_output();
  auto [rc, out] = run_command(py("tessera_ckpt_check.py " + dir + "/plain --state worker --world-size 2 --prefix opt") +
                               " && " +
                               py("tessera_ckpt_check.py " + dir + "/full.safetensors --state worker --kind consolidated "
                                  "--world-size 2 --prefix opt. --prefix-count 4"));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok 12 "), std::string::npos) << out;
  EXPECT_NE(out.find("ok 12 "), out.rfind("ok 12 ")) << out;  // both ran

  // The crash window of a publish without RENAME_EXCHANGE: the destination is missing and
  // the previous checkpoint is whole at its .NAME.tessera-old-* sibling, which loads instead.
  fs::rename(dir + "/plain", dir + "/.plain.tessera-old-4242-0");
  auto [arc, aout] = run_command(py("tessera_ckpt_check.py " + dir + "/plain --state worker --world-size 2"));
  EXPECT_EQ(arc, 0) << aout;
  EXPECT_NE(aout.find("ok 12 "), std::string::npos) << aout;
  fs::rename(dir + "/.plain.tessera-old-4242-0", dir + "/.plain.tessera-tmp-4242-0");  // a torn save is never read
  auto [trc, tout] = run_command(py("tessera_ckpt_expect_error.py " + dir + "/plain \"checkpoint '" + dir +
                                    "/plain' does not exist\""));
  EXPECT_EQ(trc, 0) << tout;
}

// Every dtype, plain values whose bits matter (a NaN payload, -0.0, infinities, a denormal,
// int64 extremes), unicode text, bytes with NUL, an empty nested dict, tensors of several
// 4 MiB checksum blocks (sharded and whole), column pieces and a 0-dim tensor; sharded and
// consolidated; checksums by google-crc32c (the default, and forced).
TEST(PythonPackage, DtypesPlainValuesAndMultiBlockTensorsLoadBitExact) {
  const std::string dir = temp_dir("tessera-pypkg");
  ck::save(special_state(), dir + "/ckpt", *solo(), {ck::SaveMode::Sharded});
  ck::save(special_state(), dir + "/full.safetensors", *solo(), {ck::SaveMode::Full});
  auto [erc, eout] = run_command(kCli + " ckpt export " + dir + "/ckpt --format torch -o " + dir + "/ckpt.pt");
  ASSERT_EQ(erc, 0) << eout;
  // 29 keys against the expected state, 15 tensors against torch.load, 29 against the
  // safetensors library and the consolidated file's plain-value JSON.
  auto [rc, out] = run_command(py("tessera_ckpt_check.py " + dir + "/ckpt --state special --kind sharded --world-size 1 "
                                  "--torch " + dir + "/ckpt.pt --safetensors " + dir +
                                  "/full.safetensors --prefix model --prefix-count 15"));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok 73 crc google_crc32c"), std::string::npos) << out;
  auto [rc2, out2] = run_command("TESSERA_CKPT_CRC=package " +
                                 py("tessera_ckpt_check.py " + dir + "/full.safetensors --state special --kind "
                                    "consolidated --world-size 1"));
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("ok 29 crc google_crc32c"), std::string::npos) << out2;
  // A flipped byte in the last block of the 24 MB tensor (read in 16 MiB pieces, each
  // checksummed on another thread while the next is read): the error names that block.
  const std::string damaged = dir + "/damaged.safetensors";
  fs::copy_file(dir + "/full.safetensors", damaged);
  {
    ck::SafetensorsReader reader(damaged);
    flip_byte(damaged, reader.find("model.whole")->begin + 21000000);
  }
  auto [rc4, out4] = run_command(py("tessera_ckpt_expect_error.py " + damaged +
                                    " --also-verify --loads-unverified \"'model.whole'\" 'checksum mismatch in block 5 '"));
  EXPECT_EQ(rc4, 0) << out4;
  EXPECT_NE(out4.find("refused:"), std::string::npos) << out4;
}

// Both CRC32C implementations of the package (google-crc32c's C extension, the pure-Python
// loop) against the standard's test vectors, each other, and the block checksums this writer
// put in a sharded checkpoint and a consolidated file (a whole 4 MiB block and a short one).
TEST(PythonPackage, Crc32cImplementationsAgreeWithTheStandardEachOtherAndTheWriter) {
  const std::string dir = temp_dir("tessera-pycrc");
  state::StateDict sd;
  sd.set("w", at::randn({(4 << 20) / 4 + 1000}));
  sd.set("b", at::arange(7, at::kDouble));
  ck::save(sd, dir + "/ckpt", *solo(), {ck::SaveMode::Sharded});
  ck::save(sd, dir + "/full.safetensors", *solo(), {ck::SaveMode::Full});
  auto [rc, out] = run_command(py("tessera_ckpt_crc.py --checkpoint " + dir + "/ckpt --file " + dir + "/full.safetensors"));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok package python"), std::string::npos) << out;
}

// Damage of each kind is refused, naming the file (and the key where one is at fault); a
// flipped tensor byte loads with verify=False (only the block checksums see it), so the
// refusal with verify=True is the checksum's doing.
TEST(PythonPackage, FlippedBytesAndEditedMetadataAreRefusedNamingFileAndKey) {
  const std::string dir = temp_dir("tessera-pypkg");
  const std::string base = dir + "/base";
  auto r = run_ranks(3, {"ckpt_save", base, "sharded", "sharded"}, 120);
  ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
  auto [crc, cout_] = run_command(kCli + " ckpt consolidate " + base + " -o " + dir + "/full.safetensors");
  ASSERT_EQ(crc, 0) << cout_;
  std::string cases;
  auto add = [&](const std::string& path, const std::string& flags_and_substrings) {
    cases += (cases.empty() ? "" : " -- ") + path + " " + flags_and_substrings;
  };

  const std::string data = copy_of(base, dir + "/data");
  flip_byte(data + "/data-rank00001.safetensors", chunk_begin(data, "model.w", "data-rank00001.safetensors") + 3);
  add(data, "--also-verify --loads-unverified data-rank00001.safetensors \"'model.w'\" 'checksum mismatch in block 0'");

  const std::string edited = copy_of(base, dir + "/edited");
  edit_metadata(edited, "\"value\": 7", "\"value\": 8", false);  // opt.step, checksum left as it was
  add(edited, "tessera-checkpoint.json 'metadata checksum mismatch'");

  const std::string dtype = copy_of(base, dir + "/dtype");
  edit_metadata(dtype, "\"dtype\": \"BF16\"", "\"dtype\": \"F8E4\"", true);  // model.v, re-checksummed
  add(dtype, "tessera-checkpoint.json \"'model.v'\" 'unknown dtype' F8E4");

  const std::string dup = copy_of(base, dir + "/dup");
  edit_metadata(dup, "\n \"format\": \"tessera-checkpoint\",",
                "\n \"format\": \"tessera-checkpoint\",\n \"format\": \"tessera-checkpoint\",", true);
  add(dup, "tessera-checkpoint.json \"duplicate key 'format'\"");

  const std::string tiling = copy_of(base, dir + "/tiling");
  edit_metadata(tiling, "\"shape\": [\n    7,", "\"shape\": [\n    8,", true);  // model.w [7, 5] -> [8, 5]
  add(tiling, "tessera-checkpoint.json \"key 'model.w'\" 'the chunks cover 35 of 40 elements'");

  const std::string header = copy_of(base, dir + "/header");
  {
    const std::string f = header + "/data-rank00002.safetensors";
    const size_t at = read_bytes(f).find("\"format\":\"pt\"");
    ASSERT_NE(at, std::string::npos);
    flip_byte(f, at + 11);  // "pt" -> "pd": still valid JSON, a different header
  }
  add(header, "--also-verify data-rank00002.safetensors 'header checksum mismatch'");

  const std::string missing = copy_of(base, dir + "/missing");
  fs::remove(missing + "/data-rank00001.safetensors");
  add(missing, "\"data file 'data-rank00001.safetensors' is missing\"");

  const std::string cons = dir + "/cons.safetensors";
  fs::copy_file(dir + "/full.safetensors", cons);
  {
    ck::SafetensorsReader reader(cons);
    const uint64_t at = reader.find("opt.big")->begin + 17;
    flip_byte(cons, at);
  }
  add(cons, "--also-verify --loads-unverified cons.safetensors \"'opt.big'\" 'checksum mismatch'");

  auto [rc, out] = run_command(py("tessera_ckpt_expect_error.py " + cases));
  EXPECT_EQ(rc, 0) << out;
  size_t refused = 0;
  for (size_t p = out.find("refused:"); p != std::string::npos; p = out.find("refused:", p + 1)) ++refused;
  EXPECT_EQ(refused, 8u) << out;
  // The untouched original still loads (the copies were damaged, not it).
  auto [rc2, out2] = run_command(py("tessera_ckpt_check.py " + base + " --state worker --world-size 3"));
  EXPECT_EQ(rc2, 0) << out2;
}

// A GPT trained with FSDP on 2 ranks (examples/gpt): its sharded last.ckpt loads whole,
// equal to torch.load of its export and to the safetensors library's view of its
// consolidation; prefix "model." gives the module's state dict.
TEST(PythonPackage, LoadsAnFsdpGptCheckpointWrittenByTwoRanks) {
  if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (examples disabled)";
  const std::string dir = temp_dir("tessera-pypkg");
  std::string text;
  for (int i = 0; i < 600; ++i) text += (i % 3 ? "shard tensor " : "gather rank.\n");
  write_bytes(dir + "/text.txt", text);
  auto [rc, out] = run_command(kNoLauncherEnv + kCli + " run -n 2 -- " + kGpt +
                               " train --strategy fsdp --max-steps 3 --data " + dir + "/text.txt --out " + dir +
                               "/run --n-layer 2 --n-head 2 --d-model 32 --seq-len 16 --batch-size 8 --seed 5 "
                               "--val-every 3 --threads 1 --no-progress-bar");
  ASSERT_EQ(rc, 0) << out;
  const std::string ckpt = dir + "/run/checkpoints/last.ckpt";
  ASSERT_TRUE(fs::is_directory(ckpt)) << out;
  auto [erc, eout] = run_command(kCli + " ckpt export " + ckpt + " --format torch -o " + dir + "/gpt.pt");
  ASSERT_EQ(erc, 0) << eout;
  auto [crc, cout_] = run_command(kCli + " ckpt consolidate " + ckpt + " -o " + dir + "/gpt.safetensors");
  ASSERT_EQ(crc, 0) << cout_;
  auto [prc, pout] = run_command(py("tessera_ckpt_check.py " + ckpt + " --kind sharded --world-size 2 --torch " + dir +
                                    "/gpt.pt --safetensors " + dir + "/gpt.safetensors --prefix model."));
  EXPECT_EQ(prc, 0) << pout;
  EXPECT_NE(pout.find("ok "), std::string::npos) << pout;
  // The module's state dict: torch's own load_state_dict(strict=True) of a module built
  // from the exported names and shapes accepts it.
  auto [src, sout] = run_command(
      std::string(TESSERA_PYTHON) + " -c \"import sys; sys.path.insert(0, '" + TESSERA_SOURCE_DIR +
      "/python'); import torch, tessera_ckpt\n"
      "sd = tessera_ckpt.load('" + ckpt + "', prefix='model.')\n"
      "m = torch.nn.Module()\n"
      "for k, v in sd.items():\n"
      "    parent = m\n"
      "    *path, leaf = k.split('.')\n"
      "    for p in path:\n"
      "        if not hasattr(parent, p): parent.add_module(p, torch.nn.Module())\n"
      "        parent = getattr(parent, p)\n"
      "    parent.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(v)))\n"
      "m.load_state_dict(sd, strict=True)\n"
      "assert all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())\n"
      "print('module loaded', len(sd), sum(v.numel() for v in sd.values()))\"");
  EXPECT_EQ(src, 0) << sout;
  EXPECT_NE(sout.find("module loaded"), std::string::npos) << sout;
}

// `pip install ./python` (offline, into a fresh target directory) gives an importable
// package, and `python -m tessera_ckpt inspect|verify` works from it.
TEST(PythonPackage, InstallsWithPipAndRunsAsAModule) {
  const std::string dir = temp_dir("tessera-pypkg");
  const std::string src = dir + "/src";
  fs::create_directories(src + "/tessera_ckpt");
  fs::copy_file(std::string(TESSERA_SOURCE_DIR) + "/python/pyproject.toml", src + "/pyproject.toml");
  for (const auto& e : fs::directory_iterator(std::string(TESSERA_SOURCE_DIR) + "/python/tessera_ckpt"))
    if (e.path().extension() == ".py") fs::copy_file(e.path(), src + "/tessera_ckpt/" + e.path().filename().string());
  auto [prc, pout] = run_command(std::string(TESSERA_PYTHON) + " -m pip install --no-deps --no-build-isolation --no-index "
                                 "--disable-pip-version-check --target " + dir + "/site " + src);
  ASSERT_EQ(prc, 0) << pout;
  ASSERT_TRUE(fs::exists(dir + "/site/tessera_ckpt/__init__.py")) << pout;
  bool crc_dependency = false;  // google-crc32c is declared: pip installs it with the package
  for (const auto& e : fs::directory_iterator(dir + "/site"))
    if (e.path().extension() == ".dist-info")
      crc_dependency |= read_bytes(e.path().string() + "/METADATA").find("Requires-Dist: google-crc32c") != std::string::npos;
  EXPECT_TRUE(crc_dependency) << pout;
  auto r = run_ranks(2, {"ckpt_save", dir + "/ckpt", "sharded", "sharded"}, 120);
  ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
  const std::string env = "cd " + dir + " && PYTHONPATH=" + dir + "/site " + TESSERA_PYTHON;
  auto [irc, iout] = run_command(env + " -c 'import tessera_ckpt; print(tessera_ckpt.__file__)' && " + env +
                                 " -m tessera_ckpt inspect ckpt && " + env + " -m tessera_ckpt verify ckpt");
  EXPECT_EQ(irc, 0) << iout;
  EXPECT_NE(iout.find(dir + "/site/tessera_ckpt/__init__.py"), std::string::npos) << iout;
  EXPECT_NE(iout.find("sharded checkpoint, format version 2, world size at save 2"), std::string::npos) << iout;
  EXPECT_NE(iout.find("opt.step"), std::string::npos) << iout;
  EXPECT_NE(iout.find("OK: ckpt: "), std::string::npos) << iout;
  EXPECT_NE(iout.find("(CRC32C by google_crc32c)"), std::string::npos) << iout;
  auto [brc, bout] = run_command(env + " -m tessera_ckpt verify nowhere");
  EXPECT_EQ(brc, 1) << bout;
  EXPECT_NE(bout.find("'nowhere' does not exist"), std::string::npos) << bout;
}
