// What the sharded and the consolidated save share (internal to the checkpoint layer;
// save.cpp, save_full.cpp, save_async.cpp): their entry points, describing an entry,
// preparing the target and removing rank 0's temporary, and the check that the ranks agree
// on what they save. How the ranks learn each other's outcome: rank_agreement.h; the bytes
// they send: wire.h; the consolidated save's own I/O: save_full_io.h; test hooks: test_hooks.h.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/distributed/communicator.h"
#include "tessera/state/state_dict.h"

namespace tessera::checkpoint {

// The two kinds of save, behind save() and save_async() (save_async.cpp): sharded
// (save.cpp) and consolidated (save_full.cpp). The path was checked where it entered.
void save_sharded(const state::StateDict& sd, const CheckedPath& path, distributed::Communicator& comm);
void save_full(const state::StateDict& sd, const CheckedPath& path, distributed::Communicator& comm);

// The entry describing value `v` of key `fqn`: its kind, and a tensor's dtype and global
// shape, or the value itself. Throws for an undefined tensor or a dtype the format cannot
// store.
EntryInfo describe_entry(const std::string& fqn, const state::Value& v);

// Rank 0's preparation of the target `path` of a save, before anything is written:
// recovers what an interrupted save left beside it, checks that it may be replaced, and
// names in `tmp` the temporary sibling the save writes (created here as a directory when
// `dir`). Returns the error ("" on success) rather than throwing, for rank 0 to hand to
// the other ranks.
std::string prepare_target(const CheckedPath& path, bool dir, std::optional<CheckedPath>& tmp);

// Rank 0 removes the temporary it created on every way out of a save but the commit,
// an exception from a collective included.
struct TempGuard {
  std::optional<CheckedPath> tmp;
  bool committed = false;
  ~TempGuard();
};

// What the ranks of a save must agree on, as (key, description) records in save order.
// A consolidated save's ranks write their bytes at offsets each computes from its own
// list of entries, matched by position: the description is the kind, dtype, shape and,
// for sharded tensors, every shard's box and rank. A sharded save's: the entry's JSON
// without a plain value's value (kind, dtype, shape, layout). Plain values are not
// compared: ranks may hold different ones (a per-rank metric), and rank 0's are written.
// The path is not among them: every rank writes into what rank 0 names.
struct SaveLayout {
  std::vector<std::pair<std::string, std::string>> records;
  std::string packed() const;
  // 64-bit FNV-1a of packed(), exchanged instead of the records themselves.
  uint64_t digest() const;
};
// What the ranks of a sharded save must agree on: each entry's JSON as format 2 writes it,
// but a plain value's kind only. Not the value: ranks may hold different plain values (a
// per-rank metric), as they may in a consolidated save, and rank 0's are written.
SaveLayout structure_of(const CheckpointMetadata& m);

// Refuses, on every rank alike, when the digests (`digests[r]`, one per rank, already
// exchanged) differ: the ranks then exchange their records (only then) and the error
// names the first rank that differs from rank 0, the first entry where it does, and
// what a save of `mode` needs. Collective when (and only when) the digests differ,
// which every rank sees alike.
void check_same_layout(distributed::Communicator& comm, const SaveLayout& mine, const std::vector<uint64_t>& digests,
                       const std::string& path, SaveMode mode);

}  // namespace tessera::checkpoint
