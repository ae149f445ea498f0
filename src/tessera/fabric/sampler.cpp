#include "tessera/fabric/sampler.h"

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <numeric>
#include <random>

#include "tessera/core/error.h"

namespace tessera::fabric {

namespace {

// Uniform integer in [0, bound) from a 64-bit engine, without modulo bias; written out
// so the permutation does not depend on the standard library's distributions.
uint64_t uniform_below(std::mt19937_64& g, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - (UINT64_MAX % bound);
  uint64_t x;
  do {
    x = g();
  } while (x >= limit);
  return x % bound;
}

}  // namespace

std::vector<size_t> distributed_indices(size_t n, int replicas, int rank, const SamplerOptions& o, int64_t epoch) {
  TESSERA_CHECK(replicas >= 1, "DistributedSampler: num_replicas must be at least 1, got ", replicas);
  TESSERA_CHECK(rank >= 0 && rank < replicas, "DistributedSampler: rank ", rank, " is outside [0, ", replicas, ")");
  const size_t W = static_cast<size_t>(replicas);
  std::vector<size_t> all(n);
  std::iota(all.begin(), all.end(), size_t{0});
  if (o.shuffle && n > 1) {
    std::mt19937_64 g(o.seed + static_cast<uint64_t>(epoch));
    for (size_t i = n - 1; i > 0; --i) std::swap(all[i], all[uniform_below(g, i + 1)]);
  }
  const size_t per_rank = o.drop_last ? n / W : (n + W - 1) / W;
  const size_t total = per_rank * W;
  if (total > n) {
    TESSERA_CHECK(n > 0, "DistributedSampler: cannot pad an empty dataset to ", total, " samples");
    for (size_t i = n; i < total; ++i) all.push_back(all[i - n]);
  }
  std::vector<size_t> mine;
  mine.reserve(per_rank);
  for (size_t p = static_cast<size_t>(rank); p < total; p += W) mine.push_back(all[p]);
  return mine;
}

DistributedSampler::DistributedSampler(size_t dataset_size, int num_replicas, int rank, SamplerOptions options)
    : size_(dataset_size), replicas_(num_replicas), rank_(rank), options_(options) {
  rebuild();
}

void DistributedSampler::rebuild() {
  indices_ = distributed_indices(size_, replicas_, rank_, options_, epoch_);
  num_samples_ = indices_.size();
  position_ = 0;
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (keep_position_once_ && !new_size) {
    keep_position_once_ = false;
    return;
  }
  keep_position_once_ = false;
  if (new_size) size_ = *new_size;
  rebuild();
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (position_ >= indices_.size()) return c10::nullopt;
  const size_t end = std::min(indices_.size(), position_ + batch_size);
  std::vector<size_t> out(indices_.begin() + static_cast<std::ptrdiff_t>(position_),
                          indices_.begin() + static_cast<std::ptrdiff_t>(end));
  position_ = end;
  return out;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  keep_position_once_ = false;
  epoch_ = epoch;
  rebuild();
}

state::StateDict DistributedSampler::state() const {
  state::StateDict sd;
  sd.set("epoch", epoch_);
  sd.set("position", static_cast<int64_t>(position_));
  sd.set("seed", static_cast<int64_t>(options_.seed));
  sd.set("dataset_size", static_cast<int64_t>(size_));
  sd.set("num_replicas", static_cast<int64_t>(replicas_));
  sd.set("shuffle", options_.shuffle);
  sd.set("drop_last", options_.drop_last);
  return sd;
}

void DistributedSampler::load_state(const state::StateDict& sd) {
  auto same = [&](const char* key, int64_t mine) {
    if (!sd.contains(key)) return;
    TESSERA_CHECK(sd.integer(key) == mine, "DistributedSampler::load_state: '", key, "' is ", sd.integer(key),
                  " in the saved state but ", mine, " here");
  };
  same("dataset_size", static_cast<int64_t>(size_));
  same("num_replicas", replicas_);
  if (sd.contains("seed")) options_.seed = static_cast<uint64_t>(sd.integer("seed"));
  if (sd.contains("shuffle")) options_.shuffle = sd.boolean("shuffle");
  if (sd.contains("drop_last")) options_.drop_last = sd.boolean("drop_last");
  epoch_ = sd.integer("epoch");
  rebuild();
  const int64_t pos = sd.integer("position");
  TESSERA_CHECK(pos >= 0 && static_cast<size_t>(pos) <= indices_.size(), "DistributedSampler::load_state: 'position' ",
                pos, " is outside [0, ", indices_.size(), "]");
  position_ = static_cast<size_t>(pos);
  keep_position_once_ = true;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", at::tensor(epoch_, at::kLong), /*is_buffer=*/true);
  archive.write("position", at::tensor(static_cast<int64_t>(position_), at::kLong), /*is_buffer=*/true);
  archive.write("seed", at::tensor(static_cast<int64_t>(options_.seed), at::kLong), /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch = at::empty({}, at::kLong), position = at::empty({}, at::kLong), seed = at::empty({}, at::kLong);
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", position, /*is_buffer=*/true);
  archive.read("seed", seed, /*is_buffer=*/true);
  options_.seed = static_cast<uint64_t>(seed.item<int64_t>());
  epoch_ = epoch.item<int64_t>();
  rebuild();
  position_ = std::min(indices_.size(), static_cast<size_t>(position.item<int64_t>()));
  keep_position_once_ = true;
}

}  // namespace tessera::fabric
