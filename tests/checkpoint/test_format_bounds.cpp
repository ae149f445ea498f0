// Issue 35, items 1, 2 and 16: numbers in a checkpoint's metadata or safetensors header
// that wrapped or misaligned the reader's arithmetic, each in a checkpoint whose checksums
// were recomputed as an attacker would (so only validation stands in the way):
//  - a checksum block size that is not a multiple of 8 (reads from the wrong bytes, or
//    past a buffer), one near 2^64 (block count 0: no checksums), one over 1 GiB;
//  - a chunk at an offset near 2^63 (offset + size wrapped: "inside" the shape, "disjoint"
//    from the others, so that consolidate/export wrote bytes never read);
//  - a shape whose element count wraps to the chunks' volume ([256, 64 + 2^56]).
// Each must be refused by the C++ reader (open, load, verify, consolidate, export) and by
// the Python package (python/tessera_ckpt), naming the key or field.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <limits>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/offline/hf_export.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/sharding/sharded_tensor.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string kMeta = "/tessera-checkpoint.json";
const std::string kCrcMarker = "\n \"metadata_crc32c\": \"";
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// `full` split into `pieces` along dim 0, every piece on this (single) rank.
sharding::ShardedTensor split(const at::Tensor& full, int pieces) {
  std::vector<sharding::ShardMetadata> shards;
  std::vector<sharding::Shard> local;
  const auto shape = full.sizes().vec();
  for (int i = 0; i < pieces; ++i) {
    sharding::ShardMetadata m{sharding::chunk_box(shape, 0, pieces, i), {0, c10::kCPU}};
    shards.push_back(m);
    local.push_back({sharding::narrow_to(full, sharding::full_box(shape), m.box).clone(), m});
  }
  return sharding::ShardedTensor::from_parts(local, shards, shape, full.scalar_type(), solo());
}

std::string hex_list(const std::vector<uint32_t>& crcs) {
  std::string s;
  for (uint32_t c : crcs) s += ck::crc_hex(c);
  return s;
}

// DIR's metadata edited through `edit` (on the parsed JSON), then re-checksummed.
void tamper_metadata(const std::string& dir, const std::function<void(json&)>& edit) {
  tessera::testing::downgrade_to_v1(dir);  // these bounds in version 1's chunk lists (format 2: test_format_v2.cpp)
  json j = json::parse(read_bytes(dir + kMeta));
  edit(j);
  j["metadata_crc32c"] = "00000000";
  std::string text = j.dump(1);
  const size_t at = text.find(kCrcMarker);
  ASSERT_NE(at, std::string::npos);
  text.replace(at + kCrcMarker.size(), 8, ck::crc_hex(ck::crc32c(text.data(), text.size())));
  write_bytes(dir + kMeta, text);
  ASSERT_NO_THROW(ck::check_metadata_checksum(text, dir + kMeta));  // only validation can refuse it now
}

// The block checksums of chunk `c` (sharded checkpoint `dir`) for another block size.
json crcs_for_block(const std::string& dir, const json& c, uint64_t block) {
  const std::string data = read_bytes(dir + "/" + c["file"].get<std::string>());
  const uint64_t b = c["byte_range"][0].get<uint64_t>(), e = c["byte_range"][1].get<uint64_t>();
  json out = json::array();
  for (uint32_t x : ck::block_crcs(data.data() + b, e - b, block)) out.push_back(ck::crc_hex(x));
  return out;
}

// A sharded checkpoint of one plain F32 tensor "w" = 0, 1, 2, ... of `shape`.
std::string save_plain(const std::string& dir, std::vector<int64_t> shape) {
  state::StateDict sd;
  int64_t n = 1;
  for (auto d : shape) n *= d;
  sd.set("w", at::arange(n, at::kFloat).reshape(shape));
  ck::save(sd, dir, *solo(), {ck::SaveMode::Sharded});
  tessera::testing::downgrade_to_v1(dir);  // these tests edit version 1's chunk lists
  return dir;
}

// The metadata's crc32c_block set to `block`, every chunk's checksums recomputed for it
// (`none`: no checksum at all, as many as (bytes + block - 1) / block wrapped to for a block
// near 2^64).
void set_block(const std::string& dir, uint64_t block, bool none = false) {
  tamper_metadata(dir, [&](json& j) {
    j["crc32c_block"] = block;
    for (auto& [k, e] : j["entries"].items())
      if (e.contains("chunks"))
        for (auto& c : e["chunks"]) c["crc32c"] = none ? json::array() : crcs_for_block(dir, c, block);
  });
}


// The Python package refuses every case ("CKPT SUBSTR..." separated by " -- ").
void expect_python_refuses(const std::string& cases) {
  auto [rc, out] = run_command(py("tessera_ckpt_expect_error.py " + cases));
  EXPECT_EQ(rc, 0) << out;
}

// Every C++ reader of `dir` refuses it with a message holding each of `want`.
void expect_cpp_refuses(const std::string& dir, const std::vector<std::string>& want) {
  const std::string out = fs::path(dir).parent_path().string();
  std::vector<std::pair<std::string, std::string>> errors = {
      {"open", error_of([&] { ck::open_checkpoint(dir); })},
      {"load", error_of([&] {
         ck::CheckpointMetadata m = ck::open_checkpoint(dir);
         state::StateDict t;
         t.set("w", at::zeros(m.entries.at("w").shape, at::kFloat));
         ck::load_local(t, dir);
       })},
      {"consolidate", error_of([&] { ck::consolidate(dir, out + "/c.safetensors", true); })},
      {"export", error_of([&] { ck::export_checkpoint(dir, ck::ExportFormat::Safetensors, out + "/e.st", true); })},
      {"export torch", error_of([&] { ck::export_checkpoint(dir, ck::ExportFormat::Torch, out + "/e.pt", true); })},
      {"export hf", error_of([&] { ck::export_hf(dir, out + "/hf", {}, true); })},
      {"reshard", error_of([&] { ck::reshard(dir, 4, out + "/r4", true); })},
  };
  const ck::VerifyReport v = ck::verify(dir);
  EXPECT_FALSE(v.ok) << dir << ": verify said OK";
  errors.push_back({"verify", v.problems.empty() ? "(no problem)" : v.problems.front()});
  for (const auto& [what, msg] : errors)
    for (const auto& w : want) EXPECT_NE(msg.find(w), std::string::npos) << what << ": '" << w << "' not in: " << msg;
  EXPECT_FALSE(fs::exists(out + "/c.safetensors") || fs::exists(out + "/e.st") || fs::exists(out + "/e.pt") ||
               fs::exists(out + "/hf") || fs::exists(out + "/r4"))
      << "an output was written from " << dir;
}

}  // namespace

// Item 1: block 6 for F32 [8] resharded to 4 read rows [2:4] from bytes [10, 18); block 5
// for F32 [4] read 12 bytes into an 8-byte buffer; a block near 2^64 recorded no checksum.
TEST(FormatBounds, ChecksumBlockSizesThatSplitElementsOrWrapAreRefused) {
  const std::string d = temp_dir("format-block");
  struct Case {
    std::string name;
    std::vector<int64_t> shape;
    uint64_t block;
  };
  const std::vector<Case> cases = {{"six", {8}, 6},
                                   {"five", {4}, 5},
                                   {"twelve", {4, 4}, 12},
                                   {"wrap", {8}, std::numeric_limits<uint64_t>::max()},
                                   {"huge", {8}, 1ull << 40}};
  std::string py_cases;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    fs::create_directories(d + "/" + c.name);
    const std::string dir = save_plain(d + "/" + c.name + "/ckpt", c.shape);
    set_block(dir, c.block, c.name == "wrap");
    expect_cpp_refuses(dir, {"crc32c_block", "checksum block size " + std::to_string(c.block)});
    py_cases += concat(py_cases.empty() ? "" : " -- ", dir, " crc32c_block 'checksum block size ", c.block, "'");
  }
  expect_python_refuses(py_cases);
  // A consolidated file's tessera.crc32c_block, too (its checksums recomputed for block 6).
  const std::string file = d + "/full.safetensors";
  state::StateDict sd;
  sd.set("w", at::arange(8, at::kFloat));
  ck::save(sd, file, *solo(), {ck::SaveMode::Full});
  tamper_header(file, [&](nlohmann::ordered_json& h) {
    const std::string data = read_bytes(file);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(data[i]);
    const uint64_t b = h["w"]["data_offsets"][0].get<uint64_t>(), e = h["w"]["data_offsets"][1].get<uint64_t>();
    h["__metadata__"]["tessera.crc32c_block"] = "6";
    h["__metadata__"]["tessera.crc32c"] = hex_list(ck::block_crcs(data.data() + 8 + n + b, e - b, 6));
  });
  EXPECT_CONTAINS(error_of([&] { ck::open_checkpoint(file); }), "tessera.crc32c_block: checksum block size 6");
  EXPECT_FALSE(ck::verify(file).ok);
  expect_python_refuses(file + " tessera.crc32c_block 'checksum block size 6'");
}

// Item 1, the reader itself: metadata built in code (not parsed) with block 5 must not make
// copy_into read past its buffer; valid odd-sized blocks (multiples of 8 that divide
// neither the rows nor the chunk) read every box of every dtype exactly.
TEST(FormatBounds, ReaderWidensToAnyValidBlockSizeExactly) {
  const std::string d = temp_dir("format-widen");
  state::StateDict sd;
  sd.set("f16", (at::arange(7 * 9, at::kFloat) - 5).reshape({7, 9}).to(at::kHalf));
  sd.set("f32", split(at::arange(11 * 5, at::kFloat).reshape({11, 5}), 3));
  sd.set("f64", (at::arange(13, at::kDouble) * 0.5).reshape({13}));
  sd.set("u8", at::arange(37, at::kLong).to(at::kByte));
  const std::string dir = d + "/ckpt";
  ck::save(sd, dir, *solo(), {ck::SaveMode::Sharded});
  tessera::testing::downgrade_to_v1(dir);  // version 1's chunk lists are edited below
  for (uint64_t block : {8, 24, 40, 56}) {
    SCOPED_TRACE(block);
    ck::CheckpointMetadata m = ck::open_checkpoint(dir);
    m.crc_block = block;
    for (auto& [k, e] : m.entries)
      for (auto& c : e.chunks) {
        const std::string data = read_bytes(dir + "/" + c.file);
        c.crcs = ck::block_crcs(data.data() + c.begin, c.end - c.begin, block);
      }
    ck::ChunkReader r(m);
    for (const auto& k : m.keys) {
      const auto& e = m.entries.at(k);
      const at::Tensor whole = r.read_box(k, e, sharding::full_box(e.shape));
      const int64_t rows = e.shape[0];
      for (int64_t a = 0; a < rows; ++a)
        for (int64_t b = a + 1; b <= rows; b += 2) {
          sharding::Box box = sharding::full_box(e.shape);
          box.offsets[0] = a;
          box.sizes[0] = b - a;
          EXPECT_TRUE(at::equal(r.read_box(k, e, box), whole.narrow(0, a, b - a))) << k << " rows " << a << ":" << b;
        }
    }
  }
  // Block 5 (never accepted by parsing) in code-built metadata: refused, not read past the buffer.
  ck::CheckpointMetadata m = ck::open_checkpoint(dir);
  m.crc_block = 5;
  auto& e = m.entries.at("f64");
  for (auto& c : e.chunks) c.crcs = ck::block_crcs(read_bytes(dir + "/" + c.file).data() + c.begin, c.end - c.begin, 5);
  ck::ChunkReader r(m);
  sharding::Box half{{7}, {6}};
  EXPECT_CONTAINS(error_of([&] { r.read_box("f64", e, half); }), "checksum block size 5");
}

// Item 2: a chunk at offset 2^63 - 1 wrapped offset + size, lay "inside" a shape of 4 and
// "apart" from the other chunk; consolidate and export wrote the output with 2 elements
// never read from the checkpoint.
TEST(FormatBounds, ChunkBoxesPastInt64AreRefusedAndWritersCheckCoverage) {
  const std::string d = temp_dir("format-box");
  fs::create_directories(d + "/a");
  state::StateDict sd;
  sd.set("w", split(at::arange(4, at::kFloat), 2));
  const std::string dir = d + "/a/ckpt";
  ck::save(sd, dir, *solo(), {ck::SaveMode::Sharded});
  tessera::testing::downgrade_to_v1(dir);  // version 1's chunk lists are edited below
  tamper_metadata(dir, [](json& j) { j["entries"]["w"]["chunks"][1]["offsets"] = {kI64Max}; });
  expect_cpp_refuses(dir, {"key 'w'", "lies outside the shape"});
  // An empty chunk outside the shape is refused too (as the Python reader does).
  fs::create_directories(d + "/b");
  const std::string dir2 = d + "/b/ckpt";
  ck::save(sd, dir2, *solo(), {ck::SaveMode::Sharded});
  tessera::testing::downgrade_to_v1(dir2);  // version 1's chunk lists are edited below
  tamper_metadata(dir2, [](json& j) {
    json c = j["entries"]["w"]["chunks"][1];
    c["offsets"] = {kI64Max};
    c["sizes"] = {0};
    c["byte_range"] = {c["byte_range"][1], c["byte_range"][1]};
    c["crc32c"] = json::array();
    j["entries"]["w"]["chunks"].push_back(c);
  });
  EXPECT_CONTAINS(error_of([&] { ck::open_checkpoint(dir2); }), "lies outside the shape");
  expect_python_refuses(dir + " \"key 'w'\" 'lies outside the shape' -- " + dir2 + " 'lies outside the shape'");

  // The writers' own check: chunks that do not cover a tensor (metadata built in code) are
  // an error naming the key before anything is written.
  const std::string dir3 = d + "/good";
  ck::save(sd, dir3, *solo(), {ck::SaveMode::Sharded});
  tessera::testing::downgrade_to_v1(dir3);  // version 1's chunk lists are edited below
  ck::CheckpointMetadata m = ck::open_checkpoint(dir3);
  m.entries.at("w").chunks.pop_back();
  ck::ChunkReader r(m);
  const auto& e = m.entries.at("w");
  EXPECT_CONTAINS(error_of([&] { r.read_box("w", e, sharding::full_box(e.shape)); }),
                  "key 'w': the chunks cover 2 of the 4 elements of [0:4]");
  at::Tensor t = at::zeros({4});
  EXPECT_CONTAINS(error_of([&] { r.fill_box("w", e, t, sharding::full_box(e.shape), "the output"); }),
                  "the output would hold memory never read");
}

// Item 16: a shape whose element count wraps to the chunks' volume passed check_tiling
// ([4, 2^62 + 3] with one [0:4, 0:3] chunk: 12 elements either way), and verify said OK
// while the Python reader counted 12 of 18446744073709551628 elements.
TEST(FormatBounds, ShapesWhoseSizeWrapsAreRefusedByBothReaders) {
  const std::string d = temp_dir("format-shape");
  struct Case {
    std::string name;
    std::vector<int64_t> saved, declared;
  };
  const std::vector<Case> cases = {{"a", {4, 3}, {4, (int64_t(1) << 62) + 3}},
                                   {"b", {256, 64}, {256, 64 + (int64_t(1) << 56)}}};
  std::string py_cases;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    fs::create_directories(d + "/" + c.name);
    const std::string dir = save_plain(d + "/" + c.name + "/ckpt", c.saved);
    tamper_metadata(dir, [&](json& j) { j["entries"]["w"]["shape"] = c.declared; });
    expect_cpp_refuses(dir, {"key 'w'", "shape too large"});
    py_cases += concat(py_cases.empty() ? "" : " -- ", dir, " \"key 'w'\" 'shape too large'");
  }
  // A dimension above 2^63 - 1 in an empty tensor's shape: C++ never read it as an int64;
  // Python took it (0 bytes).
  fs::create_directories(d + "/c");
  const std::string dir = save_plain(d + "/c/ckpt", {4});
  tamper_metadata(dir, [&](json& j) {
    j["entries"]["w"]["shape"] = {0, uint64_t(1) << 63};
    j["entries"]["w"]["chunks"] = json::array();
  });
  EXPECT_CONTAINS(error_of([&] { ck::open_checkpoint(dir); }), "bad dimension 9223372036854775808");
  py_cases += " -- " + dir + " 'bad dimension 9223372036854775808'";
  expect_python_refuses(py_cases);
}

// Box arithmetic: numel, contains, intersect and chunk_range never wrap.
TEST(FormatBounds, BoxArithmeticIsCheckedNotWrapped) {
  const sharding::Box far{{kI64Max}, {2}}, near{{0}, {4}};
  EXPECT_FALSE(sharding::contains(near, far));
  EXPECT_FALSE(sharding::inside_shape({4}, far));
  EXPECT_TRUE(sharding::inside_shape({4}, sharding::Box{{4}, {0}}));
  EXPECT_FALSE(sharding::inside_shape({4}, sharding::Box{{5}, {0}}));
  EXPECT_FALSE(sharding::intersect(near, far).has_value());
  EXPECT_CONTAINS(error_of([&] { sharding::intersect(far, sharding::Box{{kI64Max - 1}, {5}}); }), "2^63 - 1");
  EXPECT_CONTAINS(error_of([] { sharding::Box{{0, 0}, {4, (int64_t(1) << 62) + 3}}.numel(); }), "more than 2^63 - 1");
  EXPECT_EQ((sharding::Box{{0, 0}, {0, kI64Max}}).numel(), 0);
  EXPECT_EQ(far.to_string(), "[9223372036854775807:9223372036854775807+2]");
  const auto r = sharding::chunk_range(kI64Max, 2, 1);
  EXPECT_EQ(r.begin + r.size, kI64Max);
  EXPECT_GT(r.size, 0);
}
