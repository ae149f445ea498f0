// Rank programs for test_save_safety.cpp (issue 35 items 5, 6, 10): consolidated saves
// (and sharded ones) that must fail on every rank at once, and leave the previous
// checkpoint alone, or succeed with rank 0's plain values.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>

#include "support/scenario.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/sharding/sharded_tensor.h"
#include "tessera/state/state_dict.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;

namespace {

// `full` sharded over the ranks on `dim`, each rank holding its own piece (no collective).
sharding::ShardedTensor shard_of(const at::Tensor& full, int64_t dim, const std::shared_ptr<distributed::Communicator>& c) {
  const std::vector<int64_t> shape = full.sizes().vec();
  auto shards = sharding::build_shards(sharding::ChunkSpec::over_ranks(dim, c->size()), shape);
  std::vector<sharding::Shard> local;
  for (const auto& s : shards)
    if (s.placement.rank == c->rank())
      local.push_back({sharding::narrow_to(full, sharding::full_box(shape), s.box).clone(), s});
  return sharding::ShardedTensor::from_parts(local, shards, shape, full.scalar_type(), c);
}

}  // namespace

// save_safety FILE STEP...: saves, one per STEP "[sharded/]VARIANT:ITER[:FAULT]"
// (consolidated, or sharded with the prefix "sharded/": FILE is then a directory), of
//   a, b: [8, 3] float sharded on dim 0 (written by every rank), values 1000 k + 100 ITER + i;
//   g:    [4, 6] float sharded on dim 1 (gathered to rank 0);
//   step: ITER.
// VARIANT: "base"; "swap" (rank 1 lists b before a: same shapes, another order);
// "complex1" (rank 1's g is a complex tensor, which a safetensors file cannot hold);
// "meta1" (rank 1's shard of g is on the meta device: no data); "shape1" (rank 1's b is
// [8, 4]); "plain1" (plain values that differ between the ranks: rank 1's step is
// ITER + 50, and "loss", a per-rank metric, is 0.25 + rank). FAULT ("1:write",
// "0:flip", ...): TESSERA_TEST_SAVE_FAULT for that step only; a suffix "+MODE" sets
// TESSERA_FULL_SAVE_READ_BACK=MODE for it.
// For each step each rank prints one line, "save rank R step S ms T: ok" or
// "save rank R step S ms T: error: ...", then all meet at a barrier, so that no rank is
// stopped before it has printed.
SCENARIO("save_safety") {
  auto c = comm();
  for (size_t step = 1; step < args.args.size(); ++step) {
    std::string spec = args.arg(step);
    const bool sharded = spec.rfind("sharded/", 0) == 0;
    if (sharded) spec.erase(0, 8);
    const size_t p1 = spec.find(':'), p2 = spec.find(':', p1 + 1);
    const std::string variant = spec.substr(0, p1);
    const int64_t iter = std::stoll(spec.substr(p1 + 1, p2 == std::string::npos ? std::string::npos : p2 - p1 - 1));
    std::string fault = p2 == std::string::npos ? "" : spec.substr(p2 + 1);
    ::unsetenv("TESSERA_FULL_SAVE_READ_BACK");
    if (const size_t plus = fault.find('+'); plus != std::string::npos) {
      ::setenv("TESSERA_FULL_SAVE_READ_BACK", fault.substr(plus + 1).c_str(), 1);
      fault.resize(plus);
    }
    if (fault.empty()) ::unsetenv("TESSERA_TEST_SAVE_FAULT");
    else ::setenv("TESSERA_TEST_SAVE_FAULT", fault.c_str(), 1);
    auto value = [&](int64_t k, std::vector<int64_t> shape) {
      return at::arange(shape[0] * shape[1], at::kFloat).reshape(shape) + float(1000 * k + 100 * iter);
    };
    auto a = shard_of(value(0, {8, 3}), 0, c);
    auto b = shard_of(value(1, {8, variant == "shape1" && c->rank() == 1 ? 4 : 3}), 0, c);
    state::StateDict sd;
    if (variant == "swap" && c->rank() == 1) {
      sd.set("b", b);
      sd.set("a", a);
    } else {
      sd.set("a", a);
      sd.set("b", b);
    }
    if (variant == "complex1" && c->rank() == 1) {
      sd.set("g", at::zeros({4, 6}, at::kComplexFloat));
    } else {
      auto g = shard_of(value(2, {4, 6}), 1, c);
      if (variant == "meta1" && c->rank() == 1) {
        std::vector<sharding::Shard> local;
        for (const auto& s : g.local_shards())
          local.push_back({at::empty(s.tensor.sizes(), at::TensorOptions().dtype(at::kFloat).device(at::kMeta)), s.meta});
        g = sharding::ShardedTensor::from_parts(local, g.shards_metadata(), g.shape(), g.dtype(), c);
      }
      sd.set("g", g);
    }
    if (variant == "plain1") {
      sd.set("step", c->rank() == 1 ? iter + 50 : iter);
      sd.set("loss", 0.25 + c->rank());
    } else {
      sd.set("step", iter);
    }
    std::string line = "ok";
    const auto t0 = std::chrono::steady_clock::now();
    try {
      ck::save(sd, args.arg(0), *c, {sharded ? ck::SaveMode::Sharded : ck::SaveMode::Full});
    } catch (const std::exception& e) {
      line = std::string("error: ") + e.what();
      std::replace(line.begin(), line.end(), '\n', ' ');
    }
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "save rank " << c->rank() << " step " << step << " ms " << ms << ": " << line << std::endl;
    c->barrier();
  }
  return 0;
}

// save_safety_big FILE MIB REPEAT: a consolidated save of MIB MiB of float tensors
// (4 of them, sharded on dim 0), REPEAT times; rank 0 prints the best and median times.
SCENARIO("save_safety_big") {
  auto c = comm();
  const int64_t mib = args.int_arg(1, 1024), repeat = args.int_arg(2, 3);
  state::StateDict sd;
  const int64_t rows = mib * (1 << 20) / 4 / 4 / 1024;
  for (int k = 0; k < 4; ++k) sd.set("t" + std::to_string(k), shard_of(at::rand({rows, 1024}), 0, c));
  std::vector<double> s;
  for (int64_t i = 0; i < repeat; ++i) {
    c->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    ck::save(sd, args.arg(0), *c, {ck::SaveMode::Full});
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  if (c->rank() == 0) std::cout << "full save " << mib << " MiB: best " << s.front() << " s median " << s[s.size() / 2] << " s" << std::endl;
  return 0;
}
