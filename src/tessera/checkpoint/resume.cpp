// find_resumable: list the checkpoints of some directories, order them by their stored
// global_step, and verify them newest first until one passes (checkpoint/resume.h).
#include "tessera/checkpoint/resume.h"

#include <time.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <variant>

#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace fs = std::filesystem;

namespace tessera::checkpoint {

namespace {

struct Candidate {
  std::string path;
  int64_t step = 0;
  fs::file_time_type mtime{};
};

// What a report line writes when the caller gives no report.
void default_report(const std::string& line) { std::cerr << "tessera: " << line << std::endl; }

// The paths in `dir` that may be checkpoints (see find_resumable).
std::vector<std::string> list_candidates(const std::string& dir) {
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
      std::error_code e2;
      if (fs::symlink_status(fs::path(dir) / name.substr(1, old - 1), e2).type() == fs::file_type::not_found)
        out.push_back(p.string());
      continue;
    }
    std::error_code e2;
    const bool is_dir = fs::is_directory(p, e2);
    if (is_dir ? fs::is_regular_file(p / kMetadataFile, e2) || core::ends_with(name, ".ckpt")
               : core::ends_with(name, ".ckpt") || (fs::is_regular_file(p, e2) && is_tessera_checkpoint(p.string())))
      out.push_back(p.string());
  }
  return out;
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
// no global_step) go to `unread` as (path, problem, torn), sorted.
struct Unread {
  std::string path, problem;
  bool torn = false;  // a checkpoint whose metadata is damaged (not someone else's file)
  bool operator<(const Unread& o) const { return path < o.path; }
};
std::vector<Candidate> ordered_candidates(const std::vector<std::string>& dirs, std::vector<Unread>& unread) {
  std::vector<Candidate> candidates;
  for (const auto& dir : dirs) {
    for (const std::string& path : list_candidates(dir)) {
      try {
        const CheckpointMetadata meta = open_checkpoint(path);
        auto it = meta.entries.find("global_step");
        const int64_t* step = it == meta.entries.end() ? nullptr : std::get_if<int64_t>(&it->second.value);
        if (!step) {
          unread.push_back({path, "no integer global_step (not a training checkpoint)", false});
          continue;
        }
        candidates.push_back({path, *step, modified(path)});
      } catch (const ResourceError&) {
        throw;
      } catch (const std::exception& e) {
        unread.push_back({path, std::string("cannot read its metadata: ") + e.what(), true});
      }
    }
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
  for (const auto& u : unread) chooser.skip(u.path, u.problem, u.torn);
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
  // list: "ok\n" then "<step> <path>\n" per candidate, or "error\n<message>".
  std::string msg;
  if (rank == 0) {
    try {
      std::vector<Unread> unread;
      const std::vector<Candidate> candidates = ordered_candidates(dirs, unread);
      for (const auto& u : unread) chooser.skip(u.path, u.problem, u.torn);
      msg = "ok\n";
      for (const auto& c : candidates) msg += std::to_string(c.step) + " " + c.path + "\n";
    } catch (const std::exception& e) {
      msg = std::string("error\n") + e.what();
    }
  }
  msg = comm.broadcast_bytes(msg, 0);
  TESSERA_CHECK(msg.compare(0, 6, "error\n") != 0, "find_resumable on rank 0: ", msg.substr(6));
  TESSERA_CHECK(msg.compare(0, 3, "ok\n") == 0, "find_resumable: malformed candidate list from rank 0");
  std::vector<Candidate> candidates;
  std::istringstream lines(msg.substr(3));
  for (std::string line; std::getline(lines, line);) {
    const size_t sp = line.find(' ');
    TESSERA_CHECK(sp != std::string::npos, "find_resumable: malformed candidate line from rank 0");
    candidates.push_back({line.substr(sp + 1), std::stoll(line.substr(0, sp)), {}});
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
