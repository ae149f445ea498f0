// Checkpoint throughput benchmark, one rank program (start it with `tessera run -n N`).
//   checkpoint_bench MODE DIR TOTAL_MIB [TENSOR_MIB]
// MODE: sharded | full. Builds a state of TOTAL_MIB MiB of float32 (tensors of TENSOR_MIB
// MiB each, default TOTAL_MIB/16, each sharded along dim 0 over the ranks), saves it to DIR, loads it back into a
// zeroed state of the same sharding (cold: the checkpoint's files are first dropped from
// the page cache, as for a load in a later job), checks the values and prints one JSON
// line on rank 0:
// {"mode", "ranks", "bytes", "save_s", "load_s", "save_gib_s", "load_gib_s"}.
//
// MODE gpt-save | gpt-load | gpt-async: the model + AdamW state of a GPT-like model of
// about TOTAL_MIB MiB (gpt_layout below; bench/peers/dcp_bench.py builds the same
// tensors for PyTorch DCP), every tensor sharded along dim 0 (uneven where the rows are
// odd), each step's count a replicated scalar. Each mode first saves a one-tensor state
// to DIR.warmup (both sides do, so that no one-off start-up cost lands in the figures).
//   gpt-save: save (Sharded) to DIR -> {"save_s"}; the driver drops the files' pages
//   gpt-load: a later job loads DIR into a zeroed state, checks it -> {"load_s"}
//   gpt-async: two save_async calls (DIR.1, then DIR.2 after the first is committed):
//     blocking = until save_async returns (training may continue), total = until wait()
//     returns (committed), each the maximum over the ranks -> {"first_blocking_s",
//     "first_total_s", "blocking_s", "total_s"} (the first also creates the background
//     communicator; later saves of a run are like the second).
#include <ATen/ATen.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/distributed/communicator.h"
#include "tessera/sharding/sharded_tensor.h"

using namespace tessera;
namespace ck = tessera::checkpoint;

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

state::StateDict make(const std::shared_ptr<distributed::Communicator>& c, int64_t rows, int64_t cols, int count, bool zeros) {
  state::StateDict sd;
  for (int i = 0; i < count; ++i) {
    const std::vector<int64_t> shape = {rows, cols};
    auto shards = sharding::build_shards(sharding::ChunkSpec::over_ranks(0, c->size()), shape);
    std::vector<sharding::Shard> local;
    for (const auto& s : shards) {
      if (s.placement.rank != c->rank()) continue;
      at::Tensor t = zeros ? at::zeros(s.box.sizes) : at::full(s.box.sizes, static_cast<float>(i + 1));
      local.push_back({t, s});
    }
    sd.set("layer" + std::to_string(i) + ".weight", sharding::ShardedTensor::from_parts(local, shards, shape, at::kFloat, c));
  }
  return sd;
}
// Drops the (clean, fsync'ed) pages of every file under `path` from the page cache.
void drop_cached(const std::string& path) {
  namespace fs = std::filesystem;
  auto drop = [](const fs::path& f) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  };
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path))
      if (e.is_regular_file()) drop(e.path());
  } else {
    drop(path);
  }
}

// ------------------------------------------------------------------ GPT-like layout
// Parameters of a GPT (untied head, 4 pre-norm blocks, d_model d from the size, d
// positions, a vocabulary filling the rest of TOTAL_MIB, made odd so that the embedding
// and head split unevenly over 2 ranks); the state is each parameter plus AdamW's
// exp_avg and exp_avg_sq (a third each) and its step. Mirrored in dcp_bench.py.
std::vector<std::pair<std::string, std::vector<int64_t>>> gpt_layout(int64_t mib) {
  const int64_t d = 64 * std::max<int64_t>(2, std::llround(16 * std::sqrt(static_cast<double>(mib) / 1024)));
  const int64_t layers = 4, positions = d;
  const int64_t budget = mib * (1 << 20) / 12;  // parameters: bytes / 4 (fp32) / 3 (param, exp_avg, exp_avg_sq)
  int64_t vocab = (budget - positions * d - layers * (12 * d * d + 13 * d) - 2 * d) / (2 * d);
  if (vocab % 2 == 0) --vocab;
  if (vocab < 1) throw std::runtime_error("TOTAL_MIB too small for the GPT layout");
  std::vector<std::pair<std::string, std::vector<int64_t>>> out = {{"tok_emb.weight", {vocab, d}},
                                                                   {"pos_emb.weight", {positions, d}}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"ln1.weight", {d}}, {"ln1.bias", {d}}, {"attn.qkv.weight", {3 * d, d}}, {"attn.qkv.bias", {3 * d}},
             {"attn.proj.weight", {d, d}}, {"attn.proj.bias", {d}}, {"ln2.weight", {d}}, {"ln2.bias", {d}},
             {"mlp.fc.weight", {4 * d, d}}, {"mlp.fc.bias", {4 * d}}, {"mlp.proj.weight", {d, 4 * d}},
             {"mlp.proj.bias", {d}}})
      out.push_back({b + name, shape});
  }
  out.push_back({"ln_f.weight", {d}});
  out.push_back({"ln_f.bias", {d}});
  out.push_back({"head.weight", {vocab, d}});
  return out;
}

// Every sharded tensor's local piece holds one value: its index among the sharded
// tensors + 1 + rank / 2 (dcp_bench.py uses the same), so a load that put a piece in the
// wrong place or left it zero is caught. Keys as DCP flattens {"model": ..., "optim":
// {"state": {fqn: {"exp_avg", "exp_avg_sq", "step"}}}}.
struct GptState {
  state::StateDict sd;
  std::vector<std::pair<std::string, float>> expect;  // sharded key -> value of this rank's piece
  uint64_t bytes = 0;
};

GptState make_gpt(const std::shared_ptr<distributed::Communicator>& c, int64_t mib, bool zeros) {
  GptState g;
  int index = 0;
  auto add = [&](const std::string& key, const std::vector<int64_t>& shape) {
    const float value = static_cast<float>(index++) + 1.0f + 0.5f * static_cast<float>(c->rank());
    auto shards = sharding::build_shards(sharding::ChunkSpec::over_ranks(0, c->size()), shape);
    std::vector<sharding::Shard> local;
    for (const auto& s : shards)
      if (s.placement.rank == c->rank()) local.push_back({zeros ? at::zeros(s.box.sizes) : at::full(s.box.sizes, value), s});
    g.sd.set(key, sharding::ShardedTensor::from_parts(local, shards, shape, at::kFloat, c));
    g.expect.emplace_back(key, value);
    int64_t n = 4;
    for (auto x : shape) n *= x;
    g.bytes += static_cast<uint64_t>(n);
  };
  const auto layout = gpt_layout(mib);
  for (const auto& [fqn, shape] : layout) add("model." + fqn, shape);
  for (const auto& [fqn, shape] : layout) {
    const std::string k = "optim.state." + fqn + ".";
    add(k + "exp_avg", shape);
    add(k + "exp_avg_sq", shape);
    g.sd.set(k + "step", zeros ? at::zeros({}) : at::full({}, 100.0f));
    g.bytes += 4;
  }
  return g;
}

bool check_gpt(const GptState& g) {
  for (const auto& [key, value] : g.expect)
    for (const auto& s : g.sd.sharded(key).local_shards())
      if (s.tensor.numel() && (s.tensor.min().item<float>() != value || s.tensor.max().item<float>() != value)) {
        std::cerr << "wrong values after load in " << key << "\n";
        return false;
      }
  for (const auto& k : g.sd.keys())
    if (std::get_if<at::Tensor>(&g.sd.at(k)) && g.sd.tensor(k).item<float>() != 100.0f) {
      std::cerr << "wrong value after load in " << k << "\n";
      return false;
    }
  return true;
}

// The maximum of `x` over the ranks.
double max_over_ranks(distributed::Communicator& c, double x) {
  double m = x;
  for (const auto& s : c.all_gather_bytes(std::to_string(x))) m = std::max(m, std::stod(s));
  return m;
}

int run_gpt(const std::string& mode, const std::string& dir, int64_t mib) {
  auto c = distributed::Communicator::create(distributed::World::from_env());
  {
    // Warm-up: a small save, as dcp_bench.py does (removed again by rank 0).
    state::StateDict w;
    w.set("warmup", at::ones({4}));
    ck::save(w, dir + ".warmup", *c);
    c->barrier();
    if (c->rank() == 0) std::filesystem::remove_all(dir + ".warmup");
  }
  GptState g = make_gpt(c, mib, mode == "gpt-load");
  const size_t tensors = g.sd.size();
  char json[512];
  if (mode == "gpt-save") {
    c->barrier();
    const double t0 = now_s();
    ck::save(g.sd, dir, *c);
    c->barrier();
    const double s = now_s() - t0;
    std::snprintf(json, sizeof json, "\"save_s\": %.4f", s);
  } else if (mode == "gpt-load") {
    c->barrier();
    const double t0 = now_s();
    ck::load(g.sd, dir, *c);
    c->barrier();
    const double s = now_s() - t0;
    if (!check_gpt(g)) return 1;
    std::snprintf(json, sizeof json, "\"load_s\": %.4f", s);
  } else if (mode == "gpt-async") {
    double blocking[2], total[2];
    for (int i = 0; i < 2; ++i) {
      c->barrier();
      const double t0 = now_s();
      ck::AsyncSave h = ck::save_async(g.sd, dir + "." + std::to_string(i + 1), c);
      const double t1 = now_s();
      h.wait();
      const double t2 = now_s();
      blocking[i] = max_over_ranks(*c, t1 - t0);
      total[i] = max_over_ranks(*c, t2 - t0);
    }
    std::snprintf(json, sizeof json,
                  "\"first_blocking_s\": %.4f, \"first_total_s\": %.4f, \"blocking_s\": %.4f, \"total_s\": %.4f",
                  blocking[0], total[0], blocking[1], total[1]);
  } else {
    std::cerr << "unknown mode " << mode << "\n";
    return 2;
  }
  if (c->rank() == 0)
    std::printf("{\"mode\": \"%s\", \"ranks\": %d, \"bytes\": %llu, \"tensors\": %zu, %s}\n", mode.c_str(),
                c->size(), static_cast<unsigned long long>(g.bytes), tensors, json);
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc >= 4 && std::string(argv[1]).rfind("gpt-", 0) == 0) return run_gpt(argv[1], argv[2], std::stoll(argv[3]));
  if (argc < 4) {
    std::cerr << "usage: checkpoint_bench sharded|full DIR TOTAL_MIB [TENSOR_MIB]\n"
                 "       checkpoint_bench gpt-save|gpt-load|gpt-async DIR TOTAL_MIB\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  const int64_t mib = std::stoll(argv[3]);
  auto c = distributed::Communicator::create(distributed::World::from_env());
  const int64_t tensor_mib = argc > 4 ? std::stoll(argv[4]) : std::max<int64_t>(1, mib / 16);
  const int count = static_cast<int>(std::max<int64_t>(1, mib / tensor_mib));
  const int64_t cols = 1024;
  const int64_t rows = mib * (1 << 20) / 4 / cols / count;
  const uint64_t bytes = static_cast<uint64_t>(rows * cols * 4) * count;
  auto sd = make(c, rows, cols, count, false);
  c->barrier();
  double t0 = now_s();
  ck::save(sd, dir, *c, {mode == "full" ? ck::SaveMode::Full : ck::SaveMode::Sharded});
  c->barrier();
  const double save_s = now_s() - t0;
  auto target = make(c, rows, cols, count, true);
  if (c->rank() == 0) drop_cached(dir);
  c->barrier();
  t0 = now_s();
  ck::load(target, dir, *c);
  c->barrier();
  const double load_s = now_s() - t0;
  for (int i = 0; i < count; ++i)
    for (const auto& s : target.sharded("layer" + std::to_string(i) + ".weight").local_shards())
      if (s.tensor.numel() && (s.tensor.min().item<float>() != i + 1 || s.tensor.max().item<float>() != i + 1)) {
        std::cerr << "wrong values after load\n";
        return 1;
      }
  if (c->rank() == 0) {
    const double gib = static_cast<double>(bytes) / (1 << 30);
    std::printf("{\"mode\": \"%s\", \"ranks\": %d, \"bytes\": %llu, \"save_s\": %.4f, \"load_s\": %.4f, "
                "\"save_gib_s\": %.3f, \"load_gib_s\": %.3f}\n",
                mode.c_str(), c->size(), static_cast<unsigned long long>(bytes), save_s, load_s, gib / save_s,
                gib / load_s);
  }
  return 0;
}
