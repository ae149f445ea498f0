// One AdamW step over the parameters of examples/gpt's model at three sizes, one thread:
// libtorch's torch::optim::AdamW (the tensor-operation implementation, as torch.optim's
// default on the CPU) against tessera::optim::AdamW (one pass over each parameter), and
// against the limit, a memcpy of the bytes one pass must move (read p, g, exp_avg,
// exp_avg_sq and write p, exp_avg, exp_avg_sq: 28 bytes per float parameter) measured in
// the same run. Median of 9 steps after 2 warm-up steps, the implementations alternating.
//   optim_bench [OUT.json]      (default bench/results/optim.json)
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "../../examples/gpt/model.h"
#include "tessera/config.h"
#include "tessera/core/blas.h"
#include "tessera/optim/adam.h"

TESSERA_TUNE_BLAS_AT_STARTUP();

namespace {
using Clock = std::chrono::steady_clock;

struct Size {
  const char* name;
  int layers, d, t;
};

// The parameters of examples/gpt's model itself (gpt::Gpt, untied head), each given a
// gradient of the scale training produces, so that the benchmark follows the example's
// architecture.
std::vector<at::Tensor> gpt_params(const Size& s) {
  gpt::Config c;
  c.n_layer = s.layers;
  c.n_head = s.layers;  // examples/gpt's sizes use as many heads as layers
  c.d_model = s.d;
  c.seq_len = s.t;
  gpt::Gpt model(c);
  std::vector<at::Tensor> ps;
  for (auto& p : model->parameters()) {
    at::Tensor q = p.detach().clone();
    q.set_requires_grad(true);
    q.mutable_grad() = torch::randn(q.sizes()) * 1e-3;
    ps.push_back(q);
  }
  return ps;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "bench/results/optim.json";
  at::set_num_threads(1);
  at::manual_seed(0);
  const auto opts = torch::optim::AdamWOptions(2e-3).betas({0.9, 0.95}).weight_decay(0.01);
  nlohmann::json rows = nlohmann::json::array();
  for (const Size& s : {Size{"L4 d256 T128", 4, 256, 128}, Size{"L8 d512 T64", 8, 512, 64},
                        Size{"L12 d768 T32", 12, 768, 32}}) {
    auto a = gpt_params(s);
    auto b = gpt_params(s);
    int64_t n = 0;
    for (auto& p : a) n += p.numel();
    torch::optim::AdamW theirs(a, opts);
    tessera::optim::AdamW ours(b, opts);
    // The limit: one memcpy of 14 bytes per parameter (14 read + 14 written = the 28 a
    // one-pass update moves), buffers touched beforehand.
    std::vector<char> src(static_cast<size_t>(n) * 14, 1), dst(static_cast<size_t>(n) * 14, 2);
    std::vector<double> t_theirs, t_ours, t_copy;
    for (int i = 0; i < 11; ++i) {
      auto time = [](auto&& f) {
        const auto t0 = Clock::now();
        f();
        return std::chrono::duration<double>(Clock::now() - t0).count();
      };
      const double x = time([&] { theirs.step(); });
      const double y = time([&] { ours.step(); });
      const double z = time([&] { std::memcpy(dst.data(), src.data(), src.size()); });
      if (i >= 2) {
        t_theirs.push_back(x);
        t_ours.push_back(y);
        t_copy.push_back(z);
      }
    }
    const double mt = median(t_theirs), mo = median(t_ours), mc = median(t_copy);
    rows.push_back({{"model", s.name},
                    {"params_M", n / 1e6},
                    {"libtorch_adamw_ms", mt * 1e3},
                    {"tessera_adamw_ms", mo * 1e3},
                    {"speedup", mt / mo},
                    {"limit_ms (memcpy of 28 B/param)", mc * 1e3},
                    {"tessera vs limit", mc / mo},
                    {"tessera GB/s", 28.0 * n / mo / 1e9}});
    std::cerr << "optim_bench: " << s.name << ": libtorch " << mt * 1e3 << " ms, tessera " << mo * 1e3
              << " ms, limit " << mc * 1e3 << " ms\n";
  }
  nlohmann::json doc{{"benchmark", "optim"},
                     {"rows", rows},
                     {"threads", 1},
                     {"libtorch", TESSERA_TORCH_VERSION},
                     {"method", "median of 9 steps after 2 warm-ups, implementations alternating; AdamW lr 2e-3, "
                                "betas 0.9/0.95, weight decay 0.01, fp32"}};
  std::ofstream f(out);
  f << doc.dump(2) << "\n";
  return f ? 0 : 1;
}
