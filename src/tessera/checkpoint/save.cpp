// Distributed save (sharded and full) and async save.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <set>
#include <thread>
#include <tuple>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/checksum.h"
#include "tessera/checkpoint/file_io.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/device.h"
#include "tessera/core/error.h"
#include "tessera/core/log.h"
#include "tessera/core/stream_copy.h"
#include "tessera/sharding/chunk.h"

namespace tessera::checkpoint {

namespace {

using state::Value;

// Broadcasts rank 0's outcome ("" = ok) and throws it everywhere when it is an error.
void agree(distributed::Communicator& comm, const std::string& rank0_error, const std::string& what) {
  const std::string e = comm.broadcast_bytes(rank0_error, 0);
  TESSERA_CHECK(e.empty(), what, ": ", e);
}

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
// (or its error, "E..."); the lists are exchanged, and each distinct box goes to one of
// its holders: the one with the fewest bytes assigned so far, largest boxes first, the
// lowest rank on a tie, so replica groups share the writing. Every rank computes the
// same assignment from the same lists. Returns, for each of `mine`, whether this rank
// writes it; `err` gets the errors of all ranks (the same text on every rank).
std::vector<bool> plan_writers(const std::vector<Piece>& mine, const std::string& local_err,
                               distributed::Communicator& comm, std::string& err) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& p : mine)
    list.push_back({p.fqn, p.box.offsets, p.box.sizes,
                    static_cast<uint64_t>(p.box.numel()) * c10::elementSize(p.dtype)});
  const auto all = comm.all_gather_bytes(local_err.empty() ? "C" + list.dump() : "E" + local_err);
  err.clear();
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r][0] == 'E') err += concat(err.empty() ? "" : "; ", "rank ", r, ": ", all[r].substr(1));
  std::vector<bool> keep(mine.size(), false);
  if (!err.empty()) return keep;
  using BoxKey = std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>>;
  struct Holders {
    uint64_t bytes = 0;
    std::vector<int> ranks;  // ascending
  };
  std::map<BoxKey, Holders> boxes;
  for (size_t r = 0; r < all.size(); ++r)
    for (const auto& j : nlohmann::json::parse(all[r].substr(1))) {
      Holders& h = boxes[BoxKey{j[0].get<std::string>(), j[1].get<std::vector<int64_t>>(),
                                j[2].get<std::vector<int64_t>>()}];
      h.bytes = j[3].get<uint64_t>();
      h.ranks.push_back(static_cast<int>(r));
    }
  std::vector<std::pair<const BoxKey*, const Holders*>> order;
  for (const auto& [k, h] : boxes) order.emplace_back(&k, &h);
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second->bytes > b.second->bytes; });
  std::vector<uint64_t> load(all.size(), 0);
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

void save_sharded(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm) {
  const int rank = comm.rank();
  auto flat = flatten_values(sd);
  std::string tmp, err;
  if (rank == 0) err = prepare_target(path, true, tmp);
  agree(comm, err, concat("saving '", path, "'"));
  tmp = comm.broadcast_bytes(tmp, 0);

  CheckpointMetadata m;
  m.world_size = comm.size();
  m.crc_block = kCrcBlock;
  std::vector<Piece> pieces;
  std::string local_err;
  try {
    for (const auto& [fqn, v] : flat) {
      EntryInfo e = describe(fqn, *v);
      if (auto t = std::get_if<at::Tensor>(v)) {
        if (rank == 0 && t->numel() > 0) {  // replicated: rank 0 writes it
          const at::Tensor tt = *t;
          pieces.push_back({fqn, e.dtype, sharding::full_box(e.shape), [tt] { return tt; }});
        }
      } else if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
        for (const auto& sh : s->local_shards()) {
          if (sh.meta.box.empty()) continue;
          const at::Tensor tt = sh.tensor;
          pieces.push_back({fqn, e.dtype, sh.meta.box, [tt] { return tt; }});
        }
      }
      m.keys.push_back(fqn);
      m.entries.emplace(fqn, std::move(e));
    }
  } catch (const std::exception& e) {
    local_err = e.what();
  }
  const std::vector<bool> keep = plan_writers(pieces, local_err, comm, err);
  if (err.empty()) {
    std::string mine;
    try {
      std::vector<Piece> writing;
      for (size_t i = 0; i < pieces.size(); ++i)
        if (keep[i]) writing.push_back(std::move(pieces[i]));
      mine = to_json(write_data_file(tmp, data_file_name(rank), writing));
    } catch (const std::exception& e) {
      mine = std::string("E") + e.what();
    }
    if (mine.empty() || mine[0] != 'E') mine = "D" + mine;
    auto all = comm.all_gather_bytes(mine);
    if (rank == 0) {
      for (size_t r = 0; r < all.size(); ++r)
        if (all[r][0] == 'E') err += concat(err.empty() ? "" : "; ", "rank ", r, ": ", all[r].substr(1));
      if (err.empty()) {
        try {
          for (size_t r = 0; r < all.size(); ++r) {
            DataFileResult d = data_file_result_from_json(all[r].substr(1));
            m.files.emplace_back(d.file, d.size);
            for (auto& [fqn, c] : d.chunks) {
              auto it = m.entries.find(fqn);
              TESSERA_CHECK(it != m.entries.end(), "rank ", r, " saved key '", fqn, "' that rank 0 does not have");
              it->second.chunks.push_back(std::move(c));
            }
          }
          for (const auto& k : m.keys)
            if (m.entries[k].is_tensor()) check_tiling(k, m.entries[k]);
          write_metadata_file(tmp, m);
          commit_rename(tmp, path);
        } catch (const std::exception& e) {
          err = e.what();
        }
      }
    }
  }
  if (rank == 0 && !err.empty()) {
    try {
      remove_all(tmp);
    } catch (const std::exception&) {
    }
  }
  agree(comm, err, concat("saving '", path, "'"));
}

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

// One rank's part of a consolidated file that several ranks write at once: runs of
// bytes of tensors, each at its offset, checksummed per block of its tensor as it is
// copied (the pieces rank 0 joins into the header's block checksums).
class RunWriter {
 public:
  // `tensors`: each tensor's (file offset, byte size).
  RunWriter(const std::string& path, std::vector<std::pair<uint64_t, uint64_t>> tensors)
      : out_(path, 16u << 20, StreamWriter::Open::Existing), tensors_(std::move(tensors)) {}

  // Writes `t` (any device, layout) at byte `off` of tensor `ti`.
  void write(size_t ti, uint64_t off, const at::Tensor& t) {
    const at::Tensor c = dense_cpu(t);
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    uint64_t n = static_cast<uint64_t>(c.numel()) * c.element_size();
    TESSERA_CHECK(off + n <= tensors_.at(ti).second, "internal: bytes ", off, "..", off + n, " of tensor ", ti,
                  " past its ", tensors_[ti].second);
    out_.seek(tensors_[ti].first + off);
    // Checksummed in 256 KiB steps just before each step is copied, while it is in cache.
    CrcPiece cur{static_cast<uint32_t>(ti), off, 0, 0};
    while (n > 0) {
      const uint64_t take = std::min<uint64_t>({n, kCrcBlock - off % kCrcBlock, 256u << 10});
      cur.crc = crc32c_extend(cur.crc, p, static_cast<size_t>(take));
      out_.append(p, take);
      cur.len += take;
      p += take;
      off += take;
      n -= take;
      if (off % kCrcBlock == 0 || n == 0) {
        pieces_.push_back(cur);
        cur = CrcPiece{static_cast<uint32_t>(ti), off, 0, 0};
      }
    }
  }
  void finish() { out_.finish(); }
  const std::vector<CrcPiece>& pieces() const { return pieces_; }

 private:
  StreamWriter out_;
  std::vector<std::pair<uint64_t, uint64_t>> tensors_;
  std::vector<CrcPiece> pieces_;
};

// A consolidated save. Rank 0 lays the file out (header with placeholders, every
// tensor's offset) and gives it its final size; when every rank can open that same file
// (one host, or a filesystem shared by all), each rank writes the rows of the sharded
// tensors it holds straight into it, so the disk sees as many writers as there are
// ranks and nothing crosses the network. Otherwise (node-local disks), or for tensors
// whose shards are not blocks of whole rows, rank 0 gathers the bytes and writes them.
// Every writer checksums what it writes per block; rank 0 joins the pieces (which must
// tile every tensor exactly), patches the header, fsyncs and renames. Nothing is
// renamed unless every rank's part is written and fsync'ed.
void save_full(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm) {
  // The phases, for TESSERA_LOG_LEVEL=debug: gathering, waiting for the writer, finishing.
  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();
  double gather_s = 0, wait_s = 0;
  const int rank = comm.rank();
  auto flat = flatten_values(sd);
  std::string tmp, err;
  if (rank == 0) err = prepare_target(path, false, tmp);
  agree(comm, err, concat("saving '", path, "'"));

  CheckpointMetadata m;
  m.world_size = comm.size();
  std::vector<TensorSpec> specs;
  for (const auto& [fqn, v] : flat) {
    EntryInfo e = describe(fqn, *v);
    if (e.is_tensor()) specs.push_back({fqn, e.dtype, e.shape});
    m.keys.push_back(fqn);
    m.entries.emplace(fqn, std::move(e));
  }
  // Rank 0 creates the file: the header (its checksum placeholder holding a random
  // value, so that the other ranks recognise this very file) and the final size.
  SafetensorsLayout layout;
  std::string info;  // "T<tmp>\n<data start>\n<file size>\n<crc of the header>" or "E<error>"
  if (rank == 0) {
    try {
      layout = layout_safetensors(path, specs, consolidated_header(m));
      std::string prefix = layout.prefix;
      prefix.replace(layout.header_crc_pos, 8, crc_hex(std::random_device{}()));
      File f(tmp, "w");
      f.pwrite_exact(0, prefix.data(), prefix.size());
      f.resize(layout.file_size());
      f.reserve(layout.file_size());  // lets the ranks' direct writes run side by side (ext4)
      f.close();
      info = concat("T", tmp, "\n", layout.data_start(), "\n", layout.file_size(), "\n",
                    crc32c(prefix.data(), prefix.size()));
    } catch (const std::exception& e) {
      info = concat("E", e.what());
      try {
        remove_all(tmp);
      } catch (const std::exception&) {
      }
    }
  }
  info = comm.broadcast_bytes(info, 0);
  TESSERA_CHECK(info[0] == 'T', "saving '", path, "': ", info.substr(1));
  uint64_t data_start = 0, file_size = 0;
  uint32_t header_check = 0;
  {
    std::istringstream in(info.substr(1));
    std::getline(in, tmp);
    in >> data_start >> file_size >> header_check;
  }
  std::vector<std::pair<uint64_t, uint64_t>> tensor_bytes;  // (file offset, bytes) of each tensor
  std::vector<std::pair<std::string, uint64_t>> tensor_names;
  uint64_t off = data_start;
  for (const auto& sp : specs) {
    const uint64_t nb = byte_size(sp.shape, sp.dtype, concat("key '", sp.name, "'"));
    tensor_bytes.emplace_back(off, nb);
    tensor_names.emplace_back(sp.name, nb);
    off += nb;
  }

  // Who writes: rank 0 always; every other rank when it sees rank 0's file.
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
  const auto able = comm.all_gather_bytes(writer ? "1" : "0");
  const bool shared = std::all_of(able.begin(), able.end(), [](const std::string& a) { return a == "1"; });
  if (!shared && rank != 0) {
    if (!why_not.empty()) log::debug("save_full('", path, "') rank ", rank, ": rank 0 writes alone: ", why_not);
    writer.reset();
  }

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
  if (err.empty() && !plan_err.empty()) err = plan_err;

  // Each writer copies and checksums a piece on a second thread while the next one is
  // gathered or sliced, one piece in flight (the StreamWriter's own task meanwhile
  // writes the previous buffer): memory stays at a few slices of kGatherSliceBytes.
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
  auto put = [&](at::Tensor piece, size_t ti, uint64_t off) {
    if (!writer) return;
    wait_write();
    if (!err.empty()) return;
    writing = std::async(std::launch::async,
                         [&writer, piece = std::move(piece), ti, off] { writer->write(ti, off, piece); });
  };
  // Every rank takes part in every gather, even after a failure, so that nobody hangs.
  size_t ti = 0, held_i = 0;
  for (const auto& [fqn, v] : flat) {
    if (auto s = std::get_if<sharding::ShardedTensor>(v)) {
      const std::vector<int64_t>& shape = s->shape();
      const int64_t numel = s->numel();
      if (shape.empty() || numel == 0) {
        at::Tensor full = s->gather(0);
        if (rank == 0 && numel > 0) put(full, ti, 0);
        ++ti;
        continue;
      }
      const int64_t row_bytes = numel / shape[0] * static_cast<int64_t>(c10::elementSize(s->dtype()));
      const int64_t rows = std::max<int64_t>(1, kGatherSliceBytes / std::max<int64_t>(row_bytes, 1));
      if (shared && row_blocks(*s)) {  // every holder writes its own rows, in slices
        for (; held_i < held.size() && held[held_i].fqn == fqn; ++held_i) {
          if (!keep[held_i]) continue;
          const sharding::Box& box = held[held_i].box;
          const at::Tensor shard = held[held_i].data();
          for (int64_t r0 = 0; r0 < box.sizes[0]; r0 += rows)
            put(shard.narrow(0, r0, std::min(rows, box.sizes[0] - r0)), ti,
                static_cast<uint64_t>((box.offsets[0] + r0) * row_bytes));
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
            const sharding::Shard* own = nullptr;
            for (const auto& sh : s->local_shards())
              if (sharding::contains(sh.meta.box, region)) own = &sh;
            if (own == nullptr) {  // reported after the loop, which every rank finishes (no hang)
              if (err.empty())
                err = concat("key '", fqn, "': rank 0 holds no local shard with rows ", region.to_string(),
                             " that its shard metadata gives it");
            } else {
              put(sharding::narrow_to(own->tensor, own->meta.box, region), ti, static_cast<uint64_t>(r0 * row_bytes));
            }
          }
          continue;
        }
        const auto t0 = Clock::now();
        at::Tensor piece = s->gather_region(region, 0);
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
  const auto t_finish = Clock::now();
  if (writer && err.empty()) {
    try {
      writer->finish();  // this rank's part is on disk
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  // Rank 0 learns every rank's checksum pieces (or its error), joins them and publishes.
  const auto parts = comm.all_gather_bytes(err.empty() ? "P" + (writer ? pack_crc_pieces(writer->pieces()) : "")
                                                       : "E" + err);
  writer.reset();
  if (rank == 0) {
    err.clear();
    for (size_t r = 0; r < parts.size(); ++r)
      if (parts[r][0] == 'E') err += concat(err.empty() ? "" : "; ", "rank ", r, ": ", parts[r].substr(1));
    if (err.empty()) {
      try {
        std::vector<CrcPiece> pieces;
        for (size_t r = 0; r < parts.size(); ++r) {
          auto p = unpack_crc_pieces(parts[r].substr(1), concat("rank ", r));
          pieces.insert(pieces.end(), p.begin(), p.end());
        }
        const std::string header = layout.final_prefix(assemble_block_crcs(std::move(pieces), tensor_names, path));
        File f(tmp, "u");
        f.pwrite_exact(0, header.data(), header.size());
        f.fsync();
        f.close();
        commit_rename(tmp, path);
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    if (!err.empty()) {
      try {
        remove_all(tmp);
      } catch (const std::exception&) {
      }
    }
  }
  log::debug("save_full('", path, "') rank ", rank, ": ", log::seconds(t_start, Clock::now()), " s (",
             shared ? "every rank writes" : "rank 0 writes", "): gathering ", gather_s, " s, waiting for the writer ",
             wait_s, " s, finishing (fsync, checksums, rename) ", log::seconds(t_finish, Clock::now()), " s");
  agree(comm, err, concat("saving '", path, "'"));
}

}  // namespace

// ------------------------------------------------------------------ async

struct AsyncSave::State {
  std::thread thread;
  std::mutex join_mu;  // held while joining
  std::mutex mu;       // guards finished
  bool finished = false;
  std::exception_ptr error;
  ~State() {
    if (thread.joinable()) thread.join();
  }
};

namespace {
std::mutex g_pending_mu;
thread_local bool tl_background = false;
std::shared_ptr<AsyncSave::State> g_pending;
std::function<void()> g_test_hook;  // set_async_save_hook_for_tests; guarded by g_pending_mu

struct SplitCache {
  std::mutex mu;
  std::vector<std::pair<std::weak_ptr<distributed::Communicator>, std::shared_ptr<distributed::Communicator>>> items;
};
SplitCache& split_cache() {
  static SplitCache c;
  return c;
}

std::shared_ptr<distributed::Communicator> background_comm(const std::shared_ptr<distributed::Communicator>& comm) {
  auto& c = split_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto& [w, bg] : c.items)
    if (w.lock() == comm) return bg;
  std::vector<int> all(static_cast<size_t>(comm->size()));
  for (int r = 0; r < comm->size(); ++r) all[static_cast<size_t>(r)] = r;
  auto bg = comm->split({all});
  TESSERA_CHECK(bg != nullptr, "async save: could not create the background communicator");
  c.items.emplace_back(comm, bg);
  return bg;
}

// Device tensors are staged into pinned host buffers with asynchronous copies; the
// devices they came from are recorded so that the snapshot synchronizes each once.
at::Tensor host_copy(const at::Tensor& t, std::vector<c10::Device>& staged) {
  if (t.device().is_cpu()) {
    // The copy is the blocking part of an async save (TESSERA_LOG_LEVEL=debug shows its
    // phases). A contiguous tensor is copied with streaming stores (core/stream_copy.h):
    // the writer thread reads the copy later, so it need not pass through this core's
    // cache (a tensor copy ran at 4.8 GB/s here, memcpy at 9.8, 152 MB, one thread).
    if (!t.is_contiguous()) return t.detach().clone(at::MemoryFormat::Contiguous);
    at::Tensor h = at::empty(t.sizes(), t.options());
    if (t.numel() > 0) core::copy_streaming(h.data_ptr(), t.data_ptr(), t.nbytes());
    return h;
  }
  at::Tensor h = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true));
  h.copy_(t.detach(), /*non_blocking=*/true);
  if (std::find(staged.begin(), staged.end(), t.device()) == staged.end()) staged.push_back(t.device());
  return h;
}

std::shared_ptr<state::StateDict> snapshot_into(const state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& bg,
                                                std::vector<c10::Device>& staged) {
  auto out = std::make_shared<state::StateDict>();
  for (const auto& k : sd.keys()) {
    const Value& v = sd.at(k);
    if (auto t = std::get_if<at::Tensor>(&v)) {
      out->set(k, host_copy(*t, staged));
    } else if (auto s = std::get_if<sharding::ShardedTensor>(&v)) {
      std::vector<sharding::Shard> local;
      for (const auto& sh : s->local_shards()) {
        sharding::Shard c{host_copy(sh.tensor, staged), sh.meta};
        c.meta.placement.device = c10::kCPU;
        local.push_back(std::move(c));
      }
      auto all = s->shards_metadata();
      for (auto& m : all) m.placement.device = c10::kCPU;
      out->set(k, sharding::ShardedTensor::from_parts(std::move(local), all, s->shape(), s->dtype(), bg));
    } else if (auto d = std::get_if<std::shared_ptr<state::StateDict>>(&v); d && *d) {
      out->set(k, snapshot_into(**d, bg, staged));
    } else {
      out->set(k, v);
    }
  }
  return out;
}

std::shared_ptr<state::StateDict> snapshot(const state::StateDict& sd, const std::shared_ptr<distributed::Communicator>& bg) {
  std::vector<c10::Device> staged;
  auto out = snapshot_into(sd, bg, staged);
  for (const auto& d : staged) core::synchronize(d);  // the pinned copies are complete
  return out;
}

}  // namespace

std::shared_ptr<distributed::Communicator> prepare_async_save(const std::shared_ptr<distributed::Communicator>& comm) {
  TESSERA_CHECK(comm != nullptr, "prepare_async_save: no communicator");
  return background_comm(comm);
}

void finish_pending_save() {
  try {
    wait_for_pending_save();
  } catch (const std::exception& e) {
    log::warn("the previous async checkpoint save failed: ", e.what());
  }
}

void wait_for_pending_save() {
  std::shared_ptr<AsyncSave::State> p;
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    p = std::move(g_pending);
  }
  if (p) AsyncSave(p).wait();
}

void AsyncSave::wait() {
  TESSERA_CHECK(s_ != nullptr, "AsyncSave::wait on an empty handle");
  {
    std::lock_guard<std::mutex> lock(s_->join_mu);
    if (s_->thread.joinable()) s_->thread.join();
  }
  if (s_->error) std::rethrow_exception(s_->error);
}

bool AsyncSave::done() const {
  if (!s_) return true;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->finished;
}

AsyncSave save_async(const state::StateDict& sd, const std::string& path, std::shared_ptr<distributed::Communicator> comm,
                     const SaveOptions& options) {
  TESSERA_CHECK(comm != nullptr, "save_async: no communicator");
  // The phases of the blocking part, for TESSERA_LOG_LEVEL=debug.
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  finish_pending_save();
  const auto t1 = Clock::now();
  auto bg = background_comm(comm);
  const auto t2 = Clock::now();
  auto snap = snapshot(sd, bg);
  const auto t3 = Clock::now();
  auto st = std::make_shared<AsyncSave::State>();
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    hook = g_test_hook;
  }
  st->thread = std::thread([snap, path, bg, options, hook, raw = st.get()] {
    tl_background = true;
    try {
      if (hook) hook();
      save(*snap, path, *bg, options);
    } catch (...) {
      raw->error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(raw->mu);
    raw->finished = true;
  });
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    g_pending = st;
  }
  if (log::level() <= log::Level::Debug) {
    int64_t bytes = 0;
    for (const auto& [k, v] : snap->flatten()) {
      if (auto t = std::get_if<at::Tensor>(v)) bytes += static_cast<int64_t>(t->nbytes());
      if (auto s = std::get_if<sharding::ShardedTensor>(v))
        for (const auto& sh : s->local_shards()) bytes += static_cast<int64_t>(sh.tensor.nbytes());
    }
    using log::seconds;
    log::debug("save_async('", path, "'): returned after ", seconds(t0, Clock::now()),
               " s: waiting for the previous save ", seconds(t0, t1), " s, background communicator ", seconds(t1, t2),
               " s, snapshot of ", bytes >> 20, " MiB ", seconds(t2, t3), " s, starting the writer ",
               seconds(t3, Clock::now()), " s");
  }
  return AsyncSave(st);
}

void set_async_save_hook_for_tests(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(g_pending_mu);
  g_test_hook = std::move(hook);
}

void save(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm, const SaveOptions& options) {
  // A save waits for an async one in flight (they would race on the same files).
  if (!tl_background) finish_pending_save();
  if (options.mode == SaveMode::Full) save_full(sd, path, comm);
  else save_sharded(sd, path, comm);
}

}  // namespace tessera::checkpoint
