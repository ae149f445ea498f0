#include <ATen/ATen.h>

#include <iostream>

#include "tessera/distributed/communicator.h"
#include "tessera/sharding/chunk.h"

int main() {
  auto comm = tessera::distributed::Communicator::create(tessera::distributed::World::from_env());
  at::Tensor t = at::ones({3});
  comm->all_reduce(t);
  std::cout << "consumer ok: world " << comm->size() << " sum " << t.sum().item<float>() << " chunks "
            << tessera::sharding::chunk_sizes(6, 4).size() << std::endl;
  return 0;
}
