#include "tessera/core/device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include "tessera/config.h"
#include "tessera/core/error.h"

#if TESSERA_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

namespace tessera::core {

int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

c10::Device rank_device(const std::string& accelerator, int local_rank) {
  return rank_device(accelerator == "cuda" ? c10::kCUDA : c10::kCPU, local_rank);
}

c10::Device rank_device(c10::DeviceType type, int local_rank) {
  if (type != c10::kCUDA) return c10::Device(c10::kCPU);
  const int n = cuda_device_count();
  TESSERA_CHECK(local_rank >= 0 && local_rank < n, "rank with LOCAL_RANK=", local_rank,
                " needs its own GPU (cuda:", local_rank, ") but ", n,
                " are visible; start at most that many ranks per node or set CUDA_VISIBLE_DEVICES");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

void select_device(const c10::Device& device) {
  if (device.is_cpu()) return;
  TESSERA_CHECK(device.has_index(), "select_device: ", device, " has no index");
  c10::impl::getDeviceGuardImpl(device.type())->setDevice(device);
}

void synchronize(const c10::Device& device) {
  if (device.is_cpu()) return;
  TESSERA_CHECK(device.is_cuda(), "synchronize: no synchronization for ", device);
  torch::cuda::synchronize(device.index());
}

std::optional<int64_t> peak_allocated_bytes(const c10::Device& device) {
#if TESSERA_HAS_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[0].peak;  // [0]: StatType::AGGREGATE, every pool together
  }
#endif
  (void)device;
  return std::nullopt;
}

void reset_peak_allocated_bytes(const c10::Device& device) {
#if TESSERA_HAS_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  (void)device;
}

std::optional<std::string> device_name(const c10::Device& device) {
#if TESSERA_HAS_CUDA
  if (device.is_cuda()) {
    cudaDeviceProp prop{};
    TESSERA_CHECK(cudaGetDeviceProperties(&prop, device.index()) == cudaSuccess, "cannot read the properties of ",
                  device);
    return std::string(prop.name);
  }
#endif
  (void)device;
  return std::nullopt;
}

std::optional<double> peak_tflops(const c10::Device& device) {
  const auto name = device_name(device);
  if (!name) return std::nullopt;
  const std::pair<const char*, double> known[] = {{"H100", 989}, {"H200", 989}, {"H800", 989}, {"GH200", 989},
                                                  {"A100", 312}, {"A800", 312}, {"B200", 2250}};
  for (const auto& [model, tflops] : known)
    if (name->find(model) != std::string::npos) return tflops;
  return std::nullopt;
}

}  // namespace tessera::core
