// Distributed checkpoints of a tessera::state::StateDict (format:
// docs/checkpoint-format.md).
//
//  save(sd, path, comm, {SaveMode::Sharded}): every rank writes what it owns to its own
//    data file, in parallel; rank 0 writes the metadata last and commits atomically.
//  save(sd, path, comm, {SaveMode::Full}): one consolidated safetensors file, which
//    every rank writes its rows of at their offsets (where all ranks see the file rank 0
//    laid out); otherwise sharded tensors are gathered to rank 0 in slices and streamed.
//  load(target, path, comm, {strict}): the target's entries say what is wanted and how
//    it is sharded; each rank reads only the byte ranges covering its pieces, from a
//    sharded directory saved at any world size, a consolidated or foreign safetensors
//    file, or a torch.save'd dict of tensors. Before anything is read, the ranks check
//    what `tessera ckpt verify` checks of the structure, each every size-th data file
//    (present, of this save and rank, holding exactly the pieces the layouts place there),
//    and a checkpoint that fails is refused by every rank with the target untouched.
// save and load are collective over `comm` (every rank calls them with the same keys in
// the same order); an error on any rank is raised on every rank.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/state/state_dict.h"

namespace tessera::checkpoint {

enum class SaveMode { Sharded, Full };

struct SaveOptions {
  SaveMode mode = SaveMode::Sharded;
};

struct LoadOptions {
  // Missing keys, unexpected tensors and shape/dtype/kind mismatches are one error
  // (naming every key) and nothing in the target is modified. Non-strict: they are
  // skipped and reported in the LoadResult.
  bool strict = true;
};

struct LoadResult {
  std::vector<std::string> loaded;      // FQNs written into the target
  std::vector<std::string> missing;     // wanted by the target, absent from the checkpoint
  std::vector<std::string> unexpected;  // tensors in the checkpoint the target does not have
  std::vector<std::string> mismatched;  // "fqn: reason"
  // Plain values in the checkpoint the target did not ask for (flattened FQNs).
  state::StateDict leftovers;
};

void save(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm,
          const SaveOptions& options = {});
LoadResult load(state::StateDict& target, const std::string& path, distributed::Communicator& comm,
                const LoadOptions& options = {});
// The same load without a process group (one process, or tools): checks the structure of
// every data file, then reads only what the target's local pieces need.
LoadResult load_local(state::StateDict& target, const std::string& path, const LoadOptions& options = {});

// A save running in the background. wait() blocks until it is committed and rethrows
// its error. Dropping the handle does not stop the save: the next save (or
// wait_for_pending_save()) waits for it.
class AsyncSave {
 public:
  struct State;
  AsyncSave() = default;
  explicit AsyncSave(std::shared_ptr<State> s) : s_(std::move(s)) {}
  void wait();
  bool done() const;
  bool valid() const { return s_ != nullptr; }

 private:
  std::shared_ptr<State> s_;
};

// Snapshots `sd` to host memory (copies of the local tensors), then returns; the
// snapshot is written in a background thread over a communicator split off `comm`
// (created, collectively, by prepare_async_save or the first async save of `comm`), so collectives of the
// caller keep running. A second save (async or not) from this process waits for the
// previous async save first. Collective: every rank calls it.
AsyncSave save_async(const state::StateDict& sd, const std::string& path, std::shared_ptr<distributed::Communicator> comm,
                     const SaveOptions& options = {});
// Creates, collectively, the background communicator that save_async(..., comm) writes
// over, so that the first async save does not pay for it on the training thread (the
// Trainer's ModelCheckpoint calls it at fit start when it saves asynchronously). Returns
// that communicator; calling it again for the same `comm` returns the same one without
// a collective. save_async creates it when nobody did. Collective: every rank calls it.
std::shared_ptr<distributed::Communicator> prepare_async_save(const std::shared_ptr<distributed::Communicator>& comm);
// Waits for the async save in flight, if any (rethrows its error).
void wait_for_pending_save();
// The same wait, logging the error instead of throwing it (it belongs to the save's
// handle): what save and load do before they start.
void finish_pending_save();

}  // namespace tessera::checkpoint
