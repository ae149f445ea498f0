// find_resumable: list the checkpoints of some directories, order them by their stored
// global_step, and verify them newest first until one passes (checkpoint/resume.h).
#include "tessera/checkpoint/resume.h"

#include <time.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <variant>

#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/verify.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/rank_agreement.h"
#include "tessera/checkpoint/wire.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace fs = std::filesystem;

namespace tessera::checkpoint {

namespace {

struct Candidate {
  size_t dir = 0;    // index into the directories searched
  std::string name;  // a plain name inside that directory
  std::string path;  // dirs[dir] + "/" + name
  int64_t step = 0;
  fs::file_time_type mtime{};
};

// Whether `name` holds a control character (a byte below 0x20, or 0x7f).
bool has_control_chars(const std::string& name) {
  return std::any_of(name.begin(), name.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c < 0x20 || c == 0x7f;
  });
}

// Whether `name` may name a candidate inside its directory: not empty, not "." or "..",
// no '/' and no control character. Every rank checks what rank 0 sends against this.
bool plain_candidate_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         !has_control_chars(name);
}

// What a report line writes when the caller gives no report.
void default_report(const std::string& line) { std::cerr << "tessera: " << line << std::endl; }

// The names in `dir` that may be checkpoints (see find_resumable); names holding a control
// character go to `odd` instead (never candidates: such a name cannot be shown or passed on
// safely).
std::vector<std::string> list_candidates(const std::string& dir, std::vector<std::string>& odd) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path p = it->path();
    const std::string name = p.filename().string();
    if (name.empty() || name.find(kUnverifiedTag) != std::string::npos) continue;  // set aside
    if (name[0] == '.') {
      // ".X.tessera-old-<pid>-<n>": X's previous version, moved aside by a commit that was
      // interrupted before X was in place again (the next save of X puts it back). A
      // candidate under its own name, which the loaders open like any checkpoint.
      const size_t old = name.find(".tessera-old-");
      if (old == std::string::npos || old <= 1) continue;
      if (has_control_chars(name)) {
        odd.push_back(name);
        continue;
      }
      std::error_code e2;
      if (fs::symlink_status(fs::path(dir) / name.substr(1, old - 1), e2).type() == fs::file_type::not_found)
        out.push_back(name);
      continue;
    }
    std::error_code e2;
    const bool is_dir = fs::is_directory(p, e2);
    if (is_dir ? fs::is_regular_file(p / kMetadataFile, e2) || core::ends_with(name, ".ckpt")
               : core::ends_with(name, ".ckpt") ||
                     (!has_control_chars(name) && fs::is_regular_file(p, e2) && is_tessera_checkpoint(p.string()))) {
      if (has_control_chars(name))
        odd.push_back(name);
      else
        out.push_back(name);
    }
  }
  return out;
}

// Whether `path`, which cannot be read as a checkpoint, is a damaged Tessera checkpoint
// (or was one): a directory holding Tessera's metadata or data files, or a file whose
// safetensors header names a Tessera format. Anything else (a user's notes.ckpt, a
// directory of their own data) is not Tessera's to set aside.
bool was_tessera_checkpoint(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string n = it->path().filename().string();
      if (n == kMetadataFile || (n.rfind("data-rank", 0) == 0 && core::ends_with(n, ".safetensors"))) return true;
    }
    return false;
  }
  if (!fs::is_regular_file(path, ec)) return false;
  if (is_tessera_checkpoint(path)) return true;
  // A damaged header: its 8 length bytes and a bounded header that still names a Tessera key.
  try {
    File f = open_for_reading(path);
    const uint64_t size = f.size();
    if (size < 8) return false;
    unsigned char len[8];
    f.pread_exact(0, reinterpret_cast<char*>(len), 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
    n = std::min({n, size - 8, kMaxHeaderBytes});
    std::string header(static_cast<size_t>(n), '\0');
    f.pread_exact(8, header.data(), n);
    return header.find("\"tessera.") != std::string::npos;
  } catch (const ResourceError&) {
    throw;
  } catch (const std::exception&) {
    return false;
  }
}

// The modification time that orders equal steps: the metadata file's for a directory.
fs::file_time_type modified(const std::string& path) {
  std::error_code ec;
  fs::path p = path;
  if (fs::is_directory(p, ec) && fs::is_regular_file(p / kMetadataFile, ec)) p /= kMetadataFile;
  const auto t = fs::last_write_time(p, ec);
  return ec ? fs::file_time_type{} : t;
}

std::string problems_of(const VerifyReport& r) {
  if (r.problems.empty()) return "verification failed";
  const size_t shown = std::min<size_t>(r.problems.size(), 3);
  std::string s = core::join(std::vector<std::string>(r.problems.begin(), r.problems.begin() + shown), "; ");
  if (r.problems.size() > shown) s += " (and " + std::to_string(r.problems.size() - shown) + " more problems)";
  return s;
}

// The candidates of `dirs`, newest first; those whose metadata cannot be read (or that hold
// no global_step) go to `unread` as (path, problem, damaged), sorted; a damaged one is a
// Tessera checkpoint (or was one), the others are someone else's files.
struct Unread {
  std::string path, problem;
  bool damaged = false;
  bool operator<(const Unread& o) const { return path < o.path; }
};
std::vector<Candidate> ordered_candidates(const std::vector<std::string>& dirs, std::vector<Unread>& unread) {
  std::vector<Candidate> candidates;
  for (size_t d = 0; d < dirs.size(); ++d) {
    std::vector<std::string> odd;
    for (const std::string& name : list_candidates(dirs[d], odd)) {
      const std::string path = (fs::path(dirs[d]) / name).string();
      try {
        const CheckpointMetadata meta = open_checkpoint(path);
        auto it = meta.entries.find(kGlobalStepKey);
        const int64_t* step = it == meta.entries.end() ? nullptr : std::get_if<int64_t>(&it->second.value);
        if (!step) {
          unread.push_back({path, "no integer global_step (not a training checkpoint)", false});
          continue;
        }
        candidates.push_back({d, name, path, *step, modified(path)});
      } catch (const ResourceError&) {
        throw;
      } catch (const std::exception& e) {
        const bool damaged = was_tessera_checkpoint(path);
        unread.push_back({path,
                          std::string("cannot read its metadata: ") + e.what() +
                              (damaged ? "" : " (not a Tessera checkpoint: left as it is)"),
                          damaged});
      }
    }
    for (const std::string& name : odd)
      unread.push_back({escape_path((fs::path(dirs[d]) / name).string()),
                        "its name holds a control character: not a candidate (left as it is; rename it to resume "
                        "from it)",
                        false});
  }
  std::sort(unread.begin(), unread.end());
  std::stable_sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.step != b.step) return a.step > b.step;
    if (a.mtime != b.mtime) return a.mtime > b.mtime;
    return a.path < b.path;
  });
  return candidates;
}

// Moves a damaged checkpoint out of the way of the saves that would replace it:
// "X" -> "X.unverified-<UTC time>" (a free name), which no later search takes as a
// candidate. Returns the new path, or "" (and the reason in `why`) when it could not.
std::string set_aside(const std::string& path, std::string& why) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
  std::string base = path;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  for (int n = 0; n < 1000; ++n) {
    const std::string to = base + kUnverifiedTag + stamp + (n ? "-" + std::to_string(n) : std::string());
    std::error_code ec;
    if (fs::symlink_status(to, ec).type() != fs::file_type::not_found) continue;
    fs::rename(base, to, ec);
    if (!ec) return to;
    why = ec.message();
    return "";
  }
  why = "no free name";
  return "";
}

// What a skipped candidate's report says, after setting it aside when asked.
std::string skipped_line(const std::string& path, const std::string& problem, bool damaged, Skipped skipped) {
  std::string line = path + ": " + problem;
  if (!damaged || skipped != Skipped::SetAside) return line;
  std::string why;
  const std::string to = set_aside(path, why);
  return line + (to.empty() ? "; could not set it aside (" + why + "): a later save of it may replace it"
                            : "; set aside as " + to + " (kept for inspection; never loaded)");
}

// What both forms of find_resumable say and return as they go through the candidates; on a
// rank that does not report (the collective form's ranks but 0), it only returns.
class Chooser {
 public:
  Chooser(const ResumeReport& report, Skipped skipped, bool reports)
      : report_(report ? report : ResumeReport(default_report)), skipped_(skipped), reports_(reports) {}
  void skip(const std::string& path, const std::string& problem, bool damaged) {
    if (!reports_) return;
    choice_.skipped.push_back(skipped_line(path, problem, damaged, skipped_));
    report_("skipping " + choice_.skipped.back());
  }
  ResumeChoice take(const Candidate& c) {
    choice_.path = c.path;
    choice_.global_step = c.step;
    if (reports_) report_("resuming from " + c.path + " (step " + std::to_string(c.step) + ")");
    return choice_;
  }
  ResumeChoice none(const std::vector<std::string>& dirs) {
    if (reports_)
      report_("no checkpoint that verifies in " + (dirs.empty() ? std::string("(no directories)") : core::join(dirs)) +
              ": starting fresh");
    return choice_;
  }

 private:
  ResumeReport report_;
  Skipped skipped_;
  bool reports_;
  ResumeChoice choice_;
};

}  // namespace

ResumeChoice find_resumable(const std::vector<std::string>& dirs, const ResumeReport& report, Skipped skipped) {
  Chooser chooser(report, skipped, true);
  std::vector<Unread> unread;
  const std::vector<Candidate> candidates = ordered_candidates(dirs, unread);
  for (const auto& u : unread) chooser.skip(u.path, u.problem, u.damaged);
  for (const Candidate& c : candidates) {
    const VerifyReport r = verify(c.path);  // throws only ResourceError
    if (r.ok && r.problems.empty()) return chooser.take(c);
    chooser.skip(c.path, problems_of(r), true);
  }
  return chooser.none(dirs);
}

ResumeChoice find_resumable(const std::vector<std::string>& dirs, distributed::Communicator& comm,
                            const ResumeReport& report, Skipped skipped) {
  const int rank = comm.rank(), size = comm.size();
  Chooser chooser(report, skipped, rank == 0);
  // Rank 0 lists and orders the candidates (their metadata only) and sends every rank the
  // list, typed (Packer: lengths, never separators inside the data): an error, or per
  // candidate its step, the index of its directory and its plain name there. Every rank
  // rebuilds the path from its own `dirs` and refuses a name that is not a plain one, so
  // nothing rank 0 sends can point outside the directories searched.
  std::string error, payload;
  if (rank == 0) {
    try {
      std::vector<Unread> unread;
      const std::vector<Candidate> candidates = ordered_candidates(dirs, unread);
      for (const auto& u : unread) chooser.skip(u.path, u.problem, u.damaged);
      Packer p;
      p.u64(candidates.size());
      for (const auto& c : candidates) p.u64(static_cast<uint64_t>(c.step)).u64(c.dir).str(c.name);
      payload = p.bytes();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  payload = RankAgreement(comm, "find_resumable on rank 0").from_rank0_or_throw(error, payload);
  std::vector<Candidate> candidates;
  {
    Unpacker u(payload, "find_resumable's candidate list from rank 0");
    const uint64_t n = u.u64();
    for (uint64_t i = 0; i < n; ++i) {
      Candidate c;
      c.step = static_cast<int64_t>(u.u64());
      c.dir = static_cast<size_t>(u.u64());
      c.name = u.str();
      TESSERA_CHECK(c.dir < dirs.size() && plain_candidate_name(c.name), "find_resumable: rank 0 sent candidate '",
                    escape_path(c.name), "' in directory ", c.dir, " of ", dirs.size(),
                    ", not a plain name in one of the directories searched");
      c.path = (fs::path(dirs[c.dir]) / c.name).string();
      candidates.push_back(std::move(c));
    }
    TESSERA_CHECK(u.done(), "find_resumable: trailing bytes in the candidate list from rank 0");
  }
  // Every rank verifies its part of each candidate, newest first (verify(path, rank, size):
  // each reads about 1/size of it, so that no rank waits in a collective while another
  // reads a whole checkpoint); the first rank that found a problem tells the others.
  for (const Candidate& c : candidates) {
    std::string problem;
    bool resource = false;
    try {
      const VerifyReport r = verify(c.path, rank, size);
      if (!r.ok || !r.problems.empty()) problem = problems_of(r);
    } catch (const std::exception& e) {  // ResourceError: this process's, not the checkpoint's
      problem = e.what();
      resource = true;
    }
    const int64_t first = comm.all_reduce_int(problem.empty() ? size : rank, distributed::ReduceOp::Min);
    if (first == size) return chooser.take(c);
    const std::string found = comm.broadcast_bytes(
        rank == first ? std::string(resource ? "R" : "P") + problem : std::string(), static_cast<int>(first));
    TESSERA_CHECK(found.empty() || found[0] != 'R', "find_resumable: rank ", first, " could not verify '", c.path,
                  "': ", found.substr(1));
    chooser.skip(c.path, found.substr(1) + (size > 1 ? " (found by rank " + std::to_string(first) + ")" : ""), true);
  }
  return chooser.none(dirs);
}

}  // namespace tessera::checkpoint
