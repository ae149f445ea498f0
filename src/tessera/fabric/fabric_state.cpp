// FabricState: the named modules, optimizers and plain values one checkpoint holds,
// and the checks on their names (fabric_state.h).
#include "tessera/fabric/fabric_state.h"

#include "tessera/core/error.h"

namespace tessera::fabric {

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

}  // namespace tessera::fabric
