#include "tessera/fabric/fabric.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "tessera/core/compat.h"
#include "tessera/core/cpu_allocator.h"
#include "tessera/core/device.h"
#include "tessera/core/env.h"
#include "tessera/core/log.h"
#include "tessera/distributed/launch/launcher.h"
#include "tessera/strategy/factory.h"

namespace tessera::fabric {

namespace {
c10::DispatchKey autocast_key(bool cuda) { return cuda ? c10::DispatchKey::AutocastCUDA : c10::DispatchKey::AutocastCPU; }
}  // namespace

AutocastGuard::AutocastGuard(bool cuda, at::ScalarType dtype) : active_(true), cuda_(cuda) {
  const auto key = autocast_key(cuda);
  prev_enabled_ = !c10::impl::tls_is_dispatch_key_excluded(key);
  compat::set_autocast_dtype(cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU, dtype);
  c10::impl::tls_set_dispatch_key_excluded(key, false);
  at::autocast::increment_nesting();
}

AutocastGuard::AutocastGuard(AutocastGuard&& o) noexcept
    : active_(o.active_), cuda_(o.cuda_), prev_enabled_(o.prev_enabled_), prev_dtype_(o.prev_dtype_) {
  o.active_ = false;
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  c10::impl::tls_set_dispatch_key_excluded(autocast_key(cuda_), !prev_enabled_);
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
}

// --- construction and launch -------------------------------------------------------

namespace {

std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  TESSERA_CHECK(in, "Fabric::launch: cannot read /proc/self/cmdline to re-run this program");
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::string cur;
  for (char c : all) {
    if (c == '\0') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) args.push_back(cur);
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  TESSERA_CHECK(n > 0, "Fabric::launch: cannot resolve /proc/self/exe to re-run this program");
  buf[n] = '\0';
  if (args.empty()) args.emplace_back();
  args[0] = buf;
  return args;
}

}  // namespace

namespace {
// GPUs are only counted when the accelerator may be CUDA (counting initializes the
// CUDA driver in this process). An unknown accelerator is refused as resolve() refuses it.
int gpus_to_count(const FabricOptions& o) {
  return parse_accelerator(o.accelerator) == Accelerator::Cpu ? 0 : cuda_device_count();
}
}  // namespace

// Tessera's CPU memory policy is installed first (core/cpu_allocator.h).
Fabric::Fabric(FabricOptions options)
    : opts_((core::install_cpu_allocator(), resolve(options, gpus_to_count(options)))) {}

Fabric::~Fabric() {
  // A checkpoint still being written is finished, not abandoned.
  if (!pending_save_.valid()) return;
  try {
    pending_save_.wait();
  } catch (const std::exception& e) {
    log::warn("the async checkpoint save still running when Fabric was destroyed failed: ", e.what());
  }
}

void Fabric::launch() {
  if (strategy_) return;
  const int want = opts_.world_size();
  world_ = distributed::World::from_env();
  if (!world_.is_distributed() && want > 1) {
    TESSERA_CHECK(opts_.options.num_nodes == 1, "FabricOptions.num_nodes=", opts_.options.num_nodes,
                  ": a multi-node job must be started on every node by `tessera run`, torchrun, srun or mpirun; "
                  "launch() only starts the ranks of one node");
    TESSERA_CHECK(!distributed::started_by_launcher(), "Fabric::launch: this process was started by a launcher (",
                  world_.source, ") with a world size of 1 but FabricOptions.devices=", opts_.options.devices,
                  "; start it with ", opts_.options.devices, " ranks per node, or set devices=1");
    distributed::LaunchOptions lo;
    lo.command = own_command_line();
    lo.nproc_per_node = opts_.options.devices;
    distributed::LaunchResult res = distributed::launch(lo);  // it reports a failing rank itself (once)
    std::cout.flush();
    std::exit(res.exit_code);
  }
  TESSERA_CHECK(world_.world_size == want, "FabricOptions.devices=", opts_.options.devices, " num_nodes=",
                opts_.options.num_nodes, " asks for ", want, " processes, but this job was started with ",
                world_.world_size, " (", world_.describe(), "); make them agree");
  if (world_.is_distributed()) log::set_rank(world_.rank);

  // The rank's GPU becomes current before any CUDA work, NCCL's communicators included.
  const c10::Device dev = device();
  core::select_device(dev);
  comm_ = distributed::Communicator::create(world_, opts_.options.comm);
  strategy::StrategyOptions so;
  so.ddp = opts_.options.ddp;
  so.fsdp = opts_.options.fsdp;
  const int tp = opts_.tensor_parallel_size();
  // HYBRID_SHARD over the dp dimension of a (dp, tp) mesh: its shard groups are the dp
  // ranks of one node (a 3-D mesh: replicate x shard x tp, tp innermost).
  if (tp > 1 && so.fsdp.sharding == strategy::ShardingStrategy::HybridShard && so.fsdp.ranks_per_node == 0)
    so.fsdp.ranks_per_node = world_.local_world_size / tp;
  mesh_ = std::make_unique<parallel::DeviceMesh>(comm_, std::vector<parallel::MeshDim>{
                                                            {"dp", world_.world_size / tp}, {"tp", tp}});
  so.mesh_world = comm_;  // the mesh is dp-major over it: a 2-D sharded state spans it
  strategy_ = strategy::make_strategy(opts_.strategy_kind, mesh_->comm("dp"), dev, so);
}

void Fabric::require_launched(const char* what) const {
  TESSERA_CHECK(strategy_ != nullptr, "Fabric::", what, ": call fabric.launch() first (devices=",
                opts_.options.devices, ", strategy \"", opts_.strategy, "\")");
}

strategy::Strategy& Fabric::strategy() {
  require_launched("strategy");
  return *strategy_;
}

const std::shared_ptr<distributed::Communicator>& Fabric::comm() {
  require_launched("comm");
  return comm_;
}

c10::Device Fabric::device() const {
  return core::rank_device(opts_.accelerator_kind == Accelerator::Cuda ? c10::kCUDA : c10::kCPU, world_.local_rank);
}

int Fabric::global_rank() const { return world_.rank; }
int Fabric::local_rank() const { return world_.local_rank; }
int Fabric::node_rank() const { return world_.node_rank; }
int Fabric::world_size() const { return world_.world_size; }
int Fabric::data_parallel_size() const { return world_.world_size / opts_.tensor_parallel_size(); }
int Fabric::data_parallel_rank() const { return world_.rank / opts_.tensor_parallel_size(); }

const parallel::DeviceMesh& Fabric::device_mesh() const {
  require_launched("device_mesh");
  return *mesh_;
}

parallel::TensorParallel Fabric::tensor_parallel() const {
  return parallel::TensorParallel::from_mesh(device_mesh(), "tp", opts_.options.sequence_parallel);
}

// --- setup --------------------------------------------------------------------------

torch::nn::AnyModule Fabric::setup_module(torch::nn::AnyModule module) {
  require_launched("setup_module");
  TESSERA_CHECK(!module.is_empty(), "Fabric::setup_module: the module is empty");
  TESSERA_CHECK(!setup_original_, "Fabric::setup_module: a module is already set up (", setup_original_->name(),
                "); one Fabric drives one model: put the pieces in one parent module");
  std::shared_ptr<torch::nn::Module> original = module.ptr();
  torch::nn::AnyModule out = strategy_->setup(std::move(module), {});
  setup_original_ = original;
  for (const auto& m : {original, out.ptr()}) {
    setup_aliases_.push_back(m);
    if (auto* w = dynamic_cast<strategy::WrappedModuleImpl*>(m.get())) setup_aliases_.push_back(w->wrapped());
  }
  return out;
}

torch::nn::AnyModule Fabric::setup_module(torch::nn::Sequential seq) {
  TESSERA_CHECK(!seq.is_empty(), "Fabric::setup_module: the Sequential is empty (null)");
  return setup_module(torch::nn::AnyModule(strategy::WrappedModule(std::move(seq))));
}

torch::nn::AnyModule Fabric::setup(torch::nn::Sequential seq, std::vector<OptimizerPtr> optimizers) {
  torch::nn::AnyModule out = setup_module(std::move(seq));
  setup_optimizers(optimizers);
  return out;
}

torch::nn::AnyModule Fabric::setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers) {
  torch::nn::AnyModule out = setup_module(std::move(module));
  setup_optimizers(optimizers);
  return out;
}

void Fabric::setup_optimizers(const std::vector<OptimizerPtr>& optimizers) {
  for (auto& o : optimizers) setup_optimizer(o);
}

OptimizerPtr Fabric::setup_optimizer(OptimizerPtr optimizer) {
  require_launched("setup_optimizer");
  TESSERA_CHECK(optimizer != nullptr, "Fabric::setup_optimizer: null optimizer");
  TESSERA_CHECK(setup_original_, "Fabric::setup_optimizer: call setup_module(model) first");
  for (auto& o : strategy_->optimizers())
    TESSERA_CHECK(o.get() != optimizer.get(), "Fabric::setup_optimizer: this optimizer is already set up");
  strategy_->add_optimizer(optimizer);
  return optimizer;
}

torch::nn::AnyModule Fabric::init_module(const std::function<torch::nn::AnyModule()>& build) {
  require_launched("init_module");
  return strategy_->init_module(build);
}

// --- training step ------------------------------------------------------------------

void Fabric::backward(const at::Tensor& loss) {
  require_launched("backward");
  TESSERA_CHECK(setup_original_, "Fabric::backward: call setup_module(model) first");
  strategy_->backward(loss);
}

void Fabric::step(torch::optim::Optimizer& optimizer) {
  require_launched("step");
  optimizer_index(&optimizer, "step");
  strategy_->optimizer_step(optimizer);
}

std::optional<double> Fabric::clip_gradients(const GradClip& clip) {
  require_launched("clip_gradients");
  TESSERA_CHECK(clip.max_norm.has_value() != clip.max_value.has_value(),
                "Fabric::clip_gradients: set exactly one of GradClip.max_norm and GradClip.max_value");
  if (clip.max_value) {
    TESSERA_CHECK(*clip.max_value > 0, "Fabric::clip_gradients: GradClip.max_value must be positive, got ",
                  *clip.max_value);
    strategy_->clip_grad_value(*clip.max_value);
    return std::nullopt;
  }
  TESSERA_CHECK(*clip.max_norm > 0, "Fabric::clip_gradients: GradClip.max_norm must be positive, got ", *clip.max_norm);
  const double norm = strategy_->clip_grad_norm(*clip.max_norm, clip.norm_type);
  TESSERA_CHECK(!clip.error_if_nonfinite || std::isfinite(norm), "Fabric::clip_gradients: the total gradient norm ",
                "is non-finite (", norm, "); set GradClip.error_if_nonfinite=false to clip anyway");
  return norm;
}

double Fabric::clip_grad_norm(double max_norm, double norm_type) {
  GradClip c;
  c.max_norm = max_norm;
  c.norm_type = norm_type;
  return *clip_gradients(c);
}

void Fabric::clip_grad_value(double max_value) {
  GradClip c;
  c.max_value = max_value;
  clip_gradients(c);
}

void Fabric::check_is_setup_module(const std::shared_ptr<torch::nn::Module>& m, const std::string& what) const {
  TESSERA_CHECK(setup_original_, "Fabric::", what, ": no module is set up yet (call setup_module first)");
  TESSERA_CHECK(m && std::find(setup_aliases_.begin(), setup_aliases_.end(), m) != setup_aliases_.end(), "Fabric::",
                what, ": the module is not the one given to (or returned by) setup_module");
}

NoBackwardSync Fabric::no_backward_sync(const torch::nn::AnyModule& module, bool enabled) {
  return no_backward_sync(module.ptr(), enabled);
}

NoBackwardSync Fabric::no_backward_sync(const std::shared_ptr<torch::nn::Module>& module, bool enabled) {
  require_launched("no_backward_sync");
  check_is_setup_module(module, "no_backward_sync");
  if (!enabled) return NoBackwardSync();
  return NoBackwardSync(strategy_.get());
}

AutocastGuard Fabric::autocast() const {
  if (!opts_.autocast_dtype) return AutocastGuard();
  return AutocastGuard(opts_.accelerator_kind == Accelerator::Cuda, *opts_.autocast_dtype);
}

int Fabric::optimizer_index(const torch::optim::Optimizer* opt, const std::string& what) const {
  const auto& opts = strategy_->optimizers();
  for (size_t i = 0; i < opts.size(); ++i)
    if (opts[i].get() == opt) return static_cast<int>(i);
  throw Error(concat("Fabric::", what, ": the optimizer was not set up with this Fabric (pass it to setup() or ",
                     "setup_optimizer())"));
}

// --- data and randomness ------------------------------------------------------------

DistributedSampler Fabric::distributed_sampler(size_t dataset_size, SamplerOptions options) const {
  return DistributedSampler(dataset_size, data_parallel_size(), data_parallel_rank(), options);
}

uint64_t Fabric::seed_everything(uint64_t seed, bool rank_aware) {
  const uint64_t s = seed + (rank_aware ? static_cast<uint64_t>(world_.rank) : 0);
  at::manual_seed(s);
  std::srand(static_cast<unsigned>(s));
  return s;
}

// --- collectives --------------------------------------------------------------------

at::Tensor Fabric::all_reduce(const at::Tensor& t, distributed::ReduceOp op) {
  require_launched("all_reduce");
  at::Tensor out = t.detach().clone();
  comm_->all_reduce(out, op);
  return out;
}

double Fabric::all_reduce(double value, distributed::ReduceOp op) {
  require_launched("all_reduce");
  return comm_->all_reduce_double(value, op);
}

at::Tensor Fabric::all_gather(const at::Tensor& t) {
  require_launched("all_gather");
  at::Tensor one = t.detach().unsqueeze(0).contiguous();
  return comm_->all_gather(one, std::vector<int64_t>(static_cast<size_t>(comm_->size()), 1));
}

at::Tensor Fabric::broadcast(const at::Tensor& t, int src) {
  require_launched("broadcast");
  TESSERA_CHECK(src >= 0 && src < comm_->size(), "Fabric::broadcast: src rank ", src, " is outside [0, ",
                comm_->size(), ")");
  at::Tensor out = t.detach().clone();
  comm_->broadcast(out, src);
  return out;
}

std::string Fabric::broadcast(const std::string& bytes, int src) {
  require_launched("broadcast");
  TESSERA_CHECK(src >= 0 && src < comm_->size(), "Fabric::broadcast: src rank ", src, " is outside [0, ",
                comm_->size(), ")");
  return comm_->broadcast_bytes(bytes, src);
}

void Fabric::barrier() {
  require_launched("barrier");
  comm_->barrier();
}

}  // namespace tessera::fabric
