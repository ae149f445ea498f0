// The sharded save (format 2: a data file per rank, and the metadata). The consolidated
// save is in save_full.cpp, async saves and save() itself in save_async.cpp, what both
// saves share in save_steps.cpp, how the ranks learn each other's outcome in
// rank_agreement.cpp.
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/save_plan.h"
#include "tessera/checkpoint/rank_agreement.h"
#include "tessera/checkpoint/save_steps.h"
#include "tessera/checkpoint/wire.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"
#include "tessera/sharding/chunk.h"

namespace tessera::checkpoint {

namespace {

// A sharded save (format 2). Every rank computes the whole metadata alone (every rank
// knows every shard's box: ShardedTensor keeps them) and the pieces it stores
// (save_plan.h); each writes its data file; the ranks compare a digest of what they save
// (keys, order, kinds, dtypes, shapes and layouts: structure_of) and learn each other's
// outcome through RankAgreement::agree, an all-reduce of three integers, so a save moves O(1) bytes
// per rank whatever the world size (plus the temporary's path from rank 0). Ranks that
// disagree on any of these are refused before anything is written, naming the first
// rank that differs from rank 0; rank 0's metadata, plain values included, is written.
//
// One method per phase, called by every rank in the same order (prepare, plan, agree on
// the plan, write, commit), each ending in an exchange that every rank reaches, a failed
// one included. Rank 0's temporary is removed on every way out but the commit.
class ShardedSave {
 public:
  ShardedSave(const CheckedPath& path, distributed::Communicator& comm)
      : path_(path), comm_(comm), rank_(comm.rank()), what_(concat("saving '", path.str(), "'")), ranks_(comm, what_) {}

  void run(const state::StateDict& sd) {
    prepare();
    plan(sd);
    agree_on_plan();
    write();
    commit();
  }

 private:
  // Rank 0 prepares the target (the temporary sibling) and draws the save id; every rank
  // learns both, or rank 0's error.
  void prepare() {
    std::string err;
    if (rank_ == 0) {
      err = prepare_target(path_, true, guard_.tmp);
      save_id_ = new_save_id();
    }
    const std::string tmp = guard_.tmp ? guard_.tmp->str() : std::string();
    const std::string info = ranks_.from_rank0_or_throw(err, Packer().str(tmp).str(save_id_).bytes());
    Unpacker in(info, "rank 0's temporary");
    tmp_ = in.str();
    save_id_ = in.str();
  }

  // The whole metadata and this rank's pieces, the digest of the structure, and rank 0's
  // metadata text (its bound, metadata.h, checked before anything is written). An error
  // waits for the agreement.
  void plan(const state::StateDict& sd) {
    m_.version = kFormatVersion;
    m_.world_size = comm_.size();
    m_.crc_block = kCrcBlock;
    m_.save_id = save_id_;
    try {
      // The saving rank of every world rank, for tensors on other communicators (subgroups).
      const std::vector<int>& members = comm_.members();
      for (size_t r = 0; r < members.size(); ++r) {
        if (static_cast<size_t>(members[r]) >= saving_rank_of_.size()) saving_rank_of_.resize(members[r] + 1, -1);
        saving_rank_of_[static_cast<size_t>(members[r])] = static_cast<int64_t>(r);
      }
      int64_t key_index = 0;
      for (const auto& [fqn, v] : sd.flatten()) {
        EntryInfo e = describe_entry(fqn, *v);
        if (auto t = std::get_if<at::Tensor>(v)) {
          e.layout = sharding::Layout::whole(0);  // replicated: rank 0 writes it
          if (rank_ == 0 && t->numel() > 0) {
            const at::Tensor tt = *t;
            pieces_.push_back({fqn, e.dtype, sharding::full_box(e.shape), [tt] { return tt; }});
          }
        } else if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
          e.layout = plan_sharded(fqn, e, *s, key_index);
        }
        m_.keys.push_back(fqn);
        m_.entries.emplace(fqn, std::move(e));
        ++key_index;
      }
      structure_ = structure_of(m_);
      // Only rank 0's metadata is written (the others' may hold other plain values).
      if (rank_ == 0) text_ = to_json(m_);
    } catch (const std::exception& e) {
      plan_err_ = e.what();
    }
  }

  // A sharded tensor's layout (its rule over the saving ranks), and the pieces of it that
  // this rank stores, each one of its local shards.
  sharding::Layout plan_sharded(const std::string& fqn, const EntryInfo& e, const sharding::ShardedTensor& s,
                                int64_t key_index) {
    const distributed::Communicator* c = s.comm().get();
    auto g = groups_.find(c);
    if (g == groups_.end()) {
      std::vector<int64_t> ranks;
      for (int w : c->members()) {
        TESSERA_CHECK(w >= 0 && static_cast<size_t>(w) < saving_rank_of_.size() && saving_rank_of_[w] >= 0,
                      "cannot save key '", fqn, "': it lives on world rank ", w, ", outside the saving communicator");
        ranks.push_back(saving_rank_of_[static_cast<size_t>(w)]);
      }
      g = groups_.emplace(c, group_placement(ranks, comm_.size(), fqn)).first;
    }
    static const std::vector<sharding::ShardMetadata> kRuleOnly;  // the rule is the layout: no list needed
    SavedLayout plan = plan_saved_layout(fqn, e.shape, s.layout() ? kRuleOnly : s.shards_metadata(), s.layout(),
                                         g->second, comm_.size(), rank_, key_index);
    for (int64_t i : plan.mine) {
      // The local shard holding piece i (FSDP and chunked tensors hold one).
      const sharding::Box box = plan.layout.box(e.shape, i);
      const sharding::Shard* own = nullptr;
      for (const auto& sh : s.local_shards())
        if (sh.meta.box == box) own = &sh;
      TESSERA_CHECK(own != nullptr, "cannot save key '", fqn, "': rank ", rank_, " stores piece ", box.to_string(),
                    " but holds no local shard with that box");
      const at::Tensor tt = own->tensor;
      pieces_.push_back({fqn, e.dtype, box, [tt] { return tt; }});
    }
    return std::move(plan.layout);
  }

  // Every rank learns whether every rank planned, and whether all planned the same
  // structure; when not, the first rank that differs from rank 0 is named.
  void agree_on_plan() {
    const Agreement planned = ranks_.agree_or_throw(plan_err_, structure_.digest());
    if (planned.same_digest) return;
    // Only now (an error path): every rank's digest, and the first rank that differs.
    const auto all = comm_.all_gather_bytes(Packer().u64(structure_.digest()).bytes());
    std::vector<uint64_t> digests;
    for (size_t r = 0; r < all.size(); ++r) digests.push_back(Unpacker(all[r], concat("rank ", r, "'s digest")).u64());
    check_same_layout(comm_, structure_, digests, path_, SaveMode::Sharded);
    // The all-reduce compared the same digests (62 bits of each): unreachable.
    throw Error(concat(what_, ": internal: the ranks' digests differed in the agreement but not when gathered"));
  }

  // Each rank writes its data file into the temporary.
  void write() {
    std::string err;
    try {
      write_data_file(tmp_, data_file_name(rank_), pieces_, data_file_identity(rank_, save_id_));
    } catch (const std::exception& e) {
      err = e.what();
    }
    ranks_.agree_or_throw(err);
  }

  // Rank 0 writes the metadata and renames the temporary into place; every rank learns
  // whether it did.
  void commit() {
    std::string err;
    if (rank_ == 0) {
      try {
        write_metadata_text(tmp_, text_);
        commit_rename(*guard_.tmp, path_);
        guard_.committed = true;
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    ranks_.agree_or_throw(err);
  }

  const CheckedPath path_;
  distributed::Communicator& comm_;
  const int rank_;
  const std::string what_;  // "saving 'PATH'", for messages
  RankAgreement ranks_;     // every rank learning the outcome of each phase
  TempGuard guard_;         // rank 0's temporary, removed unless committed
  std::string tmp_, save_id_;  // rank 0's temporary and save id, as every rank learns them
  CheckpointMetadata m_;
  std::vector<Piece> pieces_;
  std::vector<int64_t> saving_rank_of_;  // world rank -> saving rank (-1: not saving)
  std::map<const distributed::Communicator*, GroupPlacement> groups_;
  SaveLayout structure_;
  std::string text_;      // rank 0's: the metadata it writes
  std::string plan_err_;  // this rank's planning error, for the agreement
};

}  // namespace

void save_sharded(const state::StateDict& sd, const CheckedPath& path, distributed::Communicator& comm) {
  ShardedSave(path, comm).run(sd);
}

}  // namespace tessera::checkpoint
