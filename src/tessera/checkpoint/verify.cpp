// verify (verify.h): a checkpoint read back in full against its metadata and checksums,
// problems collected rather than thrown, so that one report names every damaged file and key.
#include "tessera/checkpoint/verify.h"

#include <algorithm>
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

}  // namespace

VerifyReport verify(const std::string& path, int part, int parts) {
  TESSERA_CHECK(parts >= 1 && part >= 0 && part < parts, "verify: part ", part, " of ", parts, " is out of range");
  VerifyReport rep;
  CheckpointMetadata m;
  try {
    if (is_hf_directory(path)) {
      HfDirectory d = read_hf_directory(path);
      m = std::move(d.meta);
      rep.notes = std::move(d.notes);
    } else {
      m = open_checkpoint(path);
    }
  } catch (const ResourceError&) {
    throw;  // out of descriptors: an error of this machine, not a problem of the checkpoint
  } catch (const HfDirectoryError& e) {  // every disagreement of the weight map and the shards
    rep.ok = false;
    for (const auto& p : e.problems) add_problem(rep, p);
    return rep;
  } catch (const std::exception& e) {
    rep.ok = false;
    add_problem(rep, e.what());
    return rep;
  }
  rep.kind = m.source_kind;
  ChunkReader reader(m);
  std::vector<bool> present;  // version 2: per rank, whether its data file is there
  if (m.source_kind == kSourceSharded && m.version >= 2) {
    // The files present against world_size first (part 0 reports it); a missing file is
    // that one problem, never opened, nor are its pieces. Every data file present: of this
    // save and rank, holding exactly the pieces the layouts place there, each at its place
    // (ChunkReader::data_file, what every reader checks of a file it opens).
    VerifyReport listing;
    present = check_data_files_present(m, listing);
    if (part == 0)
      for (auto& p : listing.problems) add_problem(rep, std::move(p));
    for (int r = part; r < m.world_size; r += parts) {
      if (!present[static_cast<size_t>(r)]) continue;
      try {
        reader.data_file(r);
      } catch (const ResourceError&) {
        throw;
      } catch (const std::exception& e) {
        add_problem(rep, e.what());
      }
    }
  } else if (m.source_kind == kSourceSharded) {
    int64_t index = 0;
    for (const auto& [name, size] : m.files) {
      if (index++ % parts != part) continue;
      try {
        reader.reader(name);
      } catch (const ResourceError&) {
        throw;
      } catch (const std::exception& e) {
        add_problem(rep, e.what());
      }
    }
  }
  // A plain safetensors file Tessera wrote (an `export --format hf` file) has them too.
  rep.has_checksums = m.source_kind == kSourceSharded || m.source_kind == kSourceConsolidated || m.crc_block > 0;
  // A Hugging Face directory: checksummed only when every shard is (a Tessera export).
  if (m.source_kind == kSourceHf)
    for (const auto& [k, e] : m.entries)
      for (const auto& c : e.chunks) rep.has_checksums &= !c.crcs.empty();
  std::vector<char> through;  // read_through's window
  int64_t unit = 0;            // every piece's (or listed chunk's) number, for the parts
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    std::vector<ChunkInfo> chunks;
    if (e.layout) {
      // Piece by piece, so that one missing or damaged file is one problem among the others.
      for (int64_t i : e.layout->overlapping(e.shape, sharding::full_box(e.shape))) {
        if (unit++ % parts != part) continue;
        const int64_t f = e.layout->file_of(i);
        if (!present.empty() && !present[static_cast<size_t>(f)]) continue;  // reported with the listing
        try {
          for (auto& c : reader.chunks(k, e, e.layout->box(e.shape, i))) chunks.push_back(std::move(c));
        } catch (const ResourceError&) {
          throw;
        } catch (const std::exception& ex) {
          add_problem(rep, ex.what());
        }
      }
    } else {
      for (const auto& c : e.chunks)
        if (unit++ % parts == part) chunks.push_back(c);
    }
    for (const auto& c : chunks) {
      try {
        if (rep.has_checksums && c.crcs.empty() && c.end > c.begin)
          throw Error(concat("key '", k, "' chunk ", c.box.to_string(), ": no checksum recorded"));
        reader.verify_chunk(k, e, c);
        if (c.crcs.empty() && !c.memory.defined() && c.end > c.begin) read_through(reader, c, through);
        rep.chunks_checked++;
        rep.bytes_checked += c.end - c.begin;
      } catch (const ResourceError&) {
        throw;
      } catch (const std::exception& ex) {
        add_problem(rep, ex.what());
      }
    }
  }
  rep.ok = rep.problems.empty();
  return rep;
}

}  // namespace tessera::checkpoint
