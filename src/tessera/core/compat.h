// The libtorch-version shim: the only place that knows how 1.13 and 2.x differ.
// Decisions come from configure-time probes (tessera/config.h, written by
// cmake/TesseraFeatures.cmake) or from type traits, never from version numbers.
#pragma once
#include <sstream>
#include <string>
#include <type_traits>

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/optim/optimizer.h>

#include "tessera/config.h"

#if TESSERA_HAS_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

// Declared, never defined: they only make the names used by compat::set_autocast_dtype
// resolvable when one of the two autocast APIs is absent. At global scope so that,
// through the using-directives, they are found together with at::autocast's (a
// using-directive makes names visible in the nearest namespace enclosing both).
namespace tessera_autocast_missing {
struct Missing {};
void set_autocast_dtype(Missing, Missing);
void set_autocast_cpu_dtype(Missing);
void set_autocast_gpu_dtype(Missing);
}  // namespace tessera_autocast_missing

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

// c10::Allocator::allocate is a const member on 1.13 and a non-const one on 2.x
// (core/cpu_allocator.cpp overrides whichever this libtorch declares).
constexpr bool kAllocatorAllocateIsConst =
    std::is_same<decltype(&c10::Allocator::allocate), c10::DataPtr (c10::Allocator::*)(size_t) const>::value;

using Work = c10d::Work;
using BackendPtr = c10::intrusive_ptr<BackendBase>;

// libtorch optimizers keep per-parameter state in a map whose key is derived from the
// parameter's TensorImpl: a string on 1.13, a pointer on later versions.
using OptimizerStateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
using OptimizerStateKey = typename OptimizerStateMap::key_type;

template <typename Key>
Key optimizer_state_key_of(c10::TensorImpl* impl) {
  if constexpr (std::is_same<Key, std::string>::value) {
    // What 1.13's c10::guts::to_string(impl) writes (it streams the pointer); 2.x dropped
    // that helper, and its optimizers key by pointer anyway.
    std::ostringstream key;
    key << impl;
    return key.str();
  } else {
    return static_cast<Key>(impl);
  }
}

inline OptimizerStateKey optimizer_state_key(const at::Tensor& param) {
  return optimizer_state_key_of<OptimizerStateKey>(param.unsafeGetTensorImpl());
}

// Autograd nodes are held by std::shared_ptr on 1.13 and by c10::intrusive_ptr later; a
// parameter's grad accumulator is set through the matching weak pointer.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

template <typename P>
struct WeakOf;
template <typename T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <typename T, typename N>
struct WeakOf<c10::intrusive_ptr<T, N>> {
  using type = c10::weak_intrusive_ptr<T, N>;
};

inline void set_grad_accumulator(const at::Tensor& param, const NodePtr& node) {
  torch::autograd::impl::set_grad_accumulator(param, typename WeakOf<NodePtr>::type(node));
}

// The autocast dtype setter is set_autocast_dtype(device, dtype) on newer libtorch and
// set_autocast_{cpu,gpu}_dtype(dtype) on 1.13; whichever exists is picked by overload
// resolution on dependent calls (the declarations taking `Missing` above only make the
// names resolvable when one API is absent).
namespace autocast_detail {
using namespace at::autocast;
using namespace ::tessera_autocast_missing;
template <typename D, typename T>
auto set_dtype(D device, T dtype, int) -> decltype(set_autocast_dtype(device, dtype), void()) {
  set_autocast_dtype(device, dtype);
}
template <typename D, typename T>
auto set_dtype(D device, T dtype, long) -> decltype(set_autocast_cpu_dtype(dtype), set_autocast_gpu_dtype(dtype), void()) {
  if (device == c10::DeviceType::CUDA)
    set_autocast_gpu_dtype(dtype);
  else
    set_autocast_cpu_dtype(dtype);
}
}  // namespace autocast_detail

inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
  autocast_detail::set_dtype(device, dtype, 0);
}

}  // namespace tessera::compat
