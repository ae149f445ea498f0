// Accelerator placement and memory figures, the same code on every libtorch build.
//
// Selecting a device and counting GPUs go through c10's device-generic guard interface
// (the CUDA library of a CUDA libtorch registers its implementation when loaded), so
// nothing here needs CUDA headers; the caching allocator's statistics do, and exist
// only where Tessera was configured against a CUDA libtorch (TESSERA_HAS_CUDA).
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

namespace tessera::core {

// GPUs this process can use (0 on a CPU-only libtorch or a machine without one).
int cuda_device_count();

// The device a rank computes on: cuda:<local_rank> for "cuda", the CPU otherwise. Throws,
// naming the rank, when the rank has no GPU of its own.
c10::Device rank_device(const std::string& accelerator, int local_rank);
// The same by device type: cuda:<local_rank> for c10::kCUDA, the CPU for any other.
c10::Device rank_device(c10::DeviceType type, int local_rank);

// Makes `device` the current device of the calling thread (cudaSetDevice for CUDA; a
// no-op for the CPU). Call it before any CUDA work of the rank, NCCL included.
void select_device(const c10::Device& device);

// Peak bytes the caching allocator handed out on `device` since the process started or
// the last reset (what torch.cuda.max_memory_allocated reports). nullopt for the CPU
// or a build without CUDA.
std::optional<int64_t> peak_allocated_bytes(const c10::Device& device);
void reset_peak_allocated_bytes(const c10::Device& device);

// The device's model name ("NVIDIA H200"); nullopt for the CPU or a build without CUDA.
std::optional<std::string> device_name(const c10::Device& device);
// Dense bf16 tensor-core peak in TFLOP/s of the GPU models whose figure Tessera knows
// (Hopper H100/H200: 989, Ampere A100: 312, Blackwell B200: 2250); nullopt otherwise.
std::optional<double> peak_tflops(const c10::Device& device);

// Blocks until the work queued on `device` is done (timing); a no-op for the CPU.
void synchronize(const c10::Device& device);

}  // namespace tessera::core
