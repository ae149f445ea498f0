// Step time of a GPT-style block stack (pre-norm attention + MLP) trained with Adam:
//   strategy_bench plain|fsdp|ddp|single [dim] [layers] [steps]
// Prints one JSON line per rank-0 run: {"mode", "world", "params", "step_ms", "peak_rss_mib",
// "base_rss_mib"}: the largest peak resident set over the ranks, and the largest resident
// set before the model was built (the runtime: libtorch, gloo, the communicator).
// World size comes from the environment (tessera run / torchrun).
#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include "tessera/core/blas.h"
#include "tessera/core/error.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"

namespace {

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  int64_t d, heads = 4;
  explicit BlockImpl(int64_t dim) : d(dim) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
    fc1 = register_module("fc1", torch::nn::Linear(dim, 4 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * dim, dim));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), hd = d / heads;
    auto parts = qkv(ln1(x)).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    at::Tensor att = at::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(double(hd));
    at::Tensor mask = at::ones({T, T}, at::kBool).triu(1);
    att = at::softmax(att.masked_fill(mask, -1e9), -1);
    at::Tensor y = at::matmul(att, parts[2]).transpose(1, 2).reshape({B, T, d});
    at::Tensor h = x + proj(y);
    return h + fc2(at::gelu(fc1(ln2(h))));
  }
};
TORCH_MODULE(Block);

// With a strategy, each block is built through its module-init context: FSDP shards a
// block's parameters as soon as it exists, so no rank ever holds the whole model.
torch::nn::Sequential make_model(int64_t dim, int layers, tessera::strategy::Strategy* strat) {
  at::manual_seed(0);
  torch::nn::Sequential s;
  s->push_back(torch::nn::Linear(dim, dim));
  for (int i = 0; i < layers; ++i) {
    if (strat) s->push_back(strat->init_module([&] { return torch::nn::AnyModule(Block(dim)); }));
    else s->push_back(Block(dim));
  }
  s->push_back(torch::nn::Linear(dim, dim));
  return s;
}

// Resident set of this process now, MiB.
double rss_now_mib() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

}  // namespace

// OpenBLAS kernels for this CPU, chosen before any library loads (tessera/core/blas.h).
TESSERA_TUNE_BLAS_AT_STARTUP();

int main(int argc, char** argv) {
  using namespace tessera;
  const std::string mode = argc > 1 ? argv[1] : "fsdp";
  const int64_t dim = argc > 2 ? std::stoll(argv[2]) : 256;
  const int layers = argc > 3 ? std::stoi(argv[3]) : 4;
  const int steps = argc > 4 ? std::stoi(argv[4]) : 20;
  const int64_t batch = 8, seq = 64;
  auto comm = distributed::Communicator::create(distributed::World::from_env());
  std::unique_ptr<strategy::Strategy> strat;
  if (mode == "fsdp") {
    strategy::FsdpOptions o;
    o.auto_wrap = strategy::wrap_by_type<BlockImpl>();
    strat = std::make_unique<strategy::FsdpStrategy>(comm, o);
  } else if (mode == "ddp") {
    strat = std::make_unique<strategy::DdpStrategy>(comm);
  } else if (mode == "single") {
    strat = std::make_unique<strategy::SingleDeviceStrategy>();
  } else if (mode != "plain") {
    std::fprintf(stderr, "mode must be plain, single, ddp or fsdp\n");
    return 2;
  }
  const double base_rss = comm->all_reduce_double(rss_now_mib(), distributed::ReduceOp::Max);
  auto seq_model = make_model(dim, layers, strat.get());
  int64_t params = 0;
  // Counted from the architecture: under FSDP the module's tensors are already shards.
  params = layers * (12 * dim * dim + 13 * dim) + 2 * (dim * dim + dim);
  if (!strat) {
    int64_t counted = 0;
    for (auto& p : seq_model->parameters()) counted += p.numel();
    TESSERA_CHECK(counted == params, "parameter count ", counted, " != ", params);
  }
  torch::nn::AnyModule m;
  std::shared_ptr<torch::nn::Module> root = seq_model.ptr();
  if (strat) {
    m = strat->setup(seq_model);
    root = strat->module();
  }
  torch::optim::Adam opt(root->parameters(), torch::optim::AdamOptions(1e-4));
  auto gen = at::detail::createCPUGenerator(1 + comm->rank());
  at::Tensor x = at::randn({batch, seq, dim}, gen), y = at::randn({batch, seq, dim}, gen);
  auto step = [&] {
    at::Tensor out = strat ? m.forward(x) : seq_model->forward(x);
    at::Tensor loss = at::mse_loss(out, y);
    if (strat) {
      strat->backward(loss);
      strat->optimizer_step(opt);
    } else {
      loss.backward();
      opt.step();
    }
    opt.zero_grad();
  };
  for (int i = 0; i < 3; ++i) step();
  comm->barrier();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  comm->barrier();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  const double rss = comm->all_reduce_double(static_cast<double>(ru.ru_maxrss) / 1024.0, distributed::ReduceOp::Max);  // KiB -> MiB
  if (comm->rank() == 0)
    std::printf(
        "{\"mode\": \"%s\", \"world\": %d, \"params\": %lld, \"batch_per_rank\": %lld, \"step_ms\": %.3f, "
        "\"peak_rss_mib\": %.1f, \"base_rss_mib\": %.1f}\n",
        mode.c_str(), comm->size(), static_cast<long long>(params), static_cast<long long>(batch), ms,
        rss, base_rss);
  return 0;
}
