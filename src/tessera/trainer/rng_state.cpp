// Saving and restoring the default random generators' states (see rng_state.h).
#include "tessera/trainer/rng_state.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <cstring>
#include <mutex>

#include "tessera/fabric/fabric.h"

namespace tessera::trainer {

std::string generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor s = gen.get_state().contiguous();
  return std::string(static_cast<const char*>(s.data_ptr()), static_cast<size_t>(s.numel()));
}

void set_generator_state(at::Generator gen, const std::string& bytes) {
  at::Tensor s = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(s.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

RngFork::RngFork(c10::Device device) {
  cpu_ = generator_state(at::detail::getDefaultCPUGenerator());
  if (device.is_cuda()) {
    device_ = device;
    cuda_ = generator_state(at::globalContext().defaultGenerator(device));
  }
}

RngFork::~RngFork() {
  set_generator_state(at::detail::getDefaultCPUGenerator(), cpu_);
  if (device_) set_generator_state(at::globalContext().defaultGenerator(*device_), cuda_);
}

state::StateDict gather_rng_states(fabric::Fabric& f) {
  state::StateDict rng;
  rng.set("world_size", static_cast<int64_t>(f.world_size()));
  auto cpu = f.comm()->all_gather_bytes(generator_state(at::detail::getDefaultCPUGenerator()));
  for (size_t r = 0; r < cpu.size(); ++r) rng.set("cpu_" + std::to_string(r), state::Bytes{cpu[r]});
  if (f.device().is_cuda()) {
    auto cuda = f.comm()->all_gather_bytes(generator_state(at::globalContext().defaultGenerator(f.device())));
    for (size_t r = 0; r < cuda.size(); ++r) rng.set("cuda_" + std::to_string(r), state::Bytes{cuda[r]});
  }
  return rng;
}

void restore_rng_states(fabric::Fabric& f, const state::StateDict& rng) {
  auto pick = [&](const std::string& kind) -> const state::Bytes* {
    const std::string mine = kind + "_" + std::to_string(f.global_rank());
    if (rng.contains(mine)) return &rng.bytes(mine);
    if (rng.contains(kind + "_0")) return &rng.bytes(kind + "_0");
    return nullptr;
  };
  if (auto b = pick("cpu")) set_generator_state(at::detail::getDefaultCPUGenerator(), b->data);
  if (f.device().is_cuda())
    if (auto b = pick("cuda")) set_generator_state(at::globalContext().defaultGenerator(f.device()), b->data);
}

}  // namespace tessera::trainer
