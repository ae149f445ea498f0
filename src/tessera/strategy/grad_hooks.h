// What DDP and FSDP share around a backward pass. Internal to the strategy layer.
//  - Gradient-ready hooks: a post hook on a parameter's AccumulateGrad node runs after
//    the gradient has been accumulated into .grad (what both need; a tensor hook runs
//    before accumulation).
//  - BackwardGuard: the frame of their backward().
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <vector>

#include "tessera/core/compat.h"
#include "tessera/core/error.h"

namespace tessera::strategy::detail {

// A tensor over t's memory that autograd does not treat as a view of it. Gradients that
// live in a strategy's flat buffer must be such aliases: libtorch's Optimizer::zero_grad
// calls detach_() on every .grad, which refuses views.
inline at::Tensor alias_of(const at::Tensor& t) {
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    // An undefined incoming gradient (e.g. a path that produced none) is not "ready".
    if (!inputs.empty() && inputs[0].defined()) fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

// Keeps one hook on a parameter's grad accumulator. libtorch drops a parameter's
// accumulator when set_data changes its dtype or device (FSDP mixed precision swaps
// fp32 shards and low-precision gathered tensors), so attach() re-installs the
// hooked node whenever the parameter holds data of the node's dtype/device again.
class AccumulatorHook {
 public:
  AccumulatorHook() = default;
  AccumulatorHook(const AccumulatorHook&) = delete;
  AccumulatorHook& operator=(const AccumulatorHook&) = delete;
  ~AccumulatorHook() { remove(); }

  void attach(const at::Tensor& param, const std::function<void()>& fn) {
    if (!param.requires_grad()) return;
    if (node_ && dtype_ == param.scalar_type() && device_ == param.device()) {
      compat::set_grad_accumulator(param, node_);
      return;
    }
    remove();
    node_ = torch::autograd::impl::grad_accumulator(param);
    dtype_ = param.scalar_type();
    device_ = param.device();
    key_ = node_->add_post_hook(std::make_unique<GradReadyHook>(fn));
  }
  void remove() {
    if (node_) node_->del_post_hook(key_);
    node_.reset();
  }

 private:
  compat::NodePtr node_;
  uintptr_t key_ = 0;
  at::ScalarType dtype_ = at::kFloat;
  c10::Device device_ = c10::kCPU;
};

// The frame of a strategy's backward(), written once for DDP and FSDP: it refuses a
// backward before setup() ("<who>: backward before setup()") and, for a strategy whose
// gradient hooks must act only inside its backward() (DDP: a plain loss.backward() must
// not start collectives the strategy never waits for), raises that strategy's flag for
// the guard's lifetime; the flag gets its previous value back when the guard goes, also
// when autograd throws. The strategy's end-of-backward work follows run(), and is skipped
// when autograd throws.
class BackwardGuard {
 public:
  BackwardGuard(const char* who, const std::shared_ptr<torch::nn::Module>& module, bool* in_backward = nullptr)
      : flag_(in_backward) {
    TESSERA_CHECK(module, who, ": backward before setup()");
    if (flag_) {
      prev_ = *flag_;
      *flag_ = true;
    }
  }
  ~BackwardGuard() {
    if (flag_) *flag_ = prev_;
  }
  BackwardGuard(const BackwardGuard&) = delete;
  BackwardGuard& operator=(const BackwardGuard&) = delete;

  // Back-propagates from `loss` (accumulating into .grad; the hooks above fire).
  void run(const at::Tensor& loss) const { torch::autograd::backward({loss}); }

 private:
  bool* flag_;
  bool prev_ = false;
};

}  // namespace tessera::strategy::detail
