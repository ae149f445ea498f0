#include "tessera/strategy/strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <map>
#include <set>

#include "tessera/core/log.h"
#include "tessera/state/module_state.h"
#include "tessera/state/optimizer_state.h"

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

double Strategy::clip_grad_norm(double max_norm, double norm_type) {
  TESSERA_CHECK(module_, name(), ": clip_grad_norm before setup()");
  std::vector<at::Tensor> params;
  for (auto& p : module_->parameters())
    if (p.grad().defined()) params.push_back(p);
  if (params.empty()) return 0.0;
  return torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type);
}

void Strategy::clip_grad_value(double clip_value) {
  TESSERA_CHECK(module_, name(), ": clip_grad_value before setup()");
  for (auto& p : module_->parameters())
    if (p.grad().defined()) p.mutable_grad().clamp_(-clip_value, clip_value);
}

namespace {
const std::string kOptimPrefix = "optim.";

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

state::StateDict Strategy::state_dict(StateDictType type, bool with_optimizers) {
  TESSERA_CHECK(module_, name(), ": state_dict before setup()");
  prepare_state();
  state::StateDict sd = state::state_dict(*module_);
  if (with_optimizers)
    for (size_t i = 0; i < optimizers_.size(); ++i)
      sd.set(kOptimPrefix + std::to_string(i),
             std::make_shared<state::StateDict>(state::optimizer_state_dict(*optimizers_[i], *module_)));
  if (type == StateDictType::Full) make_full(sd);
  return sd;
}

std::vector<std::string> Strategy::load_state_dict(const state::StateDict& sd, bool strict) {
  TESSERA_CHECK(module_, name(), ": load_state_dict before setup()");
  prepare_state();
  state::StateDict model_part;
  std::vector<std::string> rest;
  for (const auto& key : sd.keys())
    if (key.rfind(kOptimPrefix, 0) != 0) model_part.set(key, sd.at(key));
  state::LoadOptions lo;
  lo.strict = strict;
  lo.allow_reshard = true;
  state::LoadReport report = state::load_state_dict(*module_, model_part, lo);
  for (auto& k : report.unexpected) rest.push_back(k);
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    const std::string key = kOptimPrefix + std::to_string(i);
    if (sd.contains(key)) {
      state::load_optimizer_state_dict(*optimizers_[i], *module_, sd.dict(key));
    } else {
      TESSERA_CHECK(!strict, name(), ": load_state_dict: no state for optimizer ", i, " (key '", key, "')");
    }
  }
  for (const auto& key : sd.keys())
    if (key.rfind(kOptimPrefix, 0) == 0) {
      const size_t i = std::stoul(key.substr(kOptimPrefix.size()));
      if (i >= optimizers_.size()) rest.push_back(key);
    }
  return rest;
}

void Strategy::rank_zero_log(const std::string& message) const {
  if (comm_->rank() == 0) log::write(log::Level::Info, message);
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
