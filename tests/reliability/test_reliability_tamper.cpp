// Reliability: metadata edited the way an attacker would, with the checksum recomputed
// as the format requires (docs/checkpoint-format.md §3: the CRC32C of the text with the
// 8 hex digits of "metadata_crc32c" read as "00000000"; §1 for a consolidated header),
// so the checksum passes and only strict validation stands between the edit and a
// load: duplicate JSON keys at any depth, world sizes out of range or truncated on
// narrowing, integers that wrap, a readable float that disagrees with its bits, and a
// Trainer checkpoint whose global_step is negative or absurd. Each must be refused by
// load and verify with an error naming the key and the file.
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <regex>

#include "checkpoint/checkpoint_test_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/strategy/fsdp.h"
#include "trainer/trainer_test_util.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

const std::string kMeta = "/tessera-checkpoint.json";
const std::string kCrcMarker = "\n \"metadata_crc32c\": \"";

// What an attacker does after editing: recompute metadata_crc32c.
std::string rechecksum(std::string text) {
  const size_t at = text.find(kCrcMarker);
  EXPECT_NE(at, std::string::npos);
  text.replace(at + kCrcMarker.size(), 8, "00000000");
  text.replace(at + kCrcMarker.size(), 8, ck::crc_hex(ck::crc32c(text.data(), text.size())));
  return text;
}

// Replaces the first `from` in `text` by `to` (the edit must apply).
std::string edit(const std::string& text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << "'" << from << "' not in the metadata";
  if (at == std::string::npos) return text;
  return text.substr(0, at) + to + text.substr(at + from.size());
}

// The target of what the worker's ckpt_save writes, read back whole.
state::StateDict target_for(const std::string& dir) {
  ck::CheckpointMetadata m = ck::open_checkpoint(dir);
  state::StateDict sd;
  for (const auto& k : m.keys) {
    const auto& e = m.entries.at(k);
    if (e.is_tensor()) sd.set(k, at::zeros(e.shape, at::TensorOptions().dtype(e.dtype)));
  }
  return sd;
}

// `tampered` (re-checksummed) is written over a copy of `good`; load and verify must
// refuse it with a tessera::Error naming every string in `want` and the metadata file.
void expect_refused(const std::string& good, const std::string& work, const std::string& tampered,
                    const std::vector<std::string>& want) {
  fs::remove_all(work);
  fs::copy(good, work, fs::copy_options::recursive);
  write_bytes(work + kMeta, tampered);
  // The checksum is right: only validation can catch the edit.
  EXPECT_NO_THROW(ck::check_metadata_checksum(tampered, work + kMeta));
  std::string load_err = "(no error)";
  try {
    state::StateDict t = target_for(good);
    ck::load_local(t, work);
  } catch (const Error& e) {
    load_err = e.what();
  } catch (const std::exception& e) {
    load_err = std::string("NOT a tessera::Error: ") + e.what();
  }
  ck::VerifyReport v = ck::verify(work);
  std::string problems;
  for (const auto& p : v.problems) problems += p + "\n";
  EXPECT_FALSE(v.ok) << "verify accepted: " << want[0];
  for (const std::string& w : want) {
    EXPECT_NE(load_err.find(w), std::string::npos) << "load: want '" << w << "' in: " << load_err;
    EXPECT_NE(problems.find(w), std::string::npos) << "verify: want '" << w << "' in: " << problems;
  }
  EXPECT_NE(load_err.find(work + kMeta), std::string::npos) << "load error does not name the file: " << load_err;
}

}  // namespace

TEST(ReliabilityTamper, EditedAndRechecksummedMetadataIsRefused) {
  const std::string dir = temp_dir("tessera-rel-tamper");
  const std::string good = dir + "/good", work = dir + "/work";
  auto s = run_ranks(2, {"ckpt_save", good, "sharded", "sharded"}, 120);
  ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
  tessera::testing::downgrade_to_v1(good);  // edits of version 1's indented text
  const std::string text = read_bytes(good + kMeta);
  ASSERT_TRUE(ck::verify(good).ok);
  // The writer's layout, which the edits below rely on.
  ASSERT_NE(text.find("\n \"world_size\": 2\n}"), std::string::npos) << text;  // the last key
  ASSERT_NE(text.find("\n \"version\": 1,"), std::string::npos) << text;
  // The untouched text re-checksummed is accepted (the helper is right).
  state::StateDict t = target_for(good);
  fs::copy(good, dir + "/same", fs::copy_options::recursive);
  write_bytes(dir + "/same" + kMeta, rechecksum(edit(text, "\"value\": 7", "\"value\": 8")));
  ck::LoadResult same = ck::load_local(t, dir + "/same");
  EXPECT_EQ(same.leftovers.integer("opt.step"), 8);  // the helper's checksum is what the reader computes

  // Duplicate keys, at each depth. nlohmann keeps the last silently, so the file would
  // show a reviewer one value and load another.
  expect_refused(good, work, rechecksum(edit(text, "\n \"world_size\": 2\n", "\n \"world_size\": 3,\n \"world_size\": 2\n")),
                 {"duplicate key 'world_size'", "top-level object"});
  expect_refused(good, work,
                 rechecksum(edit(text, "\"kind\": \"int\",", "\"kind\": \"int\",\n   \"value\": 1000000,")),
                 {"duplicate key 'value'", "'entries' > 'opt.step'"});
  {
    // A second entry for the same key inside "entries".
    const size_t at = text.find("\n  \"opt.step\": {");
    ASSERT_NE(at, std::string::npos);
    const size_t end = text.find("\n  }", at);
    std::string block = text.substr(at, end + 4 - at);
    std::string fake = edit(block, "\"value\": 7", "\"value\": 9000");
    expect_refused(good, work, rechecksum(text.substr(0, at) + fake + "," + text.substr(at)),
                   {"duplicate key 'opt.step'", "'entries'"});
  }
  expect_refused(good, work,
                 rechecksum(edit(text, "\"file\": \"data-rank00000.safetensors\",",
                                 "\"file\": \"data-rank00001.safetensors\",\"file\": \"data-rank00000.safetensors\",")),
                 {"duplicate key 'file'", "'entries' > 'model.b' > 'chunks'[]"});

  // world_size: zero, negative, above 2^32 (would truncate to 2 in an int), in range but
  // not the number of data files.
  for (const char* ws : {"0", "-1", "4294967298", "9223372036854775807", "18446744073709551615"})
    expect_refused(good, work, rechecksum(edit(text, "\"world_size\": 2\n", std::string("\"world_size\": ") + ws + "\n")),
                   {"world_size is " + std::string(ws) + ", outside [1, 1048576]"});
  expect_refused(good, work, rechecksum(edit(text, "\"world_size\": 2\n", "\"world_size\": 3\n")),
                 {"world_size is 3 but 2 data files are listed"});
  expect_refused(good, work, rechecksum(edit(text, "\"world_size\": 2\n", "\"world_size\": 2.0\n")),
                 {"world_size: expected an integer"});
  // version 2^32 + 1 would truncate to 1 in an int.
  expect_refused(good, work, rechecksum(edit(text, "\"version\": 1,", "\"version\": 4294967297,")),
                 {"format version 4294967297 is not supported"});
  // An int value above 2^63 would wrap to a negative step.
  expect_refused(good, work, rechecksum(edit(text, "\"value\": 7", "\"value\": 18446744073709551615")),
                 {"key 'opt.step' value is 18446744073709551615, outside"});
  // The readable float changed, its bits not: the edit must not pass unnoticed.
  expect_refused(good, work, rechecksum(edit(text, "\"value\": 0.125", "\"value\": 0.5")),
                 {"key 'opt.lr'", "float value 0.5 disagrees with its bits"});
  EXPECT_TRUE(ck::verify(good).ok);
}

// A consolidated file: tessera.world_size in the safetensors __metadata__, with the
// header checksum recomputed (same length, so offsets stay valid).
TEST(ReliabilityTamper, ConsolidatedWorldSizeAndDuplicateHeaderKeysAreRefused) {
  const std::string dir = temp_dir("tessera-rel-tamper-full");
  const std::string good = dir + "/full.safetensors", work = dir + "/work.safetensors";
  auto s = run_ranks(2, {"ckpt_save", good, "full", "sharded"}, 120);
  ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
  const std::string bytes = read_bytes(good);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  const std::string marker = "\"tessera.header_crc32c\":\"";
  auto reheader = [&](std::string header) {
    EXPECT_EQ(header.size(), n);
    const size_t at = header.find(marker);
    EXPECT_NE(at, std::string::npos);
    header.replace(at + marker.size(), 8, "00000000");
    const std::string lenb = bytes.substr(0, 8);
    uint32_t crc = ck::crc32c_extend(ck::crc32c(lenb.data(), 8), header.data(), header.size());
    header.replace(at + marker.size(), 8, ck::crc_hex(crc));
    return lenb + header + bytes.substr(8 + n);
  };
  const std::string header = bytes.substr(8, n);
  ASSERT_NE(header.find("\"tessera.world_size\":\"2\""), std::string::npos) << header;
  for (const auto& [to, want] : std::vector<std::pair<std::string, std::string>>{
           {"\"tessera.world_size\":\"0\"", "tessera.world_size '0' is not a world size in [1, 1048576]"},
           {"\"tessera.world_size\":\"x\"", "tessera.world_size 'x' is not a world size"}}) {
    write_bytes(work, reheader(edit(header, "\"tessera.world_size\":\"2\"", to)));
    const std::string e = error_of([&] { ck::open_checkpoint(work); });
    EXPECT_CONTAINS(e, want);
    EXPECT_CONTAINS(e, work);
  }
  // The same tensor name twice in the header (model.z renamed model.b: same length).
  ASSERT_NE(header.find("\"model.z\":{"), std::string::npos) << header;
  write_bytes(work, reheader(edit(header, "\"model.z\":{", "\"model.b\":{")));
  const std::string e = error_of([&] { ck::open_checkpoint(work); });
  EXPECT_CONTAINS(e, "duplicate key 'model.b'");
  EXPECT_CONTAINS(e, work);
}

namespace {

struct TinyMlp : trainer::TrainingModule {
  torch::nn::Sequential net;
  torch::nn::AnyModule configure_model() override {
    at::manual_seed(9);
    net = torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 1));
    return torch::nn::AnyModule(strategy::WrappedModule(net));
  }
  trainer::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1))};
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean();
  }
};

}  // namespace

// A Trainer checkpoint whose global_step (or epoch, or sampler counters) was edited to a
// negative or absurd value, re-checksummed: resuming refuses it, naming the key and the
// checkpoint, and leaves the checkpoint as it was.
TEST(ReliabilityTamper, TrainerRefusesOutOfRangeCountersOnResume) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.max_steps = 3;
  o.fabric.state_dict_type = strategy::StateDictType::Sharded;
  {
    trainer::Trainer t(o);
    TinyMlp m;
    t.fit(m, regression_data(12));
  }
  const std::string ckpt = tmp.path + "/checkpoints/last.ckpt";
  ASSERT_TRUE(fs::is_directory(ckpt));
  tessera::testing::downgrade_to_v1(ckpt);
  const std::string text = read_bytes(ckpt + kMeta);
  const std::regex step_re("(\"global_step\": \\{\\s*\"kind\": \"int\",\\s*\"value\": )3\n");
  ASSERT_TRUE(std::regex_search(text, step_re)) << text;
  auto set_value = [&](const std::string& key, const std::string& value) {
    const std::regex re("(\"" + key + "\": \\{\\s*\"kind\": \"int\",\\s*\"value\": )-?[0-9]+\n");
    EXPECT_TRUE(std::regex_search(text, re)) << key;
    return rechecksum(std::regex_replace(text, re, "$01" + value + "\n", std::regex_constants::format_first_only));
  };
  struct Case {
    std::string key, value, name;
  };
  for (const Case& c : std::vector<Case>{{"global_step", "-1", "global_step"},
                                         {"global_step", "9223372036854775807", "global_step"},
                                         {"global_step", "1099511627777", "global_step"},
                                         {"epoch", "-5", "epoch"},
                                         {"sampler.num_replicas", "0", "sampler.num_replicas"},
                                         {"sampler.position", "-3", "sampler.position"}}) {
    const std::string tampered = set_value(c.key, c.value);
    write_bytes(ckpt + kMeta, tampered);
    EXPECT_NO_THROW(ck::check_metadata_checksum(tampered, ckpt));
    auto o2 = o;
    o2.max_steps = 6;
    trainer::Trainer t(o2);
    TinyMlp m;
    const std::string e = error_of([&] { t.fit(m, regression_data(12), ckpt); });
    EXPECT_CONTAINS(e, "key '" + c.name + "' is " + c.value + ", outside");
    EXPECT_CONTAINS(e, ckpt);
    EXPECT_EQ(read_bytes(ckpt + kMeta), tampered) << "the checkpoint changed";
  }
  // The original resumes.
  write_bytes(ckpt + kMeta, text);
  auto o3 = o;
  o3.max_steps = 6;
  trainer::Trainer t(o3);
  TinyMlp m;
  t.fit(m, regression_data(12), ckpt);
  EXPECT_EQ(t.global_step(), 6);
}
