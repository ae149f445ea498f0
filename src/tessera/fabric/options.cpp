#include "tessera/fabric/options.h"

#include <torch/cuda.h>

#include "tessera/core/error.h"
#include "tessera/strategy/factory.h"

namespace tessera::fabric {

namespace {

bool one_of(const std::string& v, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed)
    if (v == a) return true;
  return false;
}

}  // namespace

const char* to_string(strategy::StateDictType t) {
  return t == strategy::StateDictType::Sharded ? "sharded" : "full";
}

int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

ResolvedOptions resolve(const FabricOptions& o, int cuda_devices) {
  ResolvedOptions r;
  r.options = o;

  TESSERA_CHECK(one_of(o.accelerator, {"cpu", "cuda", "auto"}), "FabricOptions.accelerator: unknown value '",
                o.accelerator, "' (expected \"cpu\", \"cuda\" or \"auto\")");
  TESSERA_CHECK(one_of(o.strategy, {"auto", "single", "ddp", "fsdp"}), "FabricOptions.strategy: unknown value '",
                o.strategy, "' (expected \"auto\", \"single\", \"ddp\" or \"fsdp\")");
  TESSERA_CHECK(one_of(o.precision, {"32", "bf16-mixed", "16-mixed"}), "FabricOptions.precision: unknown value '",
                o.precision, "' (expected \"32\", \"bf16-mixed\" or \"16-mixed\")");
  TESSERA_CHECK(o.devices >= 1, "FabricOptions.devices must be at least 1, got ", o.devices);
  TESSERA_CHECK(o.num_nodes >= 1, "FabricOptions.num_nodes must be at least 1, got ", o.num_nodes);

  if (o.accelerator == "cuda") {
    TESSERA_CHECK(cuda_devices > 0, "FabricOptions.accelerator: \"cuda\" requested but this libtorch sees no CUDA ",
                  "device (CPU-only build or no GPU); use \"cpu\" or \"auto\"");
  }
  r.accelerator = o.accelerator == "auto" ? (cuda_devices > 0 ? "cuda" : "cpu") : o.accelerator;
  if (r.accelerator == "cuda") {
    TESSERA_CHECK(o.devices <= cuda_devices, "FabricOptions.devices=", o.devices, " with accelerator \"cuda\" but only ",
                  cuda_devices, " GPU(s) are visible");
  }

  const int world = o.devices * o.num_nodes;
  r.strategy = o.strategy == "auto" ? (world > 1 ? "ddp" : "single") : o.strategy;
  TESSERA_CHECK(!(r.strategy == "single" && world > 1), "FabricOptions.strategy \"single\" runs one process, but devices=",
                o.devices, " num_nodes=", o.num_nodes, " asks for ", world, "; use \"ddp\" or \"fsdp\" (or devices=1)");

  if (o.precision == "16-mixed") {
    TESSERA_CHECK(r.accelerator == "cuda", "FabricOptions.precision \"16-mixed\" needs accelerator \"cuda\" (fp16 autocast ",
                  "is not supported on the CPU by this libtorch); use \"bf16-mixed\" or \"32\" on the CPU");
    r.autocast_dtype = at::kHalf;
  } else if (o.precision == "bf16-mixed") {
    r.autocast_dtype = at::kBFloat16;
  }

  if (r.strategy == "fsdp") {
    if (r.accelerator == "cuda") {
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
  r.state_dict_type = o.state_dict_type.value_or(strategy::default_state_dict_type(r.strategy));
  return r;
}

}  // namespace tessera::fabric
