#include "tessera/state/module_state.h"

#include <ATen/ATen.h>

#include <functional>
#include <mutex>
#include <set>
#include <unordered_map>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::state {

using sharding::ShardedTensor;
using torch::nn::Module;

namespace {

struct Entry {
  std::weak_ptr<const Module> owner;
  bool has_owner = false;
  std::vector<std::pair<std::string, ShardedTensor>> tensors;  // registration order
};

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<const Module*, Entry>& registry() {
  static std::unordered_map<const Module*, Entry> reg;
  return reg;
}

// Drops entries whose module is gone; returns the entry of `m` (nullptr if none).
// Caller holds the mutex.
Entry* entry_locked(const Module& m, bool create) {
  auto& reg = registry();
  for (auto it = reg.begin(); it != reg.end();) {
    if (it->second.has_owner && it->second.owner.expired()) {
      it = reg.erase(it);
    } else {
      ++it;
    }
  }
  auto it = reg.find(&m);
  if (it == reg.end()) {
    if (!create) return nullptr;
    it = reg.emplace(&m, Entry{}).first;
  }
  Entry& e = it->second;
  if (!e.has_owner) {
    auto w = m.weak_from_this();
    if (!w.expired()) {
      e.owner = w;
      e.has_owner = true;
    }
  }
  return &e;
}

std::vector<std::pair<std::string, ShardedTensor>> registered(const Module& m) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  Entry* e = entry_locked(m, false);
  return e ? e->tensors : std::vector<std::pair<std::string, ShardedTensor>>{};
}

bool is_only_local_shard(const ShardedTensor& st, const at::Tensor& t) {
  return st.local_shards().size() == 1 && t.defined() &&
         st.local_shards()[0].tensor.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
}

void visit(const Module& m, const std::string& prefix, const std::function<void(const Module&, const std::string&)>& fn) {
  fn(m, prefix);
  for (const auto& child : m.named_children()) visit(*child.value(), prefix + child.key() + ".", fn);
}

ShardedTensor detached_alias(const ShardedTensor& st) {
  std::vector<sharding::Shard> local;
  for (const auto& s : st.local_shards()) local.push_back(sharding::Shard{s.tensor.detach(), s.meta});
  return st.with_local(std::move(local), st.dtype());
}


}  // namespace

void register_sharded_tensor(Module& module, const std::string& name, ShardedTensor tensor) {
  TESSERA_CHECK(!name.empty() && name.find('.') == std::string::npos, "sharded tensor name '", name,
                "' must be non-empty and contain no '.'");
  TESSERA_CHECK(tensor.defined(), "register_sharded_tensor('", name, "'): the sharded tensor is undefined");
  const auto params = module.named_parameters(false);
  const auto buffers = module.named_buffers(false);
  if (const at::Tensor* t = params.find(name)) {
    TESSERA_CHECK(is_only_local_shard(tensor, *t), "register_sharded_tensor('", name,
                  "'): the module's parameter of that name is not the sharded tensor's only local shard");
  }
  if (const at::Tensor* t = buffers.find(name)) {
    TESSERA_CHECK(is_only_local_shard(tensor, *t), "register_sharded_tensor('", name,
                  "'): the module's buffer of that name is not the sharded tensor's only local shard");
  }
  std::lock_guard<std::mutex> lock(registry_mutex());
  Entry* e = entry_locked(module, true);
  for (auto& [n, t] : e->tensors) {
    if (n == name) {
      t = std::move(tensor);
      return;
    }
  }
  e->tensors.emplace_back(name, std::move(tensor));
}

at::Tensor register_sharded_parameter(Module& module, const std::string& name, ShardedTensor tensor,
                                      bool requires_grad) {
  TESSERA_CHECK(tensor.defined() && tensor.local_shards().size() == 1, "register_sharded_parameter('", name,
                "'): rank ", tensor.defined() ? tensor.comm()->rank() : -1, " holds ",
                tensor.local_shards().size(), " shards; a sharded parameter needs exactly one local shard (possibly empty)");
  at::Tensor p = module.register_parameter(name, tensor.local_shards()[0].tensor, requires_grad);
  // register_parameter may hand back a different tensor object (1.13 sets requires_grad
  // in place, but keep the registered one as the shard to be safe).
  tensor.local_shards()[0].tensor = p;
  register_sharded_tensor(module, name, std::move(tensor));
  return p;
}

std::optional<ShardedTensor> find_sharded_tensor(const Module& module, const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  Entry* e = entry_locked(module, false);
  if (!e) return std::nullopt;
  for (auto& [n, t] : e->tensors)
    if (n == name) return t;
  return std::nullopt;
}

std::vector<std::pair<std::string, ShardedTensor>> named_sharded_tensors(const Module& module, bool recurse) {
  std::vector<std::pair<std::string, ShardedTensor>> out;
  auto add = [&](const Module& m, const std::string& prefix) {
    for (auto& [n, t] : registered(m)) out.emplace_back(prefix + n, t);
  };
  if (recurse) {
    visit(module, "", add);
  } else {
    add(module, "");
  }
  return out;
}

bool unregister_sharded_tensor(Module& module, const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  Entry* e = entry_locked(module, false);
  if (!e) return false;
  for (auto it = e->tensors.begin(); it != e->tensors.end(); ++it) {
    if (it->first == name) {
      e->tensors.erase(it);
      return true;
    }
  }
  return false;
}

void clear_sharded_tensors(const Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(&module);
}

std::vector<ParamInfo> named_parameters_info(const Module& root) {
  std::vector<ParamInfo> out;
  visit(root, "", [&](const Module& m, const std::string& prefix) {
    auto reg = registered(m);
    for (const auto& p : m.named_parameters(false)) {
      ParamInfo info{prefix + p.key(), p.value(), std::nullopt};
      for (auto& [n, st] : reg)
        if (n == p.key() && is_only_local_shard(st, p.value())) info.sharded = st;
      out.push_back(std::move(info));
    }
  });
  return out;
}

StateDict state_dict(const Module& module) {
  StateDict sd;
  visit(module, "", [&](const Module& m, const std::string& prefix) {
    auto reg = registered(m);
    auto own = [&](const std::string& name, const at::Tensor& t, const char* what) {
      if (!t.defined()) return;
      for (auto& [n, st] : reg) {
        if (n != name) continue;
        TESSERA_CHECK(is_only_local_shard(st, t), "state_dict: the ", what, " '", prefix + name,
                      "' is not the local shard of the sharded tensor registered under the same name");
        return;  // listed as the ShardedTensor below
      }
      sd.set(prefix + name, t.detach());
    };
    for (const auto& p : m.named_parameters(false)) own(p.key(), p.value(), "parameter");
    for (const auto& b : m.named_buffers(false)) own(b.key(), b.value(), "buffer");
    for (auto& [n, st] : reg) sd.set(prefix + n, detached_alias(st));
  });
  return sd;
}

StateDict clone_state_dict(const StateDict& sd) {
  StateDict out;
  sd.for_each([&](const std::string& k, const Value& v) {
    if (auto* t = std::get_if<at::Tensor>(&v)) {
      out.set(k, t->defined() ? t->clone() : at::Tensor());
    } else if (auto* st = std::get_if<ShardedTensor>(&v)) {
      out.set(k, st->defined() ? st->clone() : ShardedTensor());
    } else if (auto* d = std::get_if<std::shared_ptr<StateDict>>(&v)) {
      out.set(k, *d ? std::make_shared<StateDict>(clone_state_dict(**d)) : std::shared_ptr<StateDict>());
    } else {
      out.set(k, v);
    }
  });
  return out;
}

std::string LoadReport::to_string() const {
  std::string s;
  auto list = [&](const char* what, const std::vector<std::string>& v) {
    if (v.empty()) return;
    s += concat(s.empty() ? "" : "; ", v.size(), " ", what, ": ", core::join(v));
  };
  list("missing key(s)", missing);
  list("unexpected key(s)", unexpected);
  list("mismatched", mismatched);
  return s.empty() ? "ok" : s;
}

LoadReport load_state_dict(Module& module, const StateDict& sd, bool strict) {
  LoadOptions o;
  o.strict = strict;
  return load_state_dict(module, sd, o);
}

LoadReport load_state_dict(Module& module, const StateDict& sd, const LoadOptions& options) {
  const StateDict targets = state_dict(module);
  LoadReport report;
  std::vector<std::function<void()>> plan;  // writes, run only after every check
  for (const auto& key : targets.keys()) {
    if (!sd.contains(key)) {
      report.missing.push_back(key);
      continue;
    }
    const Value& src = sd.at(key);
    const Value& dst = targets.at(key);
    const bool dst_sharded = std::holds_alternative<ShardedTensor>(dst);
    std::vector<int64_t> dshape;
    at::ScalarType ddt;
    if (dst_sharded) {
      dshape = std::get<ShardedTensor>(dst).shape();
      ddt = std::get<ShardedTensor>(dst).dtype();
    } else {
      dshape = std::get<at::Tensor>(dst).sizes().vec();
      ddt = std::get<at::Tensor>(dst).scalar_type();
    }
    auto mismatch = [&](const std::string& why) { report.mismatched.push_back(key + ": " + why); };
    std::vector<int64_t> sshape;
    at::ScalarType sdt;
    if (auto* t = std::get_if<at::Tensor>(&src)) {
      if (!t->defined()) {
        mismatch("undefined tensor in the state dict");
        continue;
      }
      sshape = t->sizes().vec();
      sdt = t->scalar_type();
    } else if (auto* st = std::get_if<ShardedTensor>(&src)) {
      if (!st->defined()) {
        mismatch("undefined sharded tensor in the state dict");
        continue;
      }
      sshape = st->shape();
      sdt = st->dtype();
    } else {
      mismatch(concat("the state dict holds a ", kind_name(src), ", the module a ", dst_sharded ? "sharded tensor" : "tensor"));
      continue;
    }
    if (sshape != dshape) {
      mismatch(concat("shape ", core::shape_string(sshape), " in the state dict, ", core::shape_string(dshape),
                      " in the module"));
      continue;
    }
    if (sdt != ddt) {
      mismatch(concat("dtype ", sdt, " in the state dict, ", ddt, " in the module"));
      continue;
    }
    if (auto* t = std::get_if<at::Tensor>(&src)) {
      at::Tensor s = *t;
      if (dst_sharded) {
        ShardedTensor d = std::get<ShardedTensor>(dst);
        plan.push_back([s, d]() mutable {
          const auto whole = sharding::full_box(d.shape());
          for (auto& sh : d.local_shards()) sharding::copy_overlap(sh.tensor, sh.meta.box, s, whole);
        });
      } else {
        at::Tensor d = std::get<at::Tensor>(dst);
        plan.push_back([s, d]() mutable { d.copy_(s); });
      }
    } else {
      const ShardedTensor& s = std::get<ShardedTensor>(src);
      if (dst_sharded) {
        ShardedTensor d = std::get<ShardedTensor>(dst);
        if (s.same_layout(d)) {
          plan.push_back([s, d]() mutable {
            for (size_t i = 0; i < d.local_shards().size(); ++i) d.local_shards()[i].tensor.copy_(s.local_shards()[i].tensor);
          });
        } else if (options.allow_reshard) {
          plan.push_back([s, d]() mutable { d.copy_from(s); });
        } else {
          mismatch(concat("sharding differs: state dict ", s.describe(), ", module ", d.describe(),
                          " (LoadOptions::allow_reshard reshards)"));
          continue;
        }
      } else if (options.allow_reshard) {
        at::Tensor d = std::get<at::Tensor>(dst);
        plan.push_back([s, d]() mutable { d.copy_(s.full_tensor()); });
      } else {
        mismatch("sharded in the state dict, a replicated tensor in the module (LoadOptions::allow_reshard gathers it)");
        continue;
      }
    }
    report.loaded.push_back(key);
  }
  for (const auto& key : sd.keys())
    if (!targets.contains(key)) report.unexpected.push_back(key);
  if (options.strict && !report.ok()) {
    throw Error("load_state_dict (strict) failed, nothing was loaded: " + report.to_string());
  }
  for (auto& step : plan) step();
  return report;
}

int configure_model(Module& root, const std::shared_ptr<distributed::Communicator>& comm) {
  int count = 0;
  std::function<void(Module&)> walk = [&](Module& m) {
    if (auto* c = dynamic_cast<ConfigurableModel*>(&m); c && !c->configured_) {
      c->configure_model(comm);
      c->configured_ = true;
      ++count;
    }
    for (const auto& child : m.children()) walk(*child);
  };
  walk(root);
  return count;
}

}  // namespace tessera::state
