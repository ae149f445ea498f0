// make_strategy: strategy names to strategy classes.
#include "tessera/strategy/factory.h"

#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::strategy {

const std::vector<std::string>& strategy_names() {
  static const std::vector<std::string> names{"single", "ddp", "fsdp"};
  return names;
}

namespace {
void check_known(const std::string& name) {
  for (const auto& n : strategy_names())
    if (n == name) return;
  throw Error(concat("unknown strategy '", name, "' (known: ", core::join(strategy_names()), ")"));
}
}  // namespace

std::unique_ptr<Strategy> make_strategy(const std::string& name, std::shared_ptr<distributed::Communicator> comm,
                                        c10::Device device, const StrategyOptions& options) {
  check_known(name);
  if (name == "single") return std::make_unique<SingleDeviceStrategy>(device);
  if (name == "ddp") return std::make_unique<DdpStrategy>(std::move(comm), options.ddp, device);
  FsdpOptions fo = options.fsdp;
  if (fo.device.is_cuda() && !fo.device.has_index()) fo.device = device;
  return std::make_unique<FsdpStrategy>(std::move(comm), fo);
}

StateDictType default_state_dict_type(const std::string& name) {
  check_known(name);
  return name == "fsdp" ? FsdpStrategy::kDefaultStateDictType : Strategy::kDefaultStateDictType;
}

}  // namespace tessera::strategy
