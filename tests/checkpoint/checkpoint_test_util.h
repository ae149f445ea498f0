// Shared by the tests that drive checkpoints from one process (the CLI's and the bad-input
// ones): a single-process communicator and a tiny known state.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "support/test_util.h"
#include "tessera/checkpoint/format/checksum.h"
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

// A safetensors file's header edited through `edit`, the header checksum recomputed (what
// an attacker, or a writer's bug, leaves: only validation stands in the way).
inline void tamper_header(const std::string& file, const std::function<void(nlohmann::ordered_json&)>& edit) {
  const std::string bytes = read_bytes(file);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  auto h = nlohmann::ordered_json::parse(bytes.substr(8, n));
  edit(h);
  h["__metadata__"]["tessera.header_crc32c"] = "00000000";
  std::string text = h.dump();
  while (text.size() % 8) text.push_back(' ');
  std::string len(8, '\0');
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  const std::string marker = "\"tessera.header_crc32c\":\"";
  const size_t at = text.find(marker);
  ASSERT_NE(at, std::string::npos);
  const uint32_t crc = checkpoint::crc32c_extend(checkpoint::crc32c(len.data(), 8), text.data(), text.size());
  text.replace(at + marker.size(), 8, checkpoint::crc_hex(crc));
  write_bytes(file, len + text + bytes.substr(8 + n));
}

// The format-2 metadata of checkpoint `dir` edited through `edit`, metadata_crc32c
// recomputed as docs/checkpoint-format.md §3 says.
inline void tamper_v2_metadata(const std::string& dir, const std::function<void(nlohmann::ordered_json&)>& edit) {
  const std::string path = checkpoint::join_path(dir, checkpoint::kMetadataFile);
  auto j = nlohmann::ordered_json::parse(read_bytes(path));
  edit(j);
  j.erase("metadata_crc32c");
  std::string text = j.dump();
  text.pop_back();
  text += ",\"metadata_crc32c\":\"00000000\"}";
  const std::string crc = checkpoint::crc_hex(checkpoint::crc32c(text.data(), text.size()));
  text.replace(text.size() - 10, 8, crc);
  write_bytes(path, text);
  ASSERT_NO_THROW(checkpoint::check_metadata_checksum(text, path));  // only validation can refuse it now
}

}  // namespace tessera::testing
