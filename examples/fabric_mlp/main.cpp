// Fabric example: a small MLP regression trained with a hand-written loop.
//
//   ./fabric_mlp --devices 2 --strategy fsdp --steps 20 --ckpt /tmp/mlp-ckpt
//
// Started like this (no launcher), launch() re-runs the program on 2 ranks. It runs
// unchanged under `tessera run -n 2 -- ./fabric_mlp --devices 2`, torchrun, srun or
// mpirun. Run it again with the same --ckpt to resume from the saved step.
#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <filesystem>
#include <iostream>
#include <string>

#include "tessera/core/blas.h"
#include "tessera/fabric/fabric.h"

using namespace tessera;

// OpenBLAS kernels for this CPU, chosen before any library loads (tessera/core/blas.h).
TESSERA_TUNE_BLAS_AT_STARTUP();

int main(int argc, char** argv) {
  fabric::FabricOptions options;
  options.accelerator = "cpu";
  options.strategy = "ddp";
  options.devices = 2;
  int64_t steps = 20;
  std::string ckpt;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--devices") options.devices = std::stoi(v);
    else if (k == "--strategy") options.strategy = v;
    else if (k == "--precision") options.precision = v;
    else if (k == "--steps") steps = std::stoll(v);
    else if (k == "--ckpt") ckpt = v;
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }

  // Each Linear becomes its own FSDP unit (ignored by the other strategies).
  if (options.strategy == "fsdp") options.fsdp.auto_wrap = strategy::wrap_by_size(1);

  try {
    fabric::Fabric fabric(options);  // invalid options are refused here, naming the option
    fabric.launch();                 // before any torch op: may re-run this program `devices` times
    std::cout << "rank " << fabric.global_rank() << " of " << fabric.world_size() << std::endl;
    fabric.seed_everything(42);      // same initial weights on every rank

    // Data: y = sin(x W) for a fixed random W, 256 samples; each rank reads its share,
    // reshuffled every epoch. (The sampler also plugs into torch::data::make_data_loader.)
    at::Tensor x = at::randn({256, 16});
    at::Tensor y = at::sin(x.matmul(at::randn({16, 4})));
    fabric::DistributedSampler sampler = fabric.distributed_sampler(256, {/*shuffle=*/true, /*seed=*/42});

    // Model and optimizer.
    auto net = torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::GELU(), torch::nn::Linear(64, 64),
                                     torch::nn::GELU(), torch::nn::Linear(64, 4));
    auto model = fabric.setup_module(net);
    auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(3e-3));
    fabric.setup_optimizer(opt);

    // Resume if a checkpoint exists (a sharded directory or a consolidated file).
    int64_t step = 0;
    fabric::FabricState state;
    state.set("model", model).set("optimizer", opt).set("step", int64_t(0)).set("sampler", sampler.state());
    if (!ckpt.empty() && std::filesystem::exists(ckpt)) {
      fabric.load(ckpt, state);
      step = state.values().integer("step");
      sampler.load_state(state.values().dict("sampler"));
      fabric.print("resumed at step ", step);
    }

    const int accumulate = 2;  // micro-batches per optimizer step
    const size_t micro_batch = 8;
    int micro = 0;
    while (step < steps) {
      c10::optional<std::vector<size_t>> batch = sampler.next(micro_batch);
      if (!batch) {  // end of this rank's share: next epoch, new permutation
        sampler.set_epoch(sampler.epoch() + 1);
        continue;
      }
      at::Tensor rows = at::tensor(std::vector<int64_t>(batch->begin(), batch->end()), at::kLong);
      at::Tensor bx = x.index_select(0, rows), by = y.index_select(0, rows);
      const bool last_micro = (++micro % accumulate) == 0;
      at::Tensor loss;
      {
        // The first micro-batches accumulate gradients locally; the last one syncs them.
        auto no_sync = fabric.no_backward_sync(model, /*enabled=*/!last_micro);
        auto autocast = fabric.autocast();  // bf16 with --precision bf16-mixed
        loss = (model.forward<at::Tensor>(bx).to(at::kFloat) - by).pow(2).mean() / accumulate;
        fabric.backward(loss);
      }
      if (!last_micro) continue;
      const double norm = fabric.clip_grad_norm(1.0);  // global norm over every rank's shard
      fabric.step(opt);
      opt->zero_grad();
      ++step;
      const double mean_loss = fabric.all_reduce(loss.item<double>() * accumulate);  // average over ranks
      if (step % 5 == 0 || step == steps) fabric.print("step ", step, " loss ", mean_loss, " grad norm ", norm);
    }

    if (!ckpt.empty()) {
      state.set("step", step).set("sampler", sampler.state());
      fabric.save(ckpt, state);
      fabric.print("saved ", ckpt, " at step ", step);
    }
    fabric.barrier();
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
