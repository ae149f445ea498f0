#include "tessera/parallel/plan.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <vector>

#include "tessera/core/error.h"
#include "tessera/parallel/layers.h"

namespace tessera::parallel {

namespace {

// A planned child: its Sequential, its index there and the replacement.
struct Slot {
  torch::nn::SequentialImpl* seq;
  size_t index;
  std::string name;  // the child's name on the Sequential
  torch::nn::AnyModule replacement;
};

torch::nn::AnyModule twin(const torch::nn::Module& child, TpStyle style, const TensorParallel& tp,
                          const std::string& fqn) {
  if (const auto* lin = dynamic_cast<const torch::nn::LinearImpl*>(&child)) {
    const int64_t in = lin->options.in_features(), out = lin->options.out_features();
    const bool bias = lin->options.bias();
    if (style == TpStyle::Colwise) {
      ColumnParallelLinear m(in, out, tp, bias, /*stripes=*/1, /*seq_dim=*/1, /*draw=*/false);
      m->assign(lin->weight, bias ? lin->bias : at::Tensor());
      return torch::nn::AnyModule(m);
    }
    RowParallelLinear m(in, out, tp, bias, /*seq_dim=*/1, /*draw=*/false);
    m->assign(lin->weight, bias ? lin->bias : at::Tensor());
    return torch::nn::AnyModule(m);
  }
  if (const auto* emb = dynamic_cast<const torch::nn::EmbeddingImpl*>(&child)) {
    TESSERA_CHECK(style == TpStyle::Colwise, "parallelize: '", fqn,
                  "' is an Embedding; only Colwise (its rows, the vocabulary) cuts one");
    VocabParallelEmbedding m(emb->weight.size(0), emb->weight.size(1), tp, /*seq_dim=*/1, /*draw=*/false);
    m->assign(emb->weight);
    return torch::nn::AnyModule(m);
  }
  throw Error(concat("parallelize: '", fqn, "' is a ", child.name(), "; a plan cuts torch::nn::Linear (Colwise, ",
                     "Rowwise) and torch::nn::Embedding (Colwise)"));
}

// Every Sequential element under `m` by FQN.
void find_slots(torch::nn::Module& m, const std::string& prefix, const std::map<std::string, TpStyle>& plan,
                const TensorParallel& tp, std::vector<Slot>& out, std::map<std::string, bool>& found) {
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    auto names = seq->named_children();
    size_t i = 0;
    for (auto it = seq->begin(); it != seq->end() && i < names.size(); ++it, ++i) {
      const std::string fqn = prefix + names[i].key();
      auto p = plan.find(fqn);
      if (p != plan.end()) {
        out.push_back({seq, i, names[i].key(), twin(*it->ptr(), p->second, tp, fqn)});
        found[fqn] = true;
      } else {
        find_slots(*it->ptr(), fqn + ".", plan, tp, out, found);
      }
    }
    return;
  }
  for (auto& kv : m.named_children()) {
    const std::string fqn = prefix + kv.key();
    if (plan.count(fqn))
      throw Error(concat("parallelize: '", fqn, "' is not an element of a torch::nn::Sequential (libtorch modules ",
                         "have no forward hooks, so only a Sequential's slot can be replaced); build it with the ",
                         "tensor-parallel modules (tessera/parallel/layers.h) instead"));
    find_slots(*kv.value(), fqn + ".", plan, tp, out, found);
  }
}

}  // namespace

int parallelize(torch::nn::Module& root, const std::map<std::string, TpStyle>& plan, const TensorParallel& tp) {
  std::vector<Slot> slots;
  std::map<std::string, bool> found;
  find_slots(root, "", plan, tp, slots, found);  // throws before anything is replaced
  for (const auto& kv : plan)
    TESSERA_CHECK(found.count(kv.first), "parallelize: the plan names '", kv.first, "', which is not a module of the model");
  for (auto& s : slots) {
    auto it = s.seq->begin() + static_cast<std::ptrdiff_t>(s.index);
    *it = s.replacement;
    s.seq->replace_module(s.name, s.replacement.ptr());
  }
  return static_cast<int>(slots.size());
}

}  // namespace tessera::parallel
