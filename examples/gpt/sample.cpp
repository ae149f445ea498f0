// The `gpt sample` command: builds the model a checkpoint's hparams describe, loads its
// weights and prints a sampled continuation of the prompt.
#include <ATen/ATen.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "model.h"
#include "sample.h"
#include "settings.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/state/module_state.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace gpt {

int run_sample(const SampleArgs& a) {
  at::set_num_threads(std::max(1u, std::thread::hardware_concurrency()));
  if (!fs::exists(a.ckpt)) throw CLI::ValidationError("--ckpt: '" + a.ckpt + "' does not exist");
  // The model's shape comes from the hyper-parameters the Trainer saved with it, checked
  // like the flags of gpt train, and against the stored weights' shapes before building it.
  const checkpoint::CheckpointMetadata meta = checkpoint::open_checkpoint(a.ckpt);
  const gpt::Config cfg = gpt::stored_config(meta);
  gpt::check_stored_weights(meta, cfg);
  checkpoint::LoadOptions lax;
  lax.strict = false;
  gpt::Gpt net(cfg);
  state::StateDict target;
  const state::StateDict own = state::state_dict(*net);
  own.for_each([&](const std::string& k, const state::Value& v) { target.set("model." + k, v); });
  // Not strict: the optimizer and scheduler state in the checkpoint are not wanted here,
  // but every weight of the model must be there with its shape.
  const checkpoint::LoadResult res = checkpoint::load_local(target, a.ckpt, lax);
  if (!res.missing.empty() || !res.mismatched.empty()) {
    std::string what;
    for (const auto& k : res.missing) what += " missing " + k + ";";
    for (const auto& k : res.mismatched) what += " " + k + ";";
    throw std::runtime_error("--ckpt: '" + a.ckpt + "' does not hold this model's weights:" + what);
  }
  net->eval();

  std::string prompt = a.prompt;
  if (prompt.empty()) prompt = "\n";
  std::vector<int64_t> ctx;
  for (unsigned char c : prompt) ctx.push_back(c);
  auto gen = at::detail::createCPUGenerator(a.seed);
  at::NoGradGuard ng;
  std::string outtext;
  for (int64_t i = 0; i < a.tokens; ++i) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(ctx.size()), cfg.seq_len);
    at::Tensor x = at::tensor(std::vector<int64_t>(ctx.end() - n, ctx.end()), at::kLong).unsqueeze(0);
    at::Tensor logits = net->forward(x).select(1, n - 1).squeeze(0).to(at::kFloat);
    int64_t next;
    if (a.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / a.temperature;
      if (a.top_k > 0 && a.top_k < gpt::kVocab) {
        const double kth = std::get<0>(logits.topk(a.top_k)).min().item<double>();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = at::multinomial(at::softmax(logits, -1), 1, false, gen).item<int64_t>();
    }
    ctx.push_back(next);
    outtext.push_back(static_cast<char>(next));
  }
  std::cout << prompt << outtext << std::endl;
  return 0;
}

}  // namespace gpt
