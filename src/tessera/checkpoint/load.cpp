// Loading into a target StateDict: validate everything first, then read only the byte
// ranges each local piece needs.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <chrono>
#include <set>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/rank_agreement.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

namespace {

using state::Value;

// What a load that failed while reading says about its target (docs/checkpoint-format.md §5).
constexpr const char* kPartlyOverwritten =
    "the target's tensors were partly overwritten: do not continue with them (Fabric::load and the "
    "Trainer load into copies and keep the live state)";

bool same_plain_kind(const Value& target, const Value& saved) {
  if (target.index() == saved.index()) return true;
  // An int saved where the target holds a float (e.g. a learning rate) is fine.
  return std::holds_alternative<double>(target) && std::holds_alternative<int64_t>(saved);
}

// A target key the checkpoint can fill: its value in the target, its entry in the checkpoint.
struct Job {
  std::string fqn;
  Value* v;
  const EntryInfo* e;
};

// Why the target's value `v` of `fqn` cannot take the saved entry `e` ("" when it can).
std::string mismatch(const std::string& fqn, const Value& v, const EntryInfo& e) {
  const bool want_tensor = std::holds_alternative<at::Tensor>(v) || std::holds_alternative<sharding::ShardedTensor>(v);
  if (!want_tensor) {
    if (e.is_tensor()) return concat(fqn, ": the checkpoint holds a tensor, the target a ", state::kind_name(v));
    if (!same_plain_kind(v, e.value))
      return concat(fqn, ": the checkpoint holds a ", e.kind, ", the target a ", state::kind_name(v));
    return "";
  }
  at::ScalarType dt;
  std::vector<int64_t> shape;
  if (auto t = std::get_if<at::Tensor>(&v)) {
    if (!t->defined()) return fqn + ": the target tensor is undefined";
    dt = t->scalar_type();
    shape = t->sizes().vec();
  } else {
    const auto& st = std::get<sharding::ShardedTensor>(v);
    dt = st.dtype();
    shape = st.shape();
  }
  if (!e.is_tensor()) return concat(fqn, ": the checkpoint holds a ", e.kind, ", the target a tensor");
  if (shape != e.shape)
    return concat(fqn, ": shape ", core::shape_string(e.shape), " in the checkpoint, ", core::shape_string(shape),
                  " in the target");
  if (dt != e.dtype) return concat(fqn, ": dtype ", e.dtype, " in the checkpoint, ", dt, " in the target");
  return "";
}

// Phase 1, before anything is read: every key of the target against the checkpoint (what
// it can fill, what is missing or mismatched), and the saved keys the target lacks (tensors
// unexpected, plain values kept as leftovers). A strict load refuses any difference.
std::vector<Job> match_keys(const CheckpointMetadata& meta, state::StateDict& target, const std::string& path,
                            const LoadOptions& options, LoadResult& res) {
  std::vector<Job> jobs;
  std::set<std::string> wanted_keys;
  for (auto& [fqn, v] : target.flatten()) {
    wanted_keys.insert(fqn);
    auto it = meta.entries.find(fqn);
    if (it == meta.entries.end()) {
      if (std::holds_alternative<std::shared_ptr<state::StateDict>>(*v)) continue;  // empty dict: nothing wanted
      res.missing.push_back(fqn);
      continue;
    }
    std::string why = mismatch(fqn, *v, it->second);
    if (why.empty()) jobs.push_back({fqn, v, &it->second});
    else res.mismatched.push_back(std::move(why));
  }
  for (const auto& k : meta.keys) {
    if (wanted_keys.count(k)) continue;
    const EntryInfo& e = meta.entries.at(k);
    if (e.is_tensor()) res.unexpected.push_back(k);
    else res.leftovers.set(k, e.value);
  }
  if (options.strict && (!res.missing.empty() || !res.unexpected.empty() || !res.mismatched.empty())) {
    std::string msg = concat("loading '", path, "' (strict) failed; nothing was loaded.");
    if (!res.missing.empty()) msg += concat(" Missing keys: ", core::join(res.missing), ".");
    if (!res.unexpected.empty()) msg += concat(" Unexpected keys: ", core::join(res.unexpected), ".");
    if (!res.mismatched.empty()) msg += concat(" Mismatched: ", core::join(res.mismatched), ".");
    throw Error(msg);
  }
  return jobs;
}

// A tensor's part the load writes: a plain tensor whole, or one local shard of a sharded one.
struct LoadPiece {
  const Job* job;
  at::Tensor dst;
  sharding::Box box;
  std::vector<ChunkInfo> chunks;  // the saved chunks it overlaps, located
};

// Phase 2: the pieces and the saved chunks each overlaps. Locating the chunks reads the
// headers of the data files that hold them, and no others (format 2): a rank's work grows
// with what it reads, not with the world size at save. An error here (a missing or
// mixed-up data file) comes before anything is written.
std::vector<LoadPiece> locate_pieces(ChunkReader& reader, const std::vector<Job>& jobs) {
  std::vector<LoadPiece> pieces;
  for (const auto& j : jobs) {
    if (auto t = std::get_if<at::Tensor>(j.v)) {
      const sharding::Box box = sharding::full_box(j.e->shape);
      pieces.push_back({&j, *t, box, reader.chunks(j.fqn, *j.e, box)});
    } else if (auto s = std::get_if<sharding::ShardedTensor>(j.v)) {
      for (auto& sh : s->local_shards())
        pieces.push_back({&j, sh.tensor, sh.meta.box, reader.chunks(j.fqn, *j.e, sh.meta.box)});
    }
  }
  return pieces;
}

// Phase 3: each piece read straight into the target (no second copy of the model in
// memory), with ReadAhead's window of requests in flight. An error here (a checksum
// mismatch, an I/O error) comes after the pieces before it were written, and says so.
void read_pieces(ChunkReader& reader, std::vector<LoadPiece>& pieces, const std::string& path) {
  // The phases, for TESSERA_LOG_LEVEL=debug: requesting read-ahead (posix_fadvise can
  // block while the disk's queue is full) and reading + checking + placing the pieces.
  using Clock = std::chrono::steady_clock;
  const auto t_read = Clock::now();
  double prefetch_s = 0;
  uint64_t bytes = 0;
  ReadAhead ahead(pieces.size(), [&](size_t i) {
    const auto t0 = Clock::now();
    const LoadPiece& q = pieces[i];
    uint64_t n = 0;
    for (const auto& c : q.chunks) n += reader.prefetch(q.job->fqn, *q.job->e, c, q.box);
    prefetch_s += log::seconds(t0, Clock::now());
    bytes += n;
    return n;
  });
  size_t k = 0;
  try {
    for (; k < pieces.size(); ++k) {
      ahead.before(k);
      LoadPiece& p = pieces[k];
      const EntryInfo& e = *p.job->e;
      int64_t n = 0;
      for (const auto& c : p.chunks) n += reader.copy_into(p.job->fqn, e, c, p.dst, p.box);
      TESSERA_CHECK(n == p.box.numel(), "loading '", path, "' key '", p.job->fqn, "': only ", n, " of ",
                    p.box.numel(), " elements of ", p.box.to_string(), " found");
    }
  } catch (const std::exception& e) {
    const std::string msg = concat(e.what(), " -- ", kPartlyOverwritten, " (", k, " of ", pieces.size(),
                                   " tensor pieces were written before the failure, then '", pieces[k].job->fqn,
                                   "' in part or not at all)");
    if (dynamic_cast<const ResourceError*>(&e)) throw ResourceError(msg);
    throw Error(msg);
  }
  const double read_s = log::seconds(t_read, Clock::now());
  log::debug("load('", path, "'): ", pieces.size(), " pieces, ", bytes >> 20, " MiB in ", read_s,
             " s: requesting read-ahead ", prefetch_s, " s, reading, checking and placing ", read_s - prefetch_s, " s");
}

// Phase 4: the plain values (an int saved where the target holds a float becomes a float).
void set_values(const std::vector<Job>& jobs, LoadResult& res) {
  for (const auto& j : jobs) {
    if (std::holds_alternative<double>(*j.v) && std::holds_alternative<int64_t>(j.e->value)) {
      *j.v = static_cast<double>(std::get<int64_t>(j.e->value));
    } else if (!std::holds_alternative<at::Tensor>(*j.v) && !std::holds_alternative<sharding::ShardedTensor>(*j.v)) {
      *j.v = j.e->value;
    }
    res.loaded.push_back(j.fqn);
  }
}

// Loads from `meta` (opened from `path`, its structure checked) into `target`.
LoadResult load_from(const CheckpointMetadata& meta, state::StateDict& target, const std::string& path,
                     const LoadOptions& options) {
  LoadResult res;
  const std::vector<Job> jobs = match_keys(meta, target, path, options, res);
  at::NoGradGuard no_grad;
  ChunkReader reader(meta);
  std::vector<LoadPiece> pieces = locate_pieces(reader, jobs);
  read_pieces(reader, pieces, path);
  set_values(jobs, res);
  return res;
}

}  // namespace

LoadResult load_local(state::StateDict& target, const std::string& path, const LoadOptions& options) {
  CheckpointMetadata meta = open_checkpoint(CheckedPath::check(path));  // storage/file.h (issue 35 item 4)
  // What verify checks of the structure, every data file, before anything is read.
  ChunkReader(meta).check_structure();
  return load_from(meta, target, path, options);
}

LoadResult load(state::StateDict& target, const std::string& path, distributed::Communicator& comm, const LoadOptions& options) {
  finish_pending_save();  // an async save of this process may be writing this path
  // What verify checks of the structure, shared out: each rank checks every size-th data
  // file (present, of this save and rank, exactly its pieces), and every rank learns the
  // outcome before anything is read, so that a checkpoint verify refuses is refused by
  // every rank alike and no target is touched (O(files / ranks) headers a rank).
  CheckpointMetadata meta;
  std::string err;
  try {
    meta = open_checkpoint(CheckedPath::check(path));
    ChunkReader(meta).check_structure(comm.rank(), comm.size());
  } catch (const std::exception& e) {
    err = e.what();
  }
  RankAgreement ranks(comm, concat("loading '", path, "'"));
  const Agreement checked = ranks.agree(err);
  if (!err.empty()) throw Error(err);
  TESSERA_CHECK(checked.ok(), "loading '", path, "' failed on rank ", checked.failed_rank, ": ", checked.error,
                " (nothing was loaded)");
  LoadResult res;
  try {
    res = load_from(meta, target, path, options);
  } catch (const std::exception& e) {
    err = e.what();
  }
  // Every rank learns whether every rank loaded, for O(1) bytes each.
  const Agreement a = ranks.agree(err);
  if (!err.empty()) throw Error(err);
  TESSERA_CHECK(a.ok(), "loading '", path, "' failed on rank ", a.failed_rank, ": ", a.error, " -- on this rank (",
                comm.rank(), ") the target was overwritten from the checkpoint all the same: do not continue ",
                "with it");
  return res;
}

}  // namespace tessera::checkpoint
