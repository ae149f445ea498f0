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

// Every rank's generator states: {"world_size", "cpu", and "cuda" on CUDA devices}, each
// a uint8 ShardedTensor [world size, state bytes] whose row r rank r holds (no
// communication; one chunk-layout line in the metadata at any world size, each row in its
// rank's data file). Ranks draw different numbers (dropout), so each keeps its own stream.
state::StateDict gather_rng_states(fabric::Fabric& f);
// Sets this rank's generators from the checkpoint at `path`: its own row of rng.cpu /
// rng.cuda, else row 0 (a checkpoint from a smaller world), else leaves the generator as
// it is. Checkpoints written before the tensor form hold one bytes value per rank
// ("cpu_<rank>", "cuda_<rank>") among the metadata's values: `rng` (the checkpoint's
// leftover values under "rng.") is read for those first. Collective: every rank calls it,
// and an error on any rank (its row unreadable) is raised on every rank, naming that rank.
void restore_rng_states(fabric::Fabric& f, const state::StateDict& rng, const std::string& path);

}  // namespace tessera::trainer
