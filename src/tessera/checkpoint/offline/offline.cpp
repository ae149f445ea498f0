#include "tessera/checkpoint/offline/offline.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <thread>
#include <atomic>
#include <exception>
#include <optional>
#include <set>
#include <sstream>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/interop/hf_dir.h"
#include "tessera/checkpoint/offline/reshard_plan.h"
#include "tessera/checkpoint/interop/torch_file.h"
#include "tessera/checkpoint/offline/offline_publish.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/sync_queue.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/env.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

namespace {

std::string value_str(const state::Value& v) {
  if (auto p = std::get_if<int64_t>(&v)) return std::to_string(*p);
  if (auto p = std::get_if<double>(&v)) {
    std::ostringstream os;
    os << std::setprecision(17) << *p;
    return os.str();
  }
  if (auto p = std::get_if<bool>(&v)) return *p ? "true" : "false";
  if (auto p = std::get_if<std::string>(&v)) return "\"" + (p->size() > 40 ? p->substr(0, 40) + "..." : *p) + "\"";
  if (auto p = std::get_if<state::Bytes>(&v)) return std::to_string(p->data.size()) + " bytes";
  return "{}";
}

// The absolute path of `path` with every symlink resolved. A path that does not exist
// (yet) is resolved through its nearest existing ancestor, the rest appended as written.
std::string real_path(const std::string& path) {
  std::string head = path.empty() ? "." : path;
  std::vector<std::string> tail;
  for (;;) {
    if (char* r = ::realpath(head.c_str(), nullptr)) {
      std::string s = r;
      std::free(r);
      for (auto it = tail.rbegin(); it != tail.rend(); ++it) s = join_path(s, *it);
      return s;
    }
    TESSERA_CHECK(errno == ENOENT || errno == ENOTDIR, "cannot resolve '", head, "': ", std::strerror(errno));
    const std::string parent = parent_dir(head);
    TESSERA_CHECK(parent != head, "cannot resolve '", path, "'");
    tail.push_back(base_name(head));
    head = parent;
  }
}

// `a` is `b` or lies below it (both real paths).
bool within(const std::string& a, const std::string& b) {
  if (a == b) return true;
  const std::string dir = b == "/" ? b : b + "/";
  return a.compare(0, dir.size(), dir) == 0;
}

// The output must not be the source, lie inside it or contain it: the commit would
// replace the checkpoint being read (or a directory holding it). Checked before
// anything else about the output, so that --force cannot get past it.
void check_not_source(const std::string& src, const CheckpointMetadata& m, const std::string& out) {
  const std::string o = real_path(out);
  for (const std::string& s : {src, m.location}) {
    if (s.empty()) continue;
    const std::string r = real_path(s);
    struct stat so, ss;
    const bool same_inode = ::stat(out.c_str(), &so) == 0 && ::stat(s.c_str(), &ss) == 0 && so.st_dev == ss.st_dev &&
                            so.st_ino == ss.st_ino;
    const char* how = (o == r || same_inode) ? "is the source"
                      : within(o, r)         ? "is inside the source"
                      : within(r, o)         ? "contains the source"
                                             : nullptr;
    if (how == nullptr) continue;
    const std::string detail = (o != out || r != src) ? concat(" (real paths '", o, "' and '", r, "')") : "";
    throw Error(concat("refusing to write '", out, "': it ", how, " '", src, "'", detail,
                       "; the source would be replaced (--force does not change this). Choose an output outside it"));
  }
}

// An output path may be written (check_output_path); with --force an existing one may be
// replaced only when Tessera wrote it or it is an empty directory (is_replaceable_output,
// the rule of every writer).
void check_output(const std::string& out, bool force, OutputKind kind, const std::string& command) {
  if (!check_output_path(out, force, kind, command)) return;
  if (is_replaceable_output(out)) return;
  if (is_directory(out))
    throw Error(concat("refusing to replace '", out, "': a non-empty directory that is not a Tessera checkpoint (",
                       "--force replaces only what Tessera wrote); nothing was touched"));
  throw Error(concat("refusing to replace '", out, "': not a file Tessera wrote (neither a Tessera safetensors file ",
                     "nor a Tessera torch export; --force replaces only those); nothing was touched. Remove it ",
                     "yourself or choose another output"));
}


void write_consolidated(const CheckpointMetadata& m, const std::string& tmp) {
  ChunkReader reader(m);
  std::vector<SafetensorsWriter::Spec> specs;
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (e.is_tensor()) specs.push_back({k, e.dtype, e.shape});
  }
  SafetensorsWriter w(tmp, specs, consolidated_header(m));
  // One buffer, sized for the largest tensor, takes every tensor in turn (chunks are
  // read straight into it): memory stays at the largest tensor, and its pages are
  // faulted in once rather than for every tensor.
  std::vector<const std::string*> tensors;
  uint64_t largest = 0;
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (!e.is_tensor()) continue;
    tensors.push_back(&k);
    largest = std::max(largest, byte_size(e.shape, e.dtype, k));
  }
  at::Tensor buffer = at::empty({static_cast<int64_t>(largest)}, at::TensorOptions().dtype(at::kByte));
  // While one tensor is read and written, the kernel reads the next ones (as a load does).
  ReadAhead ahead(tensors.size(), [&](size_t i) {
    const EntryInfo& e = m.entries.at(*tensors[i]);
    uint64_t n = 0;
    const sharding::Box whole = sharding::full_box(e.shape);
    for (const auto& c : reader.chunks(*tensors[i], e, whole)) n += reader.prefetch(*tensors[i], e, c, whole);
    return n;
  });
  for (size_t i = 0; i < tensors.size(); ++i) {
    ahead.before(i);
    const std::string& k = *tensors[i];
    const EntryInfo& e = m.entries.at(k);
    const sharding::Box box = sharding::full_box(e.shape);
    at::Tensor t = buffer.narrow(0, 0, static_cast<int64_t>(byte_size(e.shape, e.dtype, k))).view(e.dtype).view(e.shape);
    reader.fill_box(k, e, t, box, "the output");  // every element read before the tensor is written
    w.write(t);
  }
  w.finish();
}

}  // namespace

namespace {

// A version-2 or -3 layout in words, as python/tessera_ckpt (PieceLayout.describe) prints it:
// "chunk dim 0, 4 pieces", "tp dim 0, 3 stripes, tp 2, inner flat over 2".
std::string layout_words(const sharding::Layout& L) {
  using R = sharding::Layout::Rule;
  switch (L.rule) {
    case R::Whole: return concat("whole in file ", L.file);
    case R::Chunk: return concat("chunk dim ", L.dim, ", ", L.pieces, " pieces");
    case R::Flat: return concat("flat over ", L.pieces);
    case R::List: return concat("list of ", L.list.size(), " pieces");
    case R::Tp: {
      const std::string inner = L.inner == R::Chunk  ? concat("chunk dim ", L.inner_dim, " over ", L.pieces)
                                : L.inner == R::Flat ? concat("flat over ", L.pieces)
                                                     : std::string("whole");
      return concat("tp dim ", L.dim, ", ", L.stripes, " stripes, tp ", L.tp, ", inner ", inner);
    }
  }
  return "?";
}

}  // namespace

std::string inspect(const std::string& path) {
  std::optional<HfDirectory> hf;
  if (is_hf_directory(path)) hf = read_hf_directory(path);
  const CheckpointMetadata m = hf ? hf->meta : open_checkpoint(path);
  std::ostringstream os;
  uint64_t total = 0;
  struct Row {
    std::string key, kind, dtype, shape, chunks, bytes, file, layout;
  };
  std::vector<Row> rows;
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    if (e.is_tensor()) {
      const uint64_t b = byte_size(e.shape, e.dtype, k);
      total += b;
      // Format 2: the layout's non-empty pieces, counted without opening a data file.
      const size_t chunks =
          e.layout ? e.layout->overlapping(e.shape, sharding::full_box(e.shape)).size() : e.chunks.size();
      rows.push_back({k, e.kind, dtype_name(e.dtype), core::shape_string(e.shape), std::to_string(chunks),
                      std::to_string(b), hf && hf->file_of.count(k) ? hf->file_of.at(k) : "-",
                      e.layout ? layout_words(*e.layout) : "-"});
    } else {
      rows.push_back({k, e.kind, "-", value_str(e.value), "-", "-", "-", "-"});
    }
  }
  os << "checkpoint: " << path << "\n";
  os << "kind: " << m.source_kind;
  if (m.source_kind == kSourceSharded || m.source_kind == kSourceConsolidated)
    os << " (format version " << m.version << ", world size at save " << m.world_size << ")";
  if (hf && hf->has_index) os << " (a Hugging Face model directory: " << kHfIndexFile << " and " << m.files.size() << " shard file(s))";
  else if (hf) os << " (a Hugging Face model directory: " << kHfSingleFile << ")";
  os << "\n";
  if (m.source_kind == kSourceSharded) os << "data files: " << (m.version >= 2 ? static_cast<size_t>(m.world_size) : m.files.size()) << "\n";
  if (hf && hf->total_size) os << "index total_size: " << *hf->total_size << "\n";
  if (hf)
    for (const auto& n : hf->notes) os << "note: " << n << "\n";
  os << "entries: " << m.keys.size() << ", tensor bytes: " << total << "\n\n";
  Row head{"KEY", "KIND", "DTYPE", "SHAPE/VALUE", "CHUNKS", "BYTES", "FILE", "LAYOUT"};
  // The shard file of each tensor: a Hugging Face directory only; the layout rule: a sharded
  // checkpoint of format 2 or 3 only.
  const bool show[8] = {true, true, true, true, true, true, hf.has_value(),
                        m.source_kind == kSourceSharded && m.version >= 2};
  size_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  auto widen = [&](const Row& r) {
    const std::string* f[8] = {&r.key, &r.kind, &r.dtype, &r.shape, &r.chunks, &r.bytes, &r.file, &r.layout};
    for (int i = 0; i < 8; ++i) w[i] = std::max(w[i], f[i]->size());
  };
  widen(head);
  for (auto& r : rows) widen(r);
  auto print = [&](const Row& r) {
    const std::string* f[8] = {&r.key, &r.kind, &r.dtype, &r.shape, &r.chunks, &r.bytes, &r.file, &r.layout};
    for (int i = 0; i < 8; ++i)
      if (show[i]) os << std::left << std::setw(static_cast<int>(w[i]) + 2) << *f[i];
    os << "\n";
  };
  print(head);
  for (auto& r : rows) print(r);
  return os.str();
}

namespace {

// The temporary the operation in progress writes, for abandon_output_in_progress().
std::mutex g_publish_mu;
std::string g_in_progress;
bool g_abandoned = false;

const char* const kInterrupted = "interrupted: the unfinished output was removed";

// Test hook (TESSERA_TEST_PAUSE_BEFORE_COMMIT=1): stop before the commit with the
// temporary complete, so that a test can interrupt a run at a known point.
void test_pause_before_commit(const std::string& out, const std::string& tmp) {
  if (!env::get_bool("TESSERA_TEST_PAUSE_BEFORE_COMMIT").value_or(false)) return;
  std::cerr << "tessera: test pause before committing '" << out << "' (temporary '" << tmp << "')" << std::endl;
  for (;;) ::pause();
}

// Writes `out` through a temporary sibling: `write(tmp)` fills it (a directory when
// `dir`, else a file; created here), then one atomic rename publishes it; on any error
// the temporary is removed and `out` is untouched. Temporaries of dead earlier runs for
// the same output are removed first. `out` is checked once, here ("output path").
template <typename F>
void publish_via_temp(const std::string& out, bool dir, F&& write) {
  const CheckedPath dest = CheckedPath::check(out, "output path");
  remove_dead_temporaries(dest);
  const CheckedPath tmp = temp_sibling(dest);
  {
    std::lock_guard<std::mutex> lock(g_publish_mu);
    TESSERA_CHECK(!g_abandoned, kInterrupted);
    // Created under the lock: an interrupt either comes first or sees the temporary.
    if (dir) {
      make_dir(tmp);
    } else {
      File created(tmp, "w");
    }
    g_in_progress = tmp.str();
  }
  try {
    write(tmp.str());
    test_pause_before_commit(out, tmp);
    std::lock_guard<std::mutex> lock(g_publish_mu);
    TESSERA_CHECK(!g_abandoned, kInterrupted);
    commit_rename(tmp, dest);
    g_in_progress.clear();
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_publish_mu);
    g_in_progress.clear();
    try {
      remove_all(tmp);
    } catch (const Error&) {
      // The original error matters more; a dead run's leftover is removed by the next run.
    }
    throw;
  }
}

}  // namespace

std::string abandon_output_in_progress() {
  std::lock_guard<std::mutex> lock(g_publish_mu);
  g_abandoned = true;
  const std::string tmp = g_in_progress;
  g_in_progress.clear();
  // The writer may still be adding files to a directory: retry a few times.
  for (int attempt = 0; !tmp.empty() && attempt < 10; ++attempt) {
    try {
      remove_all(tmp);
      break;
    } catch (const Error&) {
    }
  }
  return tmp;
}

// Opens `src` and checks its structure as verify does (every data file present and holding
// exactly its pieces) before anything is read or written: a checkpoint verify refuses never
// comes out of an offline writer as a clean one.
namespace {
CheckpointMetadata open_whole(const std::string& src) {
  CheckpointMetadata m = open_checkpoint(src);
  ChunkReader(m).check_structure();
  return m;
}
}  // namespace

void consolidate(const std::string& src, const std::string& out, bool force) {
  CheckpointMetadata m = open_whole(src);
  check_not_source(src, m, out);
  check_output(out, force, OutputKind::File, "consolidate");
  publish_via_temp(out, false, [&](const std::string& tmp) { write_consolidated(m, tmp); });
}

void reshard(const std::string& src, int world_size, const std::string& out, bool force, int tp) {
  TESSERA_CHECK(world_size >= 1 && world_size <= kMaxReshardWorldSize, "reshard: the world size must be between 1 and ",
                kMaxReshardWorldSize, ", got ", world_size);
  TESSERA_CHECK(tp >= 1 && world_size % tp == 0, "reshard: --tp ", tp, " must divide --world-size ", world_size,
                " (a mesh of world size / tp data-parallel ranks x tp)");
  CheckpointMetadata m = open_whole(src);
  check_not_source(src, m, out);
  check_output(out, force, OutputKind::Directory, "reshard");
  // The rules a save at that mesh writes (reshard_plan.h), before anything is written.
  CheckpointMetadata planned = plan_reshard(m, ReshardTarget{world_size, tp});
  ChunkReader reader(m);
  publish_via_temp(out, true, [&](const std::string& tmp) {
    CheckpointMetadata o = std::move(planned);
    o.crc_block = kCrcBlock;
    o.save_id = new_save_id();
    // Written before any data, so an output no reader would take fails here.
    const std::string text = to_json(o);
    // Each tensor resolved once, not once per rank: its entries, its source chunks (located
    // and checked in their data files once) and the ranks its output layout gives a
    // non-empty piece, so the work below follows the pieces, not ranks x tensors.
    struct Tensor {
      const std::string* fqn;
      const EntryInfo* src;
      const EntryInfo* out;
      ChunkReader::Located chunks;
    };
    std::vector<Tensor> tensors;
    std::vector<std::vector<std::pair<size_t, int64_t>>> by_rank(static_cast<size_t>(world_size));  // (tensor, piece)
    for (const auto& k : m.keys) {
      const EntryInfo& e = m.entries.at(k);
      if (!e.is_tensor()) continue;
      const EntryInfo& oe = o.entries.at(k);
      const sharding::Box whole = sharding::full_box(e.shape);
      if (whole.empty()) continue;
      const size_t t = tensors.size();
      tensors.push_back({&k, &e, &oe, reader.locate(k, e)});
      if (oe.kind == kShardedKind) {
        for (int64_t i : oe.layout->overlapping(e.shape, whole)) by_rank[static_cast<size_t>(oe.layout->file_of(i))].push_back({t, i});
      } else {
        by_rank[0].push_back({t, -1});
      }
    }
    // Each data file's fsync runs beside the writing of the next ones (SyncQueue), all of
    // them done before the metadata is written.
    SyncQueue sync;
    // The data files are written by up to kWriters threads (rank w, w + kWriters, ...), each
    // with its own ChunkReader (a reader is not shared between threads): one thread's
    // checksumming and copying runs while another waits for its direct writes.
    auto write_ranks = [&](ChunkReader& rd, int first, int step, const std::atomic<bool>& stop) {
      for (int r = first; r < world_size && !stop; r += step) {
        std::vector<Piece> pieces;
        pieces.reserve(by_rank[static_cast<size_t>(r)].size());
        for (const auto& [t, i] : by_rank[static_cast<size_t>(r)]) {
          const Tensor& x = tensors[t];
          const sharding::Box box = i < 0 ? sharding::full_box(x.src->shape) : x.out->layout->box(x.src->shape, i);
          pieces.push_back({*x.fqn, x.src->dtype, box, [&rd, &x, box] {
                              at::Tensor d = at::empty(box.sizes, at::TensorOptions().dtype(x.src->dtype));
                              rd.fill_box(*x.fqn, *x.src, x.chunks, d, box, "the box read");
                              return d;
                            }});
        }
        write_data_file(tmp, data_file_name(r), pieces, data_file_identity(r, o.save_id), &sync);
      }
    };
    constexpr int kWriters = 2;
    const int writers = std::min(world_size, kWriters);
    std::atomic<bool> stop{false};
    std::vector<std::exception_ptr> errors(static_cast<size_t>(writers));
    std::vector<std::thread> threads;
    for (int w = 1; w < writers; ++w)
      threads.emplace_back([&, w] {
        try {
          ChunkReader own(m);
          write_ranks(own, w, writers, stop);
        } catch (...) {
          errors[static_cast<size_t>(w)] = std::current_exception();
          stop = true;
        }
      });
    try {
      write_ranks(reader, 0, writers, stop);
    } catch (...) {
      errors[0] = std::current_exception();
      stop = true;
    }
    for (auto& th : threads) th.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    sync.wait();
    write_metadata_text(tmp, text);
  });
}

void export_checkpoint(const std::string& src, ExportFormat format, const std::string& out, bool force) {
  if (format == ExportFormat::Safetensors) {
    CheckpointMetadata m = open_whole(src);
    check_not_source(src, m, out);
    check_output(out, force, OutputKind::File, "export");
    publish_via_temp(out, false, [&](const std::string& tmp) { write_consolidated(m, tmp); });
    return;
  }
  CheckpointMetadata m = open_whole(src);
  check_not_source(src, m, out);
  check_output(out, force, OutputKind::File, "export");
  ChunkReader reader(m);
  publish_via_temp(out, false, [&](const std::string& tmp) {
    {
      TorchExportWriter w(tmp);
      for (const auto& k : m.keys) {
        const EntryInfo& e = m.entries.at(k);
        if (e.is_tensor()) w.add(k, reader.read_box(k, e, sharding::full_box(e.shape)));
      }
      w.finish();
    }
    File(tmp, "r").fsync();  // PyTorchStreamWriter does not fsync
  });
}

// For the other offline writers (offline_publish.h).
void offline_check_not_source(const std::string& src, const CheckpointMetadata& m, const std::string& out) {
  check_not_source(src, m, out);
}
void offline_publish(const std::string& out, bool dir, const std::function<void(const std::string& tmp)>& write) {
  publish_via_temp(out, dir, write);
}

}  // namespace tessera::checkpoint
