#include "tessera/optim/adam.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "tessera/core/compat.h"
#include "tessera/core/error.h"

namespace tessera::optim {
namespace {

// How weight decay enters: not at all, decoupled (AdamW: the parameter shrinks by
// 1 - lr * wd before the update) or as L2 (Adam: wd * p added to the gradient).
enum class Decay { None, Decoupled, L2 };

// The per-step constants of one parameter's update, in the parameter's type.
template <typename T>
struct Coefs {
  T decay;         // Decoupled: 1 - lr * wd
  T l2;            // L2: wd
  T beta1, one_minus_beta1, beta2, one_minus_beta2;
  T bc2_sqrt;      // sqrt(1 - beta2^step)
  T eps;
  T neg_step_size; // -lr / (1 - beta1^step)
};

// The update of n elements, in the order of libtorch's tensor operations for each element
// (decay, exp_avg = exp_avg * beta1 + grad * (1 - beta1), exp_avg_sq likewise with grad^2,
// denom = sqrt(exp_avg_sq) / sqrt(bc2) + eps, p += -step_size * (exp_avg / denom)), each
// element read and written once.
template <typename T, Decay kDecay, bool kAmsgrad>
inline __attribute__((always_inline)) void update_elements(T* __restrict p, const T* __restrict g,
                                                            T* __restrict m, T* __restrict v,
                                                            T* __restrict vmax, int64_t n, const Coefs<T>& c) {
  for (int64_t i = 0; i < n; ++i) {
    T param = p[i];
    T grad = g[i];
    if constexpr (kDecay == Decay::Decoupled) param = param * c.decay;
    if constexpr (kDecay == Decay::L2) grad = grad + c.l2 * param;
    const T mi = m[i] * c.beta1 + grad * c.one_minus_beta1;
    const T vi = v[i] * c.beta2 + (grad * grad) * c.one_minus_beta2;
    m[i] = mi;
    v[i] = vi;
    T second = vi;
    if constexpr (kAmsgrad) {
      second = vmax[i] > vi ? vmax[i] : vi;
      vmax[i] = second;
    }
    const T denom = std::sqrt(second) / c.bc2_sqrt + c.eps;
    p[i] = param + c.neg_step_size * (mi / denom);
  }
}

template <typename T>
inline __attribute__((always_inline)) void update_dispatch(T* p, const T* g, T* m, T* v, T* vmax, int64_t n,
                                                            const Coefs<T>& c, Decay decay, bool amsgrad) {
  switch (decay) {
    case Decay::None:
      return amsgrad ? update_elements<T, Decay::None, true>(p, g, m, v, vmax, n, c)
                     : update_elements<T, Decay::None, false>(p, g, m, v, vmax, n, c);
    case Decay::Decoupled:
      return amsgrad ? update_elements<T, Decay::Decoupled, true>(p, g, m, v, vmax, n, c)
                     : update_elements<T, Decay::Decoupled, false>(p, g, m, v, vmax, n, c);
    case Decay::L2:
      return amsgrad ? update_elements<T, Decay::L2, true>(p, g, m, v, vmax, n, c)
                     : update_elements<T, Decay::L2, false>(p, g, m, v, vmax, n, c);
  }
}

// One clone per instruction set, chosen when the library loads: the loop above compiles to
// 16-wide AVX-512, 8-wide AVX2 or SSE2 code (sqrt and divide included: this file is built
// with -fno-math-errno).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TESSERA_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TESSERA_CPU_CLONES
#endif

TESSERA_CPU_CLONES void update_f32(float* p, const float* g, float* m, float* v, float* vmax, int64_t n,
                                   const Coefs<float>& c, Decay decay, bool amsgrad) {
  update_dispatch<float>(p, g, m, v, vmax, n, c, decay, amsgrad);
}

TESSERA_CPU_CLONES void update_f64(double* p, const double* g, double* m, double* v, double* vmax, int64_t n,
                                   const Coefs<double>& c, Decay decay, bool amsgrad) {
  update_dispatch<double>(p, g, m, v, vmax, n, c, decay, amsgrad);
}

struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
  Decay decay;
};

template <typename T>
Coefs<T> coefs_of(const Hyper& h, int64_t step) {
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  return {static_cast<T>(1 - h.lr * h.weight_decay), static_cast<T>(h.weight_decay), static_cast<T>(h.beta1),
          static_cast<T>(1 - h.beta1), static_cast<T>(h.beta2), static_cast<T>(1 - h.beta2),
          static_cast<T>(std::sqrt(bc2)), static_cast<T>(h.eps), static_cast<T>(-h.lr / bc1)};
}

bool one_pass_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                      const at::Tensor* vmax) {
  const auto dtype = p.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  for (const at::Tensor* t : {&p, &g, &m, &v, vmax}) {
    if (t == nullptr) continue;
    if (!t->device().is_cpu() || t->layout() != at::kStrided || t->scalar_type() != dtype || !t->is_contiguous() ||
        t->numel() != p.numel())
      return false;
  }
  return true;
}

template <typename T>
void one_pass(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, at::Tensor* vmax, const Hyper& h,
              int64_t step) {
  const Coefs<T> c = coefs_of<T>(h, step);
  T* pp = p.data_ptr<T>();
  const T* gp = g.data_ptr<T>();
  T* mp = m.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  T* xp = vmax ? vmax->data_ptr<T>() : nullptr;
  at::parallel_for(0, p.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    T* x = xp ? xp + begin : nullptr;
    if constexpr (std::is_same<T, float>::value)
      update_f32(pp + begin, gp + begin, mp + begin, vp + begin, x, end - begin, c, h.decay, h.amsgrad);
    else
      update_f64(pp + begin, gp + begin, mp + begin, vp + begin, x, end - begin, c, h.decay, h.amsgrad);
  });
  // Written in place, as libtorch's in-place operations would: autograd must see the change
  // (a graph that saved the parameter refuses to run backward, as it would after p.addcdiv_).
  for (at::Tensor* t : {&p, &m, &v, vmax})
    if (t != nullptr) t->unsafeGetTensorImpl()->bump_version();
}

// The same update as tensor operations: devices and dtypes the loop above does not take.
void by_tensor_ops(at::Tensor& p, at::Tensor grad, at::Tensor& m, at::Tensor& v, at::Tensor* vmax, const Hyper& h,
                   int64_t step) {
  const Coefs<double> c = coefs_of<double>(h, step);
  if (h.decay == Decay::Decoupled) p.mul_(c.decay);
  if (h.decay == Decay::L2) grad = grad.add(p, c.l2);
  m.mul_(c.beta1).add_(grad, c.one_minus_beta1);
  v.mul_(c.beta2).addcmul_(grad, grad, c.one_minus_beta2);
  at::Tensor second = v;
  if (vmax) {
    at::max_out(*vmax, *vmax, v);
    second = *vmax;
  }
  const at::Tensor denom = (second.sqrt() / c.bc2_sqrt).add_(c.eps);
  p.addcdiv_(m, denom, c.neg_step_size);
}

// One step of every parameter with a gradient; State is AdamParamState or
// AdamWParamState, whose fields (and their creation) are libtorch's.
template <typename State, typename Options, typename StateMap>
void step_all(std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& states, Decay decoupled_or_l2,
              const char* name) {
  for (auto& group : groups) {
    const auto& o = static_cast<const Options&>(group.options());
    Hyper h{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.amsgrad(),
            o.weight_decay() != 0 ? decoupled_or_l2 : Decay::None};
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& grad = p.grad();
      TESSERA_CHECK(!grad.is_sparse(), name, " does not support sparse gradients");
      auto key = compat::optimizer_state_key(p);
      auto it = states.find(key);
      if (it == states.end()) {
        auto s = std::make_unique<State>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (h.amsgrad) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        it = states.emplace(key, std::move(s)).first;
      }
      auto& s = static_cast<State&>(*it->second);
      s.step(s.step() + 1);
      at::Tensor m = s.exp_avg();
      at::Tensor v = s.exp_avg_sq();
      at::Tensor vmax = h.amsgrad ? s.max_exp_avg_sq() : at::Tensor();
      at::Tensor* vmax_p = h.amsgrad ? &vmax : nullptr;
      if (one_pass_applies(p, grad, m, v, vmax_p)) {
        if (p.scalar_type() == at::kFloat) one_pass<float>(p, grad, m, v, vmax_p, h, s.step());
        else one_pass<double>(p, grad, m, v, vmax_p, h, s.step());
      } else {
        by_tensor_ops(p, grad, m, v, vmax_p, h, s.step());
      }
    }
  }
}

template <typename StepFn>
at::Tensor with_closure(const torch::optim::Optimizer::LossClosure& closure, StepFn&& fn) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  fn();
  return loss;
}

}  // namespace

at::Tensor Adam::step(LossClosure closure) {
  return with_closure(closure, [&] {
    step_all<torch::optim::AdamParamState, torch::optim::AdamOptions>(param_groups_, state_, Decay::L2, "Adam");
  });
}

at::Tensor AdamW::step(LossClosure closure) {
  return with_closure(closure, [&] {
    step_all<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(param_groups_, state_, Decay::Decoupled,
                                                                        "AdamW");
  });
}

}  // namespace tessera::optim
