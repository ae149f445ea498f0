// The torch 2.x peers of the GPT example (bench/peers/gpt_peer.py) against gpt itself:
//  - loss parity: PyTorch FSDP2 (fully_shard per block and root, gloo, 2 ranks) saves its
//    initial weights (drawn from another seed than gpt's, so that only --init-from can
//    make them equal) as safetensors and trains 20 steps; `gpt train --strategy fsdp` at 2
//    ranks starts from that file (--init-from) and must write the same 20 losses within
//    1e-4 relative: same architecture, data order (gpt's sampler re-implemented in
//    Python), AdamW, warmup + cosine schedule, clipping and global batch;
//  - the comparison can fail: the same peer with another --seed (another data order from
//    the same weights) is far outside that tolerance;
//  - the parameter names agree: every key of the peer's state dict is a model.<fqn> of the
//    checkpoint gpt writes (`tessera ckpt inspect`), and nothing else is;
//  - the same weights through DCP: the peer's dcp.save of its sharded model, imported by
//    `tessera ckpt import-dcp`, starts gpt on the same first 3 losses.
// Compiled only where the configured Python has torch 2.x's distributed checkpoint
// (TESSERA_PYTHON_HAS_DCP: the build-torch2 suite, `make test-torch2`), which FSDP2 comes with.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "tessera_tests/python_features.h"
#include "examples/gpt_test_util.h"
#include "support/test_util.h"

#if TESSERA_PYTHON_HAS_DCP

namespace fs = std::filesystem;
using tessera::testing::read_bytes;
using tessera::testing::run_command;
using tessera::testing::temp_dir;

namespace {

using tessera::testing::gpt::kCli;
using tessera::testing::gpt::kGpt;
using tessera::testing::gpt::train_losses;
const std::string kPython = TESSERA_PYTHON;
const std::string kPeer = std::string(TESSERA_SOURCE_DIR) + "/bench/peers/gpt_peer.py";
// Outside any launcher environment the test itself may have inherited.
const std::string kPeerEnv = tessera::testing::kNoLauncherEnv + "OMP_NUM_THREADS=1 ";
// A small GPT on gpt's default data (the license texts of base-files), gpt's defaults for
// everything else (lr 2e-3, warmup 2 of 20 steps, clipping 1.0, seed 1234, 10% held out).
const std::string kShape = " --n-layer 2 --n-head 2 --d-model 64 --seq-len 32 --batch-size 8 --threads 1";
constexpr int kSteps = 20;

std::vector<double> read_numbers(const std::string& path) {
  std::vector<double> v;
  std::istringstream in(read_bytes(path));
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) v.push_back(std::stod(line));
  return v;
}

// The peer's losses (step k+1 is line k) against gpt's: the largest |a - b| / |b|.
double max_relative_diff(const std::vector<double>& peer, const std::map<int64_t, double>& gpt, std::string* detail) {
  double worst = 0;
  std::ostringstream d;
  d.precision(9);
  for (size_t k = 0; k < peer.size(); ++k) {
    auto it = gpt.find(static_cast<int64_t>(k) + 1);
    if (it == gpt.end()) return INFINITY;
    const double rel = std::abs(peer[k] - it->second) / std::abs(it->second);
    worst = std::max(worst, rel);
    d << "step " << k + 1 << ": peer " << peer[k] << " gpt " << it->second << " rel " << rel << "\n";
  }
  if (detail) *detail = d.str();
  return worst;
}

std::string peer_command(const std::string& args) {
  return kPeerEnv + kCli + " run -n 2 -- " + kPython + " " + kPeer + " --mode fsdp2 --steps " + std::to_string(kSteps) +
         kShape + args;
}

}  // namespace

TEST(Peers, GptFsdpMatchesFsdp2LossesFromTheSameWeights) {
  ASSERT_TRUE(fs::exists(kGpt)) << kGpt;
  const std::string dir = temp_dir("tessera-peers");
  const std::string init = dir + "/init.safetensors", peer_losses = dir + "/fsdp2.txt";

  // 1. FSDP2: initial weights (from seed 7; gpt's --seed 1234 orders the data on both
  //    sides) to a file, then 20 steps.
  auto [rc1, out1] = run_command(peer_command(" --init-seed 7 --save-init " + init + " --save-dcp " + dir + "/dcp" +
                                              " --losses-out " + peer_losses));
  ASSERT_EQ(rc1, 0) << out1;
  EXPECT_NE(out1.find("\"impl\": \"fsdp2\""), std::string::npos) << out1;
  EXPECT_NE(out1.find("\"world\": 2"), std::string::npos) << out1;
  const std::vector<double> fsdp2 = read_numbers(peer_losses);
  ASSERT_EQ(fsdp2.size(), static_cast<size_t>(kSteps)) << read_bytes(peer_losses);

  // 2. gpt, FSDP at 2 ranks, from the same weights.
  auto [rc2, out2] = run_command(kPeerEnv + kCli + " run -n 2 -- " + kGpt + " train --strategy fsdp --max-steps " +
                                 std::to_string(kSteps) + kShape + " --init-from " + init +
                                 " --log-every 1 --val-every 0 --no-progress-bar --out " + dir + "/gpt");
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("strategy fsdp on 2 rank(s)"), std::string::npos) << out2;
  EXPECT_NE(out2.find("gpt: initial weights from '" + init + "'"), std::string::npos) << out2;
  const auto gpt = train_losses(dir + "/gpt/metrics.csv");
  ASSERT_EQ(gpt.size(), static_cast<size_t>(kSteps)) << read_bytes(dir + "/gpt/metrics.csv");

  std::string detail;
  const double diff = max_relative_diff(fsdp2, gpt, &detail);
  std::printf("[ peers    ] gpt FSDP vs PyTorch FSDP2, %d losses: max relative difference %.3g\n", kSteps, diff);
  EXPECT_LE(diff, 1e-4) << detail;
  // The model learned something over the 20 steps (both sides alike).
  EXPECT_LT(gpt.at(kSteps), gpt.at(1) - 0.5) << detail;

  // 3. The comparison can fail: the same weights with another data order (--seed).
  const std::string other = dir + "/fsdp2-seed99.txt";
  auto [rc3, out3] = run_command(peer_command(" --seed 99 --init-from " + init + " --losses-out " + other));
  ASSERT_EQ(rc3, 0) << out3;
  const double wrong = max_relative_diff(read_numbers(other), gpt, nullptr);
  std::printf("[ peers    ] with another data order (--seed 99): max relative difference %.3g\n", wrong);
  EXPECT_GT(wrong, 1e-3);

  // 4. Parameter names: the peer's keys are exactly gpt's model.<fqn> tensors.
  auto [rc4, keys] = run_command(kPython + " -c \"import sys; from safetensors import safe_open; "
                                 "print('\\n'.join(sorted(safe_open(sys.argv[1], 'pt').keys())))\" " + init);
  ASSERT_EQ(rc4, 0) << keys;
  auto [rc5, table] = run_command(kCli + " ckpt inspect " + dir + "/gpt/checkpoints/last.ckpt");
  ASSERT_EQ(rc5, 0) << table;
  std::set<std::string> peer_keys, gpt_keys;
  std::istringstream kin(keys);
  for (std::string k; std::getline(kin, k);)
    if (!k.empty()) peer_keys.insert(k);
  std::istringstream tin(table);
  for (std::string line; std::getline(tin, line);) {
    std::istringstream ls(line);
    std::string first;
    ls >> first;
    if (first.rfind("model.", 0) == 0) gpt_keys.insert(first.substr(6));
  }
  EXPECT_EQ(peer_keys.size(), 2u + 2u * 12u + 3u) << keys;  // tok, pos; 12 per block; ln_f (2), head
  EXPECT_EQ(peer_keys, gpt_keys) << table;

  // 5. The same initial weights as FSDP2's DTensor shards through DCP and import-dcp: gpt's
  //    first 3 steps (same schedule: --lr-decay-steps 20) match the peer's.
  auto [rc6, out6] = run_command(kCli + " ckpt import-dcp " + dir + "/dcp -o " + dir + "/from-dcp.ckpt");
  ASSERT_EQ(rc6, 0) << out6;
  auto [rc7, out7] = run_command(kPeerEnv + kCli + " run -n 2 -- " + kGpt + " train --strategy fsdp --max-steps 3" +
                                 " --lr-decay-steps " + std::to_string(kSteps) + kShape + " --init-from " + dir +
                                 "/from-dcp.ckpt --log-every 1 --val-every 0 --no-progress-bar --out " + dir + "/gpt-dcp");
  ASSERT_EQ(rc7, 0) << out7;
  const auto via_dcp = train_losses(dir + "/gpt-dcp/metrics.csv");
  ASSERT_EQ(via_dcp.size(), 3u) << read_bytes(dir + "/gpt-dcp/metrics.csv");
  const double dcp_diff = max_relative_diff(std::vector<double>(fsdp2.begin(), fsdp2.begin() + 3), via_dcp, &detail);
  std::printf("[ peers    ] gpt from the peer's DCP checkpoint, 3 losses: max relative difference %.3g\n", dcp_diff);
  EXPECT_LE(dcp_diff, 1e-4) << detail;
}

#endif  // TESSERA_PYTHON_HAS_DCP
