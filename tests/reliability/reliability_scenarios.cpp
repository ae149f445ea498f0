// Rank programs for the reliability tests (tests/reliability/test_reliability*.cpp): a small
// FSDP training run through Fabric in which one rank SIGKILLs itself at a chosen phase
// (forward, backward, a collective, a save), and the load check of its checkpoint.
#include <ATen/ATen.h>
#include <signal.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>
#include <thread>

#include "support/scenario.h"
#include "tessera/core/env.h"
#include "tessera/fabric/fabric.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr int64_t kIn = 16, kHidden = 256, kOut = 4, kBatch = 12;

fabric::FabricOptions rel_options() {
  fabric::FabricOptions o;
  o.accelerator = "cpu";
  o.strategy = "fsdp";
  o.devices = static_cast<int>(env::get_int("WORLD_SIZE", 1).value_or(1));
  o.fsdp.auto_wrap = strategy::wrap_by_size(1);  // each Linear its own unit: collectives inside forward
  o.comm.timeout = std::chrono::milliseconds(env::get_int("TESSERA_TEST_TIMEOUT_MS", 1).value_or(30000));
  return o;
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void die(const char* phase) {
  std::printf("victim dies in %s at %lld\n", phase, static_cast<long long>(now_ms()));
  std::fflush(stdout);
  ::raise(SIGKILL);
  std::abort();
}

// Kills this process from a second thread after a random delay, while the main
// thread is inside the operation that follows (a collective or a save).
void die_soon(const char* phase, uint64_t seed, int max_us) {
  std::mt19937_64 rng(seed);
  const int us = std::uniform_int_distribution<int>(0, max_us)(rng);
  std::thread([phase, us] {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    die(phase);
  }).detach();
}

}  // namespace

// rel_train PHASE(forward|backward|collective|save|freeze|none) VICTIM DIR STEPS [SEED]:
// FSDP training; after step 2 a committed checkpoint DIR/ckpt; at step 4 rank VICTIM
// SIGKILLs itself in PHASE ("freeze": SIGSTOPs itself inside a collective, so only the
// timeout can tell). Survivors must fail with an error (CommError), not hang.
SCENARIO("rel_train") {
  const std::string phase = args.arg(0, "none"), dir = args.arg(2);
  const int victim = static_cast<int>(args.int_arg(1, 1));
  const int64_t steps = args.int_arg(3, 6);
  const uint64_t seed = static_cast<uint64_t>(args.int_arg(4, 1));
  fabric::Fabric f(rel_options());
  f.launch();
  std::printf("transport %s\n", f.comm()->uses_shared_memory() ? "shm" : "gloo");
  std::fflush(stdout);
  const bool me = f.global_rank() == victim;
  int64_t step = 0;
  at::manual_seed(3);
  auto net = torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
                                   torch::nn::Functional([&](at::Tensor x) {
                                     if (me && step == 4 && phase == "forward") die("forward");
                                     if (me && step == 4 && phase == "backward")
                                       x.register_hook([](at::Tensor g) -> at::Tensor { die("backward"); });
                                     return x;
                                   }),
                                   torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
                                   torch::nn::Linear(kHidden, kOut));
  auto model = f.setup_module(net);
  auto opt = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01));
  f.setup_optimizer(opt);
  const std::string ckpt = dir + "/ckpt";
  for (step = 0; step < steps; ++step) {
    at::Tensor x = at::sin(at::arange(kBatch * kIn, at::kFloat).reshape({kBatch, kIn}) + step + f.global_rank());
    at::Tensor y = at::cos(x.narrow(1, 0, kOut));
    at::Tensor loss = (model.forward<at::Tensor>(x) - y).pow(2).mean();
    f.backward(loss);
    f.step(opt);
    opt->zero_grad();
    if (me && step == 4 && phase == "collective") die_soon("collective", seed, 2000);
    if (me && step == 4 && phase == "freeze") {  // stopped, not dead: its sockets stay open
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::printf("victim freezes in collective at %lld\n", static_cast<long long>(now_ms()));
        std::fflush(stdout);
        ::raise(SIGSTOP);
      }).detach();
    }
    at::Tensor big = at::ones({1 << 21});
    f.all_reduce(big, distributed::ReduceOp::Sum);
    // The delayed kill may find the operation already done (over shared memory an 8 MiB
    // all-reduce takes ~2 ms, the save a few): then the victim dies right after it.
    if (me && step == 4 && phase == "collective") die("collective");
    if (step == 2 || step == 4) {
      if (me && step == 4 && phase == "save") die_soon("save", seed, 20000);
      fabric::FabricState st;
      st.set("model", model).set("optimizer", opt).set("step", int64_t(step));
      f.save(ckpt, st);
      if (me && step == 4 && phase == "save") die("save");
      if (f.is_global_zero()) std::printf("saved step %lld\n", static_cast<long long>(step));
      std::fflush(stdout);
    }
  }
  std::printf("rank %d finished\n", f.global_rank());
  return 0;
}

// rel_load CKPT: loads a rel_train checkpoint on one rank; prints "loaded step N".
SCENARIO("rel_load") {
  fabric::Fabric f(rel_options());
  f.launch();
  at::manual_seed(9);
  auto net = torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
                                   torch::nn::Functional([](at::Tensor x) { return x; }),
                                   torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
                                   torch::nn::Linear(kHidden, kOut));
  auto model = f.setup_module(net);
  auto opt = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01));
  f.setup_optimizer(opt);
  fabric::FabricState st;
  st.set("model", model).set("optimizer", opt).set("step", int64_t(-1));
  f.load(args.arg(0), st);
  std::printf("loaded step %lld\n", static_cast<long long>(st.values().integer("step")));
  return 0;
}
