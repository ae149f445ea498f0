// `tessera ckpt import-dcp` on DCP directories nobody vouches for (issue 35, items 8, 14,
// 15 and the DCP parts of 19), built by tests/checkpoint/dcp_fixture.h without torch 2.x:
// the output's data files come from what .metadata uses, never from the directory's file
// names (a stray __20000_0.distcp or a writer named __1048575_0 leaves one file per writer
// that holds data, not 20,002 or a million); a referenced file that is missing is named; a
// FIFO in place of .metadata is refused at once; a .metadata or .distcp symbolic link that
// leads out of the directory is refused, one inside it is followed. Runs of the real CLI
// that could run away on a regression are children with a deadline, killed when it passes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "checkpoint/dcp_fixture.h"
#include "support/child_process.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/offline/dcp_import.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/state/state_dict.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

// "w": 8 floats 0..7 in two chunks, [0:4] in `file0` and [4:8] in `file1`.
std::vector<dcp::Tensor> two_chunks(const std::string& file0, const std::string& file1) {
  return {dcp::Tensor{"w", at::arange(8, at::kFloat), {{{0}, {4}, file0}, {{4}, {4}, file1}}}};
}

std::set<std::string> names_in(const std::string& dir) {
  std::set<std::string> s;
  for (const auto& e : fs::directory_iterator(dir)) s.insert(e.path().filename().string());
  return s;
}

// The imported "w" equals 0..7.
void expect_w(const std::string& ckpt) {
  state::StateDict sd;
  sd.set("w", at::zeros({8}, at::kFloat));
  ck::load_local(sd, ckpt);
  EXPECT_TRUE(at::equal(sd.tensor("w"), at::arange(8, at::kFloat))) << sd.tensor("w");
}

}  // namespace

// Item 15: one stray empty __20000_0.distcp (and one named for rank 1048575) beside a
// checkpoint of two writers made 20,002 (a million) output files; now two, the strays named
// as ignored.
TEST(DcpImportBounds, StrayDistcpFilesDoNotSetTheWorldSize) {
  const std::string dir = temp_dir("tessera-dcp-stray");
  const std::string src = dir + "/dcp", out = dir + "/imported";
  fs::create_directory(src);
  dcp::write_checkpoint(src, two_chunks("__0_0.distcp", "__1_0.distcp"));
  dcp::write_file(src + "/__20000_0.distcp", "");
  dcp::write_file(src + "/__1048575_0.distcp", "");
  const CliRun r = run_cli({"ckpt", "import-dcp", src, "-o", out}, 60000);
  ASSERT_TRUE(r.finished) << "still running after 60 s (writing a file per rank up to the highest name?)\n" << r.out;
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "from 2 DCP writer(s)");
  EXPECT_CONTAINS(r.out, "ignored 2 .distcp file(s) that .metadata does not use: '__1048575_0.distcp', '__20000_0.distcp'");
  EXPECT_EQ(names_in(out), (std::set<std::string>{"tessera-checkpoint.json", "data-rank00000.safetensors",
                                                  "data-rank00001.safetensors"}));
  expect_w(out);
}

// Item 8: the metadata itself places the data in files of ranks 7 and 1048575 (names
// FileSystemWriter could give): one output data file per writer that holds data (two, in
// rank order), not 1,048,576 fsynced files.
TEST(DcpImportBounds, HighWriterRanksInTheMetadataMakeOneFileEach) {
  const std::string dir = temp_dir("tessera-dcp-high");
  const std::string src = dir + "/dcp", out = dir + "/imported";
  fs::create_directory(src);
  dcp::write_checkpoint(src, two_chunks("__7_0.distcp", "__1048575_0.distcp"));
  const CliRun r = run_cli({"ckpt", "import-dcp", src, "-o", out}, 60000);
  ASSERT_TRUE(r.finished) << "still running after 60 s (a million data files?)\n" << r.out;
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "from 2 DCP writer(s)");
  EXPECT_EQ(r.out.find("ignored"), std::string::npos) << r.out;
  EXPECT_EQ(names_in(out), (std::set<std::string>{"tessera-checkpoint.json", "data-rank00000.safetensors",
                                                  "data-rank00001.safetensors"}));
  expect_w(out);
}

// Item 15: every data file the metadata uses and the directory lacks is named, all at
// once, before anything is written.
TEST(DcpImportBounds, MissingDataFilesAreAllNamed) {
  const std::string dir = temp_dir("tessera-dcp-missing");
  const std::string src = dir + "/dcp";
  fs::create_directory(src);
  std::vector<dcp::Tensor> t = two_chunks("__0_0.distcp", "__1_0.distcp");
  t.push_back(dcp::Tensor{"v", at::ones({2}, at::kFloat), {{{0}, {2}, "__2_0.distcp"}}});
  dcp::write_checkpoint(src, t);
  fs::remove(src + "/__1_0.distcp");
  fs::remove(src + "/__2_0.distcp");
  const std::string e = error_of([&] { ck::import_dcp(src, dir + "/out", false); });
  EXPECT_CONTAINS(e, src + "/.metadata");
  EXPECT_CONTAINS(e, "2 file(s) that do not exist");
  EXPECT_CONTAINS(e, "'__1_0.distcp', '__2_0.distcp'");
  EXPECT_FALSE(fs::exists(dir + "/out"));
}

// Item 14: a FIFO in place of .metadata hung import-dcp forever (the open waited for a
// writer); now it is refused at once, naming it.
TEST(DcpImportBounds, FifoInPlaceOfMetadataIsRefusedAtOnce) {
  const std::string dir = temp_dir("tessera-dcp-fifo");
  const std::string src = dir + "/dcp";
  fs::create_directory(src);
  dcp::write_checkpoint(src, two_chunks("__0_0.distcp", "__1_0.distcp"));
  fs::remove(src + "/.metadata");
  ASSERT_EQ(::mkfifo((src + "/.metadata").c_str(), 0644), 0);
  const CliRun r = run_cli({"ckpt", "import-dcp", src, "-o", dir + "/out"}, 30000);
  ASSERT_TRUE(r.finished) << "import-dcp still waiting on the FIFO after 30 s\n" << r.out;
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_CONTAINS(r.out, "'" + src + "/.metadata' is not a regular file (a FIFO)");
  EXPECT_FALSE(fs::exists(dir + "/out"));
}

// Item 14, the common open: File(path, "r") refuses a FIFO at once instead of blocking in
// open() (whatever checked the path before). Run in a forked child with a deadline.
// Runs `open` (which opens `fifo` for reading) in a forked child, at most 10 s: its error
// message, or "opened"; `blocked` when the child was still in it after 10 s.
static std::string open_in_child(const std::function<void()>& open, bool* blocked) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string msg = "opened";
    try {
      open();
    } catch (const std::exception& e) {
      msg = e.what();
    }
    (void)!::write(fds[1], msg.data(), msg.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  const int64_t end = steady_ms() + 10000;
  int st = 0;
  pid_t done = 0;
  while (pid > 0 && (done = ::waitpid(pid, &st, WNOHANG)) == 0 && steady_ms() < end) ::usleep(10000);
  if (pid > 0 && done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &st, 0);
  }
  *blocked = done == 0;
  std::string msg(4096, '\0');
  const ssize_t n = ::read(fds[0], msg.data(), msg.size());
  ::close(fds[0]);
  msg.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return msg;
}

// Neither read-open of the checkpoint layer (File(path, "r"), and open_for_reading, which
// the safetensors reader also uses to reopen a data file it closed) blocks on a FIFO.
TEST(DcpImportBounds, ReadOpenOfAFifoFailsAtOnce) {
  const std::string dir = temp_dir("tessera-fifo-open");
  const std::string fifo = dir + "/pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  bool blocked = false;
  std::string msg = open_in_child([&] { ck::File f(fifo, "r"); }, &blocked);
  ASSERT_FALSE(blocked) << "File(FIFO, \"r\") still blocked after 10 s";
  EXPECT_CONTAINS(msg, "cannot open '" + fifo + "' for reading: it is not a regular file (a FIFO)");
  msg = open_in_child([&] { ck::open_for_reading(fifo); }, &blocked);
  ASSERT_FALSE(blocked) << "open_for_reading(FIFO) still blocked after 10 s";
  EXPECT_CONTAINS(msg, "cannot open '" + fifo + "' for reading: it is not a regular file (a FIFO)");
}

// Item 19: a .metadata or .distcp symbolic link that leads out of the DCP directory is
// refused naming the link; a link to a file inside the directory is followed.
TEST(DcpImportBounds, SymlinksOutOfTheDirectoryAreRefused) {
  const std::string dir = temp_dir("tessera-dcp-link");
  const std::string src = dir + "/dcp", elsewhere = dir + "/elsewhere";
  fs::create_directory(src);
  fs::create_directory(elsewhere);
  dcp::write_checkpoint(src, two_chunks("__0_0.distcp", "__1_0.distcp"));

  // A data file that is a link to a file elsewhere.
  fs::rename(src + "/__1_0.distcp", elsewhere + "/__1_0.distcp");
  fs::create_symlink(elsewhere + "/__1_0.distcp", src + "/__1_0.distcp");
  std::string e = error_of([&] { ck::import_dcp(src, dir + "/out1", false); });
  EXPECT_CONTAINS(e, "DCP data file '" + src + "/__1_0.distcp' is a symbolic link to '" + elsewhere + "/__1_0.distcp'");
  EXPECT_CONTAINS(e, "outside the DCP directory");
  EXPECT_FALSE(fs::exists(dir + "/out1"));

  // The same file moved into the directory (under another name), the link relative: followed.
  fs::remove(src + "/__1_0.distcp");
  fs::create_directory(src + "/store");
  fs::rename(elsewhere + "/__1_0.distcp", src + "/store/blob");
  fs::create_symlink("store/blob", src + "/__1_0.distcp");
  const ck::DcpImportResult ok = ck::import_dcp(src, dir + "/out2", false);
  EXPECT_EQ(ok.world_size, 2);
  expect_w(dir + "/out2");

  // .metadata a link out of the directory (through ..).
  fs::rename(src + "/.metadata", elsewhere + "/metadata");
  fs::create_symlink("../elsewhere/metadata", src + "/.metadata");
  e = error_of([&] { ck::import_dcp(src, dir + "/out3", false); });
  EXPECT_CONTAINS(e, "DCP metadata '" + src + "/.metadata' is a symbolic link to '../elsewhere/metadata'");
  EXPECT_CONTAINS(e, "outside the DCP directory");
  EXPECT_FALSE(fs::exists(dir + "/out3"));
}
