// The safetensors header Tessera writes (layout_safetensors, and the tessera.offsets value
// of data files) is built as text directly; it must stay the bytes nlohmann::json wrote
// before (readers' checksums and the byte-identical reshard rely on it). The reference
// here is the earlier construction: an ordered_json object dumped compactly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"

using namespace tessera;
using namespace tessera::checkpoint;

namespace {

std::string reference_header(const std::vector<TensorSpec>& specs, std::map<std::string, std::string> metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  uint64_t off = 0, blocks = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& s : specs) {
    const uint64_t nb = byte_size(s.shape, s.dtype, s.name);
    ranges.push_back({off, off + nb});
    off += nb;
    blocks += num_blocks(nb);
  }
  metadata["format"] = metadata.count("format") ? metadata["format"] : "pt";
  if (!metadata.count("tessera.version")) metadata["tessera.version"] = "1";
  metadata["tessera.crc32c_block"] = std::to_string(kCrcBlock);
  metadata["tessera.crc32c"] = std::string(8 * blocks, '0');
  metadata["tessera.header_crc32c"] = "00000000";
  nlohmann::ordered_json m = nlohmann::ordered_json::object();
  for (auto& [k, v] : metadata) m[k] = v;
  h["__metadata__"] = m;
  for (size_t i = 0; i < specs.size(); ++i)
    h[specs[i].name] = {{"dtype", dtype_name(specs[i].dtype)},
                        {"shape", specs[i].shape},
                        {"data_offsets", {ranges[i].first, ranges[i].second}}};
  std::string text = h.dump();
  while (text.size() % 8) text.push_back(' ');
  return text;
}

// Names and values with what JSON escapes: quotes, backslashes, control characters,
// UTF-8, DEL.
std::string odd_string(std::mt19937& rng, int i) {
  static const std::vector<std::string> parts = {"model.", "blocks.", "\"q\"", "a\\b", "\n", "\t", "\x01", "\x1f",
                                                 "\x7f", "\xc3\xa9", "\xe2\x82\xac", "weight", "@", " ", "{}", "[0]"};
  std::string s = "k" + std::to_string(i);
  const int n = static_cast<int>(rng() % 5);
  for (int j = 0; j < n; ++j) s += parts[rng() % parts.size()];
  return s;
}

}  // namespace

TEST(SafetensorsHeader, SameBytesAsNlohmannDump) {
  std::mt19937 rng(47);
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kBFloat16, at::kLong, at::kByte, at::kBool};
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<TensorSpec> specs;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      TensorSpec s;
      s.name = odd_string(rng, i);
      s.dtype = dtypes[rng() % dtypes.size()];
      const int nd = static_cast<int>(rng() % 4);
      for (int d = 0; d < nd; ++d) s.shape.push_back(static_cast<int64_t>(rng() % (trial % 7 == 0 ? 3000 : 9)));
      specs.push_back(s);
    }
    std::map<std::string, std::string> meta;
    const int nm = static_cast<int>(rng() % 4);
    for (int i = 0; i < nm; ++i) meta[odd_string(rng, 100 + i)] = odd_string(rng, 200 + i);
    if (trial % 3 == 0) meta["tessera.version"] = "2";
    if (trial % 5 == 0) meta["format"] = "mine";
    const SafetensorsLayout L = layout_safetensors("t.safetensors", specs, meta);
    const std::string want = reference_header(specs, meta);
    ASSERT_EQ(L.prefix.substr(8), want) << "trial " << trial;
    uint64_t len = 0;
    for (int i = 7; i >= 0; --i) len = len << 8 | static_cast<unsigned char>(L.prefix[static_cast<size_t>(i)]);
    EXPECT_EQ(len, want.size());
    // The checksum placeholders are where final_prefix patches them.
    EXPECT_EQ(L.prefix.compare(L.header_crc_pos - 25, 25, "\"tessera.header_crc32c\":\""), 0);
    EXPECT_EQ(L.prefix.compare(L.crc_pos - 18, 18, "\"tessera.crc32c\":\""), 0);
  }
}

TEST(SafetensorsHeader, JsonStringsAsNlohmannEscapes) {
  std::mt19937 rng(7);
  for (int i = 0; i < 500; ++i) {
    const std::string s = odd_string(rng, i);
    std::string out = "x";
    append_json_string(out, s);
    EXPECT_EQ(out, "x" + nlohmann::json(s).dump()) << i;
  }
  std::string out;
  EXPECT_THROW(append_json_string(out, std::string("bad \xff utf-8")), std::exception);
}
