// The `tessera ckpt` tool and interoperability with Python torch (/usr/bin/python3):
// exports torch.load reads, checkpoints torch.save wrote that Tessera imports, and a
// malicious pickle that is refused without running anything.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "support/build_paths.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/error.h"

using namespace tessera;
using tessera::testing::run_ranks;
using tessera::testing::temp_dir;
namespace ck = tessera::checkpoint;

namespace {

struct Cmd {
  int code = -1;
  std::string out;
};
Cmd sh(const std::string& cmd) {
  auto [code, out] = tessera::testing::run_command(cmd);
  return Cmd{code, out};
}
Cmd cli(const std::string& args) { return sh(std::string(TESSERA_CLI) + " " + args); }

bool python_has_torch() { return sh(std::string(TESSERA_PYTHON) + " -c 'import torch'").code == 0; }

std::string script(const std::string& name) { return std::string(TESSERA_SOURCE_DIR) + "/tests/python/" + name; }

// A checkpoint of the worker's known state (tests/checkpoint/checkpoint_scenarios.cpp) saved at 2 ranks.
std::string saved_checkpoint(const std::string& dir) {
  const std::string p = dir + "/ckpt";
  auto r = run_ranks(2, {"ckpt_save", p, "sharded", "sharded"}, 120);
  EXPECT_EQ(r.launch.exit_code, 0) << r.all_output();
  return p;
}

}  // namespace

TEST(CkptTool, InspectVerifyConsolidateReshard) {
  const std::string dir = temp_dir();
  const std::string ckpt = saved_checkpoint(dir);
  Cmd i = cli("ckpt inspect " + ckpt);
  EXPECT_EQ(i.code, 0) << i.out;
  for (const char* want : {"world size at save 2", "model.w", "BF16", "[3, 10]", "opt.step", "sharded", "data files: 2"})
    EXPECT_NE(i.out.find(want), std::string::npos) << want << " in\n" << i.out;
  Cmd v = cli("ckpt verify " + ckpt);
  EXPECT_EQ(v.code, 0) << v.out;
  EXPECT_NE(v.out.find("OK"), std::string::npos);

  // consolidate, then load the file into 3 sharded ranks.
  const std::string file = dir + "/one.safetensors";
  Cmd c = cli("ckpt consolidate " + ckpt + " -o " + file);
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_EQ(cli("ckpt verify " + file).code, 0);
  EXPECT_NE(cli("ckpt inspect " + file).out.find("consolidated"), std::string::npos);
  auto l = run_ranks(3, {"ckpt_load", file, "sharded"}, 120);
  EXPECT_EQ(l.launch.exit_code, 0) << l.all_output();

  // An existing output is refused without --force and left alone.
  Cmd again = cli("ckpt consolidate " + ckpt + " -o " + file);
  EXPECT_NE(again.code, 0);
  EXPECT_NE(again.out.find("exists; pass --force"), std::string::npos) << again.out;
  EXPECT_EQ(cli("ckpt consolidate " + ckpt + " -o " + file + " --force").code, 0);

  // reshard to 3 ranks: 3 data files, loads at 4.
  const std::string r3 = dir + "/r3";
  Cmd r = cli("ckpt reshard " + ckpt + " --world-size 3 -o " + r3);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(ck::is_regular_file(r3 + "/data-rank00002.safetensors"));
  EXPECT_NE(cli("ckpt inspect " + r3).out.find("world size at save 3"), std::string::npos);
  EXPECT_EQ(cli("ckpt verify " + r3).code, 0);
  auto l4 = run_ranks(4, {"ckpt_load", r3, "sharded"}, 120);
  EXPECT_EQ(l4.launch.exit_code, 0) << l4.all_output();
  EXPECT_NE(cli("ckpt reshard " + ckpt + " --world-size 3 -o " + r3).code, 0);
  EXPECT_NE(cli("ckpt reshard " + ckpt + " --world-size 0 -o " + dir + "/r0").code, 0);
}

TEST(CkptTool, VerifyNamesTheBadFileAndKey) {
  const std::string dir = temp_dir();
  const std::string ckpt = saved_checkpoint(dir);
  const std::string f = ckpt + "/data-rank00001.safetensors";
  std::fstream s(f, std::ios::in | std::ios::out | std::ios::binary);
  s.seekg(-5, std::ios::end);
  char c;
  s.get(c);
  s.seekp(-5, std::ios::end);
  s.put(static_cast<char>(c ^ 0x08));
  s.close();
  Cmd v = cli("ckpt verify " + ckpt);
  EXPECT_EQ(v.code, 1) << v.out;
  EXPECT_NE(v.out.find("CORRUPT"), std::string::npos) << v.out;
  EXPECT_NE(v.out.find(f), std::string::npos) << v.out;
  EXPECT_NE(v.out.find("key '"), std::string::npos) << v.out;
  // Bad input: a path that does not exist, a foreign directory.
  Cmd missing = cli("ckpt verify " + dir + "/nope");
  EXPECT_NE(missing.code, 0);
  EXPECT_NE(missing.out.find("does not exist"), std::string::npos) << missing.out;
  Cmd foreign = cli("ckpt inspect " + dir);
  EXPECT_NE(foreign.code, 0);
  EXPECT_NE(foreign.out.find("is not a Tessera checkpoint"), std::string::npos) << foreign.out;
  EXPECT_NE(cli("ckpt").code, 0);
  EXPECT_EQ(cli("ckpt --help").code, 0);
}

TEST(Interop, ExportsReadByPythonTorch) {
  ASSERT_TRUE(python_has_torch()) << TESSERA_PYTHON << " has no torch module (make test installs the project environment)";
  const std::string dir = temp_dir();
  const std::string ckpt = saved_checkpoint(dir);
  Cmd e1 = cli("ckpt export " + ckpt + " --format torch -o " + dir + "/out.pt");
  ASSERT_EQ(e1.code, 0) << e1.out;
  Cmd e2 = cli("ckpt export " + ckpt + " --format safetensors -o " + dir + "/out.safetensors");
  ASSERT_EQ(e2.code, 0) << e2.out;
  Cmd py = sh(std::string(TESSERA_PYTHON) + " " + script("checkpoint_read_export.py") + " " + dir + "/out.pt " + dir +
              "/out.safetensors");
  EXPECT_EQ(py.code, 0) << py.out;
  EXPECT_NE(py.out.find("ok 8"), std::string::npos) << py.out;
  // Refuses to overwrite; --force replaces.
  EXPECT_NE(cli("ckpt export " + ckpt + " -o " + dir + "/out.pt").code, 0);
  EXPECT_EQ(cli("ckpt export " + ckpt + " -o " + dir + "/out.pt -f").code, 0);
  // The export is itself importable by Tessera.
  EXPECT_EQ(cli("ckpt inspect " + dir + "/out.pt").code, 0);
}

TEST(Interop, ImportsWhatPythonWrote) {
  ASSERT_TRUE(python_has_torch()) << TESSERA_PYTHON << " has no torch module (make test installs the project environment)";
  const std::string dir = temp_dir();
  Cmd py = sh(std::string(TESSERA_PYTHON) + " " + script("checkpoint_write_torch.py") + " " + dir);
  ASSERT_EQ(py.code, 0) << py.out;
  auto target = [] {
    state::StateDict sd;
    sd.set("0.weight", at::zeros({3, 4}));
    sd.set("0.bias", at::zeros({3}));
    sd.set("1.weight", at::zeros({3}));
    sd.set("1.bias", at::zeros({3}));
    sd.set("1.running_mean", at::zeros({3}));
    sd.set("1.running_var", at::zeros({3}));
    sd.set("1.num_batches_tracked", at::zeros({}, at::kLong));
    return sd;
  };
  auto expect_model = [](const state::StateDict& sd) {
    EXPECT_TRUE(at::equal(sd.tensor("0.weight"), at::arange(12, at::kFloat).reshape({3, 4}) / 2));
    EXPECT_TRUE(at::equal(sd.tensor("0.bias"), at::arange(1, 4, at::kFloat)));
    EXPECT_TRUE(at::equal(sd.tensor("1.bias"), -(at::arange(3, at::kFloat) + 0.5)));
    EXPECT_TRUE(at::equal(sd.tensor("1.running_var"), at::arange(2, 5, at::kFloat)));
    EXPECT_EQ(sd.tensor("1.num_batches_tracked").item<int64_t>(), 9);
  };
  for (const char* f : {"model.pt", "model.safetensors"}) {
    auto sd = target();
    ck::LoadResult r = ck::load_local(sd, dir + "/" + f);
    EXPECT_EQ(r.loaded.size(), 7u) << f;
    expect_model(sd);
  }
  // Nested dicts flatten to FQNs; strided views, bf16 and plain values come through.
  state::StateDict nested;
  auto model = std::make_shared<state::StateDict>(target());
  nested.set("model", model);
  nested.set("step", int64_t(0));
  auto extra = std::make_shared<state::StateDict>();
  extra->set("bf", at::zeros({6}, at::kBFloat16));
  extra->set("view", at::zeros({3}));
  nested.set("extra", extra);
  ck::LoadResult r = ck::load_local(nested, dir + "/nested.pt");
  expect_model(*model);
  EXPECT_EQ(nested.integer("step"), 5);
  EXPECT_TRUE(at::equal(extra->tensor("bf"), at::arange(6, at::kFloat).to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(extra->tensor("view"), at::tensor({2.f, 4.f, 6.f})));
  EXPECT_EQ(r.leftovers.number("lr"), 0.5);
  EXPECT_EQ(r.leftovers.string("name"), "x");
  // Into a sharded target too (a single-process communicator with two pieces).
  auto comm = distributed::Communicator::create(distributed::World{});
  std::vector<sharding::ShardMetadata> shards = {{sharding::chunk_box({3, 4}, 1, 2, 0), {0, c10::kCPU}},
                                                 {sharding::chunk_box({3, 4}, 1, 2, 1), {0, c10::kCPU}}};
  auto st = sharding::ShardedTensor::from_parts({{at::zeros({3, 2}), shards[0]}, {at::zeros({3, 2}), shards[1]}},
                                                shards, {3, 4}, at::kFloat, comm);
  state::StateDict one;
  one.set("0.weight", st);
  ck::load_local(one, dir + "/model.pt", {false});
  EXPECT_TRUE(at::equal(at::cat({st.local_shards()[0].tensor, st.local_shards()[1].tensor}, 1),
                        at::arange(12, at::kFloat).reshape({3, 4}) / 2));
  // A pickle that would run code is refused, and nothing ran.
  state::StateDict e;
  e.set("w", at::zeros({2}));
  try {
    ck::load_local(e, dir + "/evil.pt", {false});
    FAIL() << "evil.pt loaded";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("refusing the global"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("system"), std::string::npos) << err.what();
  }
  EXPECT_FALSE(ck::path_exists(dir + "/PWNED"));
  EXPECT_NE(cli("ckpt verify " + dir + "/evil.pt").code, 0);
}
