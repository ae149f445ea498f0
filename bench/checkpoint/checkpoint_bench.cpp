// Checkpoint throughput benchmark, one rank program (start it with `tessera run -n N`).
//   checkpoint_bench MODE DIR TOTAL_MIB [TENSOR_MIB]
// MODE: sharded | full. Builds a state of TOTAL_MIB MiB of float32 (tensors of TENSOR_MIB
// MiB each, default TOTAL_MIB/16, each sharded along dim 0 over the ranks), saves it to DIR, loads it back into a
// zeroed state of the same sharding (cold: the checkpoint's files are first dropped from
// the page cache, as for a load in a later job), checks the values and prints one JSON
// line on rank 0:
// {"mode", "ranks", "bytes", "save_s", "load_s", "save_gib_s", "load_gib_s"}.
#include <ATen/ATen.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/dist/communicator.h"
#include "tessera/sharding/sharded_tensor.h"

using namespace tessera;
namespace ck = tessera::checkpoint;

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

state::StateDict make(const std::shared_ptr<dist::Communicator>& c, int64_t rows, int64_t cols, int count, bool zeros) {
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
}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: checkpoint_bench sharded|full DIR TOTAL_MIB [TENSOR_MIB]\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  const int64_t mib = std::stoll(argv[3]);
  auto c = dist::Communicator::create(dist::World::from_env());
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
