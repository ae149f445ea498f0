// Collective bandwidth over the Communicator: all-reduce, all-gather, reduce-scatter
// from 1 MiB to 256 MiB over the shared-memory channel and over Gloo, reported as GB/s
// and as a ratio to a memcpy of the same bytes measured in the same run on the same
// machine (the limit for ranks that share one host's memory). Start with:
//   tessera run -n 2 -- bench_collectives OUT.json [TABLE_NAME]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tessera/config.h"
#include "tessera/distributed/communicator.h"

using namespace tessera;
using Clock = std::chrono::steady_clock;

namespace {

template <typename F>
double best_seconds(distributed::Communicator& c, int iters, F&& f) {
  f();  // warm-up
  c.barrier();
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    c.barrier();
    auto t0 = Clock::now();
    f();
    double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    // The slowest rank defines the collective's time.
    dt = c.all_reduce_double(dt, distributed::ReduceOp::Max);
    best = std::min(best, dt);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out = argc > 1 ? argv[1] : "bench/results/collectives.json";
  // The table's name in docs/benchmarks-history.md: one per libtorch build measured.
  std::string name = argc > 2 ? argv[2] : "collectives";
  distributed::CommOptions opts{std::chrono::seconds(300)};
  auto comm = distributed::Communicator::create(distributed::World::from_env(), opts);
  const int n = comm->size(), r = comm->rank();
  // The same collectives over both CPU transports, in one run: the shared-memory channel
  // (ranks on one host, the default) and Gloo over TCP loopback (the path between hosts).
  std::vector<int> all(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) all[static_cast<size_t>(k)] = k;
  distributed::CommOptions gloo_opts = opts;
  gloo_opts.shared_memory = false;
  gloo_opts.gloo_native = false;
  auto gloo = comm->split({all}, gloo_opts);
  // Gloo's own single-tensor all-gather / reduce-scatter where this libtorch has them
  // (torch 2.x); on 1.13 the same calls fall back to point to point, and the JSON says so.
  distributed::CommOptions native_opts = gloo_opts;
  native_opts.gloo_native = true;
  auto native = comm->split({all}, native_opts);
  std::vector<std::pair<std::string, distributed::Communicator*>> transports;
  if (comm->uses_shared_memory()) transports.emplace_back("shm", comm.get());
  transports.emplace_back("gloo", gloo.get());
  transports.emplace_back("gloo-native", native.get());
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t mib : {1, 4, 16, 64, 256}) {
    const int64_t bytes = mib << 20;
    const int64_t elems = bytes / 4;
    const int iters = mib >= 64 ? 3 : 8;
    at::Tensor buf = at::ones({elems});
    at::Tensor dst = at::empty({elems});
    // memcpy limit: one copy of the same bytes on this rank.
    double t_copy = best_seconds(*comm, iters, [&] { dst.copy_(buf); });
    const double s = static_cast<double>(bytes);
    auto gbs = [](double b, double t) { return b / t / 1e9; };
    const double copy_gbs = gbs(s, t_copy);
    for (auto& [name, c] : transports) {
      double t_ar = best_seconds(*c, iters, [&] { c->all_reduce(buf); });
      const int64_t piece = elems / n;
      at::Tensor local = at::ones({piece});
      std::vector<int64_t> sizes(n, piece);
      // As FSDP calls them: all-gather into a standing output buffer, reduce-scatter with
      // its staging from the process's CPU allocator (core/cpu_allocator.h, installed by
      // Communicator::create), so the figures are the collectives' and not the first
      // touch of freshly mapped pages.
      at::Tensor gathered = at::empty({piece * n});
      double t_ag = best_seconds(*c, iters, [&] { c->all_gather_async(local, sizes, gathered).wait(); });
      at::Tensor full = at::ones({piece * n});
      double t_rs = best_seconds(*c, iters, [&] { c->reduce_scatter(full, sizes); });
      // Bus bandwidth (bytes each rank must move, as nccl-tests defines it):
      // all-reduce 2(n-1)/n * S, all-gather and reduce-scatter (n-1)/n * S.
      auto row = [&](const char* op, double t, double factor) {
        double bus = gbs(s * factor, t);
        return nlohmann::json{{"op", op},          {"transport", name},   {"mib", mib},
                              {"seconds", t},      {"algbw_gbs", gbs(s, t)}, {"busbw_gbs", bus},
                              {"memcpy_gbs", copy_gbs}, {"ratio_to_memcpy", bus / copy_gbs}};
      };
      rows.push_back(row("all_reduce", t_ar, 2.0 * (n - 1) / n));
      rows.push_back(row("all_gather", t_ag, 1.0 * (n - 1) / n));
      rows.push_back(row("reduce_scatter", t_rs, 1.0 * (n - 1) / n));
      if (r == 0) {
        std::cout << mib << " MiB " << name << ": memcpy " << copy_gbs << " GB/s; all_reduce bus "
                  << rows[rows.size() - 3]["busbw_gbs"] << ", all_gather bus " << rows[rows.size() - 2]["busbw_gbs"]
                  << ", reduce_scatter bus " << rows.back()["busbw_gbs"] << " GB/s" << std::endl;
      }
    }
  }
  const auto caps = native->capabilities();
  auto route = [](int native_cap) {
    return native_cap == 1 ? std::string("Gloo's native single-tensor form")
                           : std::string("point to point (this Gloo has no single-tensor form)");
  };
  if (r == 0) {
    nlohmann::json doc{{"benchmark", name},
                       {"libtorch", TESSERA_TORCH_VERSION},
                       {"world_size", n},
                       {"transports", {{"shm", "shared-memory channel (distributed/shm_channel.h)"},
                                       {"gloo", "Gloo over TCP loopback: all-gather and reduce-scatter point to point"},
                                       {"gloo-native", "Gloo over TCP loopback, CommOptions::gloo_native: all-gather " +
                                                           route(caps.allgather_base) + ", reduce-scatter " +
                                                           route(caps.reduce_scatter_base)}}},
                       {"intra_op_threads", static_cast<int>(at::get_num_threads())},
                       {"rows", rows}};
    std::ofstream f(out);
    f << doc.dump(2) << "\n";
    std::cout << "wrote " << out << std::endl;
  }
  return 0;
}
