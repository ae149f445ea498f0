// The `gpt sample` command: its settings and the continuation it prints.
#pragma once
#include <cstdint>
#include <string>

namespace gpt {

struct SampleArgs {
  std::string ckpt, prompt = "\n";
  int64_t tokens = 200, top_k = 0;
  double temperature = 0.8;
  uint64_t seed = 0;
};

// Loads the model weights of --ckpt and prints the prompt and --tokens sampled bytes.
// Returns the process exit code.
int run_sample(const SampleArgs& a);

}  // namespace gpt
