// Saving and restoring the default random generators' states (see rng_state.h).
#include "tessera/trainer/rng_state.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <cstring>
#include <mutex>

#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/rank_agreement.h"  // every rank learns every rank's outcome
#include "tessera/core/error.h"
#include "tessera/core/strings.h"
#include "tessera/fabric/fabric.h"
#include "tessera/sharding/layout.h"
#include "tessera/sharding/sharded_tensor.h"

namespace tessera::trainer {

std::string generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor s = gen.get_state().contiguous();
  return std::string(static_cast<const char*>(s.data_ptr()), static_cast<size_t>(s.numel()));
}

void set_generator_state(at::Generator gen, const std::string& bytes) {
  at::Tensor s = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(s.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

RngFork::RngFork(c10::Device device) {
  cpu_ = generator_state(at::detail::getDefaultCPUGenerator());
  if (device.is_cuda()) {
    device_ = device;
    cuda_ = generator_state(at::globalContext().defaultGenerator(device));
  }
}

RngFork::~RngFork() {
  set_generator_state(at::detail::getDefaultCPUGenerator(), cpu_);
  if (device_) set_generator_state(at::globalContext().defaultGenerator(*device_), cuda_);
}

namespace {

// Every rank's `bytes` as one uint8 tensor [world size, length], row r on rank r (a chunk
// layout along rows: one line in the metadata at any world size, each row in its rank's
// data file). No communication: every rank knows the layout. Made from the rule, so a
// save builds no list of every rank's row (O(world size) per save).
sharding::ShardedTensor rows_by_rank(fabric::Fabric& f, const std::string& bytes) {
  const std::shared_ptr<distributed::Communicator>& comm = f.comm();
  const int64_t w = comm->size(), r = comm->rank(), len = static_cast<int64_t>(bytes.size());
  at::Tensor row = at::empty({1, len}, at::kByte);
  std::memcpy(row.data_ptr(), bytes.data(), bytes.size());
  const sharding::ShardMetadata mine{sharding::Box{{r, 0}, {1, len}}, sharding::Placement{static_cast<int>(r)}};
  return sharding::ShardedTensor::from_rule(sharding::Shard{row, mine}, sharding::Layout::chunk(0, w), {w, len},
                                            at::kByte, comm);
}

// This rank's row of the generator states `key` of the checkpoint (rank 0's when the
// checkpoint has fewer ranks), or "" when it has none.
std::string read_row(const checkpoint::CheckpointMetadata& meta, checkpoint::ChunkReader& reader,
                     const std::string& key, int64_t rank) {
  auto it = meta.entries.find(key);
  if (it == meta.entries.end()) return "";
  const checkpoint::EntryInfo& e = it->second;
  TESSERA_CHECK(e.shape.size() == 2 && e.shape[0] >= 1 && e.dtype == at::kByte, "Trainer: checkpoint '", meta.location,
                "' key '", key, "' is not a [ranks, bytes] uint8 tensor of generator states (shape ",
                core::shape_string(e.shape), ")");
  const int64_t row = rank < e.shape[0] ? rank : 0;
  at::Tensor t = reader.read_box(key, e, sharding::Box{{row, 0}, {1, e.shape[1]}}).contiguous();
  return std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
}

}  // namespace

state::StateDict gather_rng_states(fabric::Fabric& f) {
  state::StateDict rng;
  rng.set("world_size", static_cast<int64_t>(f.world_size()));
  rng.set("cpu", rows_by_rank(f, generator_state(at::detail::getDefaultCPUGenerator())));
  if (f.device().is_cuda())
    rng.set("cuda", rows_by_rank(f, generator_state(at::globalContext().defaultGenerator(f.device()))));
  return rng;
}

void restore_rng_states(fabric::Fabric& f, const state::StateDict& rng, const std::string& path) {
  // Each rank reads its own row (from its own data file at the same world size), so one
  // rank can fail alone (its data file missing or damaged). Every rank therefore learns
  // every rank's outcome before going on: alone, a failed rank would leave the others
  // waiting in the training's next collective until the communicator's timeout.
  std::string err;
  try {
    std::string cpu, cuda;
    auto pick = [&](const std::string& kind) -> std::string {
      // Checkpoints before the tensor form: one bytes value per rank in the metadata.
      const std::string mine = kind + "_" + std::to_string(f.global_rank());
      if (rng.contains(mine)) return rng.bytes(mine).data;
      if (rng.contains(kind + "_0")) return rng.bytes(kind + "_0").data;
      return "";
    };
    cpu = pick("cpu");
    if (f.device().is_cuda()) cuda = pick("cuda");
    if (cpu.empty() && cuda.empty()) {
      const checkpoint::CheckpointMetadata meta = checkpoint::open_checkpoint(path);
      checkpoint::ChunkReader reader(meta);
      cpu = read_row(meta, reader, "rng.cpu", f.global_rank());
      if (f.device().is_cuda()) cuda = read_row(meta, reader, "rng.cuda", f.global_rank());
    }
    if (!cpu.empty()) set_generator_state(at::detail::getDefaultCPUGenerator(), cpu);
    if (!cuda.empty()) set_generator_state(at::globalContext().defaultGenerator(f.device()), cuda);
  } catch (const std::exception& e) {
    err = e.what();
  }
  // Taken by every rank whatever it found (O(1) bytes each): all fail together, naming
  // the lowest rank that failed and its error.
  checkpoint::RankAgreement(*f.comm(),
                            concat("Trainer: restoring the random generator states from checkpoint '", path, "'"))
      .agree_or_throw(err);
}

}  // namespace tessera::trainer
