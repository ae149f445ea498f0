// make_strategy: strategy names to strategy kinds, and kinds to strategy classes.
#include "tessera/strategy/factory.h"

#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::strategy {

namespace {
constexpr StrategyKind kKinds[] = {StrategyKind::Single, StrategyKind::Ddp, StrategyKind::Fsdp};
}  // namespace

const char* to_string(StrategyKind kind) {
  switch (kind) {
    case StrategyKind::Single: return "single";
    case StrategyKind::Ddp: return "ddp";
    case StrategyKind::Fsdp: return "fsdp";
  }
  throw Error(concat("unknown StrategyKind ", static_cast<int>(kind)));
}

const std::vector<std::string>& strategy_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (StrategyKind k : kKinds) out.emplace_back(to_string(k));
    return out;
  }();
  return names;
}

std::optional<StrategyKind> find_strategy(const std::string& name) {
  for (StrategyKind k : kKinds)
    if (name == to_string(k)) return k;
  return std::nullopt;
}

StrategyKind parse_strategy(const std::string& name) {
  const std::optional<StrategyKind> kind = find_strategy(name);
  if (!kind) throw Error(concat("unknown strategy '", name, "' (known: ", core::join(strategy_names()), ")"));
  return *kind;
}

std::unique_ptr<Strategy> make_strategy(const std::string& name, std::shared_ptr<distributed::Communicator> comm,
                                        c10::Device device, const StrategyOptions& options) {
  return make_strategy(parse_strategy(name), std::move(comm), device, options);
}

std::unique_ptr<Strategy> make_strategy(StrategyKind kind, std::shared_ptr<distributed::Communicator> comm,
                                        c10::Device device, const StrategyOptions& options) {
  std::unique_ptr<Strategy> s;
  switch (kind) {
    case StrategyKind::Single: s = std::make_unique<SingleDeviceStrategy>(device); break;
    case StrategyKind::Ddp: s = std::make_unique<DdpStrategy>(std::move(comm), options.ddp, device); break;
    case StrategyKind::Fsdp: {
      FsdpOptions fo = options.fsdp;
      if (fo.device.is_cuda() && !fo.device.has_index()) fo.device = device;
      s = std::make_unique<FsdpStrategy>(std::move(comm), fo);
      break;
    }
  }
  if (s) {
    s->set_mesh_world(options.mesh_world);
    return s;
  }
  throw Error(concat("make_strategy: unknown StrategyKind ", static_cast<int>(kind)));
}

StateDictType default_state_dict_type(const std::string& name) { return default_state_dict_type(parse_strategy(name)); }

StateDictType default_state_dict_type(StrategyKind kind) {
  return kind == StrategyKind::Fsdp ? FsdpStrategy::kDefaultStateDictType : Strategy::kDefaultStateDictType;
}

}  // namespace tessera::strategy
