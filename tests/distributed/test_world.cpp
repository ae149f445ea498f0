#include <gtest/gtest.h>

#include <map>

#include "distributed/openmpi_env.h"
#include "tessera/core/error.h"
#include "tessera/distributed/world.h"

using tessera::distributed::World;

namespace {
World parse(const std::map<std::string, std::string>& env) {
  return World::from_lookup([&](const std::string& k) -> std::optional<std::string> {
    auto it = env.find(k);
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const std::map<std::string, std::string>& env) {
  try {
    parse(env);
  } catch (const tessera::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(World, SingleProcessWhenNothingIsSet) {
  World w = parse({});
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.world_size, 1);
  EXPECT_FALSE(w.is_distributed());
  EXPECT_EQ(w.source, "single");
}

TEST(World, Torchrun) {
  World w = parse({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                   {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"},
                   {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.num_nodes, 2);
  EXPECT_EQ(w.master_addr, "10.0.0.1");
  EXPECT_EQ(w.master_port, 29400);
  EXPECT_TRUE(w.agent_store);
}

TEST(World, TorchrunDefaultsLocalFromGlobal) {
  World w = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.node_rank, 0);
}

TEST(World, Slurm) {
  World w = parse({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
                   {"SLURM_NTASKS_PER_NODE", "4(x2)"}, {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"},
                   {"SLURM_NODELIST", "gpu[017-018,020],cpu1"}, {"SLURM_JOB_ID", "4242"}});
  EXPECT_EQ(w.source, "slurm");
  EXPECT_EQ(w.rank, 6);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_rank, 2);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.master_addr, "gpu017");
  EXPECT_EQ(w.master_port, 15000 + 4242);
}

TEST(World, SlurmEnvOverridesDerivedMaster) {
  World w = parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODELIST", "a,b"},
                   {"SLURM_JOB_ID", "123456"}, {"MASTER_ADDR", "x"}, {"MASTER_PORT", "999"}});
  EXPECT_EQ(w.master_addr, "x");
  EXPECT_EQ(w.master_port, 999);
}

TEST(World, SlurmFirstHost) {
  EXPECT_EQ(tessera::distributed::slurm_first_host("node[03-05,9],other"), "node03");
  EXPECT_EQ(tessera::distributed::slurm_first_host("alpha,beta"), "alpha");
  EXPECT_EQ(tessera::distributed::slurm_first_host("solo"), "solo");
}

TEST(World, OpenMPI) {
  World w = parse({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                   {"MASTER_ADDR", "h0"}, {"MASTER_PORT", "5000"}});
  EXPECT_EQ(w.source, "openmpi");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.num_nodes, 2);
}

// The variables mpirun sets for each rank of `mpirun -n SIZE prog`, PER_NODE on a host.
static std::map<std::string, std::string> mpirun_env(int rank, int size, int per_node) {
  return tessera::testing::openmpi_env(rank, size, per_node, "h0", 5000);
}

TEST(World, OpenMPIOneHostTwoRanks) {
  for (int r = 0; r < 2; ++r) {
    World w = parse(mpirun_env(r, 2, 2));
    EXPECT_EQ(w.source, "openmpi");
    EXPECT_EQ(w.rank, r);
    EXPECT_EQ(w.world_size, 2);
    EXPECT_EQ(w.local_rank, r);
    EXPECT_EQ(w.local_world_size, 2);
    EXPECT_EQ(w.node_rank, 0) << w.describe();
    EXPECT_EQ(w.num_nodes, 1) << w.describe();
  }
}

// `mpirun -n 4 --host a:2,b:2 prog`: ranks 0,1 on a, 2,3 on b (mapping by slot, the
// default); on b, NODE_RANK and LOCAL_RANK are 0 and 1 again.
TEST(World, OpenMPITwoHostsOfTwoRanks) {
  for (int r = 0; r < 4; ++r) {
    World w = parse(mpirun_env(r, 4, 2));
    EXPECT_EQ(w.rank, r);
    EXPECT_EQ(w.local_rank, r % 2);
    EXPECT_EQ(w.local_world_size, 2);
    EXPECT_EQ(w.node_rank, r / 2) << w.describe();
    EXPECT_EQ(w.num_nodes, 2) << w.describe();
  }
}

TEST(World, OpenMPILayoutsWithoutANodeIndexAreRefusedNamingTheVariables) {
  // 3 ranks on two hosts (2 + 1): no common ranks-per-node.
  auto uneven = mpirun_env(0, 3, 2);
  const std::string e1 = error_of(uneven);
  EXPECT_NE(e1.find("OMPI_COMM_WORLD_LOCAL_SIZE=2, OMPI_COMM_WORLD_SIZE=3"), std::string::npos) << e1;
  EXPECT_NE(e1.find("same number of ranks on every node"), std::string::npos) << e1;
  // --map-by node: rank 1 is the first rank of the second host.
  auto by_node = mpirun_env(1, 4, 2);
  by_node["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
  by_node["OMPI_COMM_WORLD_NODE_RANK"] = "0";
  const std::string e2 = error_of(by_node);
  EXPECT_NE(e2.find("OMPI_COMM_WORLD_RANK=1 has OMPI_COMM_WORLD_LOCAL_RANK=0"), std::string::npos) << e2;
  EXPECT_NE(e2.find("--map-by node"), std::string::npos) << e2;
  auto too_many = mpirun_env(0, 2, 2);
  too_many["OMPI_COMM_WORLD_LOCAL_SIZE"] = "4";
  EXPECT_NE(error_of(too_many).find("OMPI_COMM_WORLD_LOCAL_SIZE=4 exceeds OMPI_COMM_WORLD_SIZE=2"),
            std::string::npos);
}

TEST(World, DetectLauncherFollowsTheSameRuleAsParsing) {
  auto detect = [](const std::map<std::string, std::string>& env) {
    return tessera::distributed::detect_launcher([&](const std::string& k) -> std::optional<std::string> {
      auto it = env.find(k);
      if (it == env.end()) return std::nullopt;
      return it->second;
    });
  };
  EXPECT_EQ(detect({}), "");
  EXPECT_EQ(detect({{"MASTER_ADDR", "h"}, {"OMPI_COMM_WORLD_NODE_RANK", "0"}}), "");
  EXPECT_EQ(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}}), "torchrun");  // tessera run -n 1: still launched
  EXPECT_EQ(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}), "slurm");
  EXPECT_EQ(detect({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}}), "openmpi");
  EXPECT_EQ(detect(mpirun_env(1, 2, 2)), "openmpi");
  EXPECT_EQ(detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}}), "torchrun");
  EXPECT_EQ(parse(mpirun_env(1, 2, 2)).source, detect(mpirun_env(1, 2, 2)));
}

TEST(World, TorchrunTakesPrecedenceOverSlurm) {
  // srun launching torchrun: torchrun's variables describe the worker.
  World w = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"},
                   {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_EQ(w.rank, 1);
}

TEST(World, MalformedValuesNameTheVariable) {
  EXPECT_NE(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}).find("RANK='abc' is not an integer"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2x"}}).find("WORLD_SIZE"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}).find("RANK=-1 is out of range"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}).find("WORLD_SIZE=0"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT=70000"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NTASKS_PER_NODE", "(x2)"}})
                .find("SLURM_NTASKS_PER_NODE"),
            std::string::npos);
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_RANK", "1"}}).find("OMPI_COMM_WORLD_SIZE is not set"), std::string::npos);
}

TEST(World, ContradictionsNameTheVariables) {
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK=2 is not below WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}}).find("RANK is set but WORLD_SIZE is not"), std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}}).find("WORLD_SIZE is set but RANK is not"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}})
                .find("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "4"}}).find("LOCAL_WORLD_SIZE=4 exceeds"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "2"},
                      {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}})
                .find("GROUP_RANK=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).find("MASTER_ADDR is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}).find("MASTER_PORT is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}}).find("SLURM_PROCID=3 is not below SLURM_NTASKS=2"),
            std::string::npos);
}
