// Resuming by itself: which checkpoint a restarted job continues from. The Trainer's
// ckpt_path "auto", `gpt train --resume auto` and Fabric programs call the same function.
//
//   const auto choice = checkpoint::find_resumable({"runs/x/checkpoints"}, *fabric.comm());
//   if (!choice.path.empty()) fabric.load(choice.path, state);   // else: start fresh
//
// The newest checkpoint that verifies wins; a torn or corrupted one is skipped with a
// message naming it and its problem, and is never loaded, changed or removed here.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"

namespace tessera::checkpoint {

// One report line ("resuming from X (step N)", "skipping X: <problem>", "no checkpoint
// that verifies in D: starting fresh"), without a prefix or newline.
using ResumeReport = std::function<void(const std::string&)>;

struct ResumeChoice {
  std::string path;          // the checkpoint to resume from; "" when none verifies (start fresh)
  int64_t global_step = 0;   // its stored global_step (0 when fresh)
  // Every candidate passed over, newest first, as "X: <problem>" (rank 0 only in the
  // collective form).
  std::vector<std::string> skipped;
};

// The checkpoints in `dirs` (not recursive): every directory holding
// tessera-checkpoint.json (sharded), every other entry named *.ckpt, and every file
// Tessera wrote (consolidated safetensors). Temporaries and anything hidden (".name",
// which is where saves write ".X.tessera-tmp-*" before they commit) are ignored, as is
// anything else, except a checkpoint left aside by an interrupted commit
// (".X.tessera-old-*" while X is missing), a candidate under that name.
// Missing directories hold nothing. Candidates are ordered newest first by their stored
// integer `global_step`, ties by modification time (newest first); then each is
// verified (checkpoint::verify: every data file present and every checksum checked, so
// the checkpoint is read once in full) until one passes. A candidate whose metadata
// cannot be read, that holds no integer global_step, or that fails verification is
// skipped, and reported. No collectives; throws only for an error of this process
// (ResourceError: out of descriptors), never for a bad checkpoint.
ResumeChoice find_resumable(const std::vector<std::string>& dirs, const ResumeReport& report = {});

// Collective: rank 0 of `comm` chooses (above) and reports, and every rank returns its
// choice (path and step, broadcast), so that every rank loads the same checkpoint. The
// other ranks wait in the broadcast meanwhile: the verification must end within the
// communicator's timeout. `report` is called on rank 0 only; by default it writes
// "tessera: <line>" to stderr.
ResumeChoice find_resumable(const std::vector<std::string>& dirs, distributed::Communicator& comm,
                            const ResumeReport& report = {});

}  // namespace tessera::checkpoint
