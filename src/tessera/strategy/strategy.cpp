#include "tessera/strategy/strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <map>
#include <set>

#include "tessera/core/log.h"

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

void WrappedModuleImpl::train(bool on) {
  torch::nn::Module::train(on);
  wrapped_->train(on);
}

NoSyncGuard::NoSyncGuard(Strategy* s) : s_(s), prev_(s->grad_sync_enabled()) { s_->set_grad_sync(false); }
NoSyncGuard::~NoSyncGuard() {
  if (s_) s_->set_grad_sync(prev_);
}

Strategy::Strategy(std::shared_ptr<dist::Communicator> comm) : comm_(std::move(comm)) {
  if (!comm_) comm_ = dist::Communicator::create(dist::World{});
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

state::StateDict Strategy::state_dict(StateDictType, bool with_optimizers) {
  TESSERA_CHECK(module_, name(), ": state_dict before setup()");
  state::StateDict sd;
  for (auto& kv : module_->named_parameters()) sd.set(kv.key(), kv.value().detach().clone());
  for (auto& kv : module_->named_buffers()) sd.set(kv.key(), kv.value().detach().clone());
  (void)with_optimizers;
  return sd;
}

std::vector<std::string> Strategy::load_state_dict(const state::StateDict& sd, bool strict) {
  TESSERA_CHECK(module_, name(), ": load_state_dict before setup()");
  return detail::load_module_full(*module_, sd, strict);
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

namespace {
at::Tensor full_value(const state::StateDict& sd, const std::string& key) {
  const auto& v = sd.at(key);
  if (auto* t = std::get_if<at::Tensor>(&v)) return *t;
    throw Error(concat("state dict key '", key, "' holds a ", state::kind_name(v), ", expected a tensor"));
}
}  // namespace

std::vector<std::string> load_module_full(torch::nn::Module& m, const state::StateDict& sd, bool strict) {
  std::set<std::string> used;
  std::vector<std::string> missing;
  at::NoGradGuard ng;
  auto load_one = [&](const std::string& key, at::Tensor& dst) {
    if (!sd.contains(key)) {
      missing.push_back(key);
      return;
    }
    at::Tensor v = full_value(sd, key);
    TESSERA_CHECK(v.sizes() == dst.sizes(), "state dict key '", key, "' has shape ", v.sizes(),
                  " but the module's tensor has shape ", dst.sizes());
    dst.copy_(v);
    used.insert(key);
  };
  for (auto& kv : m.named_parameters()) load_one(kv.key(), kv.value());
  for (auto& kv : m.named_buffers()) load_one(kv.key(), kv.value());
  if (strict && !missing.empty()) {
    std::string names;
    for (auto& k : missing) names += (names.empty() ? "" : ", ") + k;
    throw Error(concat("load_state_dict: missing keys: ", names));
  }
  std::vector<std::string> rest;
  for (auto& k : sd.keys())
    if (!used.count(k)) rest.push_back(k);
  return rest;
}

}  // namespace detail
}  // namespace tessera::strategy
