// Distributed save, sharded and full (consolidated); async saves and save() itself are in
// save_async.cpp, the steps every rank takes together in save_steps.cpp.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/save_plan.h"
#include "tessera/checkpoint/save_steps.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/stream_writer.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/device.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/strings.h"
#include "tessera/sharding/chunk.h"

namespace tessera::checkpoint {

namespace {

using state::Value;

// Broadcasts rank 0's outcome ("" = ok) and throws it everywhere when it is an error.
void agree(distributed::Communicator& comm, const std::string& rank0_error, const std::string& what) {
  broadcast_or_throw(comm, rank0_error, "", what);
}

// Rank 0 removes the temporary it created on every way out of a save but the commit,
// an exception from a collective included.
struct TempGuard {
  std::string tmp;
  bool committed = false;
  ~TempGuard() {
    if (committed || tmp.empty()) return;
    try {
      remove_all(tmp);
    } catch (const std::exception&) {
    }
  }
};

EntryInfo describe(const std::string& fqn, const Value& v) {
  EntryInfo e;
  if (auto t = std::get_if<at::Tensor>(&v)) {
    TESSERA_CHECK(t->defined(), "cannot save key '", fqn, "': undefined tensor");
    e.kind = "tensor";
    e.dtype = t->scalar_type();
    e.shape = t->sizes().vec();
    dtype_name(e.dtype);  // throws for unsupported dtypes
  } else if (auto s = std::get_if<sharding::ShardedTensor>(&v)) {
    TESSERA_CHECK(s->defined(), "cannot save key '", fqn, "': undefined sharded tensor");
    e.kind = "sharded";
    e.dtype = s->dtype();
    e.shape = s->shape();
    dtype_name(e.dtype);
  } else {
    e.kind = state::kind_name(v);
    e.value = v;
  }
  return e;
}

std::string prepare_target(const std::string& path, bool dir, std::string& tmp) {
  try {
    recover_siblings(path);
    check_replaceable(path);
    tmp = temp_sibling(path);
    if (dir) make_dir(tmp);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

// One writer per box. Ranks that hold the same box (the replica groups of HYBRID_SHARD
// each hold the whole model, sharded the same way) would otherwise all write it, and
// the tiling check would reject the overlap. Every rank lists the boxes it could write
// (or its error); the lists are exchanged (length-prefixed: a key is any bytes), and each
// distinct box goes to one of its holders: the one with the fewest bytes assigned so far,
// largest boxes first, the lowest rank on a tie, so replica groups share the writing.
// Every rank computes the same assignment from the same lists. Returns, for each of
// `mine`, whether this rank writes it; `err` gets the errors of all ranks (the same text
// on every rank).
std::vector<bool> plan_writers(const std::vector<Piece>& mine, const std::string& local_err,
                               distributed::Communicator& comm, std::string& err) {
  using BoxKey = std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>>;
  Packer list;
  list.u64(mine.size());
  for (const auto& p : mine) {
    list.str(p.fqn).u64(p.box.offsets.size()).u64(static_cast<uint64_t>(p.box.numel()) * c10::elementSize(p.dtype));
    for (size_t d = 0; d < p.box.offsets.size(); ++d)
      list.u64(static_cast<uint64_t>(p.box.offsets[d])).u64(static_cast<uint64_t>(p.box.sizes[d]));
  }
  const AllStatus all = exchange_status(comm, {local_err, list.bytes()});
  err = all.errors();
  std::vector<bool> keep(mine.size(), false);
  if (!err.empty()) return keep;
  struct Holders {
    uint64_t bytes = 0;
    std::vector<int> ranks;  // ascending
  };
  std::map<BoxKey, Holders> boxes;
  for (size_t r = 0; r < all.ranks.size(); ++r) {
    Unpacker in(all.ranks[r].payload, concat("rank ", r, "'s list of boxes"));
    for (uint64_t i = 0, n = in.u64(); i < n; ++i) {
      BoxKey k;
      std::get<0>(k) = in.str();
      const uint64_t dims = in.u64(), bytes = in.u64();
      TESSERA_CHECK(dims <= 64, "internal: rank ", r, " lists a box of ", dims, " dimensions");
      for (uint64_t d = 0; d < dims; ++d) {
        std::get<1>(k).push_back(static_cast<int64_t>(in.u64()));
        std::get<2>(k).push_back(static_cast<int64_t>(in.u64()));
      }
      Holders& h = boxes[k];
      h.bytes = bytes;
      h.ranks.push_back(static_cast<int>(r));
    }
  }
  std::vector<std::pair<const BoxKey*, const Holders*>> order;
  for (const auto& [k, h] : boxes) order.emplace_back(&k, &h);
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second->bytes > b.second->bytes; });
  std::vector<uint64_t> load(all.ranks.size(), 0);
  std::set<BoxKey> written_here;
  for (const auto& [k, h] : order) {
    int w = h->ranks[0];
    for (int r : h->ranks)
      if (load[static_cast<size_t>(r)] < load[static_cast<size_t>(w)]) w = r;
    load[static_cast<size_t>(w)] += h->bytes;
    if (w == comm.rank()) written_here.insert(*k);
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    const BoxKey k{mine[i].fqn, mine[i].box.offsets, mine[i].box.sizes};
    keep[i] = written_here.erase(k) > 0;  // a box listed twice by one rank is written once
  }
  return keep;
}

}  // namespace

// A sharded save (format 2). Every rank computes the whole metadata alone (every rank
// knows every shard's box: ShardedTensor keeps them) and the pieces it stores
// (save_plan.h); each writes its data file; the ranks then compare a digest of the
// metadata text and learn each other's outcome through agree(), an all-reduce of three
// integers, so a save moves O(1) bytes per rank whatever the world size (plus the
// temporary's path from rank 0). Ranks that disagree on keys, order, shapes or layouts
// are refused before rank 0 commits, naming the first rank that differs from rank 0.
void save_sharded(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm) {
  const int rank = comm.rank();
  const std::string what = concat("saving '", path, "'");
  auto flat = flatten_values(sd);
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
  std::string text;
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
      EntryInfo e = describe(fqn, *v);
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
        SavedLayout plan = plan_saved_layout(fqn, e.shape, s->shards_metadata(), s->layout(), g->second, comm.size(),
                                             rank, key_index);
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
    text = to_json(m);  // the same on every rank that saves the same thing; bounded (metadata.h)
  } catch (const std::exception& e) {
    local_err = e.what();
  }
  const Agreement planned = agree_or_throw(comm, local_err, what, fnv1a64(text));
  if (!planned.same_digest) {
    // Only now (an error path): every rank's digest, and the first rank that differs.
    SaveLayout mine;
    for (const auto& k : m.keys) mine.records.emplace_back(k, entry_json(m.entries.at(k)));
    const auto all = comm.all_gather_bytes(Packer().u64(mine.digest()).bytes());
    std::vector<uint64_t> digests;
    for (size_t r = 0; r < all.size(); ++r) digests.push_back(Unpacker(all[r], concat("rank ", r, "'s digest")).u64());
    check_same_layout(comm, mine, digests, path);
    throw Error(concat(what, ": the ranks' metadata differ (in the save id or the world size)"));
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

namespace {

// Bytes of a tensor handled at a time by a consolidated save: gathered to rank 0, or
// copied off the device by the rank that writes them.
constexpr int64_t kGatherSliceBytes = 16 << 20;

// Whether every shard of `s` is a block of whole rows (all dimensions after the first
// complete): each is then one run of bytes of the consolidated file, which its holder
// writes itself.
bool row_blocks(const sharding::ShardedTensor& s) {
  const std::vector<int64_t>& shape = s.shape();
  if (shape.empty() || s.numel() == 0) return false;
  for (const auto& m : s.shards_metadata())
    for (size_t d = 1; d < shape.size(); ++d)
      if (m.box.offsets[d] != 0 || m.box.sizes[d] != shape[d]) return false;
  return true;
}

// The entry of `layout` describing `v`, and local checks that a consolidated save needs
// before any rank writes: a shard without data (on the meta device) is refused here,
// where every rank learns it, not halfway through the writing.
void add_layout_record(SaveLayout& layout, const std::string& fqn, const Value& v, const EntryInfo& e, int rank) {
  std::string d = e.kind;
  if (e.is_tensor()) d += concat(" ", e.dtype, " ", core::shape_string(e.shape));
  if (auto s = std::get_if<sharding::ShardedTensor>(&v)) {
    d += " shards";
    for (const auto& m : s->shards_metadata()) d += concat(" ", m.box.to_string(), "@", m.placement.rank);
    for (const auto& sh : s->local_shards())
      TESSERA_CHECK(!sh.tensor.defined() || !sh.tensor.is_meta(), "cannot save key '", fqn, "': rank ", rank,
                    "'s shard ", sh.meta.box.to_string(), " is on the meta device (it holds no data)");
  } else if (auto t = std::get_if<at::Tensor>(&v); t != nullptr && rank == 0) {
    TESSERA_CHECK(!t->is_meta(), "cannot save key '", fqn, "': rank 0's tensor is on the meta device (it holds no data)");
  }
  layout.records.emplace_back(fqn, std::move(d));
}

}  // namespace

// A consolidated save. Rank 0 lays the file out (header with placeholders, every
// tensor's offset) and gives it its final size; when every rank can open that same file
// (one host, or a filesystem shared by all that keeps the byte ranges of several clients
// apart: not NFS, SMB or FUSE, see shared_writes_refusal), each rank writes the rows of
// the sharded tensors it holds straight into it, so the disk sees as many writers as
// there are ranks and nothing crosses the network. Otherwise (node-local disks), or for
// tensors whose shards are not blocks of whole rows, rank 0 gathers the bytes and writes
// them. Every writer checksums what it writes per block; rank 0 joins the pieces (which
// must tile every tensor exactly) and patches the header; with several writers, each rank
// then reads back the next rank's bytes and checks them. Nothing is renamed unless every
// rank's part is written, fsync'ed and (several writers) read back intact.
//
// Failures: the ranks first agree that they save the same entries (a digest of keys,
// kinds, dtypes, shapes and shards), and every later step ends with an exchange in which
// every rank learns every rank's error, so all fail together and at once. A rank that
// fails while writing skips the rest of its writing but still takes part in every
// gather, so that the others reach that exchange. What stays slow: a failure inside a
// collective itself (a dead peer, memory for a gather's buffer) reaches the others as
// that collective's timeout.
void save_full(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm) {
  // The phases, for TESSERA_LOG_LEVEL=debug: gathering, waiting for the writer, finishing.
  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();
  double gather_s = 0, wait_s = 0, verify_s = 0;
  const int rank = comm.rank();
  const std::string what = concat("saving '", path, "'");
  auto flat = flatten_values(sd);
  TempGuard guard;  // rank 0's temporary
  std::string err;

  // 1. Every rank describes what it saves; rank 0 also prepares the target. All learn
  //    every error and compare digests before anything is written.
  CheckpointMetadata m;
  m.world_size = comm.size();
  std::vector<TensorSpec> specs;
  SaveLayout layout_list;
  // (Not the path: a rank writes into the file rank 0 names, and ranks on other hosts may
  // reach it under another mount point, as the one-writer fallback allows.)
  std::vector<std::pair<uint64_t, uint64_t>> tensor_bytes;  // (file offset, bytes) of each tensor
  std::vector<std::pair<uint64_t, std::string>> tensor_at;  // (file offset, key) of each tensor
  std::vector<std::pair<std::string, uint64_t>> tensor_names;
  try {
    for (const auto& [fqn, v] : flat) {
      EntryInfo e = describe(fqn, *v);
      add_layout_record(layout_list, fqn, *v, e, rank);
      if (e.is_tensor()) {
        specs.push_back({fqn, e.dtype, e.shape});
        tensor_names.emplace_back(fqn, byte_size(e.shape, e.dtype, concat("key '", fqn, "'")));
      }
      m.keys.push_back(fqn);
      m.entries.emplace(fqn, std::move(e));
    }
    if (rank == 0) {
      err = prepare_target(path, false, guard.tmp);
      if (!err.empty()) guard.tmp.clear();  // nothing of ours to remove
    }
  } catch (const std::exception& e) {
    err = e.what();
  }
  {
    const auto digests = exchange_or_throw(comm, err, Packer().u64(layout_list.digest()).bytes(), what);
    std::vector<uint64_t> d;
    for (size_t r = 0; r < digests.size(); ++r) d.push_back(Unpacker(digests[r], concat("rank ", r, "'s digest")).u64());
    check_same_layout(comm, layout_list, d, path);
  }

  // 2. Rank 0 creates the file: the header (its checksum placeholder holding a random
  //    value, so that the other ranks recognise this very file) and the final size. The
  //    other ranks learn its name and layout as length-prefixed fields, never as text.
  SafetensorsLayout layout;
  std::string info;
  if (rank == 0) {
    try {
      layout = layout_safetensors(path, specs, consolidated_header(m));
      std::string prefix = layout.prefix;
      prefix.replace(layout.header_crc_pos, 8, crc_hex(std::random_device{}()));
      File f(guard.tmp, "w");
      f.pwrite_exact(0, prefix.data(), prefix.size());
      f.resize(layout.file_size());
      f.reserve(layout.file_size());  // lets the ranks' direct writes run side by side (ext4)
      f.close();
      info = Packer()
                 .str(guard.tmp)
                 .u64(layout.data_start())
                 .u64(layout.file_size())
                 .u64(crc32c(prefix.data(), prefix.size()))
                 .bytes();
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  info = broadcast_or_throw(comm, err, info, what);
  Unpacker in(info, "rank 0's file layout");
  const std::string tmp = in.str();
  const uint64_t data_start = in.u64(), file_size = in.u64();
  const auto header_check = static_cast<uint32_t>(in.u64());
  uint64_t off = data_start;
  for (const auto& [name, nb] : tensor_names) {
    tensor_bytes.emplace_back(off, nb);
    tensor_at.emplace_back(off, name);
    off += nb;
  }

  // 3. Who writes: rank 0 always; every other rank when it sees rank 0's file, and all
  //    only where the filesystem keeps several clients' byte ranges apart.
  std::unique_ptr<RunWriter> writer;
  std::string why_not;
  const bool one_writer = std::getenv("TESSERA_FULL_SAVE_ONE_WRITER") != nullptr;
  try {
    if (rank != 0) {
      TESSERA_CHECK(!one_writer, "TESSERA_FULL_SAVE_ONE_WRITER is set");
      File f(tmp, "r");
      TESSERA_CHECK(f.size() == file_size, "'", tmp, "' has ", f.size(), " bytes, rank 0 wrote ", file_size);
      std::string head(data_start, '\0');
      f.pread_exact(0, head.data(), head.size());
      TESSERA_CHECK(crc32c(head.data(), head.size()) == header_check, "'", tmp, "' is not the file rank 0 wrote");
    }
    writer = std::make_unique<RunWriter>(tmp, tensor_bytes);
  } catch (const std::exception& e) {
    why_not = e.what();
    if (rank == 0) err = why_not;  // rank 0 must write; the others only may
  }
  bool able = writer != nullptr;
  if (able && comm.size() > 1 && why_not.empty()) {
    why_not = shared_writes_refusal(tmp);
    able = why_not.empty();
  }
  // With whether it writes, each rank says which kernel (page cache) it runs on.
  const auto all_able =
      exchange_or_throw(comm, rank == 0 ? err : "", Packer().u64(able ? 1 : 0).str(kernel_identity()).bytes(), what);
  bool shared = true, one_kernel = true;
  std::string kernel0;
  for (size_t r = 0; r < all_able.size(); ++r) {
    Unpacker a(all_able[r], concat("rank ", r, "'s status"));
    shared &= a.u64() == 1;
    const std::string k = a.str();
    if (r == 0) kernel0 = k;
    one_kernel &= k == kernel0;
  }
  if (!shared && !why_not.empty()) log::debug("save_full('", path, "') rank ", rank, ": rank 0 writes alone: ", why_not);
  if (!shared && rank != 0) writer.reset();
  auto t_finish = Clock::now();
  struct LogOnExit {  // the phases, on every way out (a failed save's too)
    std::function<void()> f;
    ~LogOnExit() {
      try {
        f();
      } catch (...) {
      }
    }
  } log_phases{[&] {
    log::debug("save_full('", path, "') rank ", rank, ": ", log::seconds(t_start, Clock::now()), " s (",
               shared ? "every rank writes" : "rank 0 writes", "): gathering ", gather_s, " s, waiting for the writer ",
               wait_s, " s, finishing (fsync, checksums, read-back ", verify_s, " s, rename) ",
               log::seconds(t_finish, Clock::now()), " s");
  }};

  // With every rank writing, each distinct box of the row-block tensors goes to one of
  // its holders (the replica groups of HYBRID_SHARD hold each box several times).
  std::vector<Piece> held;
  if (shared) {
    for (const auto& [fqn, v] : flat)
      if (auto s = std::get_if<sharding::ShardedTensor>(v); s != nullptr && row_blocks(*s))
        for (const auto& sh : s->local_shards())
          if (!sh.meta.box.empty()) held.push_back({fqn, s->dtype(), sh.meta.box, [t = sh.tensor] { return t; }});
  }
  std::string plan_err;
  const std::vector<bool> keep = shared ? plan_writers(held, "", comm, plan_err) : std::vector<bool>{};
  TESSERA_CHECK(plan_err.empty(), what, ": ", plan_err);  // the same on every rank

  // 4. The writing. Each writer copies and checksums a piece on a second thread while
  //    the next one is gathered or sliced, one piece in flight (the StreamWriter's own
  //    task meanwhile writes the previous buffer): memory stays at a few slices of
  //    kGatherSliceBytes. The first local failure is kept in `err` and this rank's
  //    remaining writing skipped, while it still takes part in every gather.
  auto attempt = [&](const std::function<void()>& f) {
    if (!err.empty()) return;
    try {
      f();
    } catch (const std::exception& e) {
      err = e.what();
    }
  };
  std::future<void> writing;
  auto wait_write = [&] {
    if (!writing.valid()) return;
    const auto t0 = Clock::now();
    try {
      writing.get();
    } catch (const std::exception& e) {
      if (err.empty()) err = e.what();
    }
    wait_s += log::seconds(t0, Clock::now());
  };
  auto put = [&](const at::Tensor& piece, size_t ti, uint64_t off) {
    if (!writer) return;
    wait_write();
    attempt([&] {
      TESSERA_CHECK(!test_fault(rank, "write"), "test fault (TESSERA_TEST_SAVE_FAULT) writing key '",
                    tensor_names[ti].first, "'");
      writing = std::async(std::launch::async, [&writer, piece, ti, off] { writer->write(ti, off, piece); });
    });
  };
  size_t ti = 0, held_i = 0;
  for (const auto& [fqn, v] : flat) {
    if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
      const std::vector<int64_t>& shape = s->shape();
      const int64_t numel = s->numel();
      if (shape.empty() || numel == 0) {
        at::Tensor full = s->gather(0);  // collective: every rank, failed or not
        if (rank == 0 && numel > 0) put(full, ti, 0);
        ++ti;
        continue;
      }
      const int64_t row_bytes = numel / shape[0] * static_cast<int64_t>(c10::elementSize(s->dtype()));
      const int64_t rows = std::max<int64_t>(1, kGatherSliceBytes / std::max<int64_t>(row_bytes, 1));
      if (shared && row_blocks(*s)) {  // every holder writes its own rows, in slices (no collective)
        for (; held_i < held.size() && held[held_i].fqn == fqn; ++held_i) {
          if (!keep[held_i]) continue;
          attempt([&] {
            const sharding::Box& box = held[held_i].box;
            const at::Tensor shard = held[held_i].data();
            for (int64_t r0 = 0; r0 < box.sizes[0] && err.empty(); r0 += rows)
              put(shard.narrow(0, r0, std::min(rows, box.sizes[0] - r0)), ti,
                  static_cast<uint64_t>((box.offsets[0] + r0) * row_bytes));
          });
        }
        ++ti;
        continue;
      }
      for (int64_t r0 = 0; r0 < shape[0]; r0 += rows) {
        sharding::Box region{std::vector<int64_t>(shape.size(), 0), shape};
        region.offsets[0] = r0;
        region.sizes[0] = std::min(rows, shape[0] - r0);
        // A run inside one of rank 0's own shards needs no collective and no copy: rank
        // 0 writes it from the shard (every rank knows the shards, so all skip alike).
        bool in_rank0 = false;
        for (const auto& sm : s->shards_metadata())
          in_rank0 |= sm.placement.rank == 0 && sharding::contains(sm.box, region);
        if (in_rank0) {
          if (rank == 0) {
            attempt([&, &key = fqn] {  // a structured binding is not captured by [&] (clang, C++17)
              const sharding::Shard* own = nullptr;
              for (const auto& sh : s->local_shards())
                if (sharding::contains(sh.meta.box, region)) own = &sh;
              TESSERA_CHECK(own != nullptr, "key '", key, "': rank 0 holds no local shard with rows ",
                            region.to_string(), " that its shard metadata gives it");
              put(sharding::narrow_to(own->tensor, own->meta.box, region), ti, static_cast<uint64_t>(r0 * row_bytes));
            });
          }
          continue;
        }
        const auto t0 = Clock::now();
        at::Tensor piece = s->gather_region(region, 0);  // collective: every rank, failed or not
        gather_s += log::seconds(t0, Clock::now());
        if (rank == 0) put(piece, ti, static_cast<uint64_t>(r0 * row_bytes));
      }
      ++ti;
    } else if (auto t = std::get_if<at::Tensor>(v)) {
      if (rank == 0 && t->numel() > 0) put(*t, ti, 0);
      ++ti;
    }
  }
  wait_write();
  t_finish = Clock::now();
  std::vector<CrcPiece> my_pieces;
  std::vector<WrittenRange> my_edges;
  if (writer) {
    attempt([&] {
      writer->finish();  // this rank's part is on disk
      my_pieces = writer->pieces();
      my_edges = writer->edges();
      if (test_fault(rank, "flip") && !my_edges.empty()) flip_byte(tmp, my_edges[0].at);
    });
  }
  writer.reset();

  // 5. Every rank learns every rank's checksum pieces and edges (or its error); rank 0
  //    joins the pieces into the header's block checksums and patches it.
  const auto parts = exchange_or_throw(
      comm, err, Packer().str(pack_crc_pieces(my_pieces)).str(pack_ranges(my_edges)).bytes(), what);
  std::vector<std::vector<CrcPiece>> pieces_of(parts.size());
  std::vector<std::vector<WrittenRange>> edges_of(parts.size());
  for (size_t r = 0; r < parts.size(); ++r) {
    Unpacker in(parts[r], concat("rank ", r, "'s checksums"));
    pieces_of[r] = unpack_crc_pieces(in.str(), concat("rank ", r));
    edges_of[r] = unpack_ranges(in.str(), concat("rank ", r, "'s edges"));
  }
  if (rank == 0) {
    attempt([&] {
      std::vector<CrcPiece> pieces;
      for (const auto& p : pieces_of) pieces.insert(pieces.end(), p.begin(), p.end());
      const std::string header = layout.final_prefix(assemble_block_crcs(std::move(pieces), tensor_names, path));
      File f(tmp, "u");
      f.pwrite_exact(0, header.data(), header.size());
      f.fsync();
      f.close();
    });
  }
  exchange_or_throw(comm, err, "", what);

  // 6. With several writers, each rank reads back what the next rank wrote (read past
  //    this host's cache) and checks it against the checksums it was written with: a
  //    filesystem that mixed up the writers' pages fails the save here, while the
  //    previous checkpoint is still in place. Where all ranks share one kernel (one page
  //    cache: coherent), the pages writers may share, the first and last of each run;
  //    across hosts, or with TESSERA_FULL_SAVE_READ_BACK=all, every byte (which costs a
  //    second pass over the file: docs/checkpoint-format.md).
  if (shared && comm.size() > 1) {
    const auto t0 = Clock::now();
    const size_t next = static_cast<size_t>((rank + 1) % comm.size());
    attempt([&] {
      const char* v = std::getenv("TESSERA_FULL_SAVE_READ_BACK");
      const std::string mode = v != nullptr ? v : one_kernel ? "edges" : "all";
      TESSERA_CHECK(mode == "all" || mode == "edges", "TESSERA_FULL_SAVE_READ_BACK='", mode,
                    "': expected 'all' or 'edges'");
      std::vector<uint64_t> offsets;
      for (const auto& tb : tensor_bytes) offsets.push_back(tb.first);
      verify_read_back(tmp, mode == "all" ? piece_ranges(pieces_of[next], offsets) : edges_of[next], tensor_at,
                       concat("rank ", next));
    });
    verify_s = log::seconds(t0, Clock::now());
  }
  exchange_or_throw(comm, err, "", what);

  // 7. The commit.
  if (rank == 0) {
    attempt([&] {
      commit_rename(tmp, path);
      guard.committed = true;
    });
  }
  agree(comm, err, what);
}

}  // namespace tessera::checkpoint
