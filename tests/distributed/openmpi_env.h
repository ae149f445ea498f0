// What mpirun (Open MPI 4.x/5.x) sets for one rank, for the tests that parse it
// (test_world.cpp) and those that start real ranks under it (test_launcher_env.cpp).
#pragma once
#include <map>
#include <string>

namespace tessera::testing {

// Rank `rank` of `size`, `per_node` ranks on each host (mapping by slot, the default), plus
// the rendezvous address the user exports with -x. OMPI_COMM_WORLD_NODE_RANK is the rank
// among all jobs' processes on the host (here equal to the local rank), not the host's index.
inline std::map<std::string, std::string> openmpi_env(int rank, int size, int per_node,
                                                      const std::string& master_addr, int master_port) {
  const int local = rank % per_node;
  return {{"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(per_node)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local)},
          {"OMPI_COMM_WORLD_NODE_RANK", std::to_string(local)},
          {"OMPI_UNIVERSE_SIZE", std::to_string(size)},
          {"MASTER_ADDR", master_addr},
          {"MASTER_PORT", std::to_string(master_port)}};
}

}  // namespace tessera::testing
