// Reliability: random corruption of real checkpoints (sharded, saved by 2 rank
// processes, and consolidated). Every case — a flipped byte anywhere (data, safetensors
// header, metadata JSON), a truncation, a deleted file, appended garbage — must be
// reported by `verify` and by `load` with an error naming the damaged file; a load that
// succeeds must return exactly the saved content. Counts: TESSERA_SOAK=1 for the long
// run (make soak), TESSERA_SEED to change the base seed.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>

#include "reliability/reliability_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/state/state_dict.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

// The zero-valued plain-layout target of what the worker's ckpt_save writes
// (tests/checkpoint/checkpoint_scenarios.cpp, make_state).
state::StateDict zero_target() {
  auto model = std::make_shared<state::StateDict>();
  auto opt = std::make_shared<state::StateDict>();
  auto z = [](std::vector<int64_t> s, at::ScalarType t) { return at::zeros(s, at::TensorOptions().dtype(t)); };
  model->set("w", z({7, 5}, at::kFloat));
  model->set("v", z({3, 10}, at::kBFloat16));
  model->set("e", z({0, 4}, at::kFloat));
  model->set("b", z({5}, at::kFloat));
  model->set("s", z({}, at::kDouble));
  model->set("z", z({0}, at::kLong));
  opt->set("m", z({9}, at::kBFloat16));
  opt->set("big", z({6, 3, 2}, at::kFloat));
  opt->set("step", int64_t(0));
  opt->set("lr", 0.0);
  state::StateDict sd;
  sd.set("model", model);
  sd.set("opt", opt);
  sd.set("name", std::string());
  sd.set("blob", state::Bytes{});
  return sd;
}

// "" when equal, else the first difference.
std::string diff(const state::StateDict& a, const state::StateDict& b) {
  auto fa = a.flatten(), fb = b.flatten();
  if (fa.size() != fb.size()) return "different key counts";
  for (size_t i = 0; i < fa.size(); ++i) {
    const auto& [k, va] = fa[i];
    const state::Value* vb = fb[i].second;
    if (k != fb[i].first || va->index() != vb->index()) return "key " + k + " differs in name/kind";
    if (auto t = std::get_if<at::Tensor>(va)) {
      const auto& u = std::get<at::Tensor>(*vb);
      if (t->scalar_type() != u.scalar_type() || t->sizes() != u.sizes() || !at::equal(*t, u)) return "tensor " + k;
    } else if (auto x = std::get_if<int64_t>(va)) {
      if (*x != std::get<int64_t>(*vb)) return "int " + k;
    } else if (auto d = std::get_if<double>(va)) {
      if (std::memcmp(d, &std::get<double>(*vb), sizeof(double)) != 0) return "float " + k;
    } else if (auto s = std::get_if<std::string>(va)) {
      if (*s != std::get<std::string>(*vb)) return "string " + k;
    } else if (auto by = std::get_if<state::Bytes>(va)) {
      if (!(*by == std::get<state::Bytes>(*vb))) return "bytes " + k;
    }
  }
  return "";
}

struct Outcome {
  int tried = 0, verify_detected = 0, load_detected = 0, wrong_data = 0, silent_identical = 0;
};

void copy_checkpoint(const std::string& src, const std::string& dst) {
  fs::remove_all(dst);
  fs::copy(src, dst, fs::copy_options::recursive);
}

// One corruption case on a copy of `pristine` (a directory or a file) at `work`.
// Returns a description; updates `o`; ADD_FAILUREs name the seed.
void run_case(const std::string& pristine, const std::string& work, uint64_t seed, const state::StateDict& ref,
              std::map<std::string, Outcome>& by_kind) {
  std::mt19937_64 rng(seed);
  copy_checkpoint(pristine, work);
  std::vector<std::string> files;
  if (fs::is_directory(work)) {
    for (const auto& e : fs::directory_iterator(work)) files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(work);
  }
  const std::string file = files[std::uniform_int_distribution<size_t>(0, files.size() - 1)(rng)];
  std::string bytes = read_bytes(file);
  const int what = std::uniform_int_distribution<int>(0, 99)(rng);
  std::string kind, detail;
  if (what < 60 && !bytes.empty()) {
    // Half the flips land in the first 1 KiB (length, JSON header / metadata), half anywhere.
    const size_t lim = what < 30 ? std::min<size_t>(bytes.size(), 1024) : bytes.size();
    const size_t pos = std::uniform_int_distribution<size_t>(0, lim - 1)(rng);
    const auto x = static_cast<char>(std::uniform_int_distribution<int>(1, 255)(rng));
    bytes[pos] = static_cast<char>(bytes[pos] ^ x);
    write_bytes(file, bytes);
    kind = "flip";
    detail = "byte " + std::to_string(pos) + " ^= " + std::to_string(static_cast<unsigned char>(x));
  } else if (what < 80 && !bytes.empty()) {
    const size_t len = std::uniform_int_distribution<size_t>(0, bytes.size() - 1)(rng);
    write_bytes(file, bytes.substr(0, len));
    kind = "truncate";
    detail = "to " + std::to_string(len) + " of " + std::to_string(bytes.size()) + " bytes";
  } else if (what < 92) {
    fs::remove(file);
    kind = "delete";
  } else {
    bytes += std::string(std::uniform_int_distribution<size_t>(1, 64)(rng), '\x5a');
    write_bytes(file, bytes);
    kind = "append";
  }
  Outcome& o = by_kind[kind];
  ++o.tried;
  const std::string name = fs::path(file).filename().string();
  const std::string where = "seed " + std::to_string(seed) + ": " + kind + " " + file + " " + detail;

  ck::VerifyReport v = ck::verify(work);
  std::string problems;
  for (const auto& p : v.problems) problems += p + "\n";
  if (!v.ok) ++o.verify_detected;
  EXPECT_FALSE(v.ok) << where << ": verify accepted it";
  if (!v.ok) EXPECT_NE(problems.find(name), std::string::npos) << where << ": verify does not name the file:\n" << problems;

  state::StateDict t = zero_target();
  bool threw = false;
  try {
    ck::load_local(t, work);
  } catch (const Error& e) {
    threw = true;
    ++o.load_detected;
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << where << ": load error does not name the file: "
                                                                   << e.what();
  } catch (const std::exception& e) {
    threw = true;
    ADD_FAILURE() << where << ": load raised a non-Tessera exception: " << e.what();
  }
  if (!threw) {
    const std::string d = diff(t, ref);
    if (d.empty()) {
      ++o.silent_identical;
    } else {
      ++o.wrong_data;
    }
    ADD_FAILURE() << where << ": load succeeded" << (d.empty() ? " (content identical)" : " with WRONG data: " + d);
  }
}

}  // namespace

TEST(ReliabilityCorruption, RandomDamageIsAlwaysDetectedAndNamesTheFile) {
  const std::string dir = temp_dir("tessera-rel-corrupt");
  const std::string sharded = dir + "/sharded", full = dir + "/full.safetensors";
  auto s = run_ranks(2, {"ckpt_save", sharded, "sharded", "sharded"}, 120);
  ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
  auto f = run_ranks(2, {"ckpt_save", full, "full", "sharded"}, 120);
  ASSERT_EQ(f.launch.exit_code, 0) << f.all_output();
  ASSERT_TRUE(ck::verify(sharded).ok);
  ASSERT_TRUE(ck::verify(full).ok);
  state::StateDict ref = zero_target();
  ck::load_local(ref, sharded);
  state::StateDict ref_full = zero_target();
  ck::load_local(ref_full, full);
  ASSERT_EQ(diff(ref, ref_full), "");
  ASSERT_EQ(ref.dict("opt").integer("step"), 7);

  const int cases = scaled(100, 2000);
  const uint64_t seed0 = base_seed();
  std::map<std::string, Outcome> sh, co;
  for (int i = 0; i < cases && !::testing::Test::HasFailure(); ++i) {
    const bool consolidated = i % 2 == 1;
    run_case(consolidated ? full : sharded, dir + (consolidated ? "/work.safetensors" : "/work"), seed0 + i, ref,
             consolidated ? co : sh);
  }
  auto print = [](const char* what, const std::map<std::string, Outcome>& m) {
    for (const auto& [k, o] : m)
      std::cout << "[corruption] " << what << " " << k << ": tried " << o.tried << ", verify detected "
                << o.verify_detected << ", load detected " << o.load_detected << ", load returned identical "
                << o.silent_identical << ", wrong data " << o.wrong_data << std::endl;
  };
  print("sharded", sh);
  print("consolidated", co);
  // The pristine copies are untouched by all this.
  EXPECT_TRUE(ck::verify(sharded).ok);
}
