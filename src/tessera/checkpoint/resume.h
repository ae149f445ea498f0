// Resuming by itself: which checkpoint a restarted job continues from. The Trainer's
// ckpt_path "auto", `gpt train --resume auto` and Fabric programs call the same function.
//
//   const auto choice = checkpoint::find_resumable({"runs/x/checkpoints"}, *fabric.comm());
//   if (!choice.path.empty()) fabric.load(choice.path, state);   // else: start fresh
//
// The newest checkpoint that verifies wins; a torn or corrupted one is skipped with a
// message naming it and its problem, and is never loaded or removed. With
// Skipped::SetAside (the Trainer and gpt train, whose next save of "last.ckpt" would
// replace a damaged last.ckpt) it is renamed "X.unverified-<UTC time>" and kept there.
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

// What happens to a candidate that is skipped because it is damaged (its metadata cannot
// be read, or verification finds a problem): Leave it where it is, or SetAside: rename
// it "X.unverified-<YYYYmmddTHHMMSSZ>" so that no save replaces it and no later search
// verifies it again. A file that is no training checkpoint (no global_step) is always left.
enum class Skipped { Leave, SetAside };
// The tag of a set-aside name; a name holding it is never a candidate.
constexpr const char* kUnverifiedTag = ".unverified-";
// The plain integer value by which candidates are ordered: the training step a checkpoint
// was saved at. The Trainer saves it under this key; any program may (the GPT example does).
constexpr const char* kGlobalStepKey = "global_step";

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
// skipped, and reported (and set aside when damaged, with Skipped::SetAside). No
// collectives; throws only for an error of this process (ResourceError: out of
// descriptors), never for a bad checkpoint.
ResumeChoice find_resumable(const std::vector<std::string>& dirs, const ResumeReport& report = {},
                            Skipped skipped = Skipped::Leave);

// Collective: rank 0 of `comm` lists and orders the candidates (reading their metadata)
// and sends the list to every rank; then every rank verifies its share of each candidate,
// newest first (offline verify(path, rank, size): about 1/size of the bytes each, so no
// rank waits long in a collective while another reads), and they agree in one all-reduce;
// the first rank that found a problem sends it to the others. Every rank returns the same
// path and step, so that every rank loads the same checkpoint. Skipped candidates are
// reported (and set aside) by rank 0, and listed in rank 0's `skipped`; a rank that runs
// out of a resource fails every rank, naming it. `report` is called on rank 0 only; by
// default it writes "tessera: <line>" to stderr.
ResumeChoice find_resumable(const std::vector<std::string>& dirs, distributed::Communicator& comm,
                            const ResumeReport& report = {}, Skipped skipped = Skipped::Leave);

}  // namespace tessera::checkpoint
