// Fabric's configuration: which accelerator, strategy, how many processes and which
// precision. Every option is checked when a Fabric is constructed; an invalid value or
// combination is a tessera::Error naming the option (e.g. "FabricOptions.precision").
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

#include "tessera/distributed/communicator.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"

namespace tessera::fabric {

struct FabricOptions {
  // "cpu", "cuda" or "auto" (cuda when this libtorch sees a GPU, else cpu).
  std::string accelerator = "auto";
  // "auto" ("single" for one process, else "ddp"), "single", "ddp" or "fsdp".
  std::string strategy = "auto";
  // Processes per node. launch() starts them itself when the program was not started
  // by `tessera run` / torchrun / srun / mpirun.
  int devices = 1;
  int num_nodes = 1;
  // "32", "bf16-mixed" or "16-mixed" (CUDA only).
  std::string precision = "32";
  // Layout of save(): nullopt = the strategy's default_state_dict_type() (Sharded for
  // "fsdp", Full for the others).
  std::optional<strategy::StateDictType> state_dict_type;
  // Options of the "fsdp" and "ddp" strategies. Fabric fills fsdp.device and
  // fsdp.mixed_precision.param_dtype from accelerator/precision unless set here.
  strategy::FsdpOptions fsdp;
  strategy::DdpOptions ddp;
  // Rendezvous and collective timeouts, backend choice.
  distributed::CommOptions comm;
};

// The options after validation, with "auto" values decided.
struct ResolvedOptions {
  FabricOptions options;
  std::string accelerator;  // "cpu" or "cuda"
  std::string strategy;     // "single", "ddp" or "fsdp"
  strategy::StateDictType state_dict_type = strategy::StateDictType::Full;
  // Autocast dtype for "bf16-mixed" / "16-mixed"; nullopt for "32".
  std::optional<at::ScalarType> autocast_dtype;
  int world_size() const { return options.devices * options.num_nodes; }
};

// Validates `o` (no torch op runs; safe before launch()). `cuda_devices` is the number
// of GPUs this libtorch sees (tests pass their own). Throws tessera::Error naming the
// option at fault.
ResolvedOptions resolve(const FabricOptions& o, int cuda_devices);
// GPUs visible to this libtorch (0 in a CPU-only build).
int cuda_device_count();

const char* to_string(strategy::StateDictType t);

}  // namespace tessera::fabric
