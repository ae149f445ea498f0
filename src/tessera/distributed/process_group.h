// The c10d process groups behind one Communicator: after the rendezvous (rendezvous.h)
// a Gloo group for CPU tensors and, where this libtorch has NCCL and CUDA is present, an
// NCCL group for CUDA tensors; the same again for each subgroup of a split, under its
// own store prefix. Internal to the distributed layer.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

#include "tessera/core/compat.h"
#include "tessera/distributed/types.h"
#include "tessera/distributed/world.h"

namespace tessera::distributed {

struct ProcessGroups {
  c10::intrusive_ptr<c10d::Store> store;  // this group's (prefixed) store; null for one process
  compat::BackendPtr gloo;                // null for one process or with backend "nccl"
  compat::BackendPtr nccl;                // null unless built with NCCL and CUDA is present
};

// The options a group runs with: `options` with the environment's overrides applied
// (TESSERA_GLOO_NATIVE).
CommOptions effective_options(const CommOptions& options);

// Checks `options` (backend name, timeout, NCCL requested without NCCL support).
void check_options(const CommOptions& options);

// The world's groups: rendezvous through the TCPStore at world.master_addr:master_port,
// then the Gloo and NCCL groups `options.backend` asks for, under `prefix` in the store.
// A failure to create them throws the rendezvous's one-line CommError (how many ranks
// joined). For a single-process world nothing is created.
ProcessGroups create_world_groups(const World& world, const CommOptions& options, const std::string& prefix);

// The groups of subgroup `group` of split number `split` of `parent`, in which this
// process is `rank` of `size` (> 1): the same backends as the parent, with `options`.
ProcessGroups create_subgroups(const ProcessGroups& parent, int split, int group, int rank, int size,
                               const World& world, const CommOptions& options);

}  // namespace tessera::distributed
