// A distributed sampler for torch::data datasets, with the semantics of PyTorch's
// torch.utils.data.DistributedSampler:
//  - every rank sees ceil(n / W) indices (drop_last=false: the index list is padded
//    by repeating it from the start) or floor(n / W) (drop_last=true: the tail is
//    dropped), so all ranks run the same number of steps;
//  - rank r takes positions r, r + W, r + 2W, ... of the (shuffled) list;
//  - shuffling is a permutation drawn from `seed + epoch` (set_epoch before each
//    epoch), identical on every rank and independent of the libtorch version.
// The position inside the epoch is part of state(), so a run resumed from a
// checkpoint continues with exactly the indices it would have seen.
//
//   DistributedSampler sampler(dataset.size().value(), fabric.world_size(), fabric.global_rank());
//   auto loader = torch::data::make_data_loader(dataset, sampler, batch_size);
#pragma once
#include <torch/data/samplers/base.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "tessera/state/state_dict.h"

namespace tessera::fabric {

struct SamplerOptions {
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
};

class DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  DistributedSampler(size_t dataset_size, int num_replicas, int rank, SamplerOptions options = {});

  // Starts the epoch over (new_size: the dataset changed size). Keeps the epoch.
  // Exception: the first reset() without a new size after load_state() keeps the
  // restored position, so a DataLoader built after load_state (its begin() calls
  // reset()) resumes mid-epoch.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  // Up to batch_size of this rank's next indices; nullopt at the end of the epoch.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Selects the permutation of the coming epoch and rewinds to its start.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  // This rank's indices for the current epoch (num_samples() of them).
  const std::vector<size_t>& indices() const { return indices_; }
  size_t num_samples() const { return num_samples_; }
  // Indices already handed out in this epoch.
  size_t position() const { return position_; }

  // {"epoch", "position", "seed", "dataset_size", "num_replicas", "shuffle",
  // "drop_last"}: the same on every rank (all ranks advance together), so one copy in
  // a checkpoint serves them all. Restoring requires the same dataset size and replica
  // count (a different world size is refused with an error naming the field).
  state::StateDict state() const;
  void load_state(const state::StateDict& sd);

 private:
  void rebuild();
  size_t size_;
  int replicas_, rank_;
  SamplerOptions options_;
  int64_t epoch_ = 0;
  size_t num_samples_ = 0;
  size_t position_ = 0;
  bool keep_position_once_ = false;
  std::vector<size_t> indices_;
};

// This rank's indices of an epoch (the function the sampler uses).
std::vector<size_t> distributed_indices(size_t dataset_size, int num_replicas, int rank, const SamplerOptions& options,
                                        int64_t epoch);

}  // namespace tessera::fabric
