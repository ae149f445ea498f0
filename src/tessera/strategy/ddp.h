// Distributed data parallel: every rank holds the whole model; parameters (and
// buffers) are broadcast from rank 0 at setup; gradients are averaged by bucketed
// all-reduce. Buckets are filled in reverse registration order (roughly the order
// backward produces gradients); a bucket's all-reduce starts from a
// gradient-accumulator hook as soon as all its gradients are ready (and every earlier
// bucket has started, so all ranks issue collectives in the same order). On Gloo and
// NCCL it then runs while backward goes on; over the shared-memory channel (ranks of
// one host, CPU tensors) it completes inside the hook, so backward pauses there until
// every rank has reached the bucket (docs/architecture.md, "What overlaps, per
// transport"). backward() waits for all of them; afterwards each .grad holds the
// average, by default as an alias of its slice of the bucket buffer (the buffers live
// as long as the strategy; see DdpOptions::gradient_as_bucket_view).
#pragma once
#include "tessera/strategy/strategy.h"

namespace tessera::strategy {

struct DdpOptions {
  // Bucket capacity in bytes (PyTorch's default is 25 MiB).
  int64_t bucket_cap_bytes = 25 * 1024 * 1024;
  // Parameters that receive no gradient in a step (on some or all ranks) are
  // allowed: they count as zero on the ranks that did not use them, and a parameter
  // no rank used keeps no gradient. Costs one small all-reduce per step. When false, a
  // parameter without a gradient is an error naming it.
  bool find_unused_parameters = false;
  // Broadcast buffers from rank 0 before every forward is not done; buffers are
  // broadcast at setup only.
  bool broadcast_buffers_at_setup = true;
  // After each synced backward, every .grad is an alias of its slice of the bucket
  // buffer (allocated once), so gradients are copied into the buckets at most once and
  // never back out (PyTorch's gradient_as_bucket_view). A .grad tensor set by the user is
  // replaced by that alias. false: .grad tensors keep their identity and receive a copy
  // of the average.
  bool gradient_as_bucket_view = true;
};

class DdpStrategy : public Strategy {
 public:
  // A `device` other than the CPU: setup() moves the module there first.
  explicit DdpStrategy(std::shared_ptr<distributed::Communicator> comm, DdpOptions options = {},
                       c10::Device device = c10::kCPU);
  ~DdpStrategy() override;
  std::string name() const override { return "ddp"; }
  using Strategy::setup;
  torch::nn::AnyModule setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers = {}) override;
  void backward(const at::Tensor& loss) override;

  const DdpOptions& options() const { return options_; }
  // Number of buckets and the FQNs in each (diagnostics, tests).
  std::vector<std::vector<std::string>> buckets() const;
  // Collectives launched from hooks during the last backward (before backward's end).
  int launched_during_backward() const;

  struct Impl;

 private:
  DdpOptions options_;
  c10::Device device_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::strategy
