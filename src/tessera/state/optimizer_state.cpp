#include "tessera/state/optimizer_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>
#include <set>
#include <unordered_map>

#include "tessera/core/compat.h"
#include "tessera/core/error.h"
#include "tessera/state/module_state.h"

namespace tessera::state {

using sharding::ShardedTensor;
namespace optim = torch::optim;

namespace {

std::string kind_of(const optim::Optimizer& o) {
  if (dynamic_cast<const optim::SGD*>(&o)) return "sgd";
  if (dynamic_cast<const optim::Adam*>(&o)) return "adam";
  if (dynamic_cast<const optim::AdamW*>(&o)) return "adamw";
  if (dynamic_cast<const optim::Adagrad*>(&o)) return "adagrad";
  if (dynamic_cast<const optim::RMSprop*>(&o)) return "rmsprop";
  throw Error("optimizer state dicts support SGD, Adam, AdamW, Adagrad and RMSprop; got another optimizer type");
}

// Per-parameter state as named fields, for every supported type.
struct Fields {
  std::map<std::string, int64_t> ints;
  std::map<std::string, at::Tensor> tensors;  // undefined ones omitted
};

Fields fields_of(const optim::OptimizerParamState& s, const std::string& fqn) {
  Fields f;
  auto put = [&](const char* n, const at::Tensor& t) {
    if (t.defined()) f.tensors[n] = t;
  };
  if (auto* p = dynamic_cast<const optim::SGDParamState*>(&s)) {
    put("momentum_buffer", p->momentum_buffer());
  } else if (auto* p = dynamic_cast<const optim::AdamParamState*>(&s)) {
    f.ints["step"] = p->step();
    put("exp_avg", p->exp_avg());
    put("exp_avg_sq", p->exp_avg_sq());
    put("max_exp_avg_sq", p->max_exp_avg_sq());
  } else if (auto* p = dynamic_cast<const optim::AdamWParamState*>(&s)) {
    f.ints["step"] = p->step();
    put("exp_avg", p->exp_avg());
    put("exp_avg_sq", p->exp_avg_sq());
    put("max_exp_avg_sq", p->max_exp_avg_sq());
  } else if (auto* p = dynamic_cast<const optim::AdagradParamState*>(&s)) {
    f.ints["step"] = p->step();
    put("sum", p->sum());
  } else if (auto* p = dynamic_cast<const optim::RMSpropParamState*>(&s)) {
    f.ints["step"] = p->step();
    put("square_avg", p->square_avg());
    put("momentum_buffer", p->momentum_buffer());
    put("grad_avg", p->grad_avg());
  } else {
    throw Error(concat("optimizer state of parameter '", fqn, "' has an unsupported type"));
  }
  return f;
}

std::unique_ptr<optim::OptimizerParamState> make_state(const std::string& kind, Fields f, const std::string& fqn) {
  auto take = [&](const char* n) {
    auto it = f.tensors.find(n);
    at::Tensor t = it == f.tensors.end() ? at::Tensor() : it->second;
    if (it != f.tensors.end()) f.tensors.erase(it);
    return t;
  };
  auto step = [&]() {
    auto it = f.ints.find("step");
    TESSERA_CHECK(it != f.ints.end(), "optimizer state of '", fqn, "' lacks 'step'");
    int64_t v = it->second;
    f.ints.erase(it);
    return v;
  };
  std::unique_ptr<optim::OptimizerParamState> out;
  if (kind == "sgd") {
    auto s = std::make_unique<optim::SGDParamState>();
    s->momentum_buffer(take("momentum_buffer"));
    out = std::move(s);
  } else if (kind == "adam" || kind == "adamw") {
    int64_t st = step();
    at::Tensor a = take("exp_avg"), b = take("exp_avg_sq"), m = take("max_exp_avg_sq");
    TESSERA_CHECK(a.defined() && b.defined(), "optimizer state of '", fqn, "' lacks exp_avg/exp_avg_sq");
    if (kind == "adam") {
      auto s = std::make_unique<optim::AdamParamState>();
      s->step(st).exp_avg(a).exp_avg_sq(b).max_exp_avg_sq(m);
      out = std::move(s);
    } else {
      auto s = std::make_unique<optim::AdamWParamState>();
      s->step(st).exp_avg(a).exp_avg_sq(b).max_exp_avg_sq(m);
      out = std::move(s);
    }
  } else if (kind == "adagrad") {
    auto s = std::make_unique<optim::AdagradParamState>();
    s->step(step());
    s->sum(take("sum"));
    TESSERA_CHECK(s->sum().defined(), "optimizer state of '", fqn, "' lacks 'sum'");
    out = std::move(s);
  } else {
    auto s = std::make_unique<optim::RMSpropParamState>();
    s->step(step());
    s->square_avg(take("square_avg")).momentum_buffer(take("momentum_buffer")).grad_avg(take("grad_avg"));
    TESSERA_CHECK(s->square_avg().defined(), "optimizer state of '", fqn, "' lacks 'square_avg'");
    out = std::move(s);
  }
  TESSERA_CHECK(f.tensors.empty() && f.ints.empty(), "optimizer state of '", fqn, "' has fields a ", kind,
                " optimizer does not know (e.g. '",
                f.tensors.empty() ? f.ints.begin()->first : f.tensors.begin()->first, "')");
  return out;
}

// Adam and AdamW share their hyperparameters.
template <typename AdamLike>
void adam_options_to(const AdamLike& p, StateDict& g) {
  g.set("lr", p.lr());
  g.set("beta1", std::get<0>(p.betas()));
  g.set("beta2", std::get<1>(p.betas()));
  g.set("eps", p.eps());
  g.set("weight_decay", p.weight_decay());
  g.set("amsgrad", p.amsgrad());
}

template <typename AdamLike, typename Num, typename Flag>
std::function<void()> adam_options_from(AdamLike* p, const Num& d, const Flag& b) {
  AdamLike v(d("lr"));
  v.betas({d("beta1"), d("beta2")}).eps(d("eps")).weight_decay(d("weight_decay")).amsgrad(b("amsgrad"));
  return [p, v] { *p = v; };
}

void options_to(const optim::OptimizerOptions& o, StateDict& g) {
  if (auto* p = dynamic_cast<const optim::SGDOptions*>(&o)) {
    g.set("lr", p->lr());
    g.set("momentum", p->momentum());
    g.set("dampening", p->dampening());
    g.set("weight_decay", p->weight_decay());
    g.set("nesterov", p->nesterov());
  } else if (auto* p = dynamic_cast<const optim::AdamOptions*>(&o)) {
    adam_options_to(*p, g);
  } else if (auto* p = dynamic_cast<const optim::AdamWOptions*>(&o)) {
    adam_options_to(*p, g);
  } else if (auto* p = dynamic_cast<const optim::AdagradOptions*>(&o)) {
    g.set("lr", p->lr());
    g.set("lr_decay", p->lr_decay());
    g.set("weight_decay", p->weight_decay());
    g.set("initial_accumulator_value", p->initial_accumulator_value());
    g.set("eps", p->eps());
  } else if (auto* p = dynamic_cast<const optim::RMSpropOptions*>(&o)) {
    g.set("lr", p->lr());
    g.set("alpha", p->alpha());
    g.set("eps", p->eps());
    g.set("weight_decay", p->weight_decay());
    g.set("momentum", p->momentum());
    g.set("centered", p->centered());
  }
}

// Returns a setter that applies `g` to `o` (checked now, applied later).
std::function<void()> options_from(optim::OptimizerOptions& o, const StateDict& g, const std::string& where) {
  auto d = [&](const char* k) { return g.number(k); };
  auto b = [&](const char* k) { return g.boolean(k); };
  try {
    if (auto* p = dynamic_cast<optim::SGDOptions*>(&o)) {
      optim::SGDOptions v(d("lr"));
      v.momentum(d("momentum")).dampening(d("dampening")).weight_decay(d("weight_decay")).nesterov(b("nesterov"));
      return [p, v] { *p = v; };
    }
    if (auto* p = dynamic_cast<optim::AdamOptions*>(&o)) return adam_options_from(p, d, b);
    if (auto* p = dynamic_cast<optim::AdamWOptions*>(&o)) return adam_options_from(p, d, b);
    if (auto* p = dynamic_cast<optim::AdagradOptions*>(&o)) {
      optim::AdagradOptions v(d("lr"));
      v.lr_decay(d("lr_decay")).weight_decay(d("weight_decay")).initial_accumulator_value(d("initial_accumulator_value")).eps(d("eps"));
      return [p, v] { *p = v; };
    }
    if (auto* p = dynamic_cast<optim::RMSpropOptions*>(&o)) {
      optim::RMSpropOptions v(d("lr"));
      v.alpha(d("alpha")).eps(d("eps")).weight_decay(d("weight_decay")).momentum(d("momentum")).centered(b("centered"));
      return [p, v] { *p = v; };
    }
  } catch (const Error& e) {
    throw Error(concat(where, ": ", e.what()));
  }
  return [] {};
}

// FQN and (optional) sharding of every parameter of `model`, by TensorImpl.
std::unordered_map<const c10::TensorImpl*, ParamInfo> params_by_impl(const torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, ParamInfo> m;
  for (auto& info : named_parameters_info(model)) {
    if (info.param.defined()) m.emplace(info.param.unsafeGetTensorImpl(), info);
  }
  return m;
}

const ParamInfo& info_of(const std::unordered_map<const c10::TensorImpl*, ParamInfo>& m, const at::Tensor& p,
                         size_t group, size_t index) {
  auto it = m.find(p.unsafeGetTensorImpl());
  TESSERA_CHECK(it != m.end(), "optimizer param group ", group, " parameter ", index,
                " is not a parameter of the model (cannot name it)");
  return it->second;
}

}  // namespace

StateDict optimizer_state_dict(const optim::Optimizer& optimizer, const torch::nn::Module& model) {
  const std::string kind = kind_of(optimizer);
  auto infos = params_by_impl(model);
  StateDict out;
  out.set("optimizer", kind);
  auto state = std::make_shared<StateDict>();
  auto groups = std::make_shared<StateDict>();
  const auto& groups_in = optimizer.param_groups();
  for (size_t gi = 0; gi < groups_in.size(); ++gi) {
    auto g = std::make_shared<StateDict>();
    options_to(groups_in[gi].options(), *g);
    auto names = std::make_shared<StateDict>();
    const auto& params = groups_in[gi].params();
    for (size_t pi = 0; pi < params.size(); ++pi) {
      const ParamInfo& info = info_of(infos, params[pi], gi, pi);
      names->set(std::to_string(pi), info.fqn);
      auto it = optimizer.state().find(compat::optimizer_state_key(params[pi]));
      if (it == optimizer.state().end() || !it->second) continue;
      Fields f = fields_of(*it->second, info.fqn);
      auto entry = std::make_shared<StateDict>();
      for (auto& [n, v] : f.ints) entry->set(n, v);
      for (auto& [n, t] : f.tensors) {
        if (info.sharded && t.sizes() == params[pi].sizes()) {
          const ShardedTensor& ps = *info.sharded;
          std::vector<sharding::Shard> local{sharding::Shard{t.detach(), ps.local_shards()[0].meta}};
          entry->set(n, ps.with_local(std::move(local), t.scalar_type()));
        } else {
          entry->set(n, t.detach());
        }
      }
      state->set(info.fqn, entry);
    }
    g->set("params", names);
    groups->set(std::to_string(gi), g);
  }
  out.set("state", state);
  out.set("param_groups", groups);
  return out;
}

void load_optimizer_state_dict(optim::Optimizer& optimizer, const torch::nn::Module& model, const StateDict& sd) {
  const std::string kind = kind_of(optimizer);
  TESSERA_CHECK(sd.string("optimizer") == kind, "optimizer state dict is for a ", sd.string("optimizer"),
                " optimizer, loading into a ", kind, " optimizer");
  auto infos = params_by_impl(model);
  const StateDict& state = sd.dict("state");
  const StateDict& groups = sd.dict("param_groups");
  auto& groups_in = optimizer.param_groups();
  TESSERA_CHECK(groups.size() == groups_in.size(), "optimizer state dict has ", groups.size(),
                " param groups, the optimizer ", groups_in.size());
  std::vector<std::function<void()>> apply;
  std::vector<std::pair<compat::OptimizerStateKey, std::unique_ptr<optim::OptimizerParamState>>> fresh;
  std::vector<compat::OptimizerStateKey> all_keys;
  std::set<std::string> used;
  for (size_t gi = 0; gi < groups_in.size(); ++gi) {
    const std::string gname = concat("param group ", gi);
    const StateDict& g = groups.dict(std::to_string(gi));
    const StateDict& names = g.dict("params");
    const auto& params = groups_in[gi].params();
    TESSERA_CHECK(names.size() == params.size(), gname, " has ", names.size(), " parameters in the state dict, ",
                  params.size(), " in the optimizer");
    apply.push_back(options_from(groups_in[gi].options(), g, gname));
    for (size_t pi = 0; pi < params.size(); ++pi) {
      const ParamInfo& info = info_of(infos, params[pi], gi, pi);
      const std::string& saved = names.string(std::to_string(pi));
      TESSERA_CHECK(saved == info.fqn, gname, " parameter ", pi, " is '", saved, "' in the state dict but '",
                    info.fqn, "' in the optimizer");
      all_keys.push_back(compat::optimizer_state_key(params[pi]));
      if (!state.contains(info.fqn)) continue;
      used.insert(info.fqn);
      Fields f;
      state.dict(info.fqn).for_each([&](const std::string& n, const Value& v) {
        const std::string where = concat("optimizer state '", info.fqn, ".", n, "'");
        if (auto* i = std::get_if<int64_t>(&v)) {
          f.ints[n] = *i;
        } else if (auto* t = std::get_if<at::Tensor>(&v)) {
          f.tensors[n] = t->to(params[pi].device()).clone();
        } else if (auto* st = std::get_if<ShardedTensor>(&v)) {
          TESSERA_CHECK(info.sharded, where, " is sharded but the parameter is not");
          const ShardedTensor& ps = *info.sharded;
          TESSERA_CHECK(st->shape() == ps.shape(), where, " has global shape ",
                        sharding::full_box(st->shape()).to_string(), ", the parameter ",
                        sharding::full_box(ps.shape()).to_string());
          if (st->same_shards(ps)) {
            f.tensors[n] = st->local_tensor().clone();
          } else {
            ShardedTensor target = ShardedTensor::empty(sharding::EnumerableSpec{ps.shards_metadata()}, ps.shape(),
                                                        at::TensorOptions().dtype(st->dtype()), ps.comm());
            target.copy_from(*st);
            f.tensors[n] = target.local_tensor();
          }
        } else {
          throw Error(concat(where, " holds a ", kind_name(v), ", expected an int or a tensor"));
        }
      });
      for (auto& [n, t] : f.tensors) {
        if (t.sizes() == params[pi].sizes()) continue;
        TESSERA_CHECK(t.numel() <= 1, "optimizer state '", info.fqn, ".", n, "' has shape ",
                      sharding::full_box(t.sizes().vec()).to_string(), ", the parameter ",
                      sharding::full_box(params[pi].sizes().vec()).to_string());
      }
      fresh.emplace_back(compat::optimizer_state_key(params[pi]), make_state(kind, std::move(f), info.fqn));
    }
  }
  for (const auto& key : state.keys())
    TESSERA_CHECK(used.count(key), "optimizer state dict has state for '", key,
                  "', which is not a parameter of this optimizer");
  // Everything checked: apply.
  for (auto& a : apply) a();
  for (auto& k : all_keys) optimizer.state().erase(k);
  for (auto& [k, s] : fresh) optimizer.state()[k] = std::move(s);
}

void materialize_optimizer_state(torch::optim::Optimizer& optimizer,
                                 const std::function<void(torch::optim::Optimizer&)>& step) {
  std::vector<double> lrs;
  std::vector<std::pair<at::Tensor, at::Tensor>> grads;
  at::NoGradGuard ng;
  for (auto& g : optimizer.param_groups()) {
    lrs.push_back(g.options().get_lr());
    g.options().set_lr(0.0);
    for (auto& p : g.params()) {
      grads.emplace_back(p, p.grad());
      p.mutable_grad() = at::zeros_like(p);
    }
  }
  auto restore = [&] {
    size_t i = 0;
    for (auto& g : optimizer.param_groups()) g.options().set_lr(lrs[i++]);
    for (auto& [p, gr] : grads) p.mutable_grad() = gr;
  };
  try {
    step(optimizer);
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace tessera::state
