// `tessera ckpt` safety and the `tessera` command line's error handling: an output that
// is, lies inside or contains the source is refused (the source stays byte for byte as
// it was); an interrupted run removes its temporary output, and one killed outright has
// it removed by the next run; `--world-size` is bounded; out-of-range flags read well
// and every usage error exits 2; a FIFO or a directory in place of a checkpoint file is
// named as such. (The tool costs ~1 s of libtorch loading per start: the bulk of the
// path matrix goes through the library functions the tool calls, and the tool itself
// runs the issue's own command lines.)
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <map>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "reliability/reliability_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/interop/torch_file.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/distributed/communicator.h"
#include "tessera/state/state_dict.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

// Every file under `path` (or `path` itself) with its bytes.
std::map<std::string, std::string> snapshot(const std::string& path) {
  std::map<std::string, std::string> m;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::recursive_directory_iterator(path))
      if (e.is_regular_file()) m[e.path().string()] = read_bytes(e.path().string());
  } else {
    m[path] = read_bytes(path);
  }
  return m;
}

// The checkpoint at `path` is intact and holds state_of(n, v).
void expect_holds(const std::string& path, int64_t n, double v) {
  EXPECT_TRUE(ck::verify(path).ok) << path;
  state::StateDict t = state_of(n, 0);
  ck::load_local(t, path);
  EXPECT_TRUE(at::equal(t.tensor("w"), at::full({n}, v, at::kFloat))) << path;
  EXPECT_EQ(t.integer("step"), static_cast<int64_t>(v)) << path;
}

std::vector<std::string> temporaries_in(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".tessera-tmp-") != std::string::npos) v.push_back(e.path().string());
  return v;
}


// spawn() with SIGINT and SIGTERM at their default action in the child, whatever this
// process inherited (a background job starts with SIGINT ignored, and the child would
// keep ignoring it).
Child spawn_interruptible(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  struct sigaction dfl {}, old_int {}, old_term {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGINT, &dfl, &old_int);
  ::sigaction(SIGTERM, &dfl, &old_term);
  Child c = spawn(argv, env);
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return c;
}

}  // namespace

// Each writing operation, onto its own source by every route: the path itself, a symlink
// to it, a symlinked parent, a path inside it, a directory containing it; with and
// without force. Each is refused naming both paths, and the source is unchanged.
TEST(CkptSafety, OutputThatIsInsideOrContainsTheSourceIsRefused) {
  const std::string dir = temp_dir("tessera-ckpt-self");
  const std::string sharded = dir + "/ck", file = dir + "/ck.safetensors";
  ck::save(state_of(64, 3), sharded, *solo());
  ck::save(state_of(64, 3), file, *solo(), {ck::SaveMode::Full});
  ASSERT_EQ(::symlink(dir.c_str(), (dir + "/../" + fs::path(dir).filename().string() + "-link").c_str()), 0);
  const std::string linkdir = dir + "-link";  // a symlinked parent
  ASSERT_EQ(::symlink(sharded.c_str(), (dir + "/ck-alias").c_str()), 0);
  ASSERT_EQ(::symlink(file.c_str(), (dir + "/file-alias").c_str()), 0);
  // A data file of the sharded checkpoint read as a checkpoint of its own: the directory
  // holding it is a Tessera checkpoint that --force would otherwise replace.
  const std::string inner = sharded + "/data-rank00000.safetensors";
  ASSERT_TRUE(fs::exists(inner));

  struct Case {
    std::string src, out, how;
  };
  const std::vector<Case> cases = {
      {sharded, sharded, "is the source"},
      {sharded, sharded + "/", "is the source"},
      {sharded, dir + "/ck-alias", "is the source"},
      {dir + "/ck-alias", sharded, "is the source"},
      {sharded, linkdir + "/ck", "is the source"},
      {sharded, sharded + "/out.pt", "is inside the source"},
      {sharded, inner, "is inside the source"},
      {sharded, dir, "contains the source"},
      {inner, sharded, "contains the source"},
      {file, file, "is the source"},
      {file, dir + "/file-alias", "is the source"},
      {file, linkdir + "/ck.safetensors", "is the source"},
      {file, file + "/x", "is inside the source"},
      {file, dir, "contains the source"},
  };
  const auto before_dir = snapshot(sharded);
  const auto before_file = snapshot(file);
  for (const auto& c : cases) {
    for (const bool force : {false, true}) {
      const std::vector<std::pair<std::string, std::function<void()>>> ops = {
          {"export torch", [&] { ck::export_checkpoint(c.src, ck::ExportFormat::Torch, c.out, force); }},
          {"export safetensors", [&] { ck::export_checkpoint(c.src, ck::ExportFormat::Safetensors, c.out, force); }},
          {"consolidate", [&] { ck::consolidate(c.src, c.out, force); }},
          {"reshard", [&] { ck::reshard(c.src, 2, c.out, force); }},
      };
      for (const auto& [name, op] : ops) {
        SCOPED_TRACE(name + " " + c.src + " -o " + c.out + (force ? " --force" : ""));
        const std::string e = error_of(op);
        EXPECT_CONTAINS(e, "refusing to write '" + c.out + "'");
        EXPECT_CONTAINS(e, c.how + " '" + c.src + "'");
      }
    }
  }
  EXPECT_EQ(snapshot(sharded), before_dir);
  EXPECT_EQ(snapshot(file), before_file);
  EXPECT_TRUE(temporaries_in(dir).empty());
  expect_holds(sharded, 64, 3);
  expect_holds(file, 64, 3);
  // A sibling output is still fine.
  ck::reshard(sharded, 2, dir + "/ck2", false);
  expect_holds(dir + "/ck2", 64, 3);
  fs::remove(linkdir);
}

// The issue's command lines through the tool: exit 2, both paths named, source intact.
TEST(CkptSafety, ToolRefusesToOverwriteItsSource) {
  const std::string dir = temp_dir("tessera-ckpt-self-cli");
  const std::string sharded = dir + "/ck", file = dir + "/ck.safetensors";
  ck::save(state_of(16, 5), sharded, *solo());
  ck::save(state_of(16, 5), file, *solo(), {ck::SaveMode::Full});
  const auto before_dir = snapshot(sharded);
  const auto before_file = snapshot(file);
  for (const std::string& src : {sharded, file}) {
    for (const std::string& cmd : {"export " + src + " --format torch -o " + src + " --force",
                                   "export " + src + " --format safetensors -o " + src + " --force",
                                   "consolidate " + src + " -o " + src + " --force",
                                   "reshard " + src + " --world-size 2 -o " + src + " --force"}) {
      auto [rc, out] = run_command(cli("ckpt " + cmd));
      EXPECT_EQ(rc, 2) << cmd << "\n" << out;
      EXPECT_CONTAINS(out, "refusing to write '" + src + "': it is the source '" + src + "'");
    }
  }
  EXPECT_EQ(snapshot(sharded), before_dir);
  EXPECT_EQ(snapshot(file), before_file);
  expect_holds(sharded, 16, 5);
  expect_holds(file, 16, 5);
  EXPECT_EQ(run_command(cli("ckpt verify " + sharded)).first, 0);
}

// --force replaces an existing output only when Tessera wrote it (writer.h,
// is_replaceable_output): the same rule for export --format torch as for the other
// writers. A text file, a foreign zip (a torch.save archive Tessera did not write) and a
// foreign safetensors file are refused by every file writer, byte for byte intact; a
// Tessera torch export and a Tessera safetensors file are replaced, by either format.
TEST(CkptSafety, ForceReplacesOnlyWhatTesseraWrote) {
  const std::string dir = temp_dir("tessera-ckpt-force");
  const std::string src = dir + "/ck", src2 = dir + "/ck2";
  ck::save(state_of(16, 5), src, *solo());
  ck::save(state_of(16, 6), src2, *solo());

  const std::string text = dir + "/notes.pt";
  write_bytes(text, "keep me\n");
  const std::string zip = dir + "/theirs.pt";  // a zip archive with a data.pkl, not Tessera's
  {
    caffe2::serialize::PyTorchStreamWriter w(zip);
    const std::string pkl = "\x80\x02}q\x00.";
    w.writeRecord("data.pkl", pkl.data(), pkl.size());
    w.writeEndOfFile();
  }
  const std::string foreign = dir + "/theirs.safetensors";
  {  // a safetensors file as another program writes it: no Tessera header entries
    const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    std::string bytes(8, '\0');
    for (int k = 0; k < 8; ++k) bytes[k] = static_cast<char>((header.size() >> (8 * k)) & 0xff);
    write_bytes(foreign, bytes + header + std::string(8, '\0'));
  }
  EXPECT_EQ(ck::open_checkpoint(foreign).source_kind, "safetensors");
  EXPECT_FALSE(ck::is_tessera_torch_export(zip));
  EXPECT_FALSE(ck::is_tessera_torch_export(text));
  for (const std::string& out : {text, zip, foreign}) {
    const std::string before = read_bytes(out);
    const std::vector<std::pair<std::string, std::function<void()>>> ops = {
        {"export torch", [&] { ck::export_checkpoint(src, ck::ExportFormat::Torch, out, true); }},
        {"export safetensors", [&] { ck::export_checkpoint(src, ck::ExportFormat::Safetensors, out, true); }},
        {"consolidate", [&] { ck::consolidate(src, out, true); }},
    };
    for (const auto& [name, op] : ops) {
      SCOPED_TRACE(name + " -o " + out + " --force");
      EXPECT_CONTAINS(error_of(op), "refusing to replace '" + out + "': not a file Tessera wrote");
      EXPECT_EQ(read_bytes(out), before);
    }
  }
  // The issue's command line through the tool: exit 2, the file named and intact.
  auto [rc, out] = run_command(cli("ckpt export " + src + " --format torch -o " + text + " --force"));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_CONTAINS(out, "refusing to replace '" + text + "': not a file Tessera wrote");
  EXPECT_EQ(read_bytes(text), "keep me\n");
  EXPECT_TRUE(temporaries_in(dir).empty());

  // A Tessera torch export carries its marker and is replaced with --force (not without).
  const std::string pt = dir + "/m.pt";
  ck::export_checkpoint(src, ck::ExportFormat::Torch, pt, false);
  EXPECT_TRUE(ck::is_tessera_torch_export(pt));
  EXPECT_CONTAINS(error_of([&] { ck::export_checkpoint(src2, ck::ExportFormat::Torch, pt, false); }),
                  "pass --force");
  auto [rc2, out2] = run_command(cli("ckpt export " + src2 + " --format torch -o " + pt + " --force"));
  EXPECT_EQ(rc2, 0) << out2;
  auto w_of = [](const std::string& path) {
    const ck::CheckpointMetadata m = ck::open_checkpoint(path);
    return m.entries.at("w").chunks.at(0).memory;
  };
  EXPECT_TRUE(at::equal(w_of(pt), at::full({16}, 6.0, at::kFloat)));
  // Either Tessera file output replaces the other.
  ck::consolidate(src, pt, true);
  expect_holds(pt, 16, 5);
  ck::export_checkpoint(src2, ck::ExportFormat::Torch, pt, true);
  EXPECT_TRUE(ck::is_tessera_torch_export(pt));
  EXPECT_TRUE(at::equal(w_of(pt), at::full({16}, 6.0, at::kFloat)));
  // A directory writer replaces the export as well (it is Tessera's).
  ck::reshard(src, 2, pt, true);
  expect_holds(pt, 16, 5);
}

// SIGINT or SIGTERM while a write is in progress: the temporary output is removed, the
// process ends by that signal, and nothing is published. (The test hook stops the tool
// just before its commit, with the temporary complete, and says so on stderr.)
TEST(CkptInterrupt, SignalRemovesTheTemporaryOutput) {
  const std::string dir = temp_dir("tessera-ckpt-int");
  const std::string src = dir + "/ck";
  ck::save(state_of(4096, 2), src, *solo());
  struct Case {
    int sig;
    std::vector<std::string> args;
    std::string out;
  };
  const std::vector<Case> cases = {
      {SIGINT, {"reshard", src, "--world-size", "3", "-o", dir + "/r3"}, dir + "/r3"},
      {SIGTERM, {"export", src, "--format", "torch", "-o", dir + "/m.pt"}, dir + "/m.pt"},
      {SIGTERM, {"consolidate", src, "-o", dir + "/c.safetensors"}, dir + "/c.safetensors"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.out);
    std::vector<std::string> argv = {TESSERA_CLI, "ckpt"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    Child p = spawn_interruptible(argv, {{"TESSERA_TEST_PAUSE_BEFORE_COMMIT", "1"}});
    ASSERT_GT(p.pid, 0);
    ASSERT_TRUE(p.wait_for("test pause before committing", 120000)) << p.text;
    ASSERT_TRUE(p.wait_for("')\n", 60000)) << p.text;  // the whole line
    const auto tmps = temporaries_in(dir);
    ASSERT_EQ(tmps.size(), 1u) << p.text;
    EXPECT_CONTAINS(p.text, tmps[0]);
    ASSERT_EQ(::kill(p.pid, c.sig), 0);
    const int st = p.wait_exit(60000);
    ASSERT_NE(st, -1) << "still running after the signal\n" << p.text;
    EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == c.sig) << "status " << st << "\n" << p.text;
    EXPECT_CONTAINS(p.text, "removed the unfinished output '" + tmps[0] + "'");
    EXPECT_TRUE(temporaries_in(dir).empty()) << p.text;
    EXPECT_FALSE(fs::exists(c.out));
  }
  expect_holds(src, 4096, 2);
}

// SIGKILL cannot be caught: the dead run's temporary stays, and the next run for the same
// output removes it. Temporaries of live processes and names that are not a pid stay.
TEST(CkptInterrupt, NextRunRemovesTemporariesOfDeadRuns) {
  const std::string dir = temp_dir("tessera-ckpt-kill");
  const std::string src = dir + "/ck", out = dir + "/r2";
  ck::save(state_of(4096, 4), src, *solo());
  Child p = spawn({TESSERA_CLI, "ckpt", "reshard", src, "--world-size", "2", "-o", out},
                  {{"TESSERA_TEST_PAUSE_BEFORE_COMMIT", "1"}});
  ASSERT_GT(p.pid, 0);
  ASSERT_TRUE(p.wait_for("test pause before committing", 120000)) << p.text;
  ASSERT_EQ(::kill(p.pid, SIGKILL), 0);
  ASSERT_NE(p.wait_exit(60000), -1);
  const auto left = temporaries_in(dir);
  ASSERT_EQ(left.size(), 1u);  // what the issue saw
  // A live process's temporary (this test's parent: alive) and an unparsable name stay.
  const std::string live = dir + "/.r2.tessera-tmp-" + std::to_string(::getppid()) + "-0";
  const std::string odd = dir + "/.r2.tessera-tmp-x1-0";
  ck::make_dir(live);
  ck::make_dir(odd);
  auto [rc, text] = run_command(cli("ckpt reshard " + src + " --world-size 2 -o " + out));
  EXPECT_EQ(rc, 0) << text;
  EXPECT_FALSE(fs::exists(left[0]));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(odd));
  expect_holds(out, 4096, 4);
  // The library call does the same for a file output.
  const std::string dead_file = dir + "/.m.pt.tessera-tmp-" + std::to_string(p.pid) + "-7";
  write_bytes(dead_file, "partial");
  ck::export_checkpoint(src, ck::ExportFormat::Torch, dir + "/m.pt", false);
  EXPECT_FALSE(fs::exists(dead_file));
}

// --world-size is bounded (one data file per rank) and the error names the flag. (The
// output's parent does not exist, so that without the bound the run fails at once on
// that instead of writing a million files.)
TEST(CkptCli, WorldSizeIsBounded) {
  const std::string dir = temp_dir("tessera-ckpt-ws");
  ck::save(state_of(4, 1), dir + "/ck", *solo());
  const std::string out = dir + "/missing/r";
  for (const std::string ws : {"1048576", "65537", "0", "-1"}) {
    auto [rc, text] = run_command(cli("ckpt reshard " + dir + "/ck --world-size " + ws + " -o " + out));
    EXPECT_EQ(rc, 2) << text;
    EXPECT_CONTAINS(text, "--world-size: must be between 1 and 65536, got " + ws);
  }
  EXPECT_CONTAINS(error_of([&] { ck::reshard(dir + "/ck", 65537, out, false); }), "between 1 and 65536, got 65537");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}), 1);  // the source only
}

// reshard --tp: it must divide --world-size, and above 1 it needs a checkpoint saved under
// tensor parallelism (a 1-D one does not say which tensors a tp-way job cuts). Each error
// names the flag, and nothing is written. (The 2-D cases: Gpt.OfflineReshardToAnotherMesh...)
TEST(CkptCli, ReshardTpIsCheckedAndNamed) {
  const std::string dir = temp_dir("tessera-ckpt-tp");
  ck::save(state_of(4, 1), dir + "/ck", *solo());
  const std::string out = dir + "/r";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--world-size 4 --tp 3", "--tp 3 must divide --world-size 4"},
      {"--world-size 4 --tp 0", "--tp: must be between 1 and 65536, got 0"},
      {"--world-size 4 --tp 2", "records no tensor-parallel cut"},
  };
  for (const auto& [flags, want] : cases) {
    auto [rc, text] = run_command(cli("ckpt reshard " + dir + "/ck " + flags + " -o " + out));
    EXPECT_NE(rc, 0) << flags << "\n" << text;
    EXPECT_CONTAINS(text, want);
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}), 1);  // the source only
  auto [rc, text] = run_command(cli("ckpt reshard " + dir + "/ck --world-size 4 --tp 1 -o " + out));
  EXPECT_EQ(rc, 0) << text;
  EXPECT_TRUE(ck::verify(out).ok);
}

// Usage errors exit 2 (CLI11's own codes are 105-114), --help and --version exit 0, and
// range errors print the bounds as written (no 300-digit float, no "nan" accepted).
TEST(CkptCli, UsageErrorsExitTwoAndRangeErrorsReadWell) {
  const std::vector<std::pair<std::string, std::string>> errors = {
      {"", "A subcommand is required"},
      {"--bogus", ""},  // CLI11 reports the missing subcommand first
      {"ckpt", "A subcommand is required"},
      {"ckpt frobnicate", ""},
      {"ckpt reshard", "is required"},
      {"ckpt export x --format zip -o y", "--format"},
      {"run --grace 5000 -- true", "--grace: must be between 0 and 3600, got 5000"},
      {"run --grace nan -- true", "--grace: 'nan' is not a finite number"},
      {"run --deadline -1 -- true", "--deadline: must be between 0 and 10000000, got -1"},
      {"run -n 0 -- true", "--nproc-per-node: must be between 1 and 4096, got 0"},
      {"run -n two -- true", "--nproc-per-node: 'two' is not an integer"},
  };
  for (const auto& [args, want] : errors) {
    auto [rc, out] = run_command(cli(args));
    EXPECT_EQ(rc, 2) << "tessera " << args << "\n" << out;
    EXPECT_CONTAINS(out, "tessera: error: ");
    EXPECT_CONTAINS(out, want);
    EXPECT_EQ(out.find(".000000"), std::string::npos) << out;  // CLI11's Range: "0.000000 to 3600.000000"
    EXPECT_LT(out.size(), 300u) << out;                        // its PositiveNumber: a 300-digit bound
  }
  for (const std::string args : {"--help", "--version", "ckpt --help", "ckpt reshard --help", "run --help"}) {
    auto [rc, out] = run_command(cli(args));
    EXPECT_EQ(rc, 0) << "tessera " << args << "\n" << out;
  }
}

// A FIFO or a directory where a checkpoint file should be: "is not a regular file",
// naming the path; never a hang on the FIFO and never "missing".
TEST(CkptCli, NonRegularFileInPlaceOfACheckpointFileIsNamed) {
  const std::string dir = temp_dir("tessera-ckpt-fifo");
  const std::string c = dir + "/ck";
  ck::save(state_of(8, 1), c, *solo());
  const std::string data = c + "/data-rank00000.safetensors";
  const std::string meta = c + "/tessera-checkpoint.json";
  const std::string saved_data = read_bytes(data), saved_meta = read_bytes(meta);
  struct Case {
    std::string path, kind;
  };
  for (const Case& k : {Case{data, "a FIFO"}, Case{data, "a directory"}, Case{meta, "a FIFO"},
                        Case{meta, "a directory"}}) {
    SCOPED_TRACE(k.path + " " + k.kind);
    ASSERT_TRUE(fs::remove(k.path));
    if (k.kind == "a FIFO") {
      ASSERT_EQ(::mkfifo(k.path.c_str(), 0644), 0);
    } else {
      ASSERT_TRUE(fs::create_directory(k.path));
    }
    const std::string want = "is not a regular file (" + k.kind + "): '" + k.path + "'";
    if (k.path == meta) {
      EXPECT_CONTAINS(error_of([&] { ck::inspect(c); }), want);
    } else {
      // Format 2: inspect reads the metadata only (the layouts say where the pieces are).
      EXPECT_NO_THROW(ck::inspect(c));
    }
    const ck::VerifyReport r = ck::verify(c);
    EXPECT_FALSE(r.ok);
    ASSERT_FALSE(r.problems.empty());
    EXPECT_CONTAINS(r.problems[0], k.path == meta ? want : "is not a regular file (" + k.kind + ")");
    EXPECT_CONTAINS(r.problems[0], k.path);
    EXPECT_EQ(r.problems[0].find("missing"), std::string::npos) << r.problems[0];
    fs::remove(k.path);
    write_bytes(k.path, k.path == data ? saved_data : saved_meta);
  }
  expect_holds(c, 8, 1);
  // The checkpoint path itself a FIFO.
  ASSERT_EQ(::mkfifo((dir + "/pipe").c_str(), 0644), 0);
  EXPECT_CONTAINS(error_of([&] { ck::inspect(dir + "/pipe"); }), "'" + dir + "/pipe' is neither");
  EXPECT_CONTAINS(error_of([&] { ck::inspect(dir + "/pipe"); }), "is not a regular file (a FIFO)");
}
