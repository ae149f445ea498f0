// `tessera ckpt export --format hf`: a Hugging Face style directory of a model's weights,
// checked by the real Python readers (tests/python/hf_export_check.py:
// safetensors.torch.load_file, and torch.distributed.checkpoint's HuggingFaceStorageReader
// where the configured Python has it) against an independent copy of the same checkpoint
// (`--format torch` read by torch.load): a sharded checkpoint written by 3 ranks and a gpt
// FSDP checkpoint, split into several files, as saved and converted to bf16 / fp16. Also
// the size and dtype flags, the split rule, errors naming the flag at fault, outputs that
// are never overwritten without --force (nor with it when they hold anything else), and
// an interrupted export leaving nothing behind.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "support/build_paths.h"
#include "reliability/reliability_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/offline/hf_export.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera_tests/python_features.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {



// " --dcp" where the configured Python has DCP's Hugging Face reader (torch 2.x).
std::string dcp_flag() { return TESSERA_PYTHON_HAS_DCP_HF ? " --dcp" : ""; }

// Every file under `path` with its bytes (relative names).
std::map<std::string, std::string> snapshot(const std::string& path) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::recursive_directory_iterator(path))
    if (e.is_regular_file()) m[fs::relative(e.path(), path).string()] = read_bytes(e.path().string());
  return m;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

bool has_temporaries(const std::string& dir) {
  for (const auto& n : names_in(dir))
    if (n.find(".tessera-tmp-") != std::string::npos) return true;
  return false;
}

// Exports with the CLI, then checks the result in Python (through DCP too where it can);
// returns the CLI's output.
std::string export_and_check(const std::string& src, const std::string& ref, const std::string& out,
                             const std::string& flags, const std::string& check_flags) {
  auto [rc, text] = run_command(cli("ckpt export " + src + " --format hf -o " + out + flags));
  EXPECT_EQ(rc, 0) << text;
  auto [prc, ptext] = run_command(py("hf_export_check.py " + out + " " + ref + check_flags + dcp_flag()));
  EXPECT_EQ(prc, 0) << "export" << flags << "\n" << ptext;
  EXPECT_CONTAINS(ptext, "ok ");
  if (TESSERA_PYTHON_HAS_DCP_HF) EXPECT_CONTAINS(ptext, "dcp ok");
  // Every file the export wrote carries Tessera's checksums too.
  for (const auto& n : names_in(out)) {
    if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) {
      const ck::VerifyReport r = ck::verify(out + "/" + n);
      EXPECT_TRUE(r.ok && r.has_checksums) << out << "/" << n;
    }
  }
  return text;
}

}  // namespace

// The flags' values read as transformers / huggingface_hub read them, and the split into
// files follows huggingface_hub's split_state_dict_into_shards (its own test case: a
// tensor over the limit gets a file of its own, placed when it is met, while the current
// file stays open).
TEST(HfExport, SizesDtypesAndTheSplitRule) {
  EXPECT_EQ(ck::parse_hf_size("5GB"), 5000000000ull);
  EXPECT_EQ(ck::parse_hf_size("500MB"), 500000000ull);
  EXPECT_EQ(ck::parse_hf_size("2GiB"), 2ull << 30);
  EXPECT_EQ(ck::parse_hf_size("64"), 64u);
  EXPECT_EQ(ck::parse_hf_size("64B"), 64u);
  EXPECT_EQ(ck::parse_hf_size(" 10 kb "), 10000u);
  EXPECT_EQ(ck::parse_hf_size("1.5GB"), 1500000000ull);
  EXPECT_EQ(ck::parse_hf_size("0.5KiB"), 512u);
  EXPECT_EQ(ck::parse_hf_size("1TiB"), 1ull << 40);
  for (const std::string bad : {"", "GB", "5XB", "-1", "1.5", "0", "0.0001KB", "5 G B", "1e9", "99999999999TB"})
    EXPECT_CONTAINS(error_of([&] { ck::parse_hf_size(bad); }), "size '" + bad + "'");
  EXPECT_EQ(ck::parse_hf_dtype("bf16"), ck::HfDtype::BF16);
  EXPECT_EQ(ck::parse_hf_dtype("fp16"), ck::HfDtype::F16);
  EXPECT_EQ(ck::parse_hf_dtype("fp32"), ck::HfDtype::F32);
  EXPECT_CONTAINS(error_of([] { ck::parse_hf_dtype("int8"); }), "dtype 'int8': expected bf16, fp16 or fp32");

  using Plan = std::vector<std::vector<size_t>>;
  EXPECT_EQ(ck::plan_hf_shards({6, 10, 30, 2, 2}, 10), (Plan{{0}, {2}, {1}, {3, 4}}));
  EXPECT_EQ(ck::plan_hf_shards({6, 10, 30, 2, 2}, 100), (Plan{{0, 1, 2, 3, 4}}));
  EXPECT_EQ(ck::plan_hf_shards({5, 5, 5}, 10), (Plan{{0, 1}, {2}}));        // exactly full stays
  EXPECT_EQ(ck::plan_hf_shards({0, 11, 0, 0}, 10), (Plan{{1}, {0, 2, 3}})); // empty tensors fit anywhere
  EXPECT_EQ(ck::plan_hf_shards({}, 10), Plan{});
}

// A checkpoint saved sharded by 3 ranks (uneven pieces, an empty piece, bf16, f64, int64,
// zero-size and 0-dim tensors, optimizer state and plain values beside the model).
TEST(HfExport, ShardedCheckpointOfThreeRanksLoadsInPython) {
  const std::string dir = temp_dir("tessera-hf");
  auto r = run_ranks(3, {"ckpt_save", dir + "/ckpt", "sharded", "sharded"}, 120);
  ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
  const std::string src = dir + "/ckpt", ref = dir + "/ref.pt";
  auto [rc, text] = run_command(cli("ckpt export " + src + " --format torch -o " + ref));
  ASSERT_EQ(rc, 0) << text;

  // model.w (140 bytes) is over 64 and goes alone; then {v, e} and {b, s, z}: 3 files.
  const std::string out = export_and_check(src, ref, dir + "/hf", " --max-shard-size 64",
                                           " --prefix model. --max-shard-size 64 --files 3");
  EXPECT_CONTAINS(out, "6 tensors (prefix 'model.' removed), 228 bytes in 3 file(s)");
  EXPECT_EQ(names_in(dir + "/hf"),
            (std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                      "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  // The default limit (5GB): one file, no index, as transformers writes it.
  export_and_check(src, ref, dir + "/one", "", " --prefix model. --max-shard-size 5000000000 --files 1");
  EXPECT_EQ(names_in(dir + "/one"), std::vector<std::string>{"model.safetensors"});
  // bf16: f32 and f64 converted (bf16 stays, int64 stays); fp16 and fp32 likewise.
  export_and_check(src, ref, dir + "/bf16", " --max-shard-size 50B --dtype bf16",
                   " --prefix model. --max-shard-size 50 --dtype bf16");
  export_and_check(src, ref, dir + "/fp16", " --dtype fp16", " --prefix model. --max-shard-size 1000 --dtype fp16");
  export_and_check(src, ref, dir + "/fp32", " --dtype fp32 --max-shard-size 0.1KB",
                   " --prefix model. --max-shard-size 100 --dtype fp32");
  // Another prefix (with or without its dot), and every tensor under its full key.
  export_and_check(src, ref, dir + "/opt", " --prefix opt --max-shard-size 40",
                   " --prefix opt. --max-shard-size 40 --files 2");
  const std::string all = export_and_check(src, ref, dir + "/all", " --prefix '' --max-shard-size 100",
                                           " --prefix '' --max-shard-size 100");
  EXPECT_CONTAINS(all, "8 tensors (prefix '' removed)");
  // The checksums the files carry are checked: one flipped data byte is found.
  std::string bytes = read_bytes(dir + "/hf/model-00001-of-00003.safetensors");
  bytes.back() ^= 1;
  write_bytes(dir + "/flipped.safetensors", bytes);
  const ck::VerifyReport bad = ck::verify(dir + "/flipped.safetensors");
  EXPECT_FALSE(bad.ok);
  ASSERT_EQ(bad.problems.size(), 1u);
  EXPECT_CONTAINS(bad.problems[0], "checksum mismatch");
  EXPECT_FALSE(has_temporaries(dir));
}

// A gpt checkpoint saved by 2 FSDP ranks (random weights, so bf16 rounding matters): as
// saved and in bf16, in several files; the same export from its consolidated file is
// byte for byte the same directory.
TEST(HfExport, GptCheckpointAsSavedAndInBf16) {
  const std::string gpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
  if (!fs::exists(gpt)) GTEST_SKIP() << gpt << " not built (examples disabled)";
  const std::string dir = temp_dir("tessera-hf-gpt");
  std::string text;
  for (int i = 0; i < 400; ++i) text += std::string(i % 3 ? "shard tensor " : "rank gather. ") + (i % 7 ? "" : "\n");
  write_bytes(dir + "/text.txt", text);
  auto [trc, tout] = run_command(kNoLauncherEnv + cli("run -n 2 -- " + gpt + " train --strategy fsdp --max-steps 2 --data " + dir +
                                           "/text.txt --out " + dir + "/run --n-layer 2 --n-head 2 --d-model 32 "
                                           "--seq-len 16 --batch-size 4 --seed 3 --threads 1 --no-progress-bar"));
  ASSERT_EQ(trc, 0) << tout;
  const std::string src = dir + "/run/checkpoints/last.ckpt", ref = dir + "/ref.pt";
  ASSERT_TRUE(fs::is_directory(src)) << tout;
  auto [rc, rtext] = run_command(cli("ckpt export " + src + " --format torch -o " + ref));
  ASSERT_EQ(rc, 0) << rtext;

  // 20 KB: the 32 KiB embedding and head go alone, the blocks fill the files between.
  const std::string out = export_and_check(src, ref, dir + "/hf", " --max-shard-size 20KB",
                                           " --prefix model. --max-shard-size 20000");
  EXPECT_CONTAINS(out, "(prefix 'model.' removed)");
  EXPECT_GE(names_in(dir + "/hf").size(), 5u);
  export_and_check(src, ref, dir + "/bf16", " --max-shard-size 20KB --dtype bf16",
                   " --prefix model. --max-shard-size 20000 --dtype bf16");

  auto [crc, ctext] = run_command(cli("ckpt consolidate " + src + " -o " + dir + "/full.safetensors"));
  ASSERT_EQ(crc, 0) << ctext;
  auto [erc, etext] =
      run_command(cli("ckpt export " + dir + "/full.safetensors --format hf --max-shard-size 20KB -o " + dir + "/hf2"));
  ASSERT_EQ(erc, 0) << etext;
  EXPECT_EQ(snapshot(dir + "/hf2"), snapshot(dir + "/hf"));
}

// Bad flags name the flag; a prefix that matches nothing names what there is; an existing
// output is never touched without --force, and with it only when it holds nothing but an
// earlier export; the source is never the output.
TEST(HfExport, BadFlagsAndExistingOutputsAreRefused) {
  const std::string dir = temp_dir("tessera-hf-err");
  auto r = run_ranks(2, {"ckpt_save", dir + "/ckpt", "sharded", "sharded"}, 120);
  ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
  const std::string src = dir + "/ckpt", out = dir + "/hf";
  struct Case {
    std::string flags, message;
  };
  const std::vector<Case> cases = {
      {"--format hf --max-shard-size 5XB", "--max-shard-size: size '5XB': unknown unit 'XB'"},
      {"--format hf --max-shard-size 0", "--max-shard-size: size '0' must be at least 1 byte"},
      {"--format hf --max-shard-size GB", "--max-shard-size: size 'GB' is not a size"},
      {"--format hf --dtype int8", "--dtype: int8 not in {bf16,fp16,fp32}"},
      {"--format hf --prefix nope", "--prefix 'nope' matches no tensor of '" + src + "'"},
      {"--format torch --dtype bf16", "--dtype applies to --format hf only"},
      {"--format safetensors --max-shard-size 1GB", "--max-shard-size applies to --format hf only"},
  };
  for (const auto& c : cases) {
    auto [rc, text] = run_command(cli("ckpt export " + src + " " + c.flags + " -o " + out));
    EXPECT_EQ(rc, 2) << c.flags << "\n" << text;
    EXPECT_CONTAINS(text, c.message);
  }
  EXPECT_CONTAINS(error_of([&] { ck::export_hf(src, out, {1, ck::HfDtype::AsSaved, std::string("nope")}, false); }),
                  "(tensor keys begin with 'model.', 'opt.')");
  EXPECT_FALSE(fs::exists(out));

  // An existing export: refused without --force and left as it was; replaced with it.
  ASSERT_EQ(run_command(cli("ckpt export " + src + " --format hf --max-shard-size 64 -o " + out)).first, 0);
  const auto before = snapshot(out);
  ASSERT_EQ(before.size(), 4u);
  auto [rc1, t1] = run_command(cli("ckpt export " + src + " --format hf --dtype bf16 -o " + out));
  EXPECT_EQ(rc1, 2) << t1;
  EXPECT_CONTAINS(t1, "output '" + out + "' exists; pass --force to replace it");
  EXPECT_EQ(snapshot(out), before);
  auto [rc2, t2] = run_command(cli("ckpt export " + src + " --format hf --dtype bf16 -o " + out + " --force"));
  EXPECT_EQ(rc2, 0) << t2;
  EXPECT_EQ(names_in(out), std::vector<std::string>{"model.safetensors"});  // the old files went with it

  // A directory holding anything an export does not write, a file, a Tessera checkpoint:
  // refused even with --force, untouched.
  write_bytes(out + "/config.json", "{}");
  const auto with_config = snapshot(out);
  auto [rc3, t3] = run_command(cli("ckpt export " + src + " --format hf -o " + out + " --force"));
  EXPECT_EQ(rc3, 2) << t3;
  EXPECT_CONTAINS(t3, "refusing to replace '" + out + "': it holds 'config.json'");
  EXPECT_EQ(snapshot(out), with_config);
  write_bytes(dir + "/plain", "keep");
  EXPECT_CONTAINS(error_of([&] { ck::export_hf(src, dir + "/plain", {}, true); }), "not a directory");
  EXPECT_EQ(read_bytes(dir + "/plain"), "keep");
  ck::reshard(src, 1, dir + "/other", false);
  const auto other = snapshot(dir + "/other");
  EXPECT_CONTAINS(error_of([&] { ck::export_hf(src, dir + "/other", {}, true); }),
                  "refusing to replace '" + dir + "/other': it holds '");
  EXPECT_EQ(snapshot(dir + "/other"), other);
  // The source itself, or a path inside it.
  const auto source = snapshot(src);
  EXPECT_CONTAINS(error_of([&] { ck::export_hf(src, src, {}, true); }), "is the source");
  EXPECT_CONTAINS(error_of([&] { ck::export_hf(src, src + "/hf", {}, true); }), "is inside the source");
  EXPECT_EQ(snapshot(src), source);
  EXPECT_FALSE(has_temporaries(dir));
}

// SIGINT while the export is about to publish: the temporary directory is removed and
// nothing appears at the output.
TEST(HfExport, InterruptRemovesTheUnfinishedDirectory) {
  const std::string dir = temp_dir("tessera-hf-int");
  auto r = run_ranks(2, {"ckpt_save", dir + "/ckpt", "sharded", "sharded"}, 120);
  ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
  struct sigaction dfl {}, old {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGINT, &dfl, &old);  // the child starts with SIGINT at its default action
  Child p = spawn({TESSERA_CLI, "ckpt", "export", dir + "/ckpt", "--format", "hf", "--max-shard-size", "64", "-o",
                   dir + "/hf"},
                  {{"TESSERA_TEST_PAUSE_BEFORE_COMMIT", "1"}});
  ::sigaction(SIGINT, &old, nullptr);
  ASSERT_GT(p.pid, 0);
  ASSERT_TRUE(p.wait_for("test pause before committing", 120000)) << p.text;
  ASSERT_TRUE(p.wait_for("')\n", 60000)) << p.text;
  ASSERT_TRUE(has_temporaries(dir)) << p.text;
  ASSERT_EQ(::kill(p.pid, SIGINT), 0);
  const int st = p.wait_exit(60000);
  ASSERT_NE(st, -1) << p.text;
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGINT) << st << "\n" << p.text;
  EXPECT_CONTAINS(p.text, "removed the unfinished output");
  EXPECT_FALSE(has_temporaries(dir));
  EXPECT_FALSE(fs::exists(dir + "/hf"));
}
