#include "tessera/fabric/options.h"

#include <torch/cuda.h>

#include "tessera/core/error.h"
#include "tessera/strategy/factory.h"

namespace tessera::fabric {

namespace {

constexpr Accelerator kAccelerators[] = {Accelerator::Cpu, Accelerator::Cuda};
constexpr Precision kPrecisions[] = {Precision::F32, Precision::Bf16Mixed, Precision::F16Mixed};

// The value of `all` whose to_string is `v`, or nullopt.
template <typename Kind, size_t N>
std::optional<Kind> find_named(const Kind (&all)[N], const std::string& v) {
  for (Kind k : all)
    if (v == to_string(k)) return k;
  return std::nullopt;
}

// "\"a\", \"b\" or \"c\"": the values an option takes, for its error message.
std::string choices(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += concat(i == 0 ? "" : i + 1 == names.size() ? " or " : ", ", "\"", names[i], "\"");
  return out;
}

[[noreturn]] void unknown_value(const char* option, const std::string& value, const std::vector<std::string>& names) {
  throw Error(concat("FabricOptions.", option, ": unknown value '", value, "' (expected ", choices(names), ")"));
}

}  // namespace

const char* to_string(Accelerator a) {
  switch (a) {
    case Accelerator::Cpu: return "cpu";
    case Accelerator::Cuda: return "cuda";
  }
  throw Error(concat("unknown fabric::Accelerator ", static_cast<int>(a)));
}

const char* to_string(Precision p) {
  switch (p) {
    case Precision::F32: return "32";
    case Precision::Bf16Mixed: return "bf16-mixed";
    case Precision::F16Mixed: return "16-mixed";
  }
  throw Error(concat("unknown fabric::Precision ", static_cast<int>(p)));
}

std::optional<Accelerator> parse_accelerator(const std::string& value) {
  if (value == "auto") return std::nullopt;
  if (auto a = find_named(kAccelerators, value)) return a;
  unknown_value("accelerator", value, {to_string(Accelerator::Cpu), to_string(Accelerator::Cuda), "auto"});
}

std::optional<strategy::StrategyKind> parse_strategy(const std::string& value) {
  if (value == "auto") return std::nullopt;
  if (auto k = strategy::find_strategy(value)) return k;
  std::vector<std::string> names{"auto"};
  for (const auto& n : strategy::strategy_names()) names.push_back(n);
  unknown_value("strategy", value, names);
}

Precision parse_precision(const std::string& value) {
  if (auto p = find_named(kPrecisions, value)) return *p;
  std::vector<std::string> names;
  for (Precision p : kPrecisions) names.emplace_back(to_string(p));
  unknown_value("precision", value, names);
}

const char* to_string(strategy::StateDictType t) {
  return t == strategy::StateDictType::Sharded ? "sharded" : "full";
}

int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

ResolvedOptions resolve(const FabricOptions& o, int cuda_devices) {
  ResolvedOptions r;
  r.options = o;

  // The strings, parsed once: nothing below compares them.
  const std::optional<Accelerator> asked_accelerator = parse_accelerator(o.accelerator);
  const std::optional<strategy::StrategyKind> asked_strategy = parse_strategy(o.strategy);
  r.precision = parse_precision(o.precision);
  TESSERA_CHECK(o.devices >= 1, "FabricOptions.devices must be at least 1, got ", o.devices);
  TESSERA_CHECK(o.num_nodes >= 1, "FabricOptions.num_nodes must be at least 1, got ", o.num_nodes);

  if (asked_accelerator == Accelerator::Cuda) {
    TESSERA_CHECK(cuda_devices > 0, "FabricOptions.accelerator: \"cuda\" requested but this libtorch sees no CUDA ",
                  "device (CPU-only build or no GPU); use \"cpu\" or \"auto\"");
  }
  r.accelerator_kind = asked_accelerator.value_or(cuda_devices > 0 ? Accelerator::Cuda : Accelerator::Cpu);
  r.accelerator = to_string(r.accelerator_kind);
  const bool cuda = r.accelerator_kind == Accelerator::Cuda;
  if (cuda) {
    TESSERA_CHECK(o.devices <= cuda_devices, "FabricOptions.devices=", o.devices, " with accelerator \"cuda\" but only ",
                  cuda_devices, " GPU(s) are visible");
  }

  using strategy::StrategyKind;
  const int world = o.devices * o.num_nodes;
  r.strategy_kind = asked_strategy.value_or(world > 1 ? StrategyKind::Ddp : StrategyKind::Single);
  r.strategy = strategy::to_string(r.strategy_kind);
  TESSERA_CHECK(!(r.strategy_kind == StrategyKind::Single && world > 1),
                "FabricOptions.strategy \"single\" runs one process, but devices=", o.devices, " num_nodes=",
                o.num_nodes, " asks for ", world, "; use \"ddp\" or \"fsdp\" (or devices=1)");

  if (r.precision == Precision::F16Mixed) {
    TESSERA_CHECK(cuda, "FabricOptions.precision \"16-mixed\" needs accelerator \"cuda\" (fp16 autocast ",
                  "is not supported on the CPU by this libtorch); use \"bf16-mixed\" or \"32\" on the CPU");
    r.autocast_dtype = at::kHalf;
  } else if (r.precision == Precision::Bf16Mixed) {
    r.autocast_dtype = at::kBFloat16;
  }

  if (r.strategy_kind == StrategyKind::Fsdp) {
    if (cuda) {
      if (r.options.fsdp.device.is_cpu() && !o.fsdp.cpu_offload) r.options.fsdp.device = c10::Device(c10::kCUDA);
    } else {
      TESSERA_CHECK(o.fsdp.device.is_cpu(), "FabricOptions.fsdp.device is ", o.fsdp.device.str(),
                    " but the accelerator is \"cpu\"");
    }
    if (r.autocast_dtype && !o.fsdp.mixed_precision.param_dtype) {
      r.options.fsdp.mixed_precision.param_dtype = *r.autocast_dtype;
    }
  } else {
    TESSERA_CHECK(!o.fsdp.mixed_precision.param_dtype && !o.fsdp.cpu_offload && !o.fsdp.activation_checkpointing,
                  "FabricOptions.fsdp is set (mixed_precision/cpu_offload/activation_checkpointing) but the strategy is \"",
                  r.strategy, "\"; choose strategy \"fsdp\" or leave FabricOptions.fsdp at its defaults");
  }
  const int tp = o.tensor_parallel_size;
  TESSERA_CHECK(tp >= 1, "FabricOptions.tensor_parallel_size must be at least 1, got ", tp);
  TESSERA_CHECK(o.devices % tp == 0, "FabricOptions.tensor_parallel_size=", tp, " does not divide devices=", o.devices,
                " (a tensor-parallel group is ", tp, " ranks of one node)");
  r.state_dict_type = o.state_dict_type.value_or(strategy::default_state_dict_type(r.strategy_kind));
  if (tp > 1 && r.strategy_kind == strategy::StrategyKind::Fsdp &&
      o.fsdp.sharding == strategy::ShardingStrategy::HybridShard) {
    // A (replicate, shard, tp) mesh: its checkpoints are consolidated (FsdpStrategy::
    // default_state_dict_type says why).
    TESSERA_CHECK(!o.state_dict_type || *o.state_dict_type == strategy::StateDictType::Full,
                  "FabricOptions.state_dict_type Sharded with fsdp.sharding HybridShard and tensor_parallel_size=", tp,
                  ": a (replicate, shard, tp) mesh has no sharded checkpoint form yet; use Full (its default)");
    r.state_dict_type = strategy::StateDictType::Full;
  }
  return r;
}

}  // namespace tessera::fabric
