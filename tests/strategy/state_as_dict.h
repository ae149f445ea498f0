// A strategy's typed state as the one dict checkpoint::save and checkpoint::load take
// ("model" and one "optimizer_<i>" per optimizer), and back: for the rank programs that
// checkpoint a strategy without Fabric (strategy and CUDA scenarios).
#pragma once
#include <memory>
#include <string>

#include "tessera/state/state_dict.h"
#include "tessera/strategy/strategy_state.h"

namespace tessera::testing {

inline state::StateDict as_dict(const strategy::StrategyState& st) {
  state::StateDict out;
  out.set("model", std::make_shared<state::StateDict>(st.module));
  for (const auto& [i, sd] : st.optimizers)
    out.set("optimizer_" + std::to_string(i), std::make_shared<state::StateDict>(sd));
  return out;
}

inline strategy::StrategyState from_dict(const state::StateDict& sd) {
  strategy::StrategyState st;
  st.module = sd.dict("model");
  for (const auto& k : sd.keys())
    if (k.rfind("optimizer_", 0) == 0) st.optimizers[std::stoul(k.substr(10))] = sd.dict(k);
  return st;
}

}  // namespace tessera::testing
