// Optimizer state dicts keyed by parameter FQN (never by position or pointer), for
// libtorch's SGD, Adam, AdamW, Adagrad and RMSprop. Layout:
//   "optimizer"    -> "sgd" | "adam" | "adamw" | "adagrad" | "rmsprop"
//   "state"        -> { FQN -> { "step": int, "exp_avg": tensor | sharded, ... } }
//   "param_groups" -> { "0" -> { "lr": float, ..., "params": { "0": FQN, ... } }, ... }
// State tensors of a sharded parameter (the local shard of a ShardedTensor
// registered on the model, see module_state.h) are ShardedTensors with the
// parameter's sharding; other tensors are plain. Values alias the optimizer's
// tensors; loading copies.
#pragma once
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>

#include "tessera/state/state_dict.h"

namespace tessera::state {

StateDict optimizer_state_dict(const torch::optim::Optimizer& optimizer, const torch::nn::Module& model);

// Restores state and hyperparameters in place. Checks everything before it changes
// anything: the optimizer kind, the number of param groups, each group's parameter
// FQNs (in order), state keys that name no parameter of the optimizer, shapes. A
// sharded state value with another layout than its parameter is resharded (a
// collective: every rank must load). Parameters without an entry get no state.
void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const torch::nn::Module& model,
                               const StateDict& sd);

// Gives every parameter of `optimizer` its state, as a first step would, without
// changing any parameter: `step` runs once with every gradient zero and every learning
// rate 0 (gradients and learning rates are restored afterwards, also when it throws).
// A checkpoint loaded next then has a state to land in. `step` is how the caller steps
// (e.g. through its strategy, which may step on shards).
void materialize_optimizer_state(torch::optim::Optimizer& optimizer,
                                 const std::function<void(torch::optim::Optimizer&)>& step);

}  // namespace tessera::state
