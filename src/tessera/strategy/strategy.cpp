#include "tessera/strategy/strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <map>

#include "tessera/state/module_state.h"
#include "tessera/state/optimizer_state.h"
#include "tessera/strategy/tp_state.h"

namespace tessera::strategy {

WrappedModuleImpl::WrappedModuleImpl(torch::nn::AnyModule module, const std::string& name) : torch::nn::Module(name) {
  TESSERA_CHECK(!module.is_empty(), name, ": the wrapped module is empty");
  wrapped_ = module.ptr();
  fn_ = [module](const at::Tensor& x) mutable { return module.forward(x); };
  adopt();
}

WrappedModuleImpl::WrappedModuleImpl(torch::nn::Sequential seq, const std::string& name) : torch::nn::Module(name) {
  TESSERA_CHECK(!seq.is_empty(), name, ": the wrapped Sequential is empty");
  wrapped_ = seq.ptr();
  fn_ = [seq](const at::Tensor& x) mutable { return seq->forward(x); };
  adopt();
}

void WrappedModuleImpl::adopt() {
  for (auto& kv : wrapped_->named_parameters(false)) register_parameter(kv.key(), kv.value(), kv.value().requires_grad());
  for (auto& kv : wrapped_->named_buffers(false)) register_buffer(kv.key(), kv.value());
  for (auto& kv : wrapped_->named_children()) register_module(kv.key(), kv.value());
}

void WrappedModuleImpl::refresh_children() {
  for (auto& kv : wrapped_->named_children()) {
    auto mine = named_children();
    if (!mine.contains(kv.key()))
      register_module(kv.key(), kv.value());
    else if (mine[kv.key()] != kv.value())
      replace_module(kv.key(), kv.value());
  }
}

void WrappedModuleImpl::train(bool on) {
  torch::nn::Module::train(on);
  wrapped_->train(on);
}

NoSyncGuard::NoSyncGuard(Strategy* s) : s_(s), prev_(s->grad_sync_enabled()) { s_->set_grad_sync(false); }
NoSyncGuard::~NoSyncGuard() {
  if (s_) s_->set_grad_sync(prev_);
}

Strategy::Strategy(std::shared_ptr<distributed::Communicator> comm) : comm_(std::move(comm)) {
  if (!comm_) comm_ = distributed::Communicator::create(distributed::World{});
}
Strategy::~Strategy() = default;

void Strategy::set_module(const std::shared_ptr<torch::nn::Module>& m) {
  TESSERA_CHECK(m, name(), ": setup() got an empty module");
  TESSERA_CHECK(!module_, name(), ": setup() called twice (strategy already holds module ", module_->name(), ")");
  module_ = m;
}

void Strategy::backward(const at::Tensor& loss) {
  TESSERA_CHECK(loss.defined(), name(), ": backward() got an undefined loss");
  torch::autograd::backward({loss});
}

void Strategy::optimizer_step(torch::optim::Optimizer& opt) { opt.step(); }

const detail::TpView& Strategy::tp_view() const {
  TESSERA_CHECK(module_, name(), ": tensor parallelism is known after setup()");
  if (!tp_view_) tp_view_ = std::make_unique<detail::TpView>(*module_);
  return *tp_view_;
}

std::shared_ptr<distributed::Communicator> Strategy::tensor_parallel_comm() const { return tp_view().comm(); }

double Strategy::clip_grad_norm(double max_norm, double norm_type) {
  TESSERA_CHECK(module_, name(), ": clip_grad_norm before setup()");
  std::vector<at::Tensor> params;
  for (auto& p : module_->parameters())
    if (p.grad().defined()) params.push_back(p);
  const detail::TpView& tp = tp_view();
  if (!tp.any()) {
    if (params.empty()) return 0.0;
    return torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type);
  }
  // Every rank of the group holds other pieces of the cut parameters and the same
  // replicated ones (data-parallel replicas hold the same gradients after backward).
  const bool inf = std::isinf(norm_type);
  double cut = 0.0, replicated = 0.0;
  for (auto& p : params) {
    if (p.grad().numel() == 0) continue;
    at::Tensor g = p.grad().detach().to(at::kDouble).abs();
    const double part = inf ? g.max().item<double>() : g.pow(norm_type).sum().item<double>();
    double& into = tp.is_cut(p) ? cut : replicated;
    into = inf ? std::max(into, part) : into + part;
  }
  double total = tp.combine_norm(cut, replicated, inf);
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    at::NoGradGuard ng;
    for (auto& p : params) p.mutable_grad().mul_(coef);
  }
  return total;
}

void Strategy::clip_grad_value(double clip_value) {
  TESSERA_CHECK(module_, name(), ": clip_grad_value before setup()");
  for (auto& p : module_->parameters())
    if (p.grad().defined()) p.mutable_grad().clamp_(-clip_value, clip_value);
}

namespace {
// Replaces every ShardedTensor (also in nested dicts) by its full value (collective).
void make_full(state::StateDict& sd) {
  for (const auto& key : std::vector<std::string>(sd.keys())) {
    state::Value& v = sd.at(key);
    if (auto* st = std::get_if<sharding::ShardedTensor>(&v)) {
      sd.set(key, st->full_tensor());
    } else if (auto* d = std::get_if<std::shared_ptr<state::StateDict>>(&v)) {
      auto copy = std::make_shared<state::StateDict>(**d);
      make_full(*copy);
      sd.set(key, copy);
    }
  }
}
}  // namespace

void Strategy::check_optimizer_index(size_t index, const char* what) const {
  TESSERA_CHECK(index < optimizers_.size(), name(), ": ", what, ": no optimizer ", index, " (the strategy has ",
                optimizers_.size(), ")");
}

state::StateDict Strategy::module_state(StateDictType type) {
  TESSERA_CHECK(module_, name(), ": module_state before setup()");
  prepare_state();
  state::StateDict sd = state::state_dict(*module_);
  if (type == StateDictType::Full) make_full(sd);
  if (tp_view().any()) {
    if (type == StateDictType::Full) tp_view().to_global(sd);
    else tp_view().to_sharded(sd, mesh_world_, comm_);
  }
  return sd;
}

state::StateDict Strategy::optimizer_state(size_t index, StateDictType type) {
  TESSERA_CHECK(module_, name(), ": optimizer_state before setup()");
  check_optimizer_index(index, "optimizer_state");
  prepare_state();
  state::StateDict sd = state::optimizer_state_dict(*optimizers_[index], *module_);
  if (type == StateDictType::Full) make_full(sd);
  if (tp_view().any()) {
    if (type == StateDictType::Full) tp_view().optimizer_to_global(sd);
    else tp_view().optimizer_to_sharded(sd, mesh_world_, comm_);
  }
  return sd;
}

StrategyState Strategy::state(StateDictType type) {
  std::vector<size_t> all(optimizers_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  return state(type, all);
}

StrategyState Strategy::state(StateDictType type, const std::vector<size_t>& optimizer_indices) {
  StrategyState out;
  out.module = module_state(type);
  for (size_t i : optimizer_indices) out.optimizers[i] = optimizer_state(i, type);
  return out;
}

std::vector<std::string> Strategy::load_module_state(const state::StateDict& sd, bool strict) {
  TESSERA_CHECK(module_, name(), ": load_module_state before setup()");
  prepare_state();
  state::LoadOptions lo;
  lo.strict = strict;
  lo.allow_reshard = true;
  if (tp_view().any()) return state::load_state_dict(*module_, tp_view().to_local(sd, comm_), lo).unexpected;
  return state::load_state_dict(*module_, sd, lo).unexpected;
}

void Strategy::load_optimizer_state(size_t index, const state::StateDict& sd) {
  TESSERA_CHECK(module_, name(), ": load_optimizer_state before setup()");
  check_optimizer_index(index, "load_optimizer_state");
  prepare_state();
  if (tp_view().any())
    state::load_optimizer_state_dict(*optimizers_[index], *module_, tp_view().optimizer_to_local(sd, comm_));
  else
    state::load_optimizer_state_dict(*optimizers_[index], *module_, sd);
}

std::vector<std::string> Strategy::load_state(const StrategyState& st, bool strict) {
  TESSERA_CHECK(module_, name(), ": load_state before setup()");
  for (const auto& [i, sd] : st.optimizers) check_optimizer_index(i, "load_state");
  if (strict)
    for (size_t i = 0; i < optimizers_.size(); ++i)
      TESSERA_CHECK(st.optimizers.count(i), name(), ": load_state: no state for optimizer ", i);
  std::vector<std::string> rest = load_module_state(st.module, strict);
  for (const auto& [i, sd] : st.optimizers) load_optimizer_state(i, sd);
  return rest;
}

SingleDeviceStrategy::SingleDeviceStrategy(c10::Device device) : Strategy(nullptr), device_(device) {}

torch::nn::AnyModule SingleDeviceStrategy::setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers) {
  set_module(module.ptr());
  if (device_ != c10::Device(c10::kCPU)) module_->to(device_);
  for (auto& o : optimizers) add_optimizer(o);
  return module;
}

namespace detail {

std::vector<std::pair<std::string, at::Tensor>> named_params(const torch::nn::Module& m, bool refuse_tied,
                                                              const std::string& who) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::map<const c10::TensorImpl*, std::string> seen;
  for (auto& kv : m.named_parameters()) {
    auto* impl = kv.value().unsafeGetTensorImpl();
    auto it = seen.find(impl);
    if (it != seen.end()) {
      TESSERA_CHECK(!refuse_tied, who, ": parameters '", it->second, "' and '", kv.key(),
                    "' are the same tensor (tied/shared weights); ", who,
                    " does not support tied parameters: untie them (e.g. clone one) or keep both in one unit");
      continue;
    }
    seen.emplace(impl, kv.key());
    out.emplace_back(kv.key(), kv.value());
  }
  return out;
}

}  // namespace detail
}  // namespace tessera::strategy
