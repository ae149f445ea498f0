// The typed state a strategy hands out and takes back: the module's state dict and
// one state dict per optimizer, each under its index in Strategy::optimizers(). No
// key convention joins them: whoever saves them (Fabric, a user) names the parts.
#pragma once
#include <cstddef>
#include <map>

#include "tessera/state/state_dict.h"

namespace tessera::strategy {

// Whether a state dict holds the local pieces of sharded values (each a
// ShardedTensor under its original name and global shape) or full tensors.
enum class StateDictType { Sharded, Full };

struct StrategyState {
  // Parameters and buffers under their FQNs (tessera::state::state_dict).
  state::StateDict module;
  // Optimizer index -> its state dict keyed by parameter FQN
  // (tessera::state::optimizer_state_dict). Only the optimizers asked for.
  std::map<size_t, state::StateDict> optimizers;
};

}  // namespace tessera::strategy
