// FSDP setup (units, wrap policy, sharding groups), clipping and state dicts.
#include "tessera/strategy/fsdp.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>

#include <cmath>
#include <map>
#include <set>

#include "tessera/core/log.h"
#include "tessera/state/module_state.h"
#include "tessera/strategy/fsdp_impl.h"
#include "tessera/strategy/tp_state.h"

namespace tessera::strategy {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FullShard: return "FULL_SHARD";
    case ShardingStrategy::ShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::NoShard: return "NO_SHARD";
    case ShardingStrategy::HybridShard: return "HYBRID_SHARD";
  }
  return "?";
}

WrapPolicy wrap_by_size(int64_t min_numel) {
  return [min_numel](const torch::nn::Module&, int64_t numel) { return numel >= min_numel; };
}
WrapPolicy wrap_all() {
  return [](const torch::nn::Module&, int64_t) { return true; };
}

// --- FsdpUnitImpl -------------------------------------------------------------

FsdpUnitImpl::FsdpUnitImpl(torch::nn::AnyModule inner) : WrappedModuleImpl(std::move(inner), "FsdpUnit") {
  TESSERA_CHECK(!dynamic_cast<FsdpUnitImpl*>(wrapped().get()), "FsdpUnit: wrapping a unit in a unit");
}
FsdpUnitImpl::FsdpUnitImpl(torch::nn::Sequential inner) : WrappedModuleImpl(std::move(inner), "FsdpUnit") {}

at::Tensor FsdpUnitImpl::forward(const at::Tensor& x) {
  if (!strategy) return run_wrapped(x);
  return strategy->unit_forward(*this, x);
}

// --- setup --------------------------------------------------------------------

namespace {

struct Found {
  FsdpUnitImpl* unit;
  std::string prefix;
};

// Parameters of `m` outside nested units (FQNs under `prefix`), and the nested units.
void collect(torch::nn::Module& m, const std::string& prefix, std::vector<std::pair<std::string, at::Tensor>>& params,
             std::vector<Found>& units) {
  for (auto& kv : m.named_parameters(false)) params.emplace_back(prefix + kv.key(), kv.value());
  for (auto& kv : m.named_children()) {
    if (auto* u = dynamic_cast<FsdpUnitImpl*>(kv.value().get()))
      units.push_back({u, prefix + kv.key() + "."});
    else
      collect(*kv.value(), prefix + kv.key() + ".", params, units);
  }
}

int64_t numel_outside_units(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> ps;
  std::vector<Found> us;
  collect(m, "", ps, us);
  int64_t n = 0;
  for (auto& p : ps) n += p.second.numel();
  return n;
}

void apply_wrap(torch::nn::Module& m, const WrapPolicy& policy, int& wrapped) {
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    auto names = seq->named_children();
    TESSERA_CHECK(names.size() == seq->size(), "FSDP auto-wrap: Sequential has ", names.size(), " children but ",
                  seq->size(), " elements");
    size_t i = 0;
    for (auto it = seq->begin(); it != seq->end(); ++it, ++i) {
      auto child = it->ptr();
      if (dynamic_cast<FsdpUnitImpl*>(child.get())) {
        apply_wrap(*child, policy, wrapped);
        continue;
      }
      if (policy(*child, numel_outside_units(*child))) {
        FsdpUnit unit(*it);
        *it = torch::nn::AnyModule(unit);
        seq->replace_module(names[i].key(), unit.ptr());
        ++wrapped;
        continue;
      }
      apply_wrap(*child, policy, wrapped);
    }
    return;
  }
  if (auto* w = dynamic_cast<WrappedModuleImpl*>(&m)) {
    // The wrapped module itself is not in the tree (its children are adopted).
    apply_wrap(*w->wrapped(), policy, wrapped);
    w->refresh_children();
    return;
  }
  for (auto& kv : m.named_children()) apply_wrap(*kv.value(), policy, wrapped);
}

}  // namespace

FsdpStrategy::FsdpStrategy(std::shared_ptr<distributed::Communicator> comm, FsdpOptions options)
    : Strategy(std::move(comm)), options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  impl_->self = this;
  impl_->ctx.strategy = this;
  auto single = distributed::Communicator::create(distributed::World{});
  const int n = comm_->size();
  switch (options_.sharding) {
    case ShardingStrategy::FullShard:
    case ShardingStrategy::ShardGradOp:
      shard_comm_ = comm_;
      replicate_comm_ = single;
      break;
    case ShardingStrategy::NoShard:
      shard_comm_ = single;
      replicate_comm_ = comm_;
      break;
    case ShardingStrategy::HybridShard: {
      int per = options_.ranks_per_node > 0 ? options_.ranks_per_node : comm_->world().local_world_size;
      TESSERA_CHECK(per >= 1 && n % per == 0, "FSDP HYBRID_SHARD: world size ", n,
                    " is not a multiple of ranks_per_node ", per);
      std::vector<std::vector<int>> nodes(n / per), replicas(per);
      for (int r = 0; r < n; ++r) {
        nodes[r / per].push_back(r);
        replicas[r % per].push_back(r);
      }
      const int groups = n / per;
      shard_comm_ = per == 1 ? single : (groups == 1 ? comm_ : comm_->split(nodes));
      replicate_comm_ = groups == 1 ? single : (per == 1 ? comm_ : comm_->split(replicas));
      break;
    }
  }
  auto& I = *impl_;
  const auto& mp = options_.mixed_precision;
  I.ctx.trivial_gather = shard_comm_->size() == 1 && !mp.param_dtype && !options_.cpu_offload;
  I.ctx.grad_path = !(I.ctx.trivial_gather && replicate_comm_->size() == 1 && !mp.reduce_dtype);
}

FsdpStrategy::~FsdpStrategy() {
  for (auto& [w, leaf] : impl_->registered) {
    try {
      if (auto m = w.lock()) state::unregister_sharded_tensor(*m, leaf);
    } catch (...) {
    }
  }
  for (auto& u : impl_->units) {
    if (u->module) u->module->strategy = nullptr;
    for (auto& P : u->params) P->hook.remove();
  }
}

static void register_unit(FsdpStrategy::Impl& I, FsdpUnitImpl& m, bool root) {
  auto st = std::make_unique<FsdpParamGroup>(I.ctx, static_cast<int>(I.units.size()), &m, root);
  std::vector<std::pair<std::string, at::Tensor>> ps;
  std::vector<Found> nested;
  collect(m, "", ps, nested);
  for (auto& [name, p] : ps) {
    auto P = std::make_unique<FsdpParam>();
    P->fqn = name;
    P->p = p;
    st->params.push_back(std::move(P));
  }
  m.strategy = I.self;
  m.unit_index = st->index;
  I.units.push_back(std::move(st));
  I.units.back()->shard();
}

FsdpUnit FsdpStrategy::unit(const std::function<torch::nn::AnyModule()>& build) {
  TESSERA_CHECK(!module_, "FSDP: init_module/unit after setup()");
  FsdpUnit u(build());
  // Nested units built earlier are already registered; only this unit's own params.
  register_unit(*impl_, *u, false);
  return u;
}

torch::nn::AnyModule FsdpStrategy::init_module(const std::function<torch::nn::AnyModule()>& build) {
  return torch::nn::AnyModule(unit(build));
}

torch::nn::AnyModule FsdpStrategy::setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers) {
  TESSERA_CHECK(!module.is_empty(), "FSDP: setup() got an empty module");
  for (auto& o : optimizers) add_optimizer(o);
  auto& I = *impl_;
  std::shared_ptr<FsdpUnitImpl> root = std::dynamic_pointer_cast<FsdpUnitImpl>(module.ptr());
  if (options_.device != c10::Device(c10::kCPU) && !options_.cpu_offload) module.ptr()->to(options_.device);
  if (options_.auto_wrap) {
    int wrapped = 0;
    apply_wrap(*module.ptr(), options_.auto_wrap, wrapped);
    log::debug("FSDP auto-wrap made ", wrapped, " units");
  }
  torch::nn::AnyModule result = module;
  if (!root) {
    FsdpUnit r(module);
    root = r.ptr();
    result = torch::nn::AnyModule(r);
  }
  set_module(root);
  detail::named_params(*root, /*refuse_tied=*/true, "FSDP");
  if (options_.sync_module_states && comm_->size() > 1) {
    at::NoGradGuard ng;
    for (auto& b : root->buffers()) comm_->broadcast(b, 0);
  }
  // Units in pre-order; those made by init_module()/unit() are already sharded.
  std::vector<Found> todo;
  {
    std::vector<std::pair<std::string, at::Tensor>> ps;
    collect(*root, "", ps, todo);
  }
  std::vector<Found> all;
  for (size_t i = 0; i < todo.size(); ++i) {
    all.push_back(todo[i]);
    std::vector<std::pair<std::string, at::Tensor>> ps;
    std::vector<Found> nested;
    collect(*todo[i].unit, "", ps, nested);
    for (auto& f : nested) todo.push_back({f.unit, todo[i].prefix + f.prefix});
  }
  for (auto& f : all) {
    if (f.unit->strategy != this) {
      TESSERA_CHECK(f.unit->strategy == nullptr, "FSDP: unit '", f.prefix, "' belongs to another strategy");
      register_unit(I, *f.unit, false);
    }
    auto& st = *I.units[f.unit->unit_index];
    st.prefix = f.prefix;
    // FQNs relative to the root (unit-local names were used until now).
    for (auto& P : st.params) P->fqn = f.prefix + P->fqn;
  }
  register_unit(I, *root, true);
  register_sharded_params();
  return result;
}

// --- training step helpers --------------------------------------------------------

void FsdpStrategy::optimizer_step(torch::optim::Optimizer& opt) {
  impl_->finalize_if_pending();
  TESSERA_CHECK(!any_gathered(), "FSDP: optimizer_step while parameters are gathered");
  opt.step();
}

StateDictType FsdpStrategy::default_state_dict_type() const {
  // A tensor-parallel model with an uneven cut has no sharded form under FSDP (tp_state.h),
  // nor one under HYBRID_SHARD (a 3-D mesh: its replicated parameters' shard groups are
  // strided inside each replica group, which no file map of the format describes).
  if (module_ && tp_view().any() && replicate_comm_->size() > 1) return StateDictType::Full;
  return module_ && shard_comm_->size() > 1 && tp_view().any_uneven() ? StateDictType::Full : kDefaultStateDictType;
}

double FsdpStrategy::clip_grad_norm(double max_norm, double norm_type) {
  TESSERA_CHECK(module_, "FSDP: clip_grad_norm before setup()");
  auto& I = *impl_;
  I.finalize_if_pending();
  const bool inf = std::isinf(norm_type);
  // Tensor parallelism: the pieces of cut parameters are summed over its group, the
  // replicated parameters (the same shard on every rank of that group) counted once.
  const detail::TpView& tp = tp_view();
  double cut = 0.0, replicated = 0.0;
  std::vector<at::Tensor> grads;
  for (auto& u : I.units)
    for (auto& P : u->params) {
      at::Tensor g = P->p.grad();
      if (!g.defined()) continue;
      grads.push_back(g);
      if (g.numel() == 0) continue;
      at::Tensor gd = g.detach().to(at::kDouble);
      const double part = inf ? gd.abs().max().item<double>() : gd.abs().pow(norm_type).sum().item<double>();
      double& into = tp.is_cut(P->p) ? cut : replicated;
      into = inf ? std::max(into, part) : into + part;
    }
  const double local = tp.combine_norm(cut, replicated, inf);
  double total = local;
  if (shard_comm_->size() > 1)
    total = shard_comm_->all_reduce_double(local, inf ? distributed::ReduceOp::Max : distributed::ReduceOp::Sum);
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    at::NoGradGuard ng;
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

// --- introspection ----------------------------------------------------------------

int FsdpStrategy::num_units() const { return static_cast<int>(impl_->units.size()); }

std::vector<std::vector<std::string>> FsdpStrategy::unit_params() const {
  std::vector<std::vector<std::string>> out;
  for (auto& u : impl_->units) {
    out.emplace_back();
    for (auto& P : u->params) out.back().push_back(P->fqn);
  }
  return out;
}

int64_t FsdpStrategy::local_param_bytes() const {
  int64_t b = 0;
  for (auto& u : impl_->units)
    for (auto& P : u->params) b += P->shard.numel() * static_cast<int64_t>(P->shard.element_size());
  return b;
}

int64_t FsdpStrategy::local_grad_bytes() const {
  int64_t b = 0;
  for (auto& u : impl_->units)
    for (auto& P : u->params) {
      const at::Tensor& g = P->p.grad();
      if (g.defined()) b += g.numel() * static_cast<int64_t>(g.element_size());
    }
  return b;
}

bool FsdpStrategy::any_gathered() const {
  if (impl_->ctx.trivial_gather) return false;
  for (auto& u : impl_->units)
    if (u->sharded_state() != ShardedState::Sharded) return true;
  return false;
}

int64_t FsdpStrategy::prefetches() const { return impl_->prefetch_count; }
int64_t FsdpStrategy::gathers() const { return impl_->ctx.gather_count; }

// --- state dicts ------------------------------------------------------------------

void FsdpStrategy::prepare_state() {
  auto& I = *impl_;
  I.finalize_if_pending();
  for (auto& u : I.units) u->reshard();
}

// Each sharded parameter is registered on its module as a ShardedTensor whose only
// local shard IS the parameter (between steps the parameter holds its shard), so the
// state layer's module and optimizer state dicts see original FQNs and global shapes.
void FsdpStrategy::register_sharded_params() {
  auto& I = *impl_;
  const int S = shard_comm_->size();
  if (S == 1) return;  // parameters are whole: plain tensors
  std::map<std::string, std::shared_ptr<torch::nn::Module>> by_path;
  for (auto& kv : module_->named_modules()) by_path[kv.key()] = kv.value();
  for (auto& u : I.units)
    for (auto& P : u->params) {
      TESSERA_CHECK(!P->shape.empty(), "FSDP: parameter '", P->fqn,
                    "' is 0-dimensional; FSDP shards along dim 0 (make it shape [1])");
      const auto dot = P->fqn.rfind('.');
      const std::string path = dot == std::string::npos ? "" : P->fqn.substr(0, dot);
      const std::string leaf = dot == std::string::npos ? P->fqn : P->fqn.substr(dot + 1);
      auto it = by_path.find(path);
      TESSERA_CHECK(it != by_path.end(), "FSDP: no module at '", path, "' for parameter '", P->fqn, "'");
      // Dim-0 pieces in rank order, sized by the unit's row-aligned cut (fsdp_runtime.cpp),
      // recorded as that rule: no list of every rank's shard (O(ranks) per parameter).
      const sharding::Layout rule = sharding::Layout::flat(u->numel, P->flat_offset, S);
      const int me = shard_comm_->rank();
      const sharding::Box mine = rule.box(P->shape, me);
      TESSERA_CHECK(mine.sizes[0] == P->local_rows && mine.offsets[0] == P->row_begin, "FSDP: parameter '", P->fqn,
                    "': rank ", me, " holds rows [", P->row_begin, ", +", P->local_rows, "), the unit's cut gives it ",
                    mine.to_string());
      I.registered.emplace_back(it->second, leaf);
      state::register_sharded_tensor(
          *it->second, leaf,
          sharding::ShardedTensor::from_rule(sharding::Shard{P->p, sharding::ShardMetadata{mine, {me, P->shard.device()}}},
                                             rule, P->shape, P->shard.scalar_type(), shard_comm_));
    }
}

}  // namespace tessera::strategy
