#include "tessera/strategy/ddp.h"

#include <ATen/ATen.h>

#include "tessera/core/log.h"
#include "tessera/strategy/grad_hooks.h"

namespace tessera::strategy {

struct DdpStrategy::Impl {
  struct Param {
    std::string fqn;
    at::Tensor p;
    int bucket = -1;
    int64_t offset = 0;  // in the bucket's flat buffer (elements)
    bool ready = false;
    detail::AccumulatorHook hook;
  };
  struct Bucket {
    std::vector<int> params;
    int64_t numel = 0;
    at::ScalarType dtype = at::kFloat;
    int pending_count = 0;
    at::Tensor buffer;
    distributed::Pending work;
    bool launched = false;
  };
  std::vector<std::unique_ptr<Param>> params;
  std::vector<Bucket> buckets;
  int next_bucket = 0;
  int launched_in_backward = 0;
  // Inside backward() (BackwardGuard): only then do the hooks start all-reduces.
  bool in_backward = false;
  DdpStrategy* self = nullptr;

  void reset_step() {
    for (auto& p : params) p->ready = false;
    for (auto& b : buckets) {
      b.pending_count = static_cast<int>(b.params.size());
      b.launched = false;
      b.work = distributed::Pending();
    }
    next_bucket = 0;
  }

  // Whether `g` is exactly the bucket slice `slot` (same memory, same length, dense);
  // after a step each .grad is such a slice (an alias, not an autograd view).
  static bool is_view_of(const at::Tensor& g, const at::Tensor& slot) {
    return g.defined() && g.data_ptr() == slot.data_ptr() && g.numel() == slot.numel() && g.is_contiguous();
  }

  // The bucket's buffer lives as long as the strategy (as in PyTorch's reducer): no
  // allocation and no page faults per step. After a step each parameter's .grad is (by
  // default, gradient_as_bucket_view) an alias of its slice, so gradients that stay
  // (zero_grad without set_to_none, no_sync accumulation) are accumulated by autograd in
  // place and need no copy here.
  void launch(Bucket& b) {
    const c10::Device device = params[b.params[0]]->p.device();
    if (!b.buffer.defined() || b.buffer.device() != device) {  // first step, or the module moved
      b.buffer = at::empty({b.numel}, at::TensorOptions().dtype(b.dtype).device(device));
    }
    for (int i : b.params) {
      auto& P = *params[i];
      at::Tensor dst = b.buffer.narrow(0, P.offset, P.p.numel());
      const at::Tensor& g = P.p.grad();
      if (!g.defined()) {
        dst.zero_();
      } else if (!is_view_of(g, dst)) {
        dst.copy_(g.reshape({-1}));
      }
    }
    b.work = self->comm_->all_reduce_async(b.buffer, distributed::ReduceOp::Avg);
    b.launched = true;
  }

  // Launches every consecutive ready bucket from next_bucket (same order on all ranks).
  void launch_ready() {
    while (next_bucket < static_cast<int>(buckets.size()) && buckets[next_bucket].pending_count == 0) {
      launch(buckets[next_bucket]);
      if (in_backward) ++launched_in_backward;
      ++next_bucket;
    }
  }

  void on_grad_ready(int i) {
    if (!self->sync_grads_ || !in_backward) return;
    auto& P = *params[i];
    if (P.ready) {
      // A second accumulation in the same backward (a reentrant backward, e.g. activation
      // checkpointing): harmless until the bucket starts, lost or inconsistent after.
      TESSERA_CHECK(!buckets[P.bucket].launched, "DDP: parameter '", P.fqn,
                    "' received a second gradient in one backward after its bucket's all-reduce had started "
                    "(reentrant backward, e.g. activation checkpointing, is not supported with DDP)");
      return;
    }
    P.ready = true;
    if (--buckets[P.bucket].pending_count == 0 && !self->options_.find_unused_parameters) launch_ready();
  }
};

DdpStrategy::DdpStrategy(std::shared_ptr<distributed::Communicator> comm, DdpOptions options, c10::Device device)
    : Strategy(std::move(comm)), options_(options), device_(device), impl_(std::make_unique<Impl>()) {
  impl_->self = this;
}

DdpStrategy::~DdpStrategy() {
  for (auto& p : impl_->params) p->hook.remove();
}

torch::nn::AnyModule DdpStrategy::setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers) {
  set_module(module.ptr());
  if (!device_.is_cpu()) module_->to(device_);  // before the broadcast from rank 0
  for (auto& o : optimizers) add_optimizer(o);
  auto& I = *impl_;
  {
    at::NoGradGuard ng;
    for (auto& kv : detail::named_params(*module_, false, "DDP")) comm_->broadcast(kv.second, 0);
    if (options_.broadcast_buffers_at_setup)
      for (auto& b : module_->buffers()) comm_->broadcast(b, 0);
  }
  for (auto& [fqn, p] : detail::named_params(*module_, false, "DDP")) {
    if (!p.requires_grad()) continue;
    auto P = std::make_unique<Impl::Param>();
    P->fqn = fqn;
    P->p = p;
    I.params.push_back(std::move(P));
  }
  // Buckets in reverse registration order, split by capacity and dtype.
  int64_t bytes = 0;
  for (int i = static_cast<int>(I.params.size()) - 1; i >= 0; --i) {
    auto& P = *I.params[i];
    const int64_t nb = P.p.numel() * static_cast<int64_t>(P.p.element_size());
    if (I.buckets.empty() || I.buckets.back().dtype != P.p.scalar_type() ||
        (bytes + nb > options_.bucket_cap_bytes && !I.buckets.back().params.empty())) {
      I.buckets.emplace_back();
      I.buckets.back().dtype = P.p.scalar_type();
      bytes = 0;
    }
    auto& b = I.buckets.back();
    P.bucket = static_cast<int>(I.buckets.size()) - 1;
    P.offset = b.numel;
    b.numel += P.p.numel();
    b.params.push_back(i);
    bytes += nb;
  }
  for (size_t i = 0; i < I.params.size(); ++i) {
    Impl* ip = impl_.get();
    I.params[i]->hook.attach(I.params[i]->p, [ip, i] { ip->on_grad_ready(static_cast<int>(i)); });
  }
  I.reset_step();
  return module;
}

void DdpStrategy::backward(const at::Tensor& loss) {
  auto& I = *impl_;
  {
    detail::BackwardGuard guard("DDP", module_, &I.in_backward);
    I.reset_step();
    I.launched_in_backward = 0;
    guard.run(loss);
  }
  if (!sync_grads_) return;
  // Parameters that got no gradient on this rank.
  at::Tensor used;
  if (options_.find_unused_parameters) {
    used = at::zeros({static_cast<int64_t>(I.params.size())}, at::kInt);
    for (size_t i = 0; i < I.params.size(); ++i) used[i] = I.params[i]->ready ? 1 : 0;
    comm_->all_reduce(used, distributed::ReduceOp::Max);
    for (auto& b : I.buckets) b.pending_count = 0;
  } else {
    for (auto& P : I.params)
      TESSERA_CHECK(P->ready, "DDP: parameter '", P->fqn, "' received no gradient in this step on rank ", rank(),
                    "; set DdpOptions::find_unused_parameters if some parameters are legitimately unused");
  }
  I.launch_ready();
  for (auto& b : I.buckets) {
    b.work.wait();
    for (int i : b.params) {
      auto& P = *I.params[i];
      if (used.defined() && used[i].item<int>() == 0) continue;  // no rank used it: keep no gradient
      at::Tensor avg = b.buffer.narrow(0, P.offset, P.p.numel()).view(P.p.sizes());
      if (Impl::is_view_of(P.p.grad(), avg)) continue;
      if (!options_.gradient_as_bucket_view && P.p.grad().defined()) {
        P.p.mutable_grad().copy_(avg);
      } else {
        P.p.mutable_grad() = options_.gradient_as_bucket_view ? detail::alias_of(avg) : avg.clone();
      }
    }
  }
}

std::vector<std::vector<std::string>> DdpStrategy::buckets() const {
  std::vector<std::vector<std::string>> out;
  for (auto& b : impl_->buckets) {
    out.emplace_back();
    for (int i : b.params) out.back().push_back(impl_->params[i]->fqn);
  }
  return out;
}

int DdpStrategy::launched_during_backward() const { return impl_->launched_in_backward; }

}  // namespace tessera::strategy
