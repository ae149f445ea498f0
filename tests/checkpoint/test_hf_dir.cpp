// Hugging Face model directories as input (issue 36 item 2, checkpoint/interop/hf_dir.h):
// directories written at test time by the real libraries (tests/python/hf_dir_write.py:
// huggingface_hub's save_torch_state_dict, which splits the state dict, names the shards and
// writes model.safetensors.index.json as transformers does, each shard through
// safetensors.torch.save_file; and torch DCP's HuggingFaceStorageWriter where the configured
// Python has it), read by open_checkpoint, load, `tessera ckpt inspect|verify|consolidate|
// reshard|export` and the Python package, every tensor bit for bit against the reference file
// (one safetensors file of the same tensors). Broken copies (an edited index, a missing,
// duplicated or unmapped tensor, a missing shard, file names outside the directory, a symbolic
// link leading out of it, a FIFO, a truncated shard, a huge or malformed index) are refused
// with messages naming the tensor and the file. A rank's rows of a tensor are read alone.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/interop/hf_dir.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/sharding/chunk.h"
#include "tessera/state/state_dict.h"
#include "tessera_tests/python_features.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string kCli = TESSERA_CLI;


// The fixture directories and their manifest (hf_dir_write.py's docstring), in a fresh
// temporary directory.
json write_fixtures(std::string* root) {
  *root = temp_dir("tessera-hfdir");
  auto [rc, out] = run_command(py("hf_dir_write.py " + *root + (TESSERA_PYTHON_HAS_DCP_HF ? " --dcp" : "")));
  if (rc != 0) throw std::runtime_error("hf_dir_write.py failed:\n" + out);
  return json::parse(read_bytes(*root + "/manifest.json"));
}

// Every tensor of the checkpoint at `path`, read whole through Tessera's reader.
std::map<std::string, at::Tensor> read_all(const std::string& path) {
  const ck::CheckpointMetadata m = ck::open_checkpoint(path);
  ck::ChunkReader r(m);
  std::map<std::string, at::Tensor> out;
  for (const auto& k : m.keys) {
    const ck::EntryInfo& e = m.entries.at(k);
    if (e.is_tensor()) out[k] = r.read_box(k, e, sharding::full_box(e.shape));
  }
  return out;
}

// dtype, shape and every byte equal (NaN payloads and -0.0 included).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

void expect_same(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                 const std::string& what) {
  std::set<std::string> g, w;
  for (const auto& kv : got) g.insert(kv.first);
  for (const auto& kv : want) w.insert(kv.first);
  EXPECT_EQ(g, w) << what;
  for (const auto& [k, t] : want)
    if (got.count(k)) EXPECT_TRUE(same_bits(got.at(k), t)) << what << " key " << k;
}

// Bytes this process has read through read(2)-like calls so far (/proc/self/io rchar).
uint64_t bytes_read_so_far() {
  std::ifstream in("/proc/self/io");
  std::string key;
  uint64_t v = 0;
  while (in >> key >> v)
    if (key == "rchar:") return v;
  return 0;
}

}  // namespace

TEST(HfDir, LibraryWrittenDirectoriesLoadBitForBit) {
  std::string root;
  const json man = write_fixtures(&root);
  const auto ref = read_all(man["reference"].get<std::string>());
  ASSERT_EQ(ref.size(), 15u);
  bool dcp = false;
  for (const auto& jd : man["ok"]) {
    const std::string d = jd.get<std::string>();
    SCOPED_TRACE(d);
    dcp |= d.find("/ok/dcp") != std::string::npos;
    EXPECT_TRUE(ck::is_hf_directory(d));
    EXPECT_FALSE(ck::is_tessera_checkpoint(d));
    const ck::CheckpointMetadata m = ck::open_checkpoint(d);
    EXPECT_EQ(m.source_kind, "hf");
    EXPECT_EQ(m.location, d);
    // Keys in shard order, then data order within a shard: the files never go back.
    std::map<std::string, size_t> file_index;
    for (size_t i = 0; i < m.files.size(); ++i) file_index[m.files[i].first] = i;
    EXPECT_TRUE(std::is_sorted(m.files.begin(), m.files.end()));
    size_t last = 0;
    for (const auto& k : m.keys) {
      const auto& e = m.entries.at(k);
      if (e.chunks.empty()) continue;
      ASSERT_EQ(e.chunks.size(), 1u) << k;
      ASSERT_TRUE(file_index.count(e.chunks[0].file)) << k << " in " << e.chunks[0].file;
      EXPECT_GE(file_index.at(e.chunks[0].file), last) << k;
      last = file_index.at(e.chunks[0].file);
    }
    expect_same(read_all(d), ref, d);
    // A strict load into a target of the same keys (what --init-from and Fabric do).
    state::StateDict target;
    for (const auto& [k, t] : ref) target.set(k, at::zeros_like(t));
    const ck::LoadResult res = ck::load_local(target, d);
    EXPECT_EQ(res.loaded.size(), ref.size());
    std::map<std::string, at::Tensor> loaded;
    for (const auto& [k, t] : ref) loaded[k] = target.tensor(k);
    expect_same(loaded, ref, d + " (load)");
  }
  EXPECT_EQ(dcp, TESSERA_PYTHON_HAS_DCP_HF != 0) << "DCP's HuggingFaceStorageWriter output is read where Python has it";
}

TEST(HfDir, CliInspectsVerifiesConsolidatesReshardsAndExports) {
  std::string root;
  const json man = write_fixtures(&root);
  const auto ref = read_all(man["reference"].get<std::string>());
  const std::string hub = root + "/ok/hub";
  const size_t nfiles = man["hub_files"].size();

  auto [irc, itext] = run_command(kCli + " ckpt inspect " + hub);
  EXPECT_EQ(irc, 0) << itext;
  EXPECT_CONTAINS(itext, "kind: hf (a Hugging Face model directory: model.safetensors.index.json and " +
                             std::to_string(nfiles) + " shard file(s))");
  EXPECT_CONTAINS(itext, "index total_size: " + std::to_string(man["index_total_size"].get<uint64_t>()));
  for (const auto& f : man["hub_files"]) EXPECT_CONTAINS(itext, f.get<std::string>());
  EXPECT_CONTAINS(itext, "model.layers.0.self_attn.q_proj.bias");
  auto [src, stext] = run_command(kCli + " ckpt inspect " + root + "/ok/hub-single");
  EXPECT_EQ(src, 0) << stext;
  EXPECT_CONTAINS(stext, "kind: hf (a Hugging Face model directory: model.safetensors)");

  // verify: no checksums to check; says what it checked instead.
  auto [vrc, vtext] = run_command(kCli + " ckpt verify " + hub);
  EXPECT_EQ(vrc, 0) << vtext;
  EXPECT_CONTAINS(vtext, "OK: " + hub + ": ");
  EXPECT_CONTAINS(vtext, std::string(" bytes read (") + ck::kHfVerifyChecked + ")");
  const std::string off = root + "/ok/total-size-off";
  auto [orc, otext] = run_command(kCli + " ckpt verify " + off + " && " + kCli + " ckpt inspect " + off);
  EXPECT_EQ(orc, 0) << otext;
  const std::string note = man["notes"][off][0].get<std::string>();
  EXPECT_CONTAINS(otext, "note: " + note);
  size_t notes = 0;
  for (size_t at = otext.find("note: "); at != std::string::npos; at = otext.find("note: ", at + 1)) ++notes;
  EXPECT_EQ(notes, 2u) << "one note from verify, one from inspect:\n" << otext;
  // Every directory with a note (a total_size off, or no byte count at all: -5, 12.5, "1 GB")
  // verifies, saying it; the count written as a JSON float is taken as the count (no note).
  for (const auto& [d, want] : man["notes"].items()) {
    auto [nrc, ntext] = run_command(kCli + " ckpt verify " + d);
    EXPECT_EQ(nrc, 0) << ntext;
    EXPECT_CONTAINS(ntext, "note: " + want[0].get<std::string>());
  }
  EXPECT_EQ(man["notes"].size(), 4u);
  auto [fzrc, fztext] = run_command(kCli + " ckpt verify " + root + "/ok/total-size-float");
  EXPECT_EQ(fzrc, 0) << fztext;
  EXPECT_EQ(fztext.find("note: "), std::string::npos) << fztext;

  // consolidate: a Tessera consolidated file of the same tensors, with checksums.
  const std::string cons = root + "/hub.safetensors";
  auto [crc, ctext] = run_command(kCli + " ckpt consolidate " + hub + " -o " + cons + " && " + kCli +
                                  " ckpt verify " + cons);
  EXPECT_EQ(crc, 0) << ctext;
  EXPECT_CONTAINS(ctext, "bytes verified");
  EXPECT_EQ(ck::SafetensorsReader(cons).meta("tessera.format"), "tessera-consolidated");
  expect_same(read_all(cons), ref, cons);
  // consolidate never replaces the Hugging Face directory itself (not a Tessera checkpoint).
  auto [frc, ftext] = run_command(kCli + " ckpt consolidate " + cons + " -o " + root + "/ok/hub-single --force");
  EXPECT_EQ(frc, 2) << ftext;
  EXPECT_TRUE(fs::exists(root + "/ok/hub-single/model.safetensors"));

  // reshard to a sharded checkpoint, and back to a Hugging Face directory (whose files then
  // carry Tessera's checksums: verify checks them).
  const std::string sharded = root + "/hub.ckpt", again = root + "/again";
  auto [rrc, rtext] = run_command(kCli + " ckpt reshard " + hub + " --world-size 3 -o " + sharded + " && " + kCli +
                                  " ckpt export " + hub + " --format hf --prefix '' --max-shard-size 4096 -o " + again +
                                  " && " + kCli + " ckpt verify " + again);
  EXPECT_EQ(rrc, 0) << rtext;
  EXPECT_CONTAINS(rtext, "OK: " + again + ": ");
  EXPECT_CONTAINS(rtext, "bytes verified");
  expect_same(read_all(sharded), ref, sharded);
  expect_same(read_all(again), ref, again);
}

TEST(HfDir, BrokenDirectoriesAreRefusedNamingTheTensorAndTheFile) {
  std::string root;
  const json man = write_fixtures(&root);
  ASSERT_GE(man["bad"].size(), 19u);
  for (auto it = man["bad"].begin(); it != man["bad"].end(); ++it) {
    const std::string d = it.key();
    SCOPED_TRACE(d);
    std::vector<std::string> want;
    for (const auto& w : it.value()) want.push_back(w.get<std::string>());
    const std::string open_err = error_of([&] { ck::open_checkpoint(d); });
    for (const auto& w : want) EXPECT_CONTAINS(open_err, w);
    state::StateDict target;
    target.set("model.embed_tokens.weight", at::zeros({64, 16}));
    const std::string load_err = error_of([&] { ck::load_local(target, d, {false}); });
    for (const auto& w : want) EXPECT_CONTAINS(load_err, w);
    EXPECT_TRUE(at::equal(target.tensor("model.embed_tokens.weight"), at::zeros({64, 16})));
    // verify: corrupt (exit 1), every problem on a line of its own; inspect: an error.
    auto [vrc, vtext] = run_command(kCli + " ckpt verify " + d);
    EXPECT_EQ(vrc, 1) << vtext;
    EXPECT_CONTAINS(vtext, "CORRUPT: " + d + ": ");
    for (const auto& w : want) EXPECT_CONTAINS(vtext, w);
    auto [irc, itext] = run_command(kCli + " ckpt inspect " + d);
    EXPECT_EQ(irc, 2) << itext;
    for (const auto& w : want) EXPECT_CONTAINS(itext, w);
    auto [crc, ctext] = run_command(kCli + " ckpt consolidate " + d + " -o " + root + "/out.safetensors");
    EXPECT_EQ(crc, 2) << ctext;
    EXPECT_FALSE(fs::exists(root + "/out.safetensors"));
  }
  // Several problems in one directory: each is named (and verify counts them).
  auto [src, stext] = run_command(kCli + " ckpt verify " + root + "/bad/several");
  EXPECT_CONTAINS(stext, "CORRUPT: " + root + "/bad/several: 2 problem(s)");
}

// A rank reads its rows of a tensor and nothing else: FSDP's load of its shards, the row
// cut of torch.chunk, at 2 and 3 ranks, from an 8 MiB tensor in a shard of its own.
TEST(HfDir, ARankReadsOnlyItsRows) {
  std::string root;
  const json man = write_fixtures(&root);
  const std::string dir = man["rows"]["dir"].get<std::string>(), key = man["rows"]["key"].get<std::string>();
  const at::Tensor full = read_all(man["rows"]["reference"].get<std::string>()).at(key);
  const ck::CheckpointMetadata m = ck::open_checkpoint(dir);
  ASSERT_EQ(m.source_kind, "hf");
  const ck::EntryInfo& e = m.entries.at(key);
  ASSERT_EQ(e.shape, (std::vector<int64_t>{2048, 1024}));
  const uint64_t whole = 2048 * 1024 * 4;
  for (int world : {2, 3}) {
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(std::to_string(r) + " of " + std::to_string(world));
      ck::ChunkReader reader(m);
      const sharding::Box box = sharding::chunk_box(e.shape, 0, world, r);
      const auto chunks = reader.chunks(key, e, box);  // the shard's header is read here
      ASSERT_EQ(chunks.size(), 1u);
      const uint64_t mine = static_cast<uint64_t>(box.numel()) * 4;
      EXPECT_EQ(reader.prefetch(key, e, chunks[0], box), mine) << "the byte range asked for";
      at::Tensor dst = at::empty(box.sizes, at::kFloat);
      const uint64_t before = bytes_read_so_far();
      EXPECT_EQ(reader.copy_into(key, e, chunks[0], dst, box), box.numel());
      const uint64_t read = bytes_read_so_far() - before;
      // The rows' bytes, and at most the direct-I/O alignment at each end beyond them.
      EXPECT_GE(read, mine);
      EXPECT_LE(read, mine + 2 * ck::kDirectAlign) << "of " << whole << " bytes in the tensor";
      EXPECT_TRUE(same_bits(dst, sharding::narrow_to(full, sharding::full_box(e.shape), box)));
    }
  }
}

// The Python package on the same directories (tests/python/tessera_ckpt_hf_check.py): the
// same tensors, the same refusals with the same words, `python -m tessera_ckpt verify`, and
// (torch 2.x) DCP's dcp.load through the package's storage reader.
TEST(PythonPackageHfDir, ReadsLibraryWrittenDirectoriesAndRefusesBrokenOnes) {
  std::string root;
  const json man = write_fixtures(&root);
  const std::string cons = root + "/hub.safetensors";
  auto [crc, ctext] = run_command(kCli + " ckpt consolidate " + root + "/ok/hub -o " + cons);
  ASSERT_EQ(crc, 0) << ctext;
  auto [rc, out] = run_command(py("tessera_ckpt_hf_check.py " + root + " --consolidated " + cons));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_CONTAINS(out, "ok tessera_ckpt_hf_check: " + std::to_string(man["ok"].size() + 1) + " directories, " +
                           std::to_string(man["bad"].size()) + " refusals");
  // With torch 2.x, DCP's own dcp.load reads every good directory through tessera_ckpt.dcp.Reader.
  if (TESSERA_PYTHON_HAS_DCP) EXPECT_CONTAINS(out, ", " + std::to_string(man["ok"].size()) + " through dcp.load");
}
