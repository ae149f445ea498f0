// find_resumable: list the checkpoints of some directories, order them by their stored
// global_step, and verify them newest first until one passes (checkpoint/resume.h).
#include "tessera/checkpoint/resume.h"

#include <algorithm>
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

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

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
    if (name.empty()) continue;
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
    if (is_dir ? fs::is_regular_file(p / kMetadataFile, e2) || ends_with(name, ".ckpt")
               : ends_with(name, ".ckpt") || (fs::is_regular_file(p, e2) && is_tessera_checkpoint(p.string())))
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

}  // namespace

ResumeChoice find_resumable(const std::vector<std::string>& dirs, const ResumeReport& report_fn) {
  const ResumeReport report = report_fn ? report_fn : ResumeReport(default_report);
  ResumeChoice choice;
  auto skip = [&](const std::string& path, const std::string& problem) {
    choice.skipped.push_back(path + ": " + problem);
    report("skipping " + path + ": " + problem);
  };
  std::vector<Candidate> candidates;
  std::vector<std::pair<std::string, std::string>> unread;  // path, problem: reported first
  for (const auto& dir : dirs) {
    for (const std::string& path : list_candidates(dir)) {
      try {
        const CheckpointMetadata meta = open_checkpoint(path);
        auto it = meta.entries.find("global_step");
        const int64_t* step = it == meta.entries.end() ? nullptr : std::get_if<int64_t>(&it->second.value);
        if (!step) {
          unread.emplace_back(path, "no integer global_step (not a training checkpoint)");
          continue;
        }
        candidates.push_back({path, *step, modified(path)});
      } catch (const ResourceError&) {
        throw;
      } catch (const std::exception& e) {
        unread.emplace_back(path, std::string("cannot read its metadata: ") + e.what());
      }
    }
  }
  std::sort(unread.begin(), unread.end());
  for (const auto& [path, problem] : unread) skip(path, problem);
  std::stable_sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.step != b.step) return a.step > b.step;
    if (a.mtime != b.mtime) return a.mtime > b.mtime;
    return a.path < b.path;
  });
  for (const Candidate& c : candidates) {
    const VerifyReport r = verify(c.path);  // throws only ResourceError
    if (!r.ok || !r.problems.empty()) {
      skip(c.path, problems_of(r));
      continue;
    }
    choice.path = c.path;
    choice.global_step = c.step;
    report("resuming from " + c.path + " (step " + std::to_string(c.step) + ")");
    return choice;
  }
  report("no checkpoint that verifies in " + (dirs.empty() ? std::string("(no directories)") : core::join(dirs)) +
         ": starting fresh");
  return choice;
}

ResumeChoice find_resumable(const std::vector<std::string>& dirs, distributed::Communicator& comm,
                            const ResumeReport& report) {
  // Rank 0's answer for every rank: "ok <step>\n<path>" or "error\n<message>".
  ResumeChoice choice;
  std::string msg;
  if (comm.rank() == 0) {
    try {
      choice = find_resumable(dirs, report);
      msg = "ok " + std::to_string(choice.global_step) + "\n" + choice.path;
    } catch (const std::exception& e) {
      msg = std::string("error\n") + e.what();
    }
  }
  msg = comm.broadcast_bytes(msg, 0);
  const size_t nl = msg.find('\n');
  TESSERA_CHECK(nl != std::string::npos, "find_resumable: malformed choice from rank 0");
  const std::string head = msg.substr(0, nl), body = msg.substr(nl + 1);
  TESSERA_CHECK(head != "error", "find_resumable on rank 0: ", body);
  if (comm.rank() != 0) {
    choice.path = body;
    choice.global_step = std::stoll(head.substr(3));
  }
  return choice;
}

}  // namespace tessera::checkpoint
