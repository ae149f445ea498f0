#pragma once
// Adam and AdamW whose update of a parameter is one pass over its memory.
//
// torch::optim::Adam / AdamW (libtorch's C++ optimizers, and torch.optim's default
// for-loop implementation on the CPU) update each parameter with about nine tensor
// operations (decay, two moment updates, sqrt, divide, add eps, addcdiv), each a pass over
// the parameter's memory plus a temporary; for a 25M-parameter model that is ~2.2 GB of
// memory traffic per step where one pass needs 0.7 GB. These classes are the same
// optimizers (they derive from libtorch's, take the same options, keep the same per-parameter
// state: step, exp_avg, exp_avg_sq, max_exp_avg_sq) with a step that reads and writes each
// float or double CPU parameter, its gradient and its moments once, vectorised for the CPU
// it runs on and split over the intra-op threads. Anything else (CUDA, half precision,
// non-contiguous tensors) takes the tensor-operation path of the same formulas.
//
// Drop-in: state dicts, checkpoints, LR schedulers and Tessera's strategies see a
// torch::optim::Adam / AdamW. Results agree with libtorch's to float rounding (the order of
// the operations inside one element's update differs), not bit for bit.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

namespace tessera::optim {

class Adam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  at::Tensor step(LossClosure closure = nullptr) override;
};

class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  at::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace tessera::optim
