// Rank programs for the Fabric tests: a training loop on a fixed global batch with
// each strategy (losses printed for the test to compare across world sizes),
// gradient accumulation, save/resume, and launch()'s self-spawn.
#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <thread>

#include "support/proc_memory.h"
#include "support/scenario.h"
#include "tessera/checkpoint/test_hooks.h"  // set_async_save_hook_for_tests
#include "tessera/core/env.h"
#include "tessera/fabric/fabric.h"
#include "tessera/strategy/ddp.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr int64_t kGlobalBatch = 8, kIn = 6, kHidden = 12, kOut = 3;

fabric::FabricOptions options_for(const std::string& strategy) {
  fabric::FabricOptions o;
  o.accelerator = "cpu";
  o.strategy = strategy;
  o.devices = static_cast<int>(env::get_int("WORLD_SIZE", 1).value_or(1));
  o.fsdp.auto_wrap = strategy::wrap_by_size(1);  // each Linear its own unit, root last
  o.comm.timeout = std::chrono::milliseconds(env::get_int("TESSERA_TEST_TIMEOUT_MS", 1).value_or(30000));
  return o;
}

torch::nn::Sequential make_net(uint64_t seed) {
  at::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(), torch::nn::Linear(kHidden, kOut));
}

// The global batch (identical on every rank) and this rank's contiguous slice of it.
std::pair<at::Tensor, at::Tensor> local_batch(int rank, int world, int64_t step) {
  auto gen = at::arange(kGlobalBatch * kIn, at::kFloat).reshape({kGlobalBatch, kIn});
  at::Tensor x = at::sin(gen * 0.37 + static_cast<double>(step));
  at::Tensor y = at::cos(x.narrow(1, 0, kOut) * 1.7) + 0.1 * static_cast<double>(step % 3);
  const int64_t per = kGlobalBatch / world;
  return {x.narrow(0, rank * per, per), y.narrow(0, rank * per, per)};
}

struct Loop {
  fabric::Fabric& f;
  torch::nn::AnyModule model;
  std::shared_ptr<torch::optim::Adam> opt;
  int accum = 1;
  bool clip = false;

  // One optimizer step on the global batch; returns the global mean loss.
  double step(int64_t s) {
    auto [x, y] = local_batch(f.global_rank(), f.world_size(), s);
    const int64_t per = x.size(0) / accum;
    double loss_sum = 0;
    for (int k = 0; k < accum; ++k) {
      at::Tensor xs = x.narrow(0, k * per, per), ys = y.narrow(0, k * per, per);
      auto run = [&] {
        at::Tensor out = model.forward<at::Tensor>(xs);
        at::Tensor loss = (out - ys).pow(2).mean() / static_cast<double>(accum);
        f.backward(loss);
        loss_sum += loss.item<double>();
      };
      // DDP reports the gradient collectives its hooks started during the last backward:
      // none inside no_backward_sync, some for the synchronizing one.
      auto* ddp = dynamic_cast<strategy::DdpStrategy*>(&f.strategy());
      if (k + 1 < accum) {
        auto guard = f.no_backward_sync(model);
        run();
        if (ddp) WCHECK(ddp->launched_during_backward() == 0, "no_backward_sync still communicated");
      } else {
        run();
        if (ddp && f.world_size() > 1) WCHECK(ddp->launched_during_backward() > 0, "the last micro-batch did not sync");
      }
    }
    if (clip) {
      double norm = f.clip_grad_norm(0.05);
      WCHECK(norm > 0.05, "clipping must be active in this test, norm ", norm);
    }
    f.step(opt);
    opt->zero_grad();
    return f.all_reduce(loss_sum, distributed::ReduceOp::Avg);
  }
};

void print_loss(fabric::Fabric& f, int64_t step, double loss) {
  if (f.is_global_zero()) std::printf("loss %lld %.10g\n", static_cast<long long>(step), loss);
  std::fflush(stdout);
}

}  // namespace

// fabric_train STRATEGY STEPS [ACCUM] [CLIP]: prints "loss <step> <value>" on rank 0.
SCENARIO("fabric_train") {
  fabric::Fabric f(options_for(args.arg(0)));
  f.launch();
  auto net = make_net(7);
  auto model = f.setup_module(net);
  auto opt = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.02));
  f.setup_optimizer(opt);
  Loop loop{f, model, opt, static_cast<int>(args.int_arg(2, 1)), args.int_arg(3, 0) != 0};
  const int64_t steps = args.int_arg(1, 4);
  for (int64_t s = 0; s < steps; ++s) print_loss(f, s, loop.step(s));
  return 0;
}

// fabric_resume STRATEGY SDTYPE(full|sharded) DIR PHASE(save|resume) TOTAL SAVE_AT [async]
//  save:   trains TOTAL steps printing losses, saving after SAVE_AT steps;
//  resume: builds the model from another seed, loads, trains the remaining steps.
//  async:  the save is save_async, and its background write is held at a gate until
//          this thread has trained the next step (changing every parameter and the
//          optimizer state): the call must have returned before anything was written,
//          and what is written must be the state at the call.
SCENARIO("fabric_resume") {
  auto o = options_for(args.arg(0));
  o.state_dict_type = args.arg(1) == "sharded" ? strategy::StateDictType::Sharded : strategy::StateDictType::Full;
  const std::string dir = args.arg(2), phase = args.arg(3);
  const int64_t total = args.int_arg(4, 6), save_at = args.int_arg(5, 3);
  const bool async = args.arg(6) == "async";
  fabric::Fabric f(o);
  f.launch();
  auto net = make_net(phase == "save" ? 7 : 99);
  auto model = f.setup_module(net);
  auto opt = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(phase == "save" ? 0.02 : 0.5));
  f.setup_optimizer(opt);
  Loop loop{f, model, opt};
  int64_t start = 0;
  if (phase == "resume") {
    fabric::FabricState st;
    st.set("model", net).set("optimizer", opt).set("step", int64_t(-1));
    state::StateDict rest = f.load(dir, st);
    start = st.values().integer("step");
    WCHECK(start == save_at, "restored step ", start);
    WCHECK(rest.contains("note") && rest.string("note") == "hello", "leftover 'note' not returned");
    WCHECK(!rest.contains("step"), "a requested value came back as a leftover");
    const double lr = opt->param_groups()[0].options().get_lr();
    WCHECK(std::abs(lr - 0.02) < 1e-12, "learning rate not restored: ", lr);
    std::printf("rank %d loaded step %lld\n", f.global_rank(), static_cast<long long>(start));
  }
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  checkpoint::AsyncSave pending;
  bool gate_open = false;
  for (int64_t s = start; s < total; ++s) {
    print_loss(f, s, loop.step(s));
    if (pending.valid() && !gate_open) {  // the step after save_async has run: let the write begin
      WCHECK(!pending.done() && !std::filesystem::exists(dir), "the async save finished before its gate opened");
      gate.set_value();
      gate_open = true;
    }
    if (phase == "save" && s + 1 == save_at) {
      fabric::FabricState st;
      st.set("model", model).set("optimizer", opt).set("step", int64_t(save_at)).set("note", "hello");
      if (!async) {
        f.save(dir, st);
        continue;
      }
      const auto caller = std::this_thread::get_id();
      checkpoint::set_async_save_hook_for_tests([opened, caller] {
        if (std::this_thread::get_id() == caller) throw Error("save_async wrote on the calling thread");
        opened.wait();
      });
      pending = f.save_async(dir, st);
      checkpoint::set_async_save_hook_for_tests(nullptr);
      WCHECK(!std::filesystem::exists(dir), "save_async returned after writing ", dir);
    }
  }
  if (async) {
    WCHECK(pending.valid(), "no async save was made");
    f.wait_for_checkpoint();
    WCHECK(pending.done() && std::filesystem::exists(dir), "wait_for_checkpoint returned before the commit");
  }
  return 0;
}

// fabric_deferred_init UNITS WIDTH: FSDP builds a Sequential of UNITS Linear(WIDTH,
// WIDTH) layers through init_module (each sharded as soon as it is built) and prints
// "deferred rank R rss_before_kib B peak_kib P shard_kib S unit_kib U whole_kib W": the
// resident set before the model and the process's peak after setup, against this rank's
// shards, the largest unit and the whole model.
SCENARIO("fabric_deferred_init") {
  auto o = options_for("fsdp");
  o.fsdp.auto_wrap = nullptr;
  fabric::Fabric f(o);
  f.launch();
  const int64_t units = args.int_arg(0, 8), width = args.int_arg(1, 2048);
  at::manual_seed(3);
  at::ones({1}).sum();  // the runtime's first-op allocations happen before the baseline
  f.barrier();
  const long long before = tessera::testing::proc_status_kib("VmRSS");
  torch::nn::Sequential net;
  for (int64_t i = 0; i < units; ++i)
    net->push_back(f.init_module([&] { return torch::nn::AnyModule(torch::nn::Linear(width, width)); }));
  auto model = f.setup_module(net);
  const long long peak = tessera::testing::proc_status_kib("VmHWM");
  int64_t shard_bytes = 0;
  for (auto& p : net->parameters()) shard_bytes += p.numel() * 4;
  const int64_t unit_bytes = (width * width + width) * 4;
  // The model still computes: a forward pass over the sharded units.
  at::Tensor y = model.forward<at::Tensor>(at::ones({2, width}));
  WCHECK(y.size(1) == width && std::isfinite(y.sum().item<double>()), "forward through the deferred model");
  std::printf("deferred rank %d rss_before_kib %lld peak_kib %lld shard_kib %lld unit_kib %lld whole_kib %lld\n",
              f.global_rank(), before, peak, static_cast<long long>(shard_bytes / 1024),
              static_cast<long long>(unit_bytes / 1024), static_cast<long long>(units * unit_bytes / 1024));
  std::fflush(stdout);
  return 0;
}

// fabric_collectives: all_reduce / all_gather / broadcast / barrier / sampler through Fabric.
SCENARIO("fabric_collectives") {
  fabric::Fabric f(options_for("ddp"));
  f.launch();
  const int r = f.global_rank(), n = f.world_size();
  at::Tensor t = at::full({2}, static_cast<float>(r + 1));
  at::Tensor sum = f.all_reduce(t, distributed::ReduceOp::Sum);
  WCHECK(sum[0].item<float>() == n * (n + 1) / 2.0f, "all_reduce sum ", sum);
  WCHECK(t[0].item<float>() == r + 1, "all_reduce modified its input");
  at::Tensor g = f.all_gather(at::full({3}, static_cast<float>(r)));
  WCHECK(g.sizes() == at::IntArrayRef({n, 3}), "all_gather shape ", g.sizes());
  for (int k = 0; k < n; ++k) WCHECK(g[k][0].item<float>() == k, "all_gather row ", k);
  at::Tensor b = f.broadcast(at::full({1}, static_cast<float>(r + 10)), n - 1);
  WCHECK(b.item<float>() == n - 1 + 10, "broadcast from last rank ", b);
  WCHECK(f.broadcast(std::string(r == 0 ? "zero" : "other"), 0) == "zero", "string broadcast");
  f.barrier();
  // Samplers of all ranks together cover the dataset exactly once (no padding needed).
  auto sampler = f.distributed_sampler(10 * n, {true, 5, false});
  auto mine = at::tensor(std::vector<int64_t>(sampler.indices().begin(), sampler.indices().end()), at::kLong);
  at::Tensor all = f.all_gather(mine).reshape({-1});
  auto sorted = std::get<0>(all.sort());
  WCHECK(at::equal(sorted, at::arange(10 * n, at::kLong)), "sampler shards do not partition the dataset");
  f.print("collectives ok on ", n, " ranks");
  return 0;
}

// fabric_selfspawn DEVICES EXIT_CODE: run WITHOUT a launcher; launch() re-runs this
// program on DEVICES ranks; the last rank exits with EXIT_CODE.
SCENARIO("fabric_selfspawn") {
  fabric::FabricOptions o;
  o.accelerator = "cpu";
  o.strategy = "ddp";
  o.devices = static_cast<int>(args.int_arg(0, 2));
  fabric::Fabric f(o);
  f.launch();  // the parent never returns from here
  at::Tensor t = f.all_reduce(at::ones({1}), distributed::ReduceOp::Sum);
  std::printf("selfspawn rank %d of %d sum %g launched=%s\n", f.global_rank(), f.world_size(), t.item<double>(),
              env::get("TESSERA_LAUNCHED").value_or("no").c_str());
  std::fflush(stdout);
  f.barrier();
  if (f.global_rank() == f.world_size() - 1) return static_cast<int>(args.int_arg(1, 0));
  return 0;
}
