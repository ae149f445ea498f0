// Shared by the tests that drive checkpoints from one process (the CLI's and the bad-input
// ones): a single-process communicator and a tiny known state.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/distributed/communicator.h"
#include "tessera/state/state_dict.h"

namespace tessera::testing {

// One communicator for the whole test process (world of one).
inline std::shared_ptr<distributed::Communicator> solo() {
  static auto c = distributed::Communicator::create(distributed::World{});
  return c;
}

// "w": n floats of value v, "step": v as an integer.
inline state::StateDict state_of(int64_t n, double v) {
  state::StateDict sd;
  sd.set("w", at::full({n}, v, at::kFloat));
  sd.set("step", int64_t(v));
  return sd;
}

// Rewrites the format-2 checkpoint directory `dir` as format 1: the same data files, and
// metadata listing every chunk with its file, byte range and checksums (what the
// version-1 writer wrote). The tests of the version-1 reader's defences tamper with that
// metadata; version-1 checkpoints stay readable everywhere (docs/checkpoint-format.md §3.1).
inline void downgrade_to_v1(const std::string& dir) {
  checkpoint::CheckpointMetadata m = checkpoint::open_checkpoint(dir);
  if (m.version == 1) return;
  {
    checkpoint::ChunkReader r(m);
    for (auto& [k, e] : m.entries) {
      if (!e.is_tensor()) continue;
      e.chunks = r.chunks(k, e, sharding::full_box(e.shape));
      e.layout.reset();
    }
  }
  for (int i = 0; i < m.world_size; ++i) {
    const std::string name = checkpoint::data_file_name(i);
    m.files.emplace_back(name, checkpoint::File(checkpoint::join_path(dir, name), "r").size());
  }
  m.version = 1;
  const std::string text = checkpoint::to_json(m);
  checkpoint::File f(checkpoint::join_path(dir, checkpoint::kMetadataFile), "w");
  f.write_all(text.data(), text.size());
  f.close();
}

}  // namespace tessera::testing
