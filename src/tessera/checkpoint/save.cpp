// The sharded save (format 2: a data file per rank, and the metadata). The consolidated
// save is in save_full.cpp, async saves and save() itself in save_async.cpp, the steps
// every rank takes together (and what both saves share) in save_steps.cpp.
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/save_plan.h"
#include "tessera/checkpoint/save_steps.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"
#include "tessera/sharding/chunk.h"

namespace tessera::checkpoint {

// A sharded save (format 2). Every rank computes the whole metadata alone (every rank
// knows every shard's box: ShardedTensor keeps them) and the pieces it stores
// (save_plan.h); each writes its data file; the ranks compare a digest of what they save
// (keys, order, kinds, dtypes, shapes and layouts: structure_of) and learn each other's
// outcome through agree(), an all-reduce of three integers, so a save moves O(1) bytes
// per rank whatever the world size (plus the temporary's path from rank 0). Ranks that
// disagree on any of these are refused before anything is written, naming the first
// rank that differs from rank 0; rank 0's metadata, plain values included, is written.
void save_sharded(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm) {
  const int rank = comm.rank();
  const std::string what = concat("saving '", path, "'");
  auto flat = sd.flatten();
  TempGuard guard;
  std::string err, save_id;
  if (rank == 0) {
    err = prepare_target(path, true, guard.tmp);
    save_id = new_save_id();
  }
  const std::string info = broadcast_or_throw(comm, err, Packer().str(guard.tmp).str(save_id).bytes(), what);
  Unpacker in(info, "rank 0's temporary");
  const std::string tmp = in.str();
  save_id = in.str();

  CheckpointMetadata m;
  m.version = kFormatVersion;
  m.world_size = comm.size();
  m.crc_block = kCrcBlock;
  m.save_id = save_id;
  std::vector<Piece> pieces;
  SaveLayout structure;
  std::string text;  // rank 0's: the metadata it writes
  std::string local_err;
  try {
    // The saving rank of every world rank, for tensors on other communicators (subgroups).
    const std::vector<int>& members = comm.members();
    std::vector<int64_t> saving_rank_of;
    for (size_t r = 0; r < members.size(); ++r) {
      if (static_cast<size_t>(members[r]) >= saving_rank_of.size()) saving_rank_of.resize(members[r] + 1, -1);
      saving_rank_of[static_cast<size_t>(members[r])] = static_cast<int64_t>(r);
    }
    std::map<const distributed::Communicator*, GroupPlacement> groups;
    int64_t key_index = 0;
    for (const auto& [fqn, v] : flat) {
      EntryInfo e = describe_entry(fqn, *v);
      if (auto t = std::get_if<at::Tensor>(v)) {
        e.layout = sharding::Layout::whole(0);  // replicated: rank 0 writes it
        if (rank == 0 && t->numel() > 0) {
          const at::Tensor tt = *t;
          pieces.push_back({fqn, e.dtype, sharding::full_box(e.shape), [tt] { return tt; }});
        }
      } else if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
        const distributed::Communicator* c = s->comm().get();
        auto g = groups.find(c);
        if (g == groups.end()) {
          std::vector<int64_t> ranks;
          for (int w : c->members()) {
            TESSERA_CHECK(w >= 0 && static_cast<size_t>(w) < saving_rank_of.size() && saving_rank_of[w] >= 0,
                          "cannot save key '", fqn, "': it lives on world rank ", w, ", outside the saving communicator");
            ranks.push_back(saving_rank_of[static_cast<size_t>(w)]);
          }
          g = groups.emplace(c, group_placement(ranks, comm.size(), fqn)).first;
        }
        static const std::vector<sharding::ShardMetadata> kRuleOnly;  // the rule is the layout: no list needed
        SavedLayout plan = plan_saved_layout(fqn, e.shape, s->layout() ? kRuleOnly : s->shards_metadata(), s->layout(),
                                             g->second, comm.size(), rank, key_index);
        for (int64_t i : plan.mine) {
          // The local shard holding piece i (FSDP and chunked tensors hold one).
          const sharding::Box box = plan.layout.box(e.shape, i);
          const sharding::Shard* own = nullptr;
          for (const auto& sh : s->local_shards())
            if (sh.meta.box == box) own = &sh;
          TESSERA_CHECK(own != nullptr, "cannot save key '", fqn, "': rank ", rank, " stores piece ", box.to_string(),
                        " but holds no local shard with that box");
          const at::Tensor tt = own->tensor;
          pieces.push_back({fqn, e.dtype, box, [tt] { return tt; }});
        }
        e.layout = std::move(plan.layout);
      }
      m.keys.push_back(fqn);
      m.entries.emplace(fqn, std::move(e));
      ++key_index;
    }
    structure = structure_of(m);
    // Only rank 0's metadata is written (the others' may hold other plain values); its
    // bound (metadata.h) is checked here, before anything is written.
    if (rank == 0) text = to_json(m);
  } catch (const std::exception& e) {
    local_err = e.what();
  }
  const Agreement planned = agree_or_throw(comm, local_err, what, structure.digest());
  if (!planned.same_digest) {
    // Only now (an error path): every rank's digest, and the first rank that differs.
    const auto all = comm.all_gather_bytes(Packer().u64(structure.digest()).bytes());
    std::vector<uint64_t> digests;
    for (size_t r = 0; r < all.size(); ++r) digests.push_back(Unpacker(all[r], concat("rank ", r, "'s digest")).u64());
    check_same_layout(comm, structure, digests, path, SaveMode::Sharded);
    // The all-reduce compared the same digests (62 bits of each): unreachable.
    throw Error(concat(what, ": internal: the ranks' digests differed in the agreement but not when gathered"));
  }
  try {
    write_data_file(tmp, data_file_name(rank), pieces, data_file_identity(rank, save_id));
  } catch (const std::exception& e) {
    err = e.what();
  }
  agree_or_throw(comm, err, what);
  if (rank == 0) {
    try {
      write_metadata_text(tmp, text);
      commit_rename(tmp, path);
      guard.committed = true;
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  agree_or_throw(comm, rank == 0 ? err : std::string(), what);
}

}  // namespace tessera::checkpoint
