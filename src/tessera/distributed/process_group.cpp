// Creation of the c10d process groups (process_group.h): the Gloo device for the
// rendezvous address, Gloo and NCCL options from CommOptions, the world's groups after
// the rendezvous and those of a split.
#include "tessera/distributed/process_group.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <chrono>

#include "tessera/core/env.h"
#include "tessera/core/error.h"
#include "tessera/distributed/rendezvous.h"

namespace tessera::distributed {
namespace {

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const World& world) {
  if (auto ifname = env::get("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
  }
  const std::string& a = world.master_addr;
  if (a == "localhost" || a.rfind("127.", 0) == 0 || a == "::1") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

compat::BackendPtr make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             const World& world, const CommOptions& o) {
  auto opts = c10d::ProcessGroupGloo::Options::create(o.timeout);
  opts->devices.push_back(make_gloo_device(world));
  opts->threads = std::max(1, o.gloo_threads);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

compat::BackendPtr make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             const CommOptions& o) {
#if TESSERA_HAS_NCCL
  if (!at::hasCUDA()) return {};
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = o.timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
#else
  (void)store; (void)rank; (void)size; (void)o;
  return {};
#endif
}

c10::intrusive_ptr<c10d::Store> prefixed(const std::string& prefix, const c10::intrusive_ptr<c10d::Store>& store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
}

}  // namespace

CommOptions effective_options(const CommOptions& options) {
  CommOptions o = options;
  o.gloo_native = env::get_bool("TESSERA_GLOO_NATIVE").value_or(options.gloo_native);
  return o;
}

void check_options(const CommOptions& options) {
  TESSERA_CHECK(options.backend == "auto" || options.backend == "gloo" || options.backend == "nccl",
                "backend '", options.backend, "' is not one of auto, gloo, nccl");
  TESSERA_CHECK(options.timeout.count() > 0, "communicator timeout must be positive");
}

ProcessGroups create_world_groups(const World& world, const CommOptions& options, const std::string& prefix) {
  if (options.backend == "nccl" && !TESSERA_HAS_NCCL) {
    throw Error("backend 'nccl' requested but this Tessera build has no NCCL (libtorch without CUDA/NCCL)");
  }
  ProcessGroups g;
  if (!world.is_distributed()) return g;
  TESSERA_CHECK(world.master_port > 0, "rendezvous needs MASTER_PORT (rank ", world.rank, ")");
  auto store = connect_store(world, options.timeout);
  auto base = prefixed(prefix, store);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    if (options.backend != "nccl") {
      g.gloo = make_gloo(prefixed("gloo", base), world.rank, world.world_size, world, options);
    }
    if (options.backend != "gloo") {
      g.nccl = make_nccl(prefixed("nccl", base), world.rank, world.world_size, options);
    }
  } catch (const std::exception& e) {
    throw_join_failure(world, *store, options.timeout,
                       std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0),
                       e);
  }
  g.store = base;
  return g;
}

ProcessGroups create_subgroups(const ProcessGroups& parent, int split, int group, int rank, int size,
                               const World& world, const CommOptions& options) {
  ProcessGroups g;
  g.store = prefixed(concat("split", split, "/g", group), parent.store);
  try {
    if (parent.gloo) g.gloo = make_gloo(prefixed("gloo", g.store), rank, size, world, options);
    if (parent.nccl) g.nccl = make_nccl(prefixed("nccl", g.store), rank, size, options);
  } catch (const std::exception& e) {
    throw CommError(concat("creating subgroup ", group, " (split ", split, ") on rank ", world.rank,
                           " failed: ", e.what()));
  }
  return g;
}

}  // namespace tessera::distributed
