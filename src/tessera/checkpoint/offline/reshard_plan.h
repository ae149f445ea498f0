// The layouts `tessera ckpt reshard` writes (offline.cpp): for a mesh of `world_size` ranks
// as FSDP over world_size / tp data-parallel ranks x tp-way tensor parallelism, the rule
// each tensor gets when a job on that mesh saves it, so that the job resuming there reads
// only its own data files.
//
// A checkpoint does not record a model's FSDP units or TP plan, but its rules imply them:
//  - a tensor-parallel cut (dim, stripes) is in each tp rule;
//  - FSDP's flat rule records the unit's flat size and the tensor's offset in it, so the
//    units are the runs of tensors (in the save's key order, interleaved with other units'
//    tensors) whose offsets chain from 0 to that size. At the new tp each member's
//    TP-local size changes, and the unit's offsets are chained again from the new sizes.
// Other sharded tensors (a chunked one; a TP piece saved whole, as DDP x TP saves it)
// get a torch.chunk cut over the new data-parallel ranks; replicated tensors stay whole in
// rank 0's file.
#pragma once
#include <cstdint>

#include "tessera/checkpoint/format/metadata.h"

namespace tessera::checkpoint {

struct ReshardTarget {
  int64_t world_size = 1;
  int64_t tp = 1;  // 1: a 1-D (FSDP) layout over world_size ranks
};

// The output metadata's entries (every key of `src`, plain values unchanged), its world
// size and its version. Throws tessera::Error naming the flag or the key at fault: a tp that
// does not divide the world size, a tp > 1 for a checkpoint that records no TP cut, and a
// cut that tp does not divide evenly under FSDP (a save at that mesh refuses it too). Flat
// rules that do not chain into units are not an error: those tensors get a torch.chunk
// cut (every rule is valid; the rule decides which file holds which rows, never the data).
CheckpointMetadata plan_reshard(const CheckpointMetadata& src, const ReshardTarget& target);

}  // namespace tessera::checkpoint
