// Rank programs for the CUDA tests (tests/cuda/test_cuda.cpp): NCCL collectives with
// uneven and empty pieces; DDP and FSDP on cuda:LOCAL_RANK against one GPU training the
// global batch (fp32 and bf16 mixed precision); a sharded checkpoint saved from GPUs,
// loaded on the CPU and back onto GPUs bit for bit. They only run where GPUs are visible.
#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <cstdio>
#include <functional>

#include "strategy/state_as_dict.h"
#include "support/scenario.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/core/device.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"

using namespace tessera;
using namespace tessera::testing;
using namespace tessera::strategy;

namespace {

// This rank's GPU, made current before the communicator (and so NCCL) exists.
c10::Device my_gpu() {
  const c10::Device d = core::rank_device("cuda", distributed::World::from_env().local_rank);
  core::select_device(d);
  return d;
}

at::Tensor on(const at::Tensor& t, const c10::Device& d) { return t.to(d); }

// Uneven, possibly empty pieces: rank k holds k rows (rank 0 none).
std::vector<int64_t> uneven_rows(int n) {
  std::vector<int64_t> s;
  for (int k = 0; k < n; ++k) s.push_back(k);
  return s;
}

}  // namespace

SCENARIO("cuda_collectives") {
  const c10::Device dev = my_gpu();
  auto c = comm();
  const int r = c->rank(), n = c->size();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);

  at::Tensor t = at::full({5}, double(r + 1), f32.device(dev));
  c->all_reduce(t);
  WCHECK(t.device() == dev && t.cpu().equal(at::full({5}, n * (n + 1) / 2.0, f32)), "all_reduce sum: ", t);

  at::Tensor b = at::full({4}, double(r + 1), at::TensorOptions().dtype(at::kBFloat16).device(dev));
  c->all_reduce(b, distributed::ReduceOp::Max);
  WCHECK(b.cpu().to(at::kFloat).equal(at::full({4}, double(n), f32)), "bf16 all_reduce max: ", b);

  const auto sizes = uneven_rows(n);
  at::Tensor local = at::full({sizes[r], 3}, double(r), f32.device(dev));
  at::Tensor g = c->all_gather(local, sizes);
  std::vector<at::Tensor> parts;
  for (int k = 0; k < n; ++k) parts.push_back(at::full({sizes[k], 3}, double(k), f32));
  WCHECK(g.device() == dev && g.cpu().equal(at::cat(parts)), "uneven all_gather: ", g);

  int64_t total = 0, off = 0;
  for (int k = 0; k < n; ++k) total += sizes[k];
  for (int k = 0; k < r; ++k) off += sizes[k];
  at::Tensor rows = at::arange(total, f32).unsqueeze(1).expand({total, 3}).contiguous();
  at::Tensor piece = c->reduce_scatter(on(rows + r, dev), sizes);
  at::Tensor want = rows.narrow(0, off, sizes[r]) * n + n * (n - 1) / 2.0;
  WCHECK(piece.device() == dev && piece.cpu().equal(want), "uneven reduce_scatter: ", piece, " want ", want);

  at::Tensor x = r == 0 ? at::arange(6, f32).to(dev) : at::zeros({6}, f32.device(dev));
  c->broadcast(x, 0);
  WCHECK(x.cpu().equal(at::arange(6, f32)), "broadcast: ", x);
  std::printf("cuda collectives ok rank %d\n", r);
  return 0;
}

namespace {

torch::nn::Sequential make_net(uint64_t seed = 11) {
  at::manual_seed(seed);
  torch::nn::Linear a(8, 32), b(32, 32), h(32, 4);
  return torch::nn::Sequential(a, torch::nn::GELU(), b, torch::nn::GELU(), h);
}

std::pair<at::Tensor, at::Tensor> batch(int step, const c10::Device& dev) {
  auto gen = at::detail::createCPUGenerator(500 + step);
  return {at::randn({16, 8}, gen).to(dev), at::randn({16, 4}, gen).to(dev)};
}

std::unique_ptr<Strategy> make_gpu_strategy(const std::string& kind, const c10::Device& dev) {
  if (kind == "ddp") return std::make_unique<DdpStrategy>(comm());
  FsdpOptions o;
  o.device = dev;
  o.auto_wrap = wrap_by_type<torch::nn::LinearImpl>();
  if (kind == "fsdp_bf16") o.mixed_precision.param_dtype = at::kBFloat16;
  else if (kind == "fsdp_offload") o.cpu_offload = true;
  else if (kind != "fsdp") throw Error("unknown kind " + kind);
  return std::make_unique<FsdpStrategy>(comm(), o);
}

// Losses of `steps` Adam steps: one GPU on the whole batch (reference) or this rank's rows.
std::vector<double> run(const std::string& kind, int steps, const c10::Device& dev) {
  auto c = comm();
  const int r = c->rank(), n = c->size();
  auto net = make_net();
  std::unique_ptr<Strategy> strat;
  std::function<at::Tensor(const at::Tensor&)> forward;
  torch::nn::AnyModule m;
  if (kind == "reference") {
    net->to(dev);
    forward = [net](const at::Tensor& x) mutable { return net->forward(x); };
  } else {
    strat = make_gpu_strategy(kind, dev);
    if (kind == "ddp") net->to(dev);
    m = strat->setup(net);
    forward = [&m](const at::Tensor& x) { return m.forward(x); };
  }
  auto params = strat ? strat->module()->parameters() : net->parameters();
  auto opt = std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  if (strat) strat->add_optimizer(opt);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s, dev);
    if (strat) {
      const int64_t per = x.size(0) / n;
      x = x.narrow(0, r * per, per);
      y = y.narrow(0, r * per, per);
    }
    at::Tensor loss = at::mse_loss(forward(x).to(at::kFloat), y);
    if (strat) {
      strat->backward(loss);
      losses.push_back(c->all_reduce_double(loss.item<double>(), distributed::ReduceOp::Avg));
      strat->optimizer_step(*opt);
    } else {
      loss.backward();
      losses.push_back(loss.item<double>());
      opt->step();
    }
    opt->zero_grad();
  }
  return losses;
}

}  // namespace

// args: comma-separated kinds (ddp, fsdp, fsdp_bf16, fsdp_offload), relative tolerance.
SCENARIO("cuda_parity") {
  const c10::Device dev = my_gpu();
  at::globalContext().setAllowTF32CuBLAS(false);  // fp32 parity means fp32 matmuls
  const double tol = std::stod(args.arg(1, "1e-5"));
  const auto want = run("reference", 12, dev);
  std::string kinds = args.arg(0, "ddp,fsdp");
  size_t start = 0;
  while (start <= kinds.size()) {
    const size_t end = kinds.find(',', start);
    const std::string kind = kinds.substr(start, end == std::string::npos ? std::string::npos : end - start);
    const auto got = run(kind, 12, dev);
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / std::abs(want[i]));
    WCHECK(worst <= tol, kind, ": max relative loss difference ", worst, " above ", tol);
    std::printf("%s: max rel loss diff %.3g\n", kind.c_str(), worst);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  std::printf("cuda parity ok rank %d\n", comm()->rank());
  return 0;
}

// args: checkpoint directory. FSDP on GPUs saves sharded; every rank loads the whole
// checkpoint on the CPU without a process group and compares bit for bit with the
// gathered GPU values; a fresh GPU model loads it back and must match too.
SCENARIO("cuda_checkpoint") {
  const c10::Device dev = my_gpu();
  const std::string path = args.arg(0);
  auto c = comm();
  auto s1 = make_gpu_strategy("fsdp", dev);
  auto m1 = s1->setup(make_net());
  auto opt1 = std::make_shared<torch::optim::Adam>(s1->module()->parameters(), torch::optim::AdamOptions(1e-2));
  s1->add_optimizer(opt1);
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = batch(s, dev);
    const int64_t per = x.size(0) / c->size();
    s1->backward(at::mse_loss(m1.forward(x.narrow(0, c->rank() * per, per)), y.narrow(0, c->rank() * per, per)));
    s1->optimizer_step(*opt1);
    opt1->zero_grad();
  }
  checkpoint::save(as_dict(s1->state(StateDictType::Sharded)), path, *c);
  const state::StateDict full = as_dict(s1->state(StateDictType::Full));

  // On the CPU, no process group: a target of zeros with the same keys and shapes.
  state::StateDict cpu;
  std::vector<std::pair<std::string, at::Tensor>> want;
  for (const auto& [key, v] : full.flatten()) {
    if (const auto* t = std::get_if<at::Tensor>(v)) {
      want.emplace_back(key, t->cpu());
      cpu.set(key, at::zeros_like(want.back().second));
    }
  }
  WCHECK(!want.empty(), "the full state dict holds no tensors");
  checkpoint::load_local(cpu, path);
  for (const auto& [key, t] : want) {
    WCHECK(cpu.tensor(key).device().is_cpu() && cpu.tensor(key).equal(t), "CPU load differs at ", key);
  }

  // Back onto GPUs, into a differently initialised model.
  auto s2 = make_gpu_strategy("fsdp", dev);
  auto m2 = s2->setup(make_net(99));
  auto opt2 = std::make_shared<torch::optim::Adam>(s2->module()->parameters(), torch::optim::AdamOptions(1e-2));
  s2->add_optimizer(opt2);
  state::StateDict target = as_dict(s2->state(StateDictType::Sharded));
  checkpoint::load(target, path, *c);
  s2->load_state(from_dict(target));
  const state::StateDict back = as_dict(s2->state(StateDictType::Full));
  for (const auto& [key, t] : want) {
    const auto& got = std::get<at::Tensor>(*[&] {
      for (const auto& [k, v] : back.flatten())
        if (k == key) return v;
      throw Error("reloaded state has no " + key);
    }());
    WCHECK(got.cpu().equal(t), "GPU reload differs at ", key);
  }
  std::printf("cuda checkpoint ok rank %d\n", c->rank());
  return 0;
}
