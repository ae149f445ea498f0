#include "tessera/strategy/tp_state.h"

#include <ATen/ATen.h>

#include "tessera/core/error.h"
#include "tessera/strategy/strategy.h"

namespace tessera::strategy::detail {

TpView::TpView(const torch::nn::Module& root) {
  params_ = parallel::named_tp_params(root, [](const torch::nn::Module& m) -> const torch::nn::Module* {
    const auto* w = dynamic_cast<const WrappedModuleImpl*>(&m);
    return w ? w->wrapped().get() : nullptr;
  });
  std::string first;
  for (const auto& p : params_) {
    if (!p.comm || p.comm->size() == 1) continue;
    if (!comm_) {
      comm_ = p.comm;
      first = p.fqn;
    }
    TESSERA_CHECK(p.comm == comm_, "tensor parallel: '", first, "' and '", p.fqn,
                  "' are cut over different groups; a model has one tensor-parallel group");
  }
  if (!comm_) {
    params_.clear();
    return;
  }
  auto named = root.named_parameters();
  for (const auto& p : params_) {
    const at::Tensor* t = named.find(p.fqn);
    TESSERA_CHECK(t != nullptr, "tensor parallel: the cut parameter '", p.fqn, "' is not a parameter of the model");
    impls_.insert(t->unsafeGetTensorImpl());
  }
}

at::Tensor TpView::gather(const at::Tensor& local, const parallel::TpCut& cut) const {
  TESSERA_CHECK(local.sizes().vec() == cut.local_shape(), "tensor parallel: a piece of shape ", local.sizes(),
                " for ", cut.describe());
  std::vector<int64_t> sizes;
  for (int i = 0; i < cut.pieces; ++i) sizes.push_back(cut.local_shape(i)[cut.dim]);
  at::Tensor all = comm_->all_gather(local.movedim(cut.dim, 0).contiguous(), sizes);
  std::vector<at::Tensor> pieces;
  int64_t at_row = 0;
  for (int i = 0; i < cut.pieces; ++i) {
    pieces.push_back(all.narrow(0, at_row, sizes[i]).movedim(0, cut.dim));
    at_row += sizes[i];
  }
  return cut.assemble(pieces);
}

at::Tensor TpView::localize(const state::Value& v, const parallel::TpCut& cut, const std::string& key) const {
  at::Tensor full;
  if (const auto* t = std::get_if<at::Tensor>(&v))
    full = *t;
  else if (const auto* st = std::get_if<sharding::ShardedTensor>(&v))
    full = st->full_tensor();
  else
    throw Error(concat("tensor parallel: '", key, "' holds a ", state::kind_name(v), ", not a tensor"));
  TESSERA_CHECK(full.sizes().vec() == cut.global_shape, "tensor parallel: '", key, "' has shape ", full.sizes(),
                " but the model's tensor is ", at::IntArrayRef(cut.global_shape));
  return cut.local_of(full);
}

void TpView::to_global(state::StateDict& sd) const {
  for (const auto& p : params_)
    if (sd.contains(p.fqn)) sd.set(p.fqn, gather(sd.tensor(p.fqn), p.cut));
}

namespace {
constexpr const char* kStateKey = "state";
}

void TpView::optimizer_to_global(state::StateDict& sd) const {
  if (!sd.contains(kStateKey)) return;
  state::StateDict& per_param = sd.dict(kStateKey);
  for (const auto& p : params_) {
    if (!per_param.contains(p.fqn)) continue;
    state::StateDict& entry = per_param.dict(p.fqn);
    const std::vector<int64_t> local_shape = p.cut.local_shape();
    for (const auto& k : std::vector<std::string>(entry.keys())) {
      const auto* t = std::get_if<at::Tensor>(&entry.at(k));
      if (t && t->sizes().vec() == local_shape) entry.set(k, gather(*t, p.cut));
    }
  }
}

// --- sharded state dicts: the 2-D form -------------------------------------------

namespace {

// The stripes of `data` (this rank's part of a TP-local tensor: box `have` of the local
// shape) as the local shards of holder `holder` of the Tp layout L, held by rank `rank` of
// the layout's communicator: views, one per stripe, empty ones included.
std::vector<sharding::Shard> stripe_shards(const at::Tensor& data, const sharding::Box& have, const sharding::Layout& L,
                                           const parallel::TpCut& cut, int64_t holder, int rank) {
  const size_t d = static_cast<size_t>(cut.dim);
  const int64_t rs = cut.local_shape()[d] / cut.stripes;
  std::vector<sharding::Shard> out;
  for (int64_t s = 0; s < cut.stripes; ++s) {
    const int64_t lo = std::max(have.offsets[d], s * rs), hi = std::min(have.offsets[d] + have.sizes[d], (s + 1) * rs);
    // A stripe this rank's rows miss (FSDP's piece ends before it, or begins after it):
    // an empty view at the start, not past the data's end.
    const int64_t len = std::max<int64_t>(0, hi - lo);
    at::Tensor part = data.narrow(cut.dim, len > 0 ? lo - have.offsets[d] : 0, len);
    out.push_back({part, sharding::ShardMetadata{L.box(cut.global_shape, holder * cut.stripes + s), {rank, data.device()}}});
  }
  return out;
}

bool uneven(const parallel::TpCut& cut) {
  for (int i = 1; i < cut.pieces; ++i)
    if (cut.local_shape(i) != cut.local_shape(0)) return true;
  return false;
}

}  // namespace

bool TpView::any_uneven() const {
  for (const auto& p : params_)
    if (uneven(p.cut)) return true;
  return false;
}

std::optional<state::Value> TpView::to_2d(const state::Value& v, const parallel::TpParam& p,
                                          const std::shared_ptr<distributed::Communicator>& world,
                                          const std::shared_ptr<distributed::Communicator>& dp) const {
  const parallel::TpCut& cut = p.cut;
  const std::vector<int64_t> local_shape = cut.local_shape();
  if (const auto* t = std::get_if<at::Tensor>(&v)) {
    if (t->sizes().vec() != local_shape) return std::nullopt;
    // Whole on this rank: the tensor-parallel group's ranks are the holders.
    const sharding::Layout L = sharding::Layout::tensor_parallel(cut.dim, cut.stripes, cut.pieces, sharding::Layout::whole(0));
    return sharding::ShardedTensor::from_rule(
        stripe_shards(*t, sharding::full_box(local_shape), L, cut, cut.index, p.comm->rank()), L, cut.global_shape,
        t->scalar_type(), p.comm);
  }
  const auto* st = std::get_if<sharding::ShardedTensor>(&v);
  if (!st || st->shape() != local_shape || !st->layout() || st->layout()->rule != sharding::Layout::Rule::Flat ||
      st->comm() != dp || st->local_shards().size() != 1)
    return std::nullopt;
  // FSDP over dp: the mesh's ranks are the holders, holder p·tp + t.
  TESSERA_CHECK(!uneven(cut), "tensor parallel: a sharded state dict of '", p.fqn, "' (", cut.describe(),
                ", pieces of unequal size) under FSDP over ", dp->size(),
                " ranks is not supported: FSDP then cuts the replicated parameters differently on each tensor-",
                "parallel rank; use StateDictType::Full");
  TESSERA_CHECK(world && world->size() == dp->size() * cut.pieces && world->rank() == dp->rank() * cut.pieces + cut.index,
                "tensor parallel: a sharded state dict of '", p.fqn,
                "' under FSDP needs the mesh's world communicator, dp-major (world rank = dp rank x tp + tp rank: ",
                dp->rank(), " x ", cut.pieces, " + ", cut.index, "), got ",
                world ? concat("rank ", world->rank(), " of ", world->size()) : std::string("none"),
                " (StrategyOptions::mesh_world; Fabric sets it)");
  const sharding::Layout& f = *st->layout();
  const sharding::Layout L = sharding::Layout::tensor_parallel(
      cut.dim, cut.stripes, cut.pieces, sharding::Layout::flat(f.flat_numel, f.flat_offset, dp->size()));
  const sharding::Shard& mine = st->local_shards()[0];
  return sharding::ShardedTensor::from_rule(stripe_shards(mine.tensor, mine.meta.box, L, cut, world->rank(), world->rank()),
                                            L, cut.global_shape, st->dtype(), world);
}

std::optional<state::Value> TpView::from_2d(const state::Value& v, const parallel::TpParam& p,
                                            const std::shared_ptr<distributed::Communicator>& dp) const {
  const auto* st = std::get_if<sharding::ShardedTensor>(&v);
  if (!st || !st->layout() || st->layout()->rule != sharding::Layout::Rule::Tp) return std::nullopt;
  const sharding::Layout& L = *st->layout();
  const parallel::TpCut& cut = p.cut;
  if (L.dim != cut.dim || L.stripes != cut.stripes || L.tp != cut.pieces || st->shape() != cut.global_shape ||
      static_cast<int64_t>(st->local_shards().size()) != cut.stripes)
    return std::nullopt;
  const bool whole = L.inner == sharding::Layout::Rule::Whole;
  if (whole ? st->comm() != p.comm : L.inner != sharding::Layout::Rule::Flat || !dp || L.pieces != dp->size())
    return std::nullopt;
  std::vector<at::Tensor> parts;
  for (const auto& sh : st->local_shards()) parts.push_back(sh.tensor);
  at::Tensor data = at::cat(parts, cut.dim);
  if (whole) return data;
  const sharding::Layout f = L.tp_inner(cut.index);
  const sharding::Box box = f.box(cut.local_shape(), dp->rank());
  return sharding::ShardedTensor::from_rule(sharding::Shard{data, sharding::ShardMetadata{box, {dp->rank(), data.device()}}},
                                            f, cut.local_shape(), st->dtype(), dp);
}

state::Value TpView::local_value(const state::Value& v, const parallel::TpParam& p, const std::string& key,
                                 const std::shared_ptr<distributed::Communicator>& dp) const {
  if (auto r = from_2d(v, p, dp)) return *r;
  return localize(v, p.cut, key);
}

void TpView::to_sharded(state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& world,
                        const std::shared_ptr<distributed::Communicator>& dp) const {
  for (const auto& p : params_) {
    if (!sd.contains(p.fqn)) continue;
    auto r = to_2d(sd.at(p.fqn), p, world, dp);
    if (!r) {
      const auto* st = std::get_if<sharding::ShardedTensor>(&sd.at(p.fqn));
      TESSERA_CHECK(!st || !dp || st->comm() == dp || st->comm()->size() == dp->size(), "tensor parallel: '", p.fqn,
                    "' is sharded over ", st->comm()->size(), " of the ", dp->size(),
                    " data-parallel ranks (FSDP's HYBRID_SHARD: a (replicate, shard, tp) mesh), whose sharded state ",
                    "has no checkpoint form yet; use StateDictType::Full");
    }
    TESSERA_CHECK(r.has_value(), "tensor parallel: '", p.fqn, "' holds a ", state::kind_name(sd.at(p.fqn)),
                  " that is not this rank's piece (", p.cut.describe(), ")");
    sd.set(p.fqn, *r);
  }
}

void TpView::optimizer_to_sharded(state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& world,
                                  const std::shared_ptr<distributed::Communicator>& dp) const {
  if (!sd.contains(kStateKey)) return;
  state::StateDict& per_param = sd.dict(kStateKey);
  for (const auto& p : params_) {
    if (!per_param.contains(p.fqn)) continue;
    state::StateDict& entry = per_param.dict(p.fqn);
    for (const auto& k : std::vector<std::string>(entry.keys()))
      if (auto r = to_2d(entry.at(k), p, world, dp)) entry.set(k, *r);
  }
}

state::StateDict TpView::to_local(const state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& dp) const {
  state::StateDict out = sd;
  for (const auto& p : params_)
    if (out.contains(p.fqn)) out.set(p.fqn, local_value(out.at(p.fqn), p, p.fqn, dp));
  return out;
}

state::StateDict TpView::optimizer_to_local(const state::StateDict& sd,
                                                const std::shared_ptr<distributed::Communicator>& dp) const {
  state::StateDict out = sd;
  if (!out.contains(kStateKey)) return out;
  auto per_param = std::make_shared<state::StateDict>(out.dict(kStateKey));
  for (const auto& p : params_) {
    if (!per_param->contains(p.fqn)) continue;
    auto entry = std::make_shared<state::StateDict>(per_param->dict(p.fqn));
    for (const auto& k : std::vector<std::string>(entry->keys())) {
      const state::Value& v = entry->at(k);
      if (auto r = from_2d(v, p, dp)) {
        entry->set(k, *r);
        continue;
      }
      std::vector<int64_t> shape;
      if (const auto* t = std::get_if<at::Tensor>(&v)) shape = t->sizes().vec();
      if (const auto* st = std::get_if<sharding::ShardedTensor>(&v)) shape = st->shape();
      if (shape == p.cut.global_shape) entry->set(k, localize(v, p.cut, concat(kStateKey, ".", p.fqn, ".", k)));
    }
    per_param->set(p.fqn, entry);
  }
  out.set(kStateKey, per_param);
  return out;
}

double TpView::combine_norm(double cut_part, double replicated_part, bool inf) const {
  if (!any()) return inf ? std::max(cut_part, replicated_part) : cut_part + replicated_part;
  const double cut_total = comm_->all_reduce_double(cut_part, inf ? distributed::ReduceOp::Max : distributed::ReduceOp::Sum);
  return inf ? std::max(cut_total, replicated_part) : cut_total + replicated_part;
}

}  // namespace tessera::strategy::detail
