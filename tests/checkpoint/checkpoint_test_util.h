// Shared by the tests that drive checkpoints from one process (the CLI's and the bad-input
// ones): a single-process communicator and a tiny known state.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

#include "tessera/distributed/communicator.h"
#include "tessera/state/state_dict.h"

namespace tessera::testing {

// One communicator for the whole test process (world of one).
inline std::shared_ptr<distributed::Communicator> solo() {
  static auto c = distributed::Communicator::create(distributed::World{});
  return c;
}

// "w": n floats of value v, "step": v as an integer.
inline state::StateDict state_of(int64_t n, double v) {
  state::StateDict sd;
  sd.set("w", at::full({n}, v, at::kFloat));
  sd.set("step", int64_t(v));
  return sd;
}

}  // namespace tessera::testing
