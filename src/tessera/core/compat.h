// The libtorch-version shim: the only place that knows how 1.13 and 2.x differ.
// Decisions come from configure-time probes (tessera/config.h, written by
// cmake/TesseraFeatures.cmake) or from type traits, never from version numbers.
#pragma once
#include <string>
#include <type_traits>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/optim/optimizer.h>

#include "tessera/config.h"

#if TESSERA_HAS_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace tessera::compat {

// The class that carries the collective entry points of a concrete process group:
// c10d::Backend on 2.x, c10d::ProcessGroup on 1.13.
#if TESSERA_GLOO_IS_BACKEND
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif
static_assert(std::is_base_of<BackendBase, c10d::ProcessGroupGloo>::value,
              "configure-time probe disagrees with the ProcessGroupGloo headers");

using Work = c10d::Work;
using BackendPtr = c10::intrusive_ptr<BackendBase>;

// libtorch optimizers keep per-parameter state in a map whose key is derived from the
// parameter's TensorImpl: a string on 1.13, a pointer on later versions.
using OptimizerStateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
using OptimizerStateKey = typename OptimizerStateMap::key_type;

template <typename Key>
Key optimizer_state_key_of(c10::TensorImpl* impl) {
  if constexpr (std::is_same<Key, std::string>::value) {
    return c10::guts::to_string(impl);
  } else {
    return static_cast<Key>(impl);
  }
}

inline OptimizerStateKey optimizer_state_key(const at::Tensor& param) {
  return optimizer_state_key_of<OptimizerStateKey>(param.unsafeGetTensorImpl());
}

}  // namespace tessera::compat
