// Where this process stands in the job: rank, sizes, node, and the rendezvous
// address. Read from the environment of whichever launcher started it:
// `tessera run` / torchrun (RANK, WORLD_SIZE, LOCAL_RANK, ...), SLURM's srun
// (SLURM_PROCID, SLURM_NTASKS, ...) or Open MPI's mpirun (OMPI_COMM_WORLD_*).
// With none of them set, a single process (rank 0 of 1).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace tessera::distributed {

struct World {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  int num_nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;          // 0: not needed (single process)
  bool agent_store = false;     // torchrun's agent hosts the TCPStore; every rank is a client
  // How often the launcher restarted the job (TORCHELASTIC_RESTART_COUNT; 0 at first).
  // With an agent store, this round's keys live under "/worker/attempt_<n>" (as torch's).
  int restart_count = 0;
  std::string source = "single";  // "torchrun", "slurm", "openmpi" or "single"

  bool is_distributed() const { return world_size > 1; }
  bool is_rank_zero() const { return rank == 0; }
  std::string describe() const;

  using Lookup = std::function<std::optional<std::string>(const std::string&)>;
  // Reads the process environment. Throws tessera::Error naming the variable at fault.
  static World from_env();
  // Same, with variables read through `lookup` (tests, embedding).
  static World from_lookup(const Lookup& lookup);
};

// Which launcher's variables are set, by the rule World::from_lookup() follows:
// "torchrun" (also `tessera run`: RANK or WORLD_SIZE), "slurm" (SLURM_PROCID and
// SLURM_NTASKS), "openmpi" (OMPI_COMM_WORLD_RANK or _SIZE), or "" when none is.
std::string detect_launcher(const World::Lookup& lookup);

// Whether an external launcher (tessera run, torchrun, srun, mpirun) set up this
// process's environment, even for a world of one process. A program started by hand
// (false) may start its own ranks; one started by a launcher must use the launcher's.
bool started_by_launcher();

// First host of a SLURM node list: "node[03-05,9],other" -> "node03".
std::string slurm_first_host(const std::string& nodelist);

}  // namespace tessera::distributed
