// ShardedTensor: a tensor of some global shape whose pieces (shards) live on
// different ranks of a communicator. Each rank holds the data of its own shards
// only, and the metadata of all of them: as a list, or as a rule (from_rule: FSDP's
// row-aligned cut) from which the list is built only when something needs it, so that a
// rank's metadata does not grow with the world size. Copies and aliases share it. The
// backbone of FSDP parameters, of model-parallel modules and of checkpoint resharding.
#pragma once
#include <ATen/core/Tensor.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/sharding/layout.h"
#include "tessera/sharding/spec.h"

namespace tessera::sharding {

struct Shard {
  at::Tensor tensor;  // the local data, shape == meta.box.sizes
  ShardMetadata meta;
};

class ShardedTensor {
 public:
  ShardedTensor() = default;

  // --- construction (collective where noted) ---
  static ShardedTensor empty(const ShardingSpec& spec, const std::vector<int64_t>& shape,
                             const at::TensorOptions& options, std::shared_ptr<distributed::Communicator> comm);
  static ShardedTensor zeros(const ShardingSpec& spec, const std::vector<int64_t>& shape,
                             const at::TensorOptions& options, std::shared_ptr<distributed::Communicator> comm);
  static ShardedTensor ones(const ShardingSpec& spec, const std::vector<int64_t>& shape,
                            const at::TensorOptions& options, std::shared_ptr<distributed::Communicator> comm);
  // Values equal to slicing one full torch::rand(shape) drawn with generator seed
  // `seed`: the same numbers whatever the sharding or world size.
  static ShardedTensor rand(const ShardingSpec& spec, const std::vector<int64_t>& shape, uint64_t seed,
                            const at::TensorOptions& options, std::shared_ptr<distributed::Communicator> comm);
  // Collective: every rank passes its own shards; metadata is exchanged and
  // validated (consistent global shape and dtype, shards tile the tensor).
  static ShardedTensor from_local_shards(std::vector<Shard> local, const std::vector<int64_t>& shape,
                                         std::shared_ptr<distributed::Communicator> comm);
  // No communication: the caller guarantees `all_shards` is the same on every rank
  // and `local` holds exactly this rank's pieces of it (in the same order). `layout`, when
  // given, is the rule the shards follow (shard i is piece i, on rank i: checked), which
  // a sharded checkpoint records instead of the list (FSDP passes its row-aligned cut).
  static ShardedTensor from_parts(std::vector<Shard> local, std::vector<ShardMetadata> all_shards,
                                  const std::vector<int64_t>& shape, at::ScalarType dtype,
                                  std::shared_ptr<distributed::Communicator> comm,
                                  std::optional<Layout> layout = std::nullopt);
  // No communication and no list: shard i of `layout` (a Chunk or Flat rule of one piece
  // per rank of `comm`) is on rank i, on `device`; `local` is this rank's piece (an empty
  // one too). What FSDP registers: the metadata a rank holds is O(1) per tensor where a
  // list is O(ranks) (at 16,384 ranks a Llama-3-70B's lists took 3.5 GiB per rank). The
  // list is built on first use of shards_metadata() (gather, reshard, a consolidated
  // save), not by the training step or a sharded save.
  static ShardedTensor from_rule(Shard local, Layout layout, const std::vector<int64_t>& shape, at::ScalarType dtype,
                                 std::shared_ptr<distributed::Communicator> comm);
  // The same for a rule whose holders hold several pieces (a Tp layout: holder q, rank q
  // of `comm`, holds pieces [q·stripes, (q+1)·stripes)); `local` are this rank's, in order,
  // empty ones included.
  static ShardedTensor from_rule(std::vector<Shard> local, Layout layout, const std::vector<int64_t>& shape,
                                 at::ScalarType dtype, std::shared_ptr<distributed::Communicator> comm);
  // Collective: `full` (significant on `src` only) is split by `spec` and each
  // rank receives its pieces.
  static ShardedTensor scatter(const at::Tensor& full, const ShardingSpec& spec, int src,
                               std::shared_ptr<distributed::Communicator> comm);

  bool defined() const { return comm_ != nullptr; }
  const std::vector<int64_t>& shape() const { return shape_; }
  at::ScalarType dtype() const { return dtype_; }
  int64_t numel() const;
  // Every shard, in order (the same on every rank); built here on first use for a tensor
  // made from a rule.
  const std::vector<ShardMetadata>& shards_metadata() const;
  // Whether the metadata is held as a rule only (no list built yet).
  bool metadata_is_rule_only() const;
  std::vector<Shard>& local_shards() { return local_; }
  const std::vector<Shard>& local_shards() const { return local_; }
  // The only local shard's data (throws when this rank holds != 1 shard).
  const at::Tensor& local_tensor() const;
  int64_t local_numel() const;
  const std::shared_ptr<distributed::Communicator>& comm() const { return comm_; }
  // The rule the shards follow, when the creator gave one (from_parts: FSDP does); a
  // sharded save infers torch.chunk's rule when the shards follow it, else lists them.
  const std::optional<Layout>& layout() const { return layout_; }

  // --- collectives ---
  // The full tensor on `dst`; an undefined tensor elsewhere.
  at::Tensor gather(int dst = 0) const;
  // The full tensor on every rank.
  at::Tensor full_tensor() const;
  // The part of the full tensor inside `region` (a box of the global shape), on `dst`
  // only (an undefined tensor elsewhere). Collective; each rank sends only its shards'
  // overlap with the region, so gathering a large tensor region by region bounds the
  // destination's extra memory by the region's size.
  at::Tensor gather_region(const Box& region, int dst = 0) const;
  // A new ShardedTensor with the same values laid out by `spec` (only overlapping
  // pieces move).
  ShardedTensor reshard(const ShardingSpec& spec) const;
  // Copies values from `other` (same global shape, any sharding) into this one's
  // local shards, in place.
  void copy_from(const ShardedTensor& other);

  // --- local elementwise helpers (no communication) ---
  ShardedTensor& apply_(const std::function<void(at::Tensor&)>& fn);
  ShardedTensor clone() const;
  ShardedTensor to(at::ScalarType dtype) const;

  // This tensor's shards holding other local data: `local` has the same boxes in the same
  // order (checked), of dtype `dtype`. The metadata is shared, not copied or validated
  // again: how the module and optimizer state dicts alias parameters and their moments.
  ShardedTensor with_local(std::vector<Shard> local, at::ScalarType dtype) const;
  // Same global shape and shard metadata (so local shards correspond 1:1), any dtype.
  // Compares the rules when both are rule-made (no list is built).
  bool same_shards(const ShardedTensor& other) const;
  // same_shards() and the same dtype.
  bool same_layout(const ShardedTensor& other) const;
  // "ShardedTensor(shape=[0:4, 0:2], dtype=Float, shards=[[0:2, 0:2]@rank:0/cpu, ...])".
  std::string describe() const;

 private:
  at::Tensor gather_impl(bool everywhere, int dst, const Box& region) const;

  std::vector<int64_t> shape_;
  at::ScalarType dtype_ = at::kFloat;
  // The shards' metadata, shared by copies: a list, or a rule that builds it once.
  struct ShardList {
    std::once_flag built;
    std::atomic<bool> listed{false};  // `list` holds every shard (set once it is built)
    std::vector<ShardMetadata> list;
    std::optional<Layout> rule;  // from_rule: the list is rule's pieces, piece i on rank i ...
    c10::Device device{c10::kCPU};  // ... on this device
  };
  std::shared_ptr<ShardList> all_;
  std::vector<Shard> local_;
  std::shared_ptr<distributed::Communicator> comm_;
  std::optional<Layout> layout_;
};

}  // namespace tessera::sharding
