// A checkpoint-only tool that links one layer (Tessera::tessera_checkpoint) instead of
// Tessera::tessera: it saves and loads through a Communicator (test_install.cpp runs it).
#include <ATen/ATen.h>

#include <iostream>
#include <string>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/distributed/communicator.h"
#include "tessera/state/state_dict.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: ckpt_tool DIR\n";
    return 2;
  }
  auto comm = tessera::distributed::Communicator::create(tessera::distributed::World::from_env());
  tessera::state::StateDict sd;
  sd.set("w", at::arange(6, at::kFloat));
  tessera::checkpoint::save(sd, argv[1], *comm);
  tessera::state::StateDict back;
  back.set("w", at::zeros({6}, at::kFloat));
  tessera::checkpoint::load(back, argv[1], *comm);
  std::cout << "ckpt_tool ok: sum " << back.tensor("w").sum().item<float>() << std::endl;
  return 0;
}
