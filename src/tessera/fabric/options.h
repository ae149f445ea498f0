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
#include "tessera/strategy/factory.h"
#include "tessera/strategy/fsdp.h"

namespace tessera::fabric {

// What FabricOptions' strings name, as resolve() decides them ("auto" decided). The
// strategy's kind is strategy::StrategyKind (strategy/factory.h, the one place that knows
// strategies by name).
enum class Accelerator { Cpu, Cuda };
enum class Precision { F32, Bf16Mixed, F16Mixed };

// The strings FabricOptions takes: "cpu", "cuda"; "32", "bf16-mixed", "16-mixed".
const char* to_string(Accelerator a);
const char* to_string(Precision p);
// FabricOptions' fields parsed, each a tessera::Error naming the option on an unknown
// value ("FabricOptions.accelerator: unknown value 'tpu' (expected ...)"). "auto" is
// nullopt for the accelerator and the strategy (resolve() decides it).
std::optional<Accelerator> parse_accelerator(const std::string& value);
std::optional<strategy::StrategyKind> parse_strategy(const std::string& value);
Precision parse_precision(const std::string& value);

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
  // Tensor parallelism (docs/tensor-parallel.md): the ranks of one tensor-parallel group,
  // the innermost dimension of Fabric's device mesh (dp = world / tensor_parallel_size,
  // tp = tensor_parallel_size), so a group is consecutive ranks of one node. 1: none.
  // The strategy then runs over the dp dimension, and the model is built with
  // Fabric::tensor_parallel(). Must divide devices.
  int tensor_parallel_size = 1;
  // Sequence parallelism inside the tensor-parallel group (as torchtitan: on by default).
  bool sequence_parallel = true;
};

// The options after validation, with "auto" values decided. The strings and the kinds
// say the same (accelerator is to_string(accelerator_kind), ...); Tessera branches on the
// kinds.
struct ResolvedOptions {
  FabricOptions options;
  std::string accelerator;  // "cpu" or "cuda"
  std::string strategy;     // "single", "ddp" or "fsdp"
  strategy::StateDictType state_dict_type = strategy::StateDictType::Full;
  // Autocast dtype for "bf16-mixed" / "16-mixed"; nullopt for "32".
  std::optional<at::ScalarType> autocast_dtype;
  Accelerator accelerator_kind = Accelerator::Cpu;
  strategy::StrategyKind strategy_kind = strategy::StrategyKind::Single;
  Precision precision = Precision::F32;  // options.precision, parsed
  int world_size() const { return options.devices * options.num_nodes; }
  int tensor_parallel_size() const { return options.tensor_parallel_size; }
  // The ranks that see different data: world_size() / tensor_parallel_size().
  int data_parallel_size() const { return world_size() / options.tensor_parallel_size; }
};

// Validates `o` (no torch op runs; safe before launch()). `cuda_devices` is the number
// of GPUs this libtorch sees (tests pass their own). Throws tessera::Error naming the
// option at fault.
ResolvedOptions resolve(const FabricOptions& o, int cuda_devices);
// GPUs visible to this libtorch (0 in a CPU-only build).
int cuda_device_count();

const char* to_string(strategy::StateDictType t);

}  // namespace tessera::fabric
