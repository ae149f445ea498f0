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

state::StateDict TpView::to_local(const state::StateDict& sd) const {
  state::StateDict out = sd;
  for (const auto& p : params_)
    if (out.contains(p.fqn)) out.set(p.fqn, localize(out.at(p.fqn), p.cut, p.fqn));
  return out;
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

state::StateDict TpView::optimizer_to_local(const state::StateDict& sd) const {
  state::StateDict out = sd;
  if (!out.contains(kStateKey)) return out;
  auto per_param = std::make_shared<state::StateDict>(out.dict(kStateKey));
  for (const auto& p : params_) {
    if (!per_param->contains(p.fqn)) continue;
    auto entry = std::make_shared<state::StateDict>(per_param->dict(p.fqn));
    for (const auto& k : std::vector<std::string>(entry->keys())) {
      const state::Value& v = entry->at(k);
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
