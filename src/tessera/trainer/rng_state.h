// The default random generators' states as the Trainer saves, restores and protects
// them (internal to the trainer layer): checkpoints hold every rank's CPU (and CUDA)
// generator state, and validation runs inside an RngFork so it never moves the
// training streams.
#pragma once
#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>

#include "tessera/state/state_dict.h"

namespace tessera::fabric {
class Fabric;
}

namespace tessera::trainer {

// A generator's state as bytes, and back.
std::string generator_state(at::Generator gen);
void set_generator_state(at::Generator gen, const std::string& bytes);

// Saves the default generators' states (CPU, and the device's when it is CUDA) and
// restores them on destruction.
class RngFork {
 public:
  explicit RngFork(c10::Device device);
  ~RngFork();
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  std::string cpu_, cuda_;
  std::optional<c10::Device> device_;
};

// Every rank's generator states (collective): {"world_size", "cpu_<rank>", and
// "cuda_<rank>" on CUDA devices}; ranks draw different numbers (dropout), so each keeps
// its own stream.
state::StateDict gather_rng_states(fabric::Fabric& f);
// Sets this rank's generators from such a dict: its own rank's entries, else rank 0's
// (a checkpoint from a smaller world), else leaves the generator as it is.
void restore_rng_states(fabric::Fabric& f, const state::StateDict& rng);

}  // namespace tessera::trainer
