// What Fabric::save writes and Fabric::load restores: a named collection of the
// module set up by Fabric, its optimizers and plain values (step counters, RNG
// states, sampler positions, small tensors, nested dicts).
//
//   FabricState st;
//   st.set("model", model).set("optimizer", opt).set("step", int64_t(step));
//   fabric.save("ckpt", st);
//   ...
//   state::StateDict rest = fabric.load("ckpt", st);   // restores in place
//   int64_t step = st.values().integer("step");
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/state/state_dict.h"

namespace tessera::fabric {

class FabricState {
 public:
  enum class Kind { Module, Optimizer, Value };

  FabricState& set(const std::string& name, std::shared_ptr<torch::nn::Module> module);
  FabricState& set(const std::string& name, const torch::nn::AnyModule& module) { return set(name, module.ptr()); }
  template <typename M>
  FabricState& set(const std::string& name, const torch::nn::ModuleHolder<M>& module) {
    return set(name, std::static_pointer_cast<torch::nn::Module>(module.ptr()));
  }
  FabricState& set(const std::string& name, std::shared_ptr<torch::optim::Optimizer> optimizer);
  template <typename O, typename = std::enable_if_t<std::is_base_of<torch::optim::Optimizer, O>::value>>
  FabricState& set(const std::string& name, std::shared_ptr<O> optimizer) {
    return set(name, std::static_pointer_cast<torch::optim::Optimizer>(std::move(optimizer)));
  }
  // A plain value: int64_t, double, bool, std::string, state::Bytes, a (replicated)
  // tensor or a nested state::StateDict.
  FabricState& set(const std::string& name, state::Value value);
  // Numbers: bool stays bool, integers are stored as int64_t, floating point as double.
  template <typename T, std::enable_if_t<std::is_arithmetic<T>::value, int> = 0>
  FabricState& set(const std::string& name, T value) {
    if constexpr (std::is_same<T, bool>::value) {
      return set(name, state::Value(value));
    } else if constexpr (std::is_integral<T>::value) {
      return set(name, state::Value(static_cast<int64_t>(value)));
    } else {
      return set(name, state::Value(static_cast<double>(value)));
    }
  }
  FabricState& set(const std::string& name, const char* value) { return set(name, state::Value(std::string(value))); }
  FabricState& set(const std::string& name, const state::StateDict& dict) {
    return set(name, state::Value(std::make_shared<state::StateDict>(dict)));
  }

  bool contains(const std::string& name) const;
  // Throws naming `name` when absent.
  Kind kind(const std::string& name) const;
  // Names in insertion order.
  const std::vector<std::string>& names() const { return names_; }

  const std::shared_ptr<torch::nn::Module>& module(const std::string& name) const;
  const std::shared_ptr<torch::optim::Optimizer>& optimizer(const std::string& name) const;
  // The plain values (typed access: values().integer("step"), ...). Fabric::load writes
  // the restored values here.
  const state::StateDict& values() const { return values_; }
  state::StateDict& values() { return values_; }

 private:
  void claim(const std::string& name, Kind kind);
  std::vector<std::string> names_;
  std::vector<std::pair<std::string, Kind>> kinds_;
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules_;
  std::vector<std::pair<std::string, std::shared_ptr<torch::optim::Optimizer>>> optimizers_;
  state::StateDict values_;
};

}  // namespace tessera::fabric
