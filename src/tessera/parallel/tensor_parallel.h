// Tensor parallelism's vocabulary (docs/tensor-parallel.md): the group a model is cut
// over, how one parameter is cut (TpCut), the interface a tensor-parallel module offers
// the strategies (which of its parameters are cut, and how), and the region operators
// that move activations between the layouts, Megatron's conjugate pairs:
//
//   operator                  forward                      backward
//   copy_to_tp                identity                     all-reduce (sum)
//   reduce_from_tp            all-reduce (sum)             identity
//   gather_sequence           all-gather along a dim       reduce-scatter along it
//   reduce_scatter_sequence   reduce-scatter along a dim   all-gather along it
//   split_sequence            this rank's slice            all-gather along it
//   reduce_grad_over_tp       identity                     all-reduce (sum)
//
// The last one wraps a replicated parameter used inside a sequence-parallel region (a
// norm's weight): each rank sees 1/tp of the sequence and so holds a partial gradient.
// Each operator is one collective over the group, and none for a group of one.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/sharding/chunk.h"

namespace tessera::parallel {

class DeviceMesh;

// The tensor-parallel group of a model and whether sequence parallelism is on.
struct TensorParallel {
  std::shared_ptr<distributed::Communicator> comm;  // null: no tensor parallelism
  bool sequence_parallel = false;
  int size() const { return comm ? comm->size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
  bool enabled() const { return size() > 1; }
  // The mesh's dimension `dim` (sequence parallelism on unless told otherwise).
  static TensorParallel from_mesh(const DeviceMesh& mesh, const std::string& dim = "tp",
                                  bool sequence_parallel = true);
};

// How one parameter of global shape `global_shape` is cut over `pieces` ranks: dimension
// `dim` is `stripes` equal stripes (a fused weight: qkv's q, k and v), each stripe is cut
// by torch.chunk's rule into `pieces` ranges, and piece i is the i-th range of every
// stripe, concatenated in stripe order. stripes = 1 is a plain cut along `dim`.
struct TpCut {
  int64_t dim = 0;
  int64_t stripes = 1;
  std::vector<int64_t> global_shape;
  int pieces = 1;
  int index = 0;  // the piece this rank holds

  // Checks the cut against its shape (throws naming `what`).
  void validate(const std::string& what) const;
  // The ranges along `dim` piece i covers, one per stripe (empty ones included).
  std::vector<sharding::Range> ranges(int i) const;
  std::vector<int64_t> local_shape(int i) const;
  std::vector<int64_t> local_shape() const { return local_shape(index); }
  // Piece i of a tensor of the global shape (a new contiguous tensor).
  at::Tensor piece_of(const at::Tensor& global, int i) const;
  at::Tensor local_of(const at::Tensor& global) const { return piece_of(global, index); }
  // The global tensor from every piece, in piece order (the inverse of piece_of).
  at::Tensor assemble(const std::vector<at::Tensor>& pieces) const;
  bool operator==(const TpCut& o) const {
    return dim == o.dim && stripes == o.stripes && global_shape == o.global_shape && pieces == o.pieces &&
           index == o.index;
  }
  // "dim 0, 3 stripes, piece 1 of 2".
  std::string describe() const;
};

// A module some of whose parameters are cut over a tensor-parallel group. The strategies
// ask it (through named_tp_params) which parameters are pieces of larger tensors: for the
// gradient norm, and to give state dicts the global tensors under the plain model's names.
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  // Each cut parameter of this module itself, by its name on the module ("weight").
  virtual std::vector<std::pair<std::string, TpCut>> tp_cuts() const = 0;
  virtual const TensorParallel& tensor_parallel() const = 0;
};

// A cut parameter found under a module: its FQN, its cut and the group it is cut over.
struct TpParam {
  std::string fqn;
  TpCut cut;
  std::shared_ptr<distributed::Communicator> comm;
};
// Every cut parameter under `root`, in module order. `inner`, when given, maps a module
// to the one it wraps (or null): a wrapper that registers its inner module's parameters
// as its own (the strategies' WrappedModule and FsdpUnit) is looked through.
std::vector<TpParam> named_tp_params(
    const torch::nn::Module& root,
    const std::function<const torch::nn::Module*(const torch::nn::Module&)>& inner = nullptr);

// --- region operators (table above); `dim` is the sequence dimension of `x` ---
at::Tensor copy_to_tp(const at::Tensor& x, const TensorParallel& tp);
at::Tensor reduce_from_tp(const at::Tensor& x, const TensorParallel& tp);
// The sequence length along `dim` must be divisible by the group size for split, and is
// then the same on every rank for gather and reduce-scatter.
at::Tensor gather_sequence(const at::Tensor& x, int64_t dim, const TensorParallel& tp);
at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const TensorParallel& tp);
at::Tensor split_sequence(const at::Tensor& x, int64_t dim, const TensorParallel& tp);
at::Tensor reduce_grad_over_tp(const at::Tensor& param, const TensorParallel& tp);

}  // namespace tessera::parallel
