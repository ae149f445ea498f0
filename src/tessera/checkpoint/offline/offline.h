// Offline checkpoint operations behind `tessera ckpt` (no process group needed):
// inspect, verify (verify.h), consolidate, reshard and export. Each streams one tensor (or one
// piece) at a time, so memory stays bounded by the largest tensor.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

// verify sits below the offline operations (the collective resume uses it too); declared
// there, and available through this header as before.
#include "tessera/checkpoint/verify.h"

namespace tessera::checkpoint {

// A human-readable table: kind and world size at save, then one row per key (kind,
// dtype, shape, chunks, bytes; plain values shown inline; the shard file of each tensor of
// a Hugging Face directory).
std::string inspect(const std::string& path);

// The most ranks `reshard` writes a checkpoint for (one data file per rank).
constexpr int kMaxReshardWorldSize = 65536;

// `force`: replace an existing output (a Tessera checkpoint, or a plain file for
// export); without it an existing output is an error. A non-empty directory that is
// not a Tessera checkpoint is never replaced. An output that is the source, lies inside
// it or contains it (real paths compared, symlinks resolved) is refused, with or
// without `force`. The output is written into a temporary sibling
// ".<name>.tessera-tmp-<pid>-<n>" and renamed into place at the end; temporaries that
// earlier runs left for the same output are removed first when their process is dead.
void consolidate(const std::string& src, const std::string& out, bool force);
// reshard writes what a save on a mesh of `world_size` ranks writes, with FSDP over
// world_size / tp data-parallel ranks x tp-way tensor parallelism (tp 1: FSDP alone), so
// that a job resuming there reads only its own data files (reshard_plan.h). tp > 1 needs
// a checkpoint saved under tensor parallelism (its tp rules name the cuts).
void reshard(const std::string& src, int world_size, const std::string& out, bool force, int tp = 1);
enum class ExportFormat { Torch, Safetensors };
void export_checkpoint(const std::string& src, ExportFormat format, const std::string& out, bool force);

// For a program's SIGINT/SIGTERM handling: removes the temporary output that a
// consolidate/reshard/export in progress in this process is writing, and makes that
// operation (and any later one in this process) fail instead of committing. Returns the
// removed path ("" when none was in progress). Waits for a commit in progress to end.
// Not async-signal-safe: call it from a thread that sigwait()s, not from a handler.
std::string abandon_output_in_progress();

}  // namespace tessera::checkpoint
