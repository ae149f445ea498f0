// FabricState and Fabric::save / Fabric::load.
//
// Checkpoint layout (flattened keys): "<module name>.<param FQN>" for the module,
// "<optimizer name>.<...>" for each optimizer's FQN-keyed state dict, "<value name>"
// (or "<value name>.<key>" for nested dicts) for plain values.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <map>
#include <set>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/core/compat.h"
#include "tessera/fabric/fabric.h"
#include "tessera/state/optimizer_state.h"

namespace tessera::fabric {

// --- FabricState --------------------------------------------------------------------

void FabricState::claim(const std::string& name, Kind kind) {
  TESSERA_CHECK(!name.empty(), "FabricState: empty entry name");
  for (auto& [n, k] : kinds_) {
    if (n != name) continue;
    TESSERA_CHECK(k == kind, "FabricState: entry '", name, "' already holds another kind of object");
    return;
  }
  for (const auto& n : names_) {
    TESSERA_CHECK(n.rfind(name + ".", 0) != 0 && name.rfind(n + ".", 0) != 0, "FabricState: entry names '", n,
                  "' and '", name, "' overlap in the checkpoint's flattened keys");
  }
  names_.push_back(name);
  kinds_.emplace_back(name, kind);
}

FabricState& FabricState::set(const std::string& name, std::shared_ptr<torch::nn::Module> module) {
  TESSERA_CHECK(module != nullptr, "FabricState: module '", name, "' is null");
  claim(name, Kind::Module);
  for (auto& [n, m] : modules_)
    if (n == name) {
      m = std::move(module);
      return *this;
    }
  modules_.emplace_back(name, std::move(module));
  return *this;
}

FabricState& FabricState::set(const std::string& name, std::shared_ptr<torch::optim::Optimizer> optimizer) {
  TESSERA_CHECK(optimizer != nullptr, "FabricState: optimizer '", name, "' is null");
  claim(name, Kind::Optimizer);
  for (auto& [n, o] : optimizers_)
    if (n == name) {
      o = std::move(optimizer);
      return *this;
    }
  optimizers_.emplace_back(name, std::move(optimizer));
  return *this;
}

FabricState& FabricState::set(const std::string& name, state::Value value) {
  claim(name, Kind::Value);
  values_.set(name, std::move(value));
  return *this;
}

bool FabricState::contains(const std::string& name) const {
  for (auto& [n, k] : kinds_)
    if (n == name) return true;
  return false;
}

FabricState::Kind FabricState::kind(const std::string& name) const {
  for (auto& [n, k] : kinds_)
    if (n == name) return k;
  throw Error(concat("FabricState: no entry '", name, "'"));
}

const std::shared_ptr<torch::nn::Module>& FabricState::module(const std::string& name) const {
  for (auto& [n, m] : modules_)
    if (n == name) return m;
  throw Error(concat("FabricState: no module entry '", name, "'"));
}

const std::shared_ptr<torch::optim::Optimizer>& FabricState::optimizer(const std::string& name) const {
  for (auto& [n, o] : optimizers_)
    if (n == name) return o;
  throw Error(concat("FabricState: no optimizer entry '", name, "'"));
}

// --- save / load --------------------------------------------------------------------

namespace {

using state::StateDict;
using state::Value;

std::string optim_key(int i) { return "optim." + std::to_string(i); }

bool is_optim_key(const std::string& k, const Value& v) {
  if (k.rfind("optim.", 0) != 0 || !std::holds_alternative<std::shared_ptr<StateDict>>(v)) return false;
  const std::string rest = k.substr(6);
  return !rest.empty() && rest.find_first_not_of("0123456789") == std::string::npos;
}

// Deep copy: tensors and local shards cloned, so loading into it touches nothing live.
Value clone_value(const Value& v);
StateDict clone_dict(const StateDict& sd) {
  StateDict out;
  sd.for_each([&](const std::string& k, const Value& v) { out.set(k, clone_value(v)); });
  return out;
}
Value clone_value(const Value& v) {
  if (auto t = std::get_if<at::Tensor>(&v)) return t->defined() ? t->detach().clone() : *t;
  if (auto s = std::get_if<sharding::ShardedTensor>(&v)) return s->clone();
  if (auto d = std::get_if<std::shared_ptr<StateDict>>(&v)) {
    return *d ? std::make_shared<StateDict>(clone_dict(**d)) : std::make_shared<StateDict>();
  }
  return v;
}

bool under(const std::string& key, const std::string& name) {
  return key == name || key.rfind(name + ".", 0) == 0;
}

std::string join(const std::vector<std::string>& v) {
  std::string o;
  for (const auto& s : v) o += (o.empty() ? "" : ", ") + s;
  return o;
}

}  // namespace

// The strategy's state dict split into the module part and the optimizer parts, for
// the entries `st` names. Returns {module dict, optimizer index -> dict}.
struct SplitState {
  StateDict module;
  std::map<int, StateDict> optim;
};

static SplitState split_state(strategy::Strategy& s, const std::string& strategy_name, strategy::StateDictType type,
                              const std::vector<std::pair<std::string, int>>& opts, bool want_module) {
  SplitState out;
  StateDict sd = s.state_dict(type, /*with_optimizers=*/!opts.empty());
  sd.for_each([&](const std::string& k, const Value& v) {
    if (is_optim_key(k, v)) return;
    if (want_module) out.module.set(k, v);
  });
  for (auto& [name, i] : opts) {
    if (sd.contains(optim_key(i))) {
      out.optim[i] = sd.dict(optim_key(i));
      continue;
    }
    TESSERA_CHECK(strategy_name != "fsdp", "Fabric: the fsdp strategy's state_dict has no '", optim_key(i),
                  "' entry for optimizer '", name, "'");
    out.optim[i] = state::optimizer_state_dict(*s.optimizers()[static_cast<size_t>(i)], *s.module());
  }
  return out;
}

std::pair<StateDict, checkpoint::SaveOptions> Fabric::checkpoint_of(const FabricState& st) {
  std::vector<std::pair<std::string, int>> opts;
  bool want_module = false;
  for (const auto& name : st.names()) {
    if (st.kind(name) == FabricState::Kind::Module) {
      check_is_setup_module(st.module(name), concat("save: module '", name, "'"));
      want_module = true;
    } else if (st.kind(name) == FabricState::Kind::Optimizer) {
      opts.emplace_back(name, optimizer_index(st.optimizer(name).get(), concat("save: optimizer '", name, "'")));
    }
  }
  SplitState parts;
  if (want_module || !opts.empty()) {
    TESSERA_CHECK(setup_original_, "Fabric::save: call setup_module(model) first");
    // Always the sharded form (it aliases the live tensors): a consolidated save gathers
    // each sharded tensor to rank 0 slice by slice as it writes (checkpoint::save), where
    // the strategy's Full state dict would gather every tensor on every rank first.
    parts = split_state(*strategy_, opts_.strategy, strategy::StateDictType::Sharded, opts, want_module);
  }
  StateDict out;
  size_t next_opt = 0;
  for (const auto& name : st.names()) {
    switch (st.kind(name)) {
      case FabricState::Kind::Module:
        out.set(name, std::make_shared<StateDict>(parts.module));
        break;
      case FabricState::Kind::Optimizer:
        out.set(name, std::make_shared<StateDict>(parts.optim.at(opts[next_opt++].second)));
        break;
      case FabricState::Kind::Value:
        out.set(name, st.values().at(name));
        break;
    }
  }
  checkpoint::SaveOptions so;
  so.mode = opts_.state_dict_type == strategy::StateDictType::Sharded ? checkpoint::SaveMode::Sharded
                                                                      : checkpoint::SaveMode::Full;
  return {std::move(out), so};
}

void Fabric::save(const std::string& path, const FabricState& st) {
  require_launched("save");
  wait_for_checkpoint();
  auto [sd, so] = checkpoint_of(st);
  checkpoint::save(sd, path, *comm_, so);
}

checkpoint::AsyncSave Fabric::save_async(const std::string& path, const FabricState& st) {
  require_launched("save_async");
  wait_for_checkpoint();
  auto [sd, so] = checkpoint_of(st);
  pending_save_ = checkpoint::save_async(sd, path, comm_, so);
  return pending_save_;
}

void Fabric::wait_for_checkpoint() {
  if (!pending_save_.valid()) return;
  checkpoint::AsyncSave p = std::move(pending_save_);
  pending_save_ = {};
  p.wait();
}

namespace {

// Gives every parameter of `opt` its optimizer state (as the first step would) without
// changing any parameter: zero gradients, learning rate 0. A loaded checkpoint then
// has somewhere to go; states it does not cover are dropped again after loading.
void materialize_optimizer_state(strategy::Strategy& s, torch::optim::Optimizer& opt) {
  std::vector<double> lrs;
  std::vector<std::pair<at::Tensor, at::Tensor>> grads;
  at::NoGradGuard ng;
  for (auto& g : opt.param_groups()) {
    lrs.push_back(g.options().get_lr());
    g.options().set_lr(0.0);
    for (auto& p : g.params()) {
      grads.emplace_back(p, p.grad());
      p.mutable_grad() = at::zeros_like(p);
    }
  }
  try {
    s.optimizer_step(opt);
  } catch (...) {
    size_t i = 0;
    for (auto& g : opt.param_groups()) g.options().set_lr(lrs[i++]);
    for (auto& [p, gr] : grads) p.mutable_grad() = gr;
    throw;
  }
  size_t i = 0;
  for (auto& g : opt.param_groups()) g.options().set_lr(lrs[i++]);
  for (auto& [p, gr] : grads) p.mutable_grad() = gr;
}

}  // namespace

StateDict Fabric::load(const std::string& path, FabricState& st, bool strict) {
  require_launched("load");
  wait_for_checkpoint();
  std::vector<std::pair<std::string, int>> opts;
  std::vector<std::string> module_names, value_names;
  for (const auto& name : st.names()) {
    if (st.kind(name) == FabricState::Kind::Module) {
      check_is_setup_module(st.module(name), concat("load: module '", name, "'"));
      module_names.push_back(name);
    } else if (st.kind(name) == FabricState::Kind::Optimizer) {
      opts.emplace_back(name, optimizer_index(st.optimizer(name).get(), concat("load: optimizer '", name, "'")));
    } else {
      value_names.push_back(name);
    }
  }
  // Optimizers that never stepped have no state to receive the checkpoint's.
  std::vector<int> materialized;
  for (auto& [name, i] : opts) {
    auto& opt = *strategy_->optimizers()[static_cast<size_t>(i)];
    if (opt.state().empty()) {
      materialize_optimizer_state(*strategy_, opt);
      materialized.push_back(i);
    }
  }
  SplitState parts;
  if (!module_names.empty() || !opts.empty()) {
    TESSERA_CHECK(setup_original_, "Fabric::load: call setup_module(model) first");
    // A sharded target reads only this rank's pieces, from either kind of checkpoint.
    const auto type = opts_.strategy == "fsdp" ? strategy::StateDictType::Sharded : opts_.state_dict_type;
    parts = split_state(*strategy_, opts_.strategy, type, opts, !module_names.empty());
  }
  StateDict target;
  size_t next_opt = 0;
  for (const auto& name : st.names()) {
    switch (st.kind(name)) {
      case FabricState::Kind::Module:
        target.set(name, std::make_shared<StateDict>(clone_dict(parts.module)));
        break;
      case FabricState::Kind::Optimizer:
        target.set(name, std::make_shared<StateDict>(clone_dict(parts.optim.at(opts[next_opt++].second))));
        break;
      case FabricState::Kind::Value:
        target.set(name, clone_value(st.values().at(name)));
        break;
    }
  }

  checkpoint::LoadOptions lo;
  lo.strict = false;  // strictness applies to what `st` asks for; checked below
  checkpoint::LoadResult res = checkpoint::load(target, path, *comm_, lo);

  // Parameters without optimizer state in the checkpoint (it was saved before they
  // got any) keep none here either.
  std::set<std::string> stateless_fqns;
  auto optim_state_missing = [&](const std::string& key) {
    for (auto& [name, i] : opts) {
      const std::string prefix = name + ".state.";
      if (key.rfind(prefix, 0) != 0) continue;
      for (auto& kv : strategy_->module()->named_parameters()) {
        if (key.rfind(prefix + kv.key() + ".", 0) == 0) {
          stateless_fqns.insert(name + "\n" + kv.key());
          return true;
        }
      }
    }
    return false;
  };
  std::vector<std::string> missing, unexpected;
  for (const auto& k : res.missing)
    if (!optim_state_missing(k)) missing.push_back(k);
  for (const auto& k : res.unexpected) {
    bool requested = false;
    for (const auto& name : st.names()) requested = requested || under(k, name);
    if (requested) unexpected.push_back(k);
  }
  if (strict && (!missing.empty() || !unexpected.empty() || !res.mismatched.empty())) {
    std::string msg = concat("Fabric::load('", path, "', strict): nothing was loaded.");
    if (!missing.empty()) msg += concat(" Missing from the checkpoint: ", join(missing), ".");
    if (!unexpected.empty()) msg += concat(" In the checkpoint but not in the state: ", join(unexpected), ".");
    if (!res.mismatched.empty()) msg += concat(" Mismatched: ", join(res.mismatched), ".");
    for (int i : materialized) strategy_->optimizers()[static_cast<size_t>(i)]->state().clear();
    throw Error(msg);
  }

  // Apply: module and optimizer state through the strategy, values into `st`.
  if (!module_names.empty() || !opts.empty()) {
    StateDict apply;
    if (!module_names.empty()) {
      target.dict(module_names.front()).for_each([&](const std::string& k, const Value& v) { apply.set(k, v); });
    }
    for (auto& [name, i] : opts) apply.set(optim_key(i), std::make_shared<StateDict>(target.dict(name)));
    // Strictness was checked above against what `st` names; the strategy must not
    // insist on optimizers `st` does not name.
    std::vector<std::string> rest = strategy_->load_state_dict(apply, /*strict=*/false);
    for (auto& [name, i] : opts) {
      const std::string k = optim_key(i);
      if (std::find(rest.begin(), rest.end(), k) == rest.end()) continue;  // the strategy restored it
      TESSERA_CHECK(opts_.strategy != "fsdp", "Fabric::load: the fsdp strategy did not restore optimizer '", name, "'");
      state::load_optimizer_state_dict(*strategy_->optimizers()[static_cast<size_t>(i)], *strategy_->module(),
                                       target.dict(name));
    }
    for (auto& [name, i] : opts) {
      auto& opt = *strategy_->optimizers()[static_cast<size_t>(i)];
      for (auto& kv : strategy_->module()->named_parameters()) {
        if (!stateless_fqns.count(name + "\n" + kv.key())) continue;
        opt.state().erase(compat::optimizer_state_key(kv.value()));
      }
    }
  }
  for (const auto& name : value_names) st.values().set(name, target.at(name));

  // Plain values under a requested dict value that the dict did not name are restored
  // into it (flattened key below the dict); other entries' leftovers are dropped.
  StateDict leftovers;
  res.leftovers.for_each([&](const std::string& k, const Value& v) {
    for (const auto& name : value_names) {
      if (k.rfind(name + ".", 0) != 0) continue;
      if (auto* d = std::get_if<std::shared_ptr<StateDict>>(&st.values().at(name)); d && *d) {
        auto merged = std::make_shared<StateDict>(**d);
        merged->set(k.substr(name.size() + 1), v);
        st.values().set(name, merged);
      }
      return;
    }
    for (const auto& name : st.names())
      if (under(k, name)) return;
    leftovers.set(k, v);
  });
  return leftovers;
}

}  // namespace tessera::fabric
