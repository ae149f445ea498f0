// A tour of the Tessera runtime: start it with `tessera run -n 3 -- runtime_demo`
// (or torchrun / srun / mpirun: the World is read from their environment).
#include <ATen/ATen.h>

#include <iostream>

#include "tessera/core/blas.h"
#include "tessera/distributed/communicator.h"
#include "tessera/sharding/chunk.h"

using namespace tessera;

// OpenBLAS kernels for this CPU, chosen before any library loads (tessera/core/blas.h).
TESSERA_TUNE_BLAS_AT_STARTUP();

int main() {
  distributed::World world = distributed::World::from_env();
  auto comm = distributed::Communicator::create(world);
  const int r = comm->rank(), n = comm->size();
  std::cout << "hello from " << world.describe() << std::endl;

  // Sum across ranks.
  at::Tensor t = at::full({4}, static_cast<float>(r + 1));
  comm->all_reduce(t, distributed::ReduceOp::Sum);

  // Uneven pieces by torch.chunk's rule: 7 rows over n ranks (trailing ranks may hold none).
  std::vector<int64_t> sizes = sharding::chunk_sizes(7, n);
  auto range = sharding::chunk_range(7, n, r);
  at::Tensor mine = at::arange(range.begin, range.begin + range.size, at::kFloat);
  at::Tensor all = comm->all_gather(mine, sizes);

  // Reduce-scatter: each rank receives the sum of its own piece.
  at::Tensor piece = comm->reduce_scatter(at::ones({7}), sizes);

  auto names = comm->all_gather_bytes("rank-" + std::to_string(r));
  comm->barrier();
  if (r == 0) {
    std::cout << "all_reduce(sum of rank+1) = " << t[0].item<float>() << " (expected " << n * (n + 1) / 2 << ")\n";
    std::cout << "all_gather of uneven pieces = [";
    for (int64_t i = 0; i < all.size(0); ++i) std::cout << (i ? ", " : "") << all[i].item<float>();
    std::cout << "]\n";
    std::cout << "peers:";
    for (auto& s : names) std::cout << " " << s;
    std::cout << std::endl;
  }
  std::cout << "rank " << r << " owns " << piece.size(0) << " of 7 rows after reduce_scatter, each = "
            << (piece.numel() ? piece[0].item<float>() : 0.0f) << std::endl;
  return 0;
}
