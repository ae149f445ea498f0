#include "tessera/distributed/world.h"

#include <cctype>

#include "tessera/core/env.h"
#include "tessera/core/error.h"

namespace tessera::distributed {
namespace {

struct Reader {
  const World::Lookup& lookup;
  std::optional<std::string> get(const std::string& name) const {
    auto v = lookup(name);
    if (v && v->empty()) return std::nullopt;
    return v;
  }
  std::optional<int> get_int(const std::string& name, int64_t min, int64_t max) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    return static_cast<int>(env::parse_int(*v, name, min, max));
  }
  int require_int(const std::string& name, int64_t min, int64_t max, const std::string& why) const {
    auto v = get_int(name, min, max);
    TESSERA_CHECK(v.has_value(), name, " is not set but ", why);
    return *v;
  }
};

constexpr int64_t kMaxRanks = 1 << 20;

// "4(x2),3" -> 4: the task count of the first node, as SLURM writes it.
int parse_slurm_tasks_per_node(const std::string& v, const std::string& name) {
  size_t i = 0;
  while (i < v.size() && std::isdigit(static_cast<unsigned char>(v[i]))) ++i;
  TESSERA_CHECK(i > 0, name, "='", v, "' does not start with a task count");
  return static_cast<int>(env::parse_int(v.substr(0, i), name, 1, kMaxRanks));
}

void set_master(World& w, const Reader& r, const std::string& fallback_addr, int fallback_port) {
  if (auto a = r.get("MASTER_ADDR")) {
    w.master_addr = *a;
  } else if (!fallback_addr.empty()) {
    w.master_addr = fallback_addr;
  } else if (w.world_size > 1) {
    throw Error(concat("MASTER_ADDR is not set but WORLD_SIZE is ", w.world_size,
                    " (", w.source, " environment); export MASTER_ADDR=<host of rank 0>"));
  }
  if (auto p = r.get_int("MASTER_PORT", 1, 65535)) {
    w.master_port = *p;
  } else if (fallback_port > 0) {
    w.master_port = fallback_port;
  } else if (w.world_size > 1) {
    throw Error(concat("MASTER_PORT is not set but WORLD_SIZE is ", w.world_size, " (", w.source,
                    " environment); export MASTER_PORT=<free port on rank 0's host>"));
  }
}

void validate(const World& w) {
  const std::string src = " (" + w.source + " environment)";
  TESSERA_CHECK(w.rank >= 0 && w.rank < w.world_size, "rank ", w.rank,
                " is not below the world size ", w.world_size, src);
  TESSERA_CHECK(w.local_world_size >= 1 && w.local_world_size <= w.world_size,
                "local world size ", w.local_world_size, " must be in [1, world size ",
                w.world_size, "]", src);
  TESSERA_CHECK(w.local_rank >= 0 && w.local_rank < w.local_world_size, "local rank ",
                w.local_rank, " is not below the local world size ", w.local_world_size, src);
  TESSERA_CHECK(w.local_rank <= w.rank, "local rank ", w.local_rank, " exceeds rank ", w.rank, src);
  TESSERA_CHECK(w.node_rank >= 0 && w.node_rank < w.num_nodes, "node rank ", w.node_rank,
                " is not below the number of nodes ", w.num_nodes, src);
}

World from_torchrun(const Reader& r) {
  World w;
  w.source = "torchrun";
  auto rank = r.get_int("RANK", 0, kMaxRanks);
  auto size = r.get_int("WORLD_SIZE", 1, kMaxRanks);
  TESSERA_CHECK(rank.has_value(), "WORLD_SIZE is set but RANK is not");
  TESSERA_CHECK(size.has_value(), "RANK is set but WORLD_SIZE is not");
  w.rank = *rank;
  w.world_size = *size;
  TESSERA_CHECK(w.rank < w.world_size, "RANK=", w.rank, " is not below WORLD_SIZE=", w.world_size);
  w.local_world_size = r.get_int("LOCAL_WORLD_SIZE", 1, kMaxRanks).value_or(w.world_size);
  TESSERA_CHECK(w.local_world_size <= w.world_size, "LOCAL_WORLD_SIZE=", w.local_world_size,
                " exceeds WORLD_SIZE=", w.world_size);
  w.local_rank = r.get_int("LOCAL_RANK", 0, kMaxRanks).value_or(w.rank % w.local_world_size);
  TESSERA_CHECK(w.local_rank < w.local_world_size, "LOCAL_RANK=", w.local_rank,
                " is not below LOCAL_WORLD_SIZE=", w.local_world_size);
  w.num_nodes = (w.world_size + w.local_world_size - 1) / w.local_world_size;
  w.node_rank = r.get_int("GROUP_RANK", 0, kMaxRanks).value_or(w.rank / w.local_world_size);
  TESSERA_CHECK(w.node_rank < w.num_nodes, "GROUP_RANK=", w.node_rank, " is not below the ",
                w.num_nodes, " nodes implied by WORLD_SIZE/LOCAL_WORLD_SIZE");
  if (auto a = r.get("TORCHELASTIC_USE_AGENT_STORE")) w.agent_store = (*a == "True" || *a == "1");
  w.restart_count = r.get_int("TORCHELASTIC_RESTART_COUNT", 0, 1 << 30).value_or(0);
  set_master(w, r, "", 0);
  return w;
}

World from_slurm(const Reader& r) {
  World w;
  w.source = "slurm";
  w.world_size = r.require_int("SLURM_NTASKS", 1, kMaxRanks, "SLURM_PROCID is set");
  w.rank = r.require_int("SLURM_PROCID", 0, kMaxRanks, "");
  TESSERA_CHECK(w.rank < w.world_size, "SLURM_PROCID=", w.rank, " is not below SLURM_NTASKS=",
                w.world_size);
  w.local_rank = r.get_int("SLURM_LOCALID", 0, kMaxRanks).value_or(0);
  if (auto t = r.get("SLURM_NTASKS_PER_NODE")) {
    w.local_world_size = parse_slurm_tasks_per_node(*t, "SLURM_NTASKS_PER_NODE");
  } else if (auto t2 = r.get("SLURM_STEP_TASKS_PER_NODE")) {
    w.local_world_size = parse_slurm_tasks_per_node(*t2, "SLURM_STEP_TASKS_PER_NODE");
  } else {
    w.local_world_size = w.world_size;
  }
  w.local_world_size = std::min(w.local_world_size, w.world_size);
  TESSERA_CHECK(w.local_rank < w.local_world_size, "SLURM_LOCALID=", w.local_rank,
                " is not below the tasks per node (", w.local_world_size, ")");
  w.num_nodes = r.get_int("SLURM_NNODES", 1, kMaxRanks)
                    .value_or((w.world_size + w.local_world_size - 1) / w.local_world_size);
  w.node_rank = r.get_int("SLURM_NODEID", 0, kMaxRanks).value_or(w.rank / w.local_world_size);
  TESSERA_CHECK(w.node_rank < w.num_nodes, "SLURM_NODEID=", w.node_rank,
                " is not below SLURM_NNODES=", w.num_nodes);
  std::string host;
  if (auto nl = r.get("SLURM_NODELIST")) host = slurm_first_host(*nl);
  else if (auto nl2 = r.get("SLURM_JOB_NODELIST")) host = slurm_first_host(*nl2);
  int port = 0;
  if (auto job = r.get("SLURM_JOB_ID")) {
    // Same rule as Lightning's SLURM environment: a port derived from the job id, so
    // every task of the job agrees without talking.
    std::string digits = job->size() > 4 ? job->substr(job->size() - 4) : *job;
    port = 15000 + static_cast<int>(env::parse_int(digits, "SLURM_JOB_ID", 0, 9999));
  }
  set_master(w, r, host, port);
  return w;
}

// Open MPI documents OMPI_COMM_WORLD_NODE_RANK as this process's rank among the
// processes of *all* jobs on its node, not as the node's index, so it is not read.
// The node index comes from the layout instead: mpirun's default mapping (by slot,
// which --map-by core/socket/ppr:N:node keep) gives each node a run of consecutive
// ranks, so with the same number of ranks L on every node, node = rank / L. A layout
// that is not of that form (uneven slots, --map-by node, --rank-by) is refused, naming
// the variables, rather than given node indices that disagree between ranks.
World from_openmpi(const Reader& r) {
  World w;
  w.source = "openmpi";
  w.world_size = r.require_int("OMPI_COMM_WORLD_SIZE", 1, kMaxRanks, "OMPI_COMM_WORLD_RANK is set");
  w.rank = r.require_int("OMPI_COMM_WORLD_RANK", 0, kMaxRanks, "");
  TESSERA_CHECK(w.rank < w.world_size, "OMPI_COMM_WORLD_RANK=", w.rank,
                " is not below OMPI_COMM_WORLD_SIZE=", w.world_size);
  w.local_world_size = r.get_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxRanks).value_or(w.world_size);
  TESSERA_CHECK(w.local_world_size <= w.world_size, "OMPI_COMM_WORLD_LOCAL_SIZE=", w.local_world_size,
                " exceeds OMPI_COMM_WORLD_SIZE=", w.world_size);
  const int L = w.local_world_size;
  w.local_rank = r.get_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxRanks).value_or(w.rank % L);
  TESSERA_CHECK(w.local_rank < L, "OMPI_COMM_WORLD_LOCAL_RANK=", w.local_rank,
                " is not below OMPI_COMM_WORLD_LOCAL_SIZE=", L);
  TESSERA_CHECK(w.world_size % L == 0, "Open MPI placed ", L, " of the ", w.world_size,
                " ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE=", L, ", OMPI_COMM_WORLD_SIZE=", w.world_size,
                "), which does not divide them evenly: Tessera needs the same number of ranks on every node "
                "(give every host the same slot count, e.g. --host a:", L, ",b:", L, " or --map-by ppr:", L,
                ":node)");
  TESSERA_CHECK(w.local_rank == w.rank % L, "OMPI_COMM_WORLD_RANK=", w.rank, " has OMPI_COMM_WORLD_LOCAL_RANK=",
                w.local_rank, ", but Tessera needs the ranks of a node to be consecutive (with ", L,
                " per node, rank ", w.rank, " would have local rank ", w.rank % L,
                "): use mpirun's default mapping (by slot), not --map-by node or --rank-by");
  w.num_nodes = w.world_size / L;
  w.node_rank = w.rank / L;
  set_master(w, r, "", 0);
  return w;
}

}  // namespace

std::string slurm_first_host(const std::string& nodelist) {
  // Take the first comma-separated entry that is not inside brackets.
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first.push_back(c);
  }
  auto lb = first.find('[');
  if (lb == std::string::npos) return first;
  std::string prefix = first.substr(0, lb);
  std::string range = first.substr(lb + 1);
  auto end = range.find_first_of(",-]");
  return prefix + range.substr(0, end);
}

std::string World::describe() const {
  return concat("rank ", rank, "/", world_size, " (local ", local_rank, "/", local_world_size, ", node ",
             node_rank, "/", num_nodes, ", from ", source, ")");
}

std::string detect_launcher(const World::Lookup& lookup) {
  Reader r{lookup};
  if (r.get("RANK") || r.get("WORLD_SIZE")) return "torchrun";
  if (r.get("SLURM_PROCID") && r.get("SLURM_NTASKS")) return "slurm";
  if (r.get("OMPI_COMM_WORLD_RANK") || r.get("OMPI_COMM_WORLD_SIZE")) return "openmpi";
  return "";
}

bool started_by_launcher() {
  return !detect_launcher([](const std::string& n) { return env::get(n); }).empty();
}

World World::from_lookup(const Lookup& lookup) {
  Reader r{lookup};
  const std::string launcher = detect_launcher(lookup);
  World w;
  if (launcher == "torchrun") {
    w = from_torchrun(r);
  } else if (launcher == "slurm") {
    w = from_slurm(r);
  } else if (launcher == "openmpi") {
    w = from_openmpi(r);
  } else {
    return w;
  }
  validate(w);
  return w;
}

World World::from_env() {
  return from_lookup([](const std::string& n) { return env::get(n); });
}

}  // namespace tessera::distributed
