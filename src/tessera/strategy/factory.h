// Strategies by name: the one place that maps "single", "ddp" and "fsdp" to their
// kinds and classes, so the layers above (Fabric, the Trainer) hold a StrategyKind or a
// Strategy and know none of them by name.
#pragma once
#include <c10/core/Device.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"
#include "tessera/strategy/strategy.h"

namespace tessera::strategy {

// The options of every strategy; make_strategy passes on the ones of the chosen one.
struct StrategyOptions {
  DdpOptions ddp;
  FsdpOptions fsdp;
  // Tensor parallelism: the (dp, tp) mesh's world communicator, when `comm` is its dp group
  // (Strategy::set_mesh_world).
  std::shared_ptr<distributed::Communicator> mesh_world;
};

// The strategies make_strategy builds: SingleDeviceStrategy, DdpStrategy, FsdpStrategy.
enum class StrategyKind { Single, Ddp, Fsdp };

// "single", "ddp", "fsdp": the names of the kinds, in that order.
const std::vector<std::string>& strategy_names();
// The name of `kind` ("single", "ddp" or "fsdp").
const char* to_string(StrategyKind kind);
// The kind named `name`, or nullopt when no strategy has that name.
std::optional<StrategyKind> find_strategy(const std::string& name);
// The kind named `name`; an unknown name is an error listing the known ones.
StrategyKind parse_strategy(const std::string& name);

// Builds strategy `name` for this rank. `device` is the rank's device: the single-device
// and DDP strategies place the module there; FSDP gathers to it when fsdp.device is
// CUDA without an index. "single" runs one process and ignores `comm`. An unknown name
// is an error listing the known ones.
std::unique_ptr<Strategy> make_strategy(const std::string& name, std::shared_ptr<distributed::Communicator> comm,
                                        c10::Device device, const StrategyOptions& options = {});
// The same for a kind already parsed.
std::unique_ptr<Strategy> make_strategy(StrategyKind kind, std::shared_ptr<distributed::Communicator> comm,
                                        c10::Device device, const StrategyOptions& options = {});

// What make_strategy(name, ...)->default_state_dict_type() returns, without building it.
StateDictType default_state_dict_type(const std::string& name);
StateDictType default_state_dict_type(StrategyKind kind);

}  // namespace tessera::strategy
