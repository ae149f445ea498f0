// Fabric::save, save_async and load: the module and optimizers a FabricState names go
// through the strategy's typed state (strategy_state.h), plain values as they are.
//
// Checkpoint layout (flattened keys): "<module name>.<param FQN>" for the module,
// "<optimizer name>.<...>" for each optimizer's FQN-keyed state dict, "<value name>"
// (or "<value name>.<key>" for nested dicts) for plain values.
#include <ATen/ATen.h>

#include <set>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/core/compat.h"
#include "tessera/core/strings.h"
#include "tessera/fabric/fabric.h"
#include "tessera/state/optimizer_state.h"

namespace tessera::fabric {

namespace {

using state::StateDict;
using state::Value;

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

// The nested layout a checkpoint of `st` has: a module entry holds the module's state, an
// optimizer entry its optimizer's state (`optimizers`: each optimizer entry's name and
// index, in `st`'s order), a value entry the value. `copy`: tensors and shards cloned, so
// that loading into the result touches nothing live.
StateDict nest(const FabricState& st, const std::vector<std::pair<std::string, size_t>>& optimizers,
               const strategy::StrategyState& live, bool copy) {
  StateDict out;
  size_t next_opt = 0;
  for (const auto& name : st.names()) {
    switch (st.kind(name)) {
      case FabricState::Kind::Module:
        out.set(name, std::make_shared<StateDict>(copy ? clone_dict(live.module) : live.module));
        break;
      case FabricState::Kind::Optimizer: {
        const StateDict& sd = live.optimizers.at(optimizers[next_opt++].second);
        out.set(name, std::make_shared<StateDict>(copy ? clone_dict(sd) : sd));
        break;
      }
      case FabricState::Kind::Value:
        out.set(name, copy ? clone_value(st.values().at(name)) : st.values().at(name));
        break;
    }
  }
  return out;
}

}  // namespace

Fabric::StateParts Fabric::parts_of(const FabricState& st, const char* what) const {
  StateParts parts;
  for (const auto& name : st.names()) {
    switch (st.kind(name)) {
      case FabricState::Kind::Module:
        check_is_setup_module(st.module(name), concat(what, ": module '", name, "'"));
        parts.modules.push_back(name);
        break;
      case FabricState::Kind::Optimizer: {
        const int i = optimizer_index(st.optimizer(name).get(), concat(what, ": optimizer '", name, "'"));
        parts.optimizers.emplace_back(name, static_cast<size_t>(i));
        break;
      }
      case FabricState::Kind::Value:
        parts.values.push_back(name);
        break;
    }
  }
  return parts;
}

strategy::StrategyState Fabric::strategy_state_of(const StateParts& parts, strategy::StateDictType type,
                                                  const char* what) {
  strategy::StrategyState out;
  if (parts.modules.empty() && parts.optimizers.empty()) return out;
  TESSERA_CHECK(setup_original_, "Fabric::", what, ": call setup_module(model) first");
  if (!parts.modules.empty()) out.module = strategy_->module_state(type);
  for (const auto& [name, i] : parts.optimizers)
    if (!out.optimizers.count(i)) out.optimizers[i] = strategy_->optimizer_state(i, type);
  return out;
}

std::pair<StateDict, checkpoint::SaveOptions> Fabric::checkpoint_of(const FabricState& st) {
  const StateParts parts = parts_of(st, "save");
  // The sharded form (it aliases the live tensors): a consolidated save gathers each
  // sharded tensor to rank 0 slice by slice as it writes (checkpoint::save), where the
  // strategy's Full state would gather every tensor on every rank first. A consolidated
  // save of a tensor-parallel model takes its Full state (the plain model's global
  // tensors); its sharded save the 2-D form (docs/tensor-parallel.md).
  const bool sharded = opts_.state_dict_type == strategy::StateDictType::Sharded;
  const auto live_type = opts_.tensor_parallel_size() > 1 && !sharded ? strategy::StateDictType::Full
                                                                      : strategy::StateDictType::Sharded;
  const strategy::StrategyState live = strategy_state_of(parts, live_type, "save");
  StateDict out = nest(st, parts.optimizers, live, /*copy=*/false);
  checkpoint::SaveOptions so;
  so.mode = sharded ? checkpoint::SaveMode::Sharded : checkpoint::SaveMode::Full;
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

StateDict Fabric::load(const std::string& path, FabricState& st, bool strict) {
  require_launched("load");
  wait_for_checkpoint();
  const StateParts parts = parts_of(st, "load");
  // Optimizers that never stepped have no state to receive the checkpoint's.
  std::vector<size_t> materialized;
  for (const auto& [name, i] : parts.optimizers) {
    auto& opt = *strategy_->optimizers()[i];
    if (opt.state().empty()) {
      state::materialize_optimizer_state(opt, [this](torch::optim::Optimizer& o) { strategy_->optimizer_step(o); });
      materialized.push_back(i);
    }
  }
  // A strategy whose state is sharded at rest reads only this rank's pieces, from
  // either kind of checkpoint.
  const auto type = strategy_->default_state_dict_type() == strategy::StateDictType::Sharded
                        ? strategy::StateDictType::Sharded
                        : opts_.state_dict_type;
  const strategy::StrategyState live = strategy_state_of(parts, type, "load");
  StateDict target = nest(st, parts.optimizers, live, /*copy=*/true);

  checkpoint::LoadOptions lo;
  lo.strict = false;  // strictness applies to what `st` asks for; checked below
  checkpoint::LoadResult res = checkpoint::load(target, path, *comm_, lo);

  // Parameters without optimizer state in the checkpoint (it was saved before they
  // got any) keep none here either.
  std::set<std::string> stateless_fqns;
  auto optim_state_missing = [&](const std::string& key) {
    for (const auto& [name, i] : parts.optimizers) {
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
    if (!missing.empty()) msg += concat(" Missing from the checkpoint: ", core::join(missing), ".");
    if (!unexpected.empty()) msg += concat(" In the checkpoint but not in the state: ", core::join(unexpected), ".");
    if (!res.mismatched.empty()) msg += concat(" Mismatched: ", core::join(res.mismatched), ".");
    for (size_t i : materialized) strategy_->optimizers()[i]->state().clear();
    throw Error(msg);
  }

  // Apply: module and optimizer state through the strategy, values into `st`.
  if (!parts.modules.empty() || !parts.optimizers.empty()) {
    strategy::StrategyState loaded;
    if (!parts.modules.empty()) loaded.module = target.dict(parts.modules.front());
    for (const auto& [name, i] : parts.optimizers) loaded.optimizers[i] = target.dict(name);
    // Strictness was checked above against what `st` names; the strategy must not
    // insist on the module or on optimizers `st` does not name.
    strategy_->load_state(loaded, /*strict=*/false);
    for (const auto& [name, i] : parts.optimizers) {
      auto& opt = *strategy_->optimizers()[i];
      for (auto& kv : strategy_->module()->named_parameters()) {
        if (!stateless_fqns.count(name + "\n" + kv.key())) continue;
        opt.state().erase(compat::optimizer_state_key(kv.value()));
      }
    }
  }
  for (const auto& name : parts.values) st.values().set(name, target.at(name));

  // Plain values under a requested dict value that the dict did not name are restored
  // into it (flattened key below the dict); other entries' leftovers are dropped.
  StateDict leftovers;
  res.leftovers.for_each([&](const std::string& k, const Value& v) {
    for (const auto& name : parts.values) {
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
