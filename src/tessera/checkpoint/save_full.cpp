// The consolidated save (one safetensors file), as a sequence of named phases: FullSave's
// methods are the phases and its members what one phase hands the next. The sharded save
// is in save.cpp, async saves and save() itself in save_async.cpp, the steps every rank
// takes together in rank_agreement.cpp, what both saves share in save_steps.cpp, and this
// save's own I/O (runs of one file written by several ranks, the read-back) in
// save_full_io.cpp.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <tuple>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/rank_agreement.h"
#include "tessera/checkpoint/save_full_io.h"
#include "tessera/checkpoint/save_steps.h"
#include "tessera/checkpoint/test_hooks.h"
#include "tessera/checkpoint/wire.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/stream_writer.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/device.h"
#include "tessera/core/env.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/strings.h"
#include "tessera/sharding/chunk.h"

namespace tessera::checkpoint {

namespace {

using state::Value;

// Bytes of a tensor handled at a time by a consolidated save: gathered to rank 0, or
// copied off the device by the rank that writes them.
constexpr int64_t kGatherSliceBytes = 16 << 20;

// One writer per box. Ranks that hold the same box (the replica groups of HYBRID_SHARD
// each hold the whole model, sharded the same way) would otherwise all write it, and
// the tiling check would reject the overlap. Every rank lists the boxes it could write
// (or its error); the lists are exchanged (length-prefixed: a key is any bytes), and each
// distinct box goes to one of its holders: the one with the fewest bytes assigned so far,
// largest boxes first, the lowest rank on a tie, so replica groups share the writing.
// Every rank computes the same assignment from the same lists. Returns, for each of
// `mine`, whether this rank writes it; `err` gets the errors of all ranks (the same text
// on every rank).
std::vector<bool> plan_writers(const std::vector<Piece>& mine, const std::string& local_err, int rank,
                               RankAgreement& ranks, std::string& err) {
  using BoxKey = std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>>;
  Packer list;
  list.u64(mine.size());
  for (const auto& p : mine) {
    list.str(p.fqn).u64(p.box.offsets.size()).u64(static_cast<uint64_t>(p.box.numel()) * c10::elementSize(p.dtype));
    for (size_t d = 0; d < p.box.offsets.size(); ++d)
      list.u64(static_cast<uint64_t>(p.box.offsets[d])).u64(static_cast<uint64_t>(p.box.sizes[d]));
  }
  const AllOutcomes all = ranks.gather(local_err, list.bytes());
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
    if (w == rank) written_here.insert(*k);
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    const BoxKey k{mine[i].fqn, mine[i].box.offsets, mine[i].box.sizes};
    keep[i] = written_here.erase(k) > 0;  // a box listed twice by one rank is written once
  }
  return keep;
}

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
// kinds, dtypes, shapes and shards), and every later phase's errors reach every rank at
// an exchange (the writing's at the first of join_checksums), so all fail together and
// at once. A rank that fails while writing skips the rest of its writing but still takes
// part in every gather, so that the others reach that exchange: its first error waits in
// `err_` (attempt). What stays slow: a failure inside a collective itself (a dead peer,
// memory for a gather's buffer) reaches the others as that collective's timeout.
//
// One object per rank and save. Every rank calls the phases once each, in the order they
// are declared, so all take part in the same exchanges; one that throws (on every rank
// alike, an exchange's outcome, but for the slow case above) ends the save, and the
// object's destruction then removes rank 0's temporary.
class FullSave {
 public:
  FullSave(const state::StateDict& sd, const CheckedPath& path, distributed::Communicator& comm)
      : t_start_(Clock::now()),
        comm_(comm),
        path_(path),
        rank_(comm.rank()),
        what_(concat("saving '", path.str(), "'")),
        ranks_(comm, what_),
        flat_(sd.flatten()) {}

  void describe_and_agree();  // 1. every rank describes what it saves; all compare
  void create_file();         // 2. rank 0 creates the file; all learn its layout
  void choose_writers();      // 3. which ranks write, and which boxes each
  void write_pieces();        // 4. the writing, gathers included
  void join_checksums();      // 5. rank 0 joins every writer's checksums into the header
  void read_back();           // 6. each rank checks what the next rank wrote
  void commit();              // 7. rank 0 renames the file into place

 private:
  using Clock = std::chrono::steady_clock;

  // Runs `f` unless this rank has already failed; an exception from it becomes this
  // rank's error (`err_`), learned by all at the next exchange.
  void attempt(const std::function<void()>& f);
  // Waits for the piece in flight (if any) to be written; its error becomes this rank's.
  void wait_write();
  // Hands `piece` (bytes from `off` of tensor `ti`) to this rank's writer, on a second
  // thread, once the previous piece is written; nothing when this rank does not write.
  void put(const at::Tensor& piece, size_t ti, uint64_t off);
  // The writing of sharded tensor `s` (tensor `ti` of the file), part of write_pieces.
  void write_sharded(const std::string& fqn, const sharding::ShardedTensor& s, size_t ti);

  // The phases' timing, for TESSERA_LOG_LEVEL=debug: gathering, waiting for the writer,
  // finishing.
  const Clock::time_point t_start_;
  Clock::time_point t_finish_;
  double gather_s_ = 0, wait_s_ = 0, verify_s_ = 0;

  distributed::Communicator& comm_;
  const CheckedPath& path_;  // checked where the save entered
  const int rank_;
  const std::string what_;
  RankAgreement ranks_;  // every rank learning the outcome of each phase
  const std::vector<std::pair<std::string, const Value*>> flat_;
  std::string err_;  // this rank's first error ("" while it has none)

  // describe_and_agree: the entries, and each tensor's (key, bytes) in file order.
  CheckpointMetadata m_;
  std::vector<TensorSpec> specs_;
  std::vector<std::pair<std::string, uint64_t>> tensor_names_;
  // create_file: rank 0's layout of the file, and what every rank learns of it.
  SafetensorsLayout layout_;  // rank 0's only
  std::string tmp_;           // the file, as rank 0 names it
  uint64_t data_start_ = 0, file_size_ = 0;
  uint32_t header_check_ = 0;  // checksum of the header rank 0 wrote (random placeholder included)
  std::vector<std::pair<uint64_t, uint64_t>> tensor_bytes_;  // (file offset, bytes) of each tensor
  std::vector<std::pair<uint64_t, std::string>> tensor_at_;  // (file offset, key) of each tensor
  // choose_writers: whether every rank writes (else rank 0 alone), whether all share one
  // kernel, and the row blocks this rank holds with whether it writes each.
  bool shared_ = true, one_kernel_ = true;
  std::vector<Piece> held_;
  std::vector<bool> keep_;
  // write_pieces: the next of held_ to write, and what this rank's writer wrote.
  size_t held_i_ = 0;
  std::vector<CrcPiece> my_pieces_;
  std::vector<WrittenRange> my_edges_;
  // join_checksums: every rank's checksum pieces and edges.
  std::vector<std::vector<CrcPiece>> pieces_of_;
  std::vector<std::vector<WrittenRange>> edges_of_;

  // Destroyed in the reverse order, on every way out: the piece in flight is waited for
  // (its task uses the writer), the phases are logged, the writer is closed, and rank 0's
  // temporary is removed unless committed.
  TempGuard guard_;                    // rank 0's temporary
  std::unique_ptr<RunWriter> writer_;  // this rank's writer, when it writes
  struct LogOnExit {                   // the phases, on every way out (a failed save's too)
    std::function<void()> f;           // set once the writers are chosen
    ~LogOnExit() {
      try {
        if (f) f();
      } catch (...) {
      }
    }
  } log_phases_;
  std::future<void> writing_;  // the piece in flight
};

void FullSave::attempt(const std::function<void()>& f) {
  if (!err_.empty()) return;
  try {
    f();
  } catch (const std::exception& e) {
    err_ = e.what();
  }
}

// 1. Every rank describes what it saves; rank 0 also prepares the target. All learn
//    every error and compare digests before anything is written.
void FullSave::describe_and_agree() {
  m_.world_size = comm_.size();
  // What the ranks compare. (Not the path: a rank writes into the file rank 0 names, and
  // ranks on other hosts may reach it under another mount point, as the one-writer
  // fallback allows.)
  SaveLayout layout_list;
  try {
    for (const auto& [fqn, v] : flat_) {
      EntryInfo e = describe_entry(fqn, *v);
      add_layout_record(layout_list, fqn, *v, e, rank_);
      if (e.is_tensor()) {
        specs_.push_back({fqn, e.dtype, e.shape});
        tensor_names_.emplace_back(fqn, byte_size(e.shape, e.dtype, concat("key '", fqn, "'")));
      }
      m_.keys.push_back(fqn);
      m_.entries.emplace(fqn, std::move(e));
    }
    if (rank_ == 0) {
      err_ = prepare_target(path_, false, guard_.tmp);
      if (!err_.empty()) guard_.tmp.reset();  // nothing of ours to remove
    }
  } catch (const std::exception& e) {
    err_ = e.what();
  }
  const auto digests = ranks_.gather_or_throw(err_, Packer().u64(layout_list.digest()).bytes());
  std::vector<uint64_t> d;
  for (size_t r = 0; r < digests.size(); ++r) d.push_back(Unpacker(digests[r], concat("rank ", r, "'s digest")).u64());
  check_same_layout(comm_, layout_list, d, path_, SaveMode::Full);
}

// 2. Rank 0 creates the file: the header (its checksum placeholder holding a random
//    value, so that the other ranks recognise this very file) and the final size. The
//    other ranks learn its name and layout as length-prefixed fields, never as text.
void FullSave::create_file() {
  std::string info;
  if (rank_ == 0) {
    try {
      layout_ = layout_safetensors(path_, specs_, consolidated_header(m_));
      std::string prefix = layout_.prefix;
      prefix.replace(layout_.header_crc_pos, 8, crc_hex(std::random_device{}()));
      File f(*guard_.tmp, "w");
      f.pwrite_exact(0, prefix.data(), prefix.size());
      f.resize(layout_.file_size());
      f.reserve(layout_.file_size());  // lets the ranks' direct writes run side by side (ext4)
      f.close();
      info = Packer()
                 .str(*guard_.tmp)
                 .u64(layout_.data_start())
                 .u64(layout_.file_size())
                 .u64(crc32c(prefix.data(), prefix.size()))
                 .bytes();
    } catch (const std::exception& e) {
      err_ = e.what();
    }
  }
  info = ranks_.from_rank0_or_throw(err_, info);
  Unpacker in(info, "rank 0's file layout");
  tmp_ = in.str();
  data_start_ = in.u64();
  file_size_ = in.u64();
  header_check_ = static_cast<uint32_t>(in.u64());
  uint64_t off = data_start_;
  for (const auto& [name, nb] : tensor_names_) {
    tensor_bytes_.emplace_back(off, nb);
    tensor_at_.emplace_back(off, name);
    off += nb;
  }
}

// 3. Who writes: rank 0 always; every other rank when it sees rank 0's file, and all
//    only where the filesystem keeps several clients' byte ranges apart.
void FullSave::choose_writers() {
  std::string why_not;
  const bool one_writer = env::get_bool("TESSERA_FULL_SAVE_ONE_WRITER").value_or(false);
  try {
    if (rank_ != 0) {
      TESSERA_CHECK(!one_writer, "TESSERA_FULL_SAVE_ONE_WRITER is set");
      File f(tmp_, "r");
      TESSERA_CHECK(f.size() == file_size_, "'", tmp_, "' has ", f.size(), " bytes, rank 0 wrote ", file_size_);
      std::string head(data_start_, '\0');
      f.pread_exact(0, head.data(), head.size());
      TESSERA_CHECK(crc32c(head.data(), head.size()) == header_check_, "'", tmp_, "' is not the file rank 0 wrote");
    }
    writer_ = std::make_unique<RunWriter>(tmp_, tensor_bytes_);
  } catch (const std::exception& e) {
    why_not = e.what();
    if (rank_ == 0) err_ = why_not;  // rank 0 must write; the others only may
  }
  bool able = writer_ != nullptr;
  if (able && comm_.size() > 1 && why_not.empty()) {
    why_not = shared_writes_refusal(tmp_);
    able = why_not.empty();
  }
  // With whether it writes, each rank says which kernel (page cache) it runs on.
  const auto all_able =
      ranks_.gather_or_throw(rank_ == 0 ? err_ : "", Packer().u64(able ? 1 : 0).str(kernel_identity()).bytes());
  std::string kernel0;
  for (size_t r = 0; r < all_able.size(); ++r) {
    Unpacker a(all_able[r], concat("rank ", r, "'s status"));
    shared_ &= a.u64() == 1;
    const std::string k = a.str();
    if (r == 0) kernel0 = k;
    one_kernel_ &= k == kernel0;
  }
  if (!shared_ && !why_not.empty())
    log::debug("save_full('", path_.str(), "') rank ", rank_, ": rank 0 writes alone: ", why_not);
  if (!shared_ && rank_ != 0) writer_.reset();
  t_finish_ = Clock::now();
  log_phases_.f = [this] {
    log::debug("save_full('", path_.str(), "') rank ", rank_, ": ", log::seconds(t_start_, Clock::now()), " s (",
               shared_ ? "every rank writes" : "rank 0 writes", "): gathering ", gather_s_,
               " s, waiting for the writer ", wait_s_, " s, finishing (fsync, checksums, read-back ", verify_s_,
               " s, rename) ", log::seconds(t_finish_, Clock::now()), " s");
  };

  // With every rank writing, each distinct box of the row-block tensors goes to one of
  // its holders (the replica groups of HYBRID_SHARD hold each box several times).
  if (shared_) {
    for (const auto& [fqn, v] : flat_)
      if (auto s = std::get_if<sharding::ShardedTensor>(v); s != nullptr && row_blocks(*s))
        for (const auto& sh : s->local_shards())
          if (!sh.meta.box.empty()) held_.push_back({fqn, s->dtype(), sh.meta.box, [t = sh.tensor] { return t; }});
  }
  std::string plan_err;
  keep_ = shared_ ? plan_writers(held_, "", rank_, ranks_, plan_err) : std::vector<bool>{};
  TESSERA_CHECK(plan_err.empty(), what_, ": ", plan_err);  // the same on every rank
}

void FullSave::wait_write() {
  if (!writing_.valid()) return;
  const auto t0 = Clock::now();
  try {
    writing_.get();
  } catch (const std::exception& e) {
    if (err_.empty()) err_ = e.what();
  }
  wait_s_ += log::seconds(t0, Clock::now());
}

void FullSave::put(const at::Tensor& piece, size_t ti, uint64_t off) {
  if (!writer_) return;
  wait_write();
  attempt([&] {
    TESSERA_CHECK(!test_fault(rank_, "write"), "test fault (TESSERA_TEST_SAVE_FAULT) writing key '",
                  tensor_names_[ti].first, "'");
    writing_ = std::async(std::launch::async, [w = writer_.get(), piece, ti, off] { w->write(ti, off, piece); });
  });
}

// 4. The writing. Each writer copies and checksums a piece on a second thread while
//    the next one is gathered or sliced, one piece in flight (the StreamWriter's own
//    task meanwhile writes the previous buffer): memory stays at a few slices of
//    kGatherSliceBytes. The first local failure is kept in `err_` and this rank's
//    remaining writing skipped, while it still takes part in every gather. Ends with
//    this rank's part on disk (fsync'ed) and its checksum pieces and edges known.
void FullSave::write_pieces() {
  size_t ti = 0;
  for (const auto& [fqn, v] : flat_) {
    if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
      write_sharded(fqn, *s, ti);
      ++ti;
    } else if (auto t = std::get_if<at::Tensor>(v)) {
      if (rank_ == 0 && t->numel() > 0) put(*t, ti, 0);
      ++ti;
    }
  }
  wait_write();
  t_finish_ = Clock::now();
  if (writer_) {
    attempt([&] {
      writer_->finish();  // this rank's part is on disk
      my_pieces_ = writer_->pieces();
      my_edges_ = writer_->edges();
      if (test_fault(rank_, "flip") && !my_edges_.empty()) flip_byte(tmp_, my_edges_[0].at);
    });
  }
  writer_.reset();
}

// A scalar or empty tensor is gathered whole to rank 0. Otherwise, in slices of
// kGatherSliceBytes of rows: with every rank writing and shards that are blocks of whole
// rows, each box's chosen holder writes it (no collective); else rank 0 writes each slice,
// gathered to it unless it lies in one of rank 0's own shards. Every rank calls this for
// every sharded tensor in the same order, so all enter the same gathers.
void FullSave::write_sharded(const std::string& fqn, const sharding::ShardedTensor& s, size_t ti) {
  const std::vector<int64_t>& shape = s.shape();
  const int64_t numel = s.numel();
  if (shape.empty() || numel == 0) {
    at::Tensor full = s.gather(0);  // collective: every rank, failed or not
    if (rank_ == 0 && numel > 0) put(full, ti, 0);
    return;
  }
  const int64_t row_bytes = numel / shape[0] * static_cast<int64_t>(c10::elementSize(s.dtype()));
  const int64_t rows = std::max<int64_t>(1, kGatherSliceBytes / std::max<int64_t>(row_bytes, 1));
  if (shared_ && row_blocks(s)) {  // every holder writes its own rows, in slices (no collective)
    for (; held_i_ < held_.size() && held_[held_i_].fqn == fqn; ++held_i_) {
      if (!keep_[held_i_]) continue;
      attempt([&] {
        const sharding::Box& box = held_[held_i_].box;
        const at::Tensor shard = held_[held_i_].data();
        for (int64_t r0 = 0; r0 < box.sizes[0] && err_.empty(); r0 += rows)
          put(shard.narrow(0, r0, std::min(rows, box.sizes[0] - r0)), ti,
              static_cast<uint64_t>((box.offsets[0] + r0) * row_bytes));
      });
    }
    return;
  }
  for (int64_t r0 = 0; r0 < shape[0]; r0 += rows) {
    sharding::Box region{std::vector<int64_t>(shape.size(), 0), shape};
    region.offsets[0] = r0;
    region.sizes[0] = std::min(rows, shape[0] - r0);
    // A run inside one of rank 0's own shards needs no collective and no copy: rank
    // 0 writes it from the shard (every rank knows the shards, so all skip alike).
    bool in_rank0 = false;
    for (const auto& sm : s.shards_metadata())
      in_rank0 |= sm.placement.rank == 0 && sharding::contains(sm.box, region);
    if (in_rank0) {
      if (rank_ == 0) {
        attempt([&] {
          const sharding::Shard* own = nullptr;
          for (const auto& sh : s.local_shards())
            if (sharding::contains(sh.meta.box, region)) own = &sh;
          TESSERA_CHECK(own != nullptr, "key '", fqn, "': rank 0 holds no local shard with rows ",
                        region.to_string(), " that its shard metadata gives it");
          put(sharding::narrow_to(own->tensor, own->meta.box, region), ti, static_cast<uint64_t>(r0 * row_bytes));
        });
      }
      continue;
    }
    const auto t0 = Clock::now();
    at::Tensor piece = s.gather_region(region, 0);  // collective: every rank, failed or not
    gather_s_ += log::seconds(t0, Clock::now());
    if (rank_ == 0) put(piece, ti, static_cast<uint64_t>(r0 * row_bytes));
  }
}

// 5. Every rank learns every rank's checksum pieces and edges (or its error); rank 0
//    joins the pieces into the header's block checksums and patches it.
void FullSave::join_checksums() {
  const auto parts =
      ranks_.gather_or_throw(err_, Packer().str(pack_crc_pieces(my_pieces_)).str(pack_ranges(my_edges_)).bytes());
  pieces_of_.resize(parts.size());
  edges_of_.resize(parts.size());
  for (size_t r = 0; r < parts.size(); ++r) {
    Unpacker in(parts[r], concat("rank ", r, "'s checksums"));
    pieces_of_[r] = unpack_crc_pieces(in.str(), concat("rank ", r));
    edges_of_[r] = unpack_ranges(in.str(), concat("rank ", r, "'s edges"));
  }
  if (rank_ == 0) {
    attempt([&] {
      std::vector<CrcPiece> pieces;
      for (const auto& p : pieces_of_) pieces.insert(pieces.end(), p.begin(), p.end());
      const std::string header = layout_.final_prefix(assemble_block_crcs(std::move(pieces), tensor_names_, path_));
      File f(tmp_, "u");
      f.pwrite_exact(0, header.data(), header.size());
      f.fsync();
      f.close();
    });
  }
  ranks_.gather_or_throw(err_);
}

// 6. With several writers, each rank reads back what the next rank wrote (read past
//    this host's cache) and checks it against the checksums it was written with: a
//    filesystem that mixed up the writers' pages fails the save here, while the
//    previous checkpoint is still in place. Where all ranks share one kernel (one page
//    cache: coherent), the pages writers may share, the first and last of each run;
//    across hosts, or with TESSERA_FULL_SAVE_READ_BACK=all, every byte (which costs a
//    second pass over the file: docs/checkpoint-format.md).
void FullSave::read_back() {
  if (shared_ && comm_.size() > 1) {
    const auto t0 = Clock::now();
    const size_t next = static_cast<size_t>((rank_ + 1) % comm_.size());
    attempt([&] {
      const std::string mode = env::get("TESSERA_FULL_SAVE_READ_BACK").value_or(one_kernel_ ? "edges" : "all");
      TESSERA_CHECK(mode == "all" || mode == "edges", "TESSERA_FULL_SAVE_READ_BACK='", mode,
                    "': expected 'all' or 'edges'");
      std::vector<uint64_t> offsets;
      for (const auto& tb : tensor_bytes_) offsets.push_back(tb.first);
      verify_read_back(tmp_, mode == "all" ? piece_ranges(pieces_of_[next], offsets) : edges_of_[next], tensor_at_,
                       concat("rank ", next));
    });
    verify_s_ = log::seconds(t0, Clock::now());
  }
  ranks_.gather_or_throw(err_);
}

// 7. The commit: rank 0 renames the file into place; every rank learns its outcome.
void FullSave::commit() {
  if (rank_ == 0) {
    attempt([&] {
      commit_rename(*guard_.tmp, path_);
      guard_.committed = true;
    });
  }
  ranks_.from_rank0_or_throw(err_);  // rank 0's outcome, thrown everywhere when an error
}

}  // namespace

void save_full(const state::StateDict& sd, const CheckedPath& path, distributed::Communicator& comm) {
  FullSave save(sd, path, comm);
  save.describe_and_agree();
  save.create_file();
  save.choose_writers();
  save.write_pieces();
  save.join_checksums();
  save.read_back();
  save.commit();
}

}  // namespace tessera::checkpoint
