// Issue 35, item 9: what a load that fails while reading leaves in its target. The pieces
// are read straight into the target (no second copy of the model in memory), so a checksum
// error halfway leaves the tensors before it overwritten: the error says so, and
// Fabric::load (the Trainer's resume, gpt --init-from) reads into copies, so that a failed
// load there leaves the live model as it was.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "checkpoint/checkpoint_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/fabric/fabric.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;

// Item 9: the error of a load that failed halfway says what it left in the target.
TEST(FormatPartialLoad, ALoadThatFailsWhileReadingSaysTheTargetWasPartlyOverwritten) {
  const std::string d = temp_dir("format-partial");
  state::StateDict sd;
  sd.set("a", at::full({1000}, 1.0, at::kFloat));
  sd.set("b", at::full({1000}, 2.0, at::kFloat));
  ck::save(sd, d + "/ckpt", *solo(), {ck::SaveMode::Sharded});
  const ck::CheckpointMetadata m = ck::open_checkpoint(d + "/ckpt");
  ck::ChunkReader locate(m);
  const ck::ChunkInfo cb = locate.chunks("b", m.entries.at("b"), sharding::Box{{0}, {1000}}).at(0);
  std::string bytes = read_bytes(d + "/ckpt/" + cb.file);
  bytes[cb.begin + 5] ^= 0x10;
  write_bytes(d + "/ckpt/" + cb.file, bytes);
  state::StateDict t;
  t.set("a", at::zeros({1000}, at::kFloat));
  t.set("b", at::zeros({1000}, at::kFloat));
  const std::string err = error_of([&] { ck::load_local(t, d + "/ckpt"); });
  EXPECT_CONTAINS(err, "checksum mismatch");
  EXPECT_CONTAINS(err, "the target's tensors were partly overwritten: do not continue with them");
  EXPECT_CONTAINS(err, "1 of 2 tensor pieces were written before the failure, then 'b'");
  EXPECT_TRUE(at::equal(t.tensor("a"), sd.tensor("a")));  // what the message says
}

// Item 9: Fabric::load reads into copies: after a failed load the live model is untouched.
TEST(FormatPartialLoad, AFailedFabricLoadLeavesTheLiveModelAsItWas) {
  const std::string d = temp_dir("format-fabric");
  fabric::FabricOptions o;
  o.accelerator = "cpu";
  fabric::Fabric f(o);
  f.launch();
  at::manual_seed(1);
  auto net = torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::Tanh(), torch::nn::Linear(64, 64));
  auto model = f.setup_module(net);
  fabric::FabricState st;
  st.set("model", model);
  f.save(d + "/ckpt", st);
  // The last tensor in the data file is damaged: the ones before it are read first.
  const ck::CheckpointMetadata m = ck::open_checkpoint(d + "/ckpt");
  const ck::ChunkInfo* last = nullptr;
  for (const auto& [k, e] : m.entries)
    for (const auto& c : e.chunks)
      if (!last || c.begin > last->begin) last = &c;
  ASSERT_NE(last, nullptr);
  const std::string file = m.source_kind == "sharded" ? m.location + "/" + last->file : m.location;
  std::string bytes = read_bytes(file);
  ASSERT_LT(last->begin, bytes.size()) << file;
  bytes[last->begin] ^= 0x01;
  write_bytes(file, bytes);
  for (auto& p : net->parameters()) p.detach().mul_(-3).add_(0.25);  // the live values differ from the saved
  std::vector<at::Tensor> before;
  for (auto& p : net->parameters()) before.push_back(p.detach().clone());
  EXPECT_CONTAINS(error_of([&] { f.load(d + "/ckpt", st); }), "checksum mismatch");
  const auto after = net->parameters();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(after[i], before[i])) << "parameter " << i;
}
