#include "tessera/parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "tessera/core/error.h"
#include "tessera/parallel/mesh.h"

namespace tessera::parallel {

TensorParallel TensorParallel::from_mesh(const DeviceMesh& mesh, const std::string& dim, bool sequence_parallel) {
  TensorParallel tp;
  tp.comm = mesh.comm(dim);
  tp.sequence_parallel = sequence_parallel;
  return tp;
}

// --- TpCut -----------------------------------------------------------------------

void TpCut::validate(const std::string& what) const {
  const int64_t nd = static_cast<int64_t>(global_shape.size());
  TESSERA_CHECK(dim >= 0 && dim < nd, what, ": cut dimension ", dim, " outside a tensor of ", nd, " dimensions");
  TESSERA_CHECK(pieces >= 1 && index >= 0 && index < pieces, what, ": piece ", index, " of ", pieces);
  TESSERA_CHECK(stripes >= 1 && global_shape[dim] % stripes == 0, what, ": dimension ", dim, " of size ",
                global_shape[dim], " is not ", stripes, " equal stripes");
}

std::vector<sharding::Range> TpCut::ranges(int i) const {
  const int64_t stripe = global_shape.at(dim) / stripes;
  std::vector<sharding::Range> out;
  for (int64_t s = 0; s < stripes; ++s) {
    sharding::Range r = sharding::chunk_range(stripe, pieces, i);
    r.begin += s * stripe;
    out.push_back(r);
  }
  return out;
}

std::vector<int64_t> TpCut::local_shape(int i) const {
  std::vector<int64_t> shape = global_shape;
  shape[dim] = 0;
  for (const auto& r : ranges(i)) shape[dim] += r.size;
  return shape;
}

at::Tensor TpCut::piece_of(const at::Tensor& global, int i) const {
  TESSERA_CHECK(global.sizes().vec() == global_shape, "TpCut::piece_of: tensor of shape ", global.sizes(),
                " for a cut of ", describe());
  std::vector<at::Tensor> parts;
  for (const auto& r : ranges(i)) parts.push_back(global.narrow(dim, r.begin, r.size));
  return parts.size() == 1 ? parts[0].contiguous() : at::cat(parts, dim);
}

at::Tensor TpCut::assemble(const std::vector<at::Tensor>& pieces_in) const {
  TESSERA_CHECK(static_cast<int>(pieces_in.size()) == pieces, "TpCut::assemble: ", pieces_in.size(), " pieces for ",
                describe());
  std::vector<at::Tensor> parts;
  for (int64_t s = 0; s < stripes; ++s)
    for (int i = 0; i < pieces; ++i) {
      const sharding::Range r = ranges(i)[s];
      TESSERA_CHECK(pieces_in[i].sizes().vec() == local_shape(i), "TpCut::assemble: piece ", i, " has shape ",
                    pieces_in[i].sizes(), " for ", describe());
      parts.push_back(pieces_in[i].narrow(dim, s * r.size, r.size));
    }
  return at::cat(parts, dim);
}

std::string TpCut::describe() const {
  return concat("dim ", dim, stripes > 1 ? concat(", ", stripes, " stripes") : std::string(), ", piece ", index, " of ",
                pieces, " of ", at::IntArrayRef(global_shape));
}

std::vector<TpParam> named_tp_params(
    const torch::nn::Module& root, const std::function<const torch::nn::Module*(const torch::nn::Module&)>& inner) {
  std::vector<TpParam> out;
  std::function<void(const torch::nn::Module&, const std::string&)> visit = [&](const torch::nn::Module& m,
                                                                               const std::string& prefix) {
    const torch::nn::Module* self = &m;
    if (inner)
      while (const torch::nn::Module* in = inner(*self)) self = in;
    if (const auto* tpm = dynamic_cast<const TensorParallelModule*>(self))
      for (auto& [name, cut] : tpm->tp_cuts()) out.push_back({prefix + name, cut, tpm->tensor_parallel().comm});
    for (const auto& child : m.named_children()) visit(*child.value(), prefix + child.key() + ".");
  };
  visit(root, "");
  return out;
}

// --- region operators --------------------------------------------------------------

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t pack(distributed::Communicator* c) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(c)); }
distributed::Communicator& unpack(AutogradContext* ctx) {
  return *reinterpret_cast<distributed::Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
}

at::Tensor all_reduced(const at::Tensor& x, distributed::Communicator& c) {
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  c.all_reduce(out);
  return out;
}

at::Tensor gathered(const at::Tensor& x, int64_t dim, distributed::Communicator& c) {
  at::Tensor front = x.movedim(dim, 0).contiguous();
  at::Tensor all = c.all_gather(front, std::vector<int64_t>(c.size(), front.size(0)));
  return all.movedim(0, dim).contiguous();
}

at::Tensor reduce_scattered(const at::Tensor& x, int64_t dim, distributed::Communicator& c) {
  at::Tensor front = x.movedim(dim, 0).contiguous();
  TESSERA_CHECK(front.size(0) % c.size() == 0, "tensor parallel: the sequence dimension ", dim, " of size ",
                front.size(0), " does not divide over ", c.size(), " ranks");
  at::Tensor mine = c.reduce_scatter(front, std::vector<int64_t>(c.size(), front.size(0) / c.size()));
  return mine.movedim(0, dim).contiguous();
}

at::Tensor own_slice(const at::Tensor& x, int64_t dim, distributed::Communicator& c) {
  const int64_t n = x.size(dim);
  TESSERA_CHECK(n % c.size() == 0, "tensor parallel: the sequence dimension ", dim, " of size ", n,
                " does not divide over ", c.size(), " ranks");
  return x.narrow(dim, c.rank() * (n / c.size()), n / c.size()).contiguous();
}

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduced(g[0], unpack(ctx)), at::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t comm) {
    return all_reduced(x, *reinterpret_cast<distributed::Communicator*>(static_cast<intptr_t>(comm)));
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

// A sequence-dimension operator: `Forward` in the forward pass, `Backward` (its conjugate)
// on the gradient.
using SequenceFn = at::Tensor (*)(const at::Tensor&, int64_t, distributed::Communicator&);
template <SequenceFn Forward, SequenceFn Backward>
struct SequenceOp : torch::autograd::Function<SequenceOp<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["dim"] = dim;
    return Forward(x, dim, unpack(ctx));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {Backward(g[0], ctx->saved_data["dim"].toInt(), unpack(ctx)), at::Tensor(), at::Tensor()};
  }
};
using GatherSequence = SequenceOp<gathered, reduce_scattered>;
using ReduceScatterSequence = SequenceOp<reduce_scattered, gathered>;
using SplitSequence = SequenceOp<own_slice, gathered>;

int64_t seq_dim(const at::Tensor& x, int64_t dim) {
  const int64_t nd = x.dim();
  const int64_t d = dim < 0 ? dim + nd : dim;
  TESSERA_CHECK(d >= 0 && d < nd, "tensor parallel: sequence dimension ", dim, " outside a tensor of ", nd,
                " dimensions");
  return d;
}

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x, const TensorParallel& tp) {
  return tp.enabled() ? CopyToTp::apply(x, pack(tp.comm.get())) : x;
}
at::Tensor reduce_from_tp(const at::Tensor& x, const TensorParallel& tp) {
  return tp.enabled() ? ReduceFromTp::apply(x, pack(tp.comm.get())) : x;
}
at::Tensor gather_sequence(const at::Tensor& x, int64_t dim, const TensorParallel& tp) {
  return tp.enabled() ? GatherSequence::apply(x, seq_dim(x, dim), pack(tp.comm.get())) : x;
}
at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const TensorParallel& tp) {
  return tp.enabled() ? ReduceScatterSequence::apply(x, seq_dim(x, dim), pack(tp.comm.get())) : x;
}
at::Tensor split_sequence(const at::Tensor& x, int64_t dim, const TensorParallel& tp) {
  return tp.enabled() ? SplitSequence::apply(x, seq_dim(x, dim), pack(tp.comm.get())) : x;
}
at::Tensor reduce_grad_over_tp(const at::Tensor& param, const TensorParallel& tp) { return copy_to_tp(param, tp); }

}  // namespace tessera::parallel
