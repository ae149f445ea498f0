// verify (verify.h): a checkpoint read back in full against its metadata and checksums,
// problems collected rather than thrown, so that one report names every damaged file and key.
#include "tessera/checkpoint/verify.h"

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/interop/hf_dir.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

VerifyReport verify(const std::string& path) { return verify(path, 0, 1); }

namespace {

// Reads every byte of chunk `c`, which has no checksums (a foreign safetensors file or a
// Hugging Face shard): what this finds is a read error or a file shorter than its header says.
void read_through(ChunkReader& reader, const ChunkInfo& c, std::vector<char>& buf) {
  const File& f = reader.reader(c.file).file();
  const uint64_t window = 32u << 20;
  buf.resize(static_cast<size_t>(std::min<uint64_t>(window, c.end - c.begin)));
  for (uint64_t off = c.begin; off < c.end; off += window) f.pread_exact(off, buf.data(), std::min(window, c.end - off));
}

// How many problems verify reports one by one; the rest are counted ("and K more problem(s)").
// python/tessera_ckpt: MAX_REPORTED_PROBLEMS.
constexpr size_t kMaxReportedProblems = 100;

// The first kMaxReportedProblems problems are kept, the others counted (issue 44 item 4: a
// checkpoint with a million bad pieces printed a million lines).
void add_problem(VerifyReport& rep, std::string p) {
  if (rep.problems.size() < kMaxReportedProblems) rep.problems.push_back(std::move(p));
  else ++rep.more_problems;
}

// "'a', 'b', 'c', ..." of at most three names.
std::string some_names(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < 3; ++i) s += concat(i ? ", '" : "'", names[i], "'");
  return names.size() > 3 ? s + ", ..." : s;
}

// Version 2: the data files the directory holds against world_size, from one listing, before
// any is opened (a world_size of 2^20 over two files was a million failed opens): a problem
// for the missing ones and one for files of ranks at or above world_size. Returns, per rank,
// whether its file is there.
std::vector<bool> check_data_files_present(const CheckpointMetadata& m, VerifyReport& rep) {
  std::set<std::string> present;
  for (const auto& n : list_dir(m.location))
    if (n.rfind("data-rank", 0) == 0 && n.size() > 21 && n.compare(n.size() - 12, 12, ".safetensors") == 0)
      present.insert(n);
  std::vector<bool> there(static_cast<size_t>(m.world_size));
  std::vector<std::string> missing;
  int64_t n_missing = 0;
  for (int r = 0; r < m.world_size; ++r) {
    const std::string name = data_file_name(r);
    const auto it = present.find(name);
    if (it != present.end()) {
      there[static_cast<size_t>(r)] = true;
      present.erase(it);
    } else {
      if (missing.size() < 4) missing.push_back(name);  // a 4th only says "..."
      ++n_missing;
    }
  }
  if (n_missing > 0) {
    add_problem(rep, concat("'", m.location, "': world_size is ", m.world_size, ", but ", n_missing,
                            " of its data files are missing (", some_names(missing), ")"));
  }
  if (!present.empty()) {
    std::vector<std::string> extra(present.begin(), present.end());
    add_problem(rep, concat("'", m.location, "': ", extra.size(), " data file(s) of no rank below world_size ",
                            m.world_size, " (", some_names(extra), "): the world size was edited or files were added"));
  }
  return there;
}

// Records the error of `f` as a problem, unless it is a ResourceError: out of descriptors
// is an error of this machine, not a problem of the checkpoint, and is thrown on.
template <typename F>
void as_problem(VerifyReport& rep, F&& f) {
  try {
    f();
  } catch (const ResourceError&) {
    throw;
  } catch (const std::exception& e) {
    add_problem(rep, e.what());
  }
}

// One verification (or one part of it), in its phases: open the metadata, check the data
// files, check every chunk's bytes.
class Verification {
 public:
  Verification(const std::string& path, int part, int parts) : path_(path), part_(part), parts_(parts) {}

  VerifyReport run() {
    if (!open()) return std::move(rep_);
    rep_.kind = m_.source_kind;
    reader_.emplace(m_);
    check_files();
    check_chunks();
    rep_.ok = rep_.problems.empty();
    return std::move(rep_);
  }

 private:
  // The metadata (a Hugging Face directory: its index against its shards); false, with
  // the problems recorded, when it cannot be read.
  bool open() {
    try {
      if (is_hf_directory(path_)) {
        HfDirectory d = read_hf_directory(path_);
        m_ = std::move(d.meta);
        rep_.notes = std::move(d.notes);
      } else {
        m_ = open_checkpoint(path_);
      }
      return true;
    } catch (const ResourceError&) {
      throw;  // out of descriptors: an error of this machine, not a problem of the checkpoint
    } catch (const HfDirectoryError& e) {  // every disagreement of the weight map and the shards
      for (const auto& p : e.problems) add_problem(rep_, p);
    } catch (const std::exception& e) {
      add_problem(rep_, e.what());
    }
    rep_.ok = false;
    return false;
  }

  // The data files of a sharded checkpoint, this part's share of them.
  void check_files() {
    if (m_.source_kind != kSourceSharded) return;
    if (m_.version >= 2) {
      // The files present against world_size first (part 0 reports it); a missing file is
      // that one problem, never opened, nor are its pieces. Every data file present: of this
      // save and rank, holding exactly the pieces the layouts place there, each at its place
      // (ChunkReader::data_file, what every reader checks of a file it opens).
      VerifyReport listing;
      present_ = check_data_files_present(m_, listing);
      if (part_ == 0)
        for (auto& p : listing.problems) add_problem(rep_, std::move(p));
      for (int r = part_; r < m_.world_size; r += parts_)
        if (present_[static_cast<size_t>(r)]) as_problem(rep_, [&] { reader_->data_file(r); });
      return;
    }
    int64_t index = 0;
    for (const auto& [name, size] : m_.files)
      if (index++ % parts_ == part_) as_problem(rep_, [&, n = name] { reader_->reader(n); });
  }

  // Every chunk (this part's share of the pieces) read and checked against its checksums,
  // or read through where the source has none.
  void check_chunks() {
    // A plain safetensors file Tessera wrote (an `export --format hf` file) has them too.
    rep_.has_checksums =
        m_.source_kind == kSourceSharded || m_.source_kind == kSourceConsolidated || m_.crc_block > 0;
    // A Hugging Face directory: checksummed only when every shard is (a Tessera export).
    if (m_.source_kind == kSourceHf)
      for (const auto& [k, e] : m_.entries)
        for (const auto& c : e.chunks) rep_.has_checksums &= !c.crcs.empty();
    int64_t unit = 0;  // every piece's (or listed chunk's) number, for the parts
    for (const auto& k : m_.keys) {
      const EntryInfo& e = m_.entries.at(k);
      for (const auto& c : chunks_of(k, e, unit)) as_problem(rep_, [&] { check_chunk(k, e, c); });
    }
  }

  // This part's chunks of entry `k`: piece by piece where a layout places them, so that one
  // missing or damaged file is one problem among the others.
  std::vector<ChunkInfo> chunks_of(const std::string& k, const EntryInfo& e, int64_t& unit) {
    std::vector<ChunkInfo> chunks;
    if (!e.layout) {
      for (const auto& c : e.chunks)
        if (unit++ % parts_ == part_) chunks.push_back(c);
      return chunks;
    }
    for (int64_t i : e.layout->overlapping(e.shape, sharding::full_box(e.shape))) {
      if (unit++ % parts_ != part_) continue;
      const int64_t f = e.layout->file_of(i);
      if (!present_.empty() && !present_[static_cast<size_t>(f)]) continue;  // reported with the listing
      as_problem(rep_, [&] {
        for (auto& c : reader_->chunks(k, e, e.layout->box(e.shape, i))) chunks.push_back(std::move(c));
      });
    }
    return chunks;
  }

  void check_chunk(const std::string& k, const EntryInfo& e, const ChunkInfo& c) {
    if (rep_.has_checksums && c.crcs.empty() && c.end > c.begin)
      throw Error(concat("key '", k, "' chunk ", c.box.to_string(), ": no checksum recorded"));
    reader_->verify_chunk(k, e, c);
    if (c.crcs.empty() && !c.memory.defined() && c.end > c.begin) read_through(*reader_, c, through_);
    rep_.chunks_checked++;
    rep_.bytes_checked += c.end - c.begin;
  }

  const std::string path_;
  const int part_, parts_;
  VerifyReport rep_;
  CheckpointMetadata m_;
  std::optional<ChunkReader> reader_;
  std::vector<bool> present_;  // version 2: per rank, whether its data file is there
  std::vector<char> through_;  // read_through's window
};

}  // namespace

VerifyReport verify(const std::string& path, int part, int parts) {
  TESSERA_CHECK(parts >= 1 && part >= 0 && part < parts, "verify: part ", part, " of ", parts, " is out of range");
  return Verification(path, part, parts).run();
}

}  // namespace tessera::checkpoint
