// tessera run's output relay holds a bounded part of a rank's output (issue 35, item 18):
// a rank that never ends its line (one 20 MB line; 2,000,000 '\r' progress updates to a
// file) used to be buffered whole by the launcher (437 MB for 3M updates, 596 MB for a
// 150 MB line). Now a '\r' ends a line for prefixing when the output is not a terminal,
// and a line longer than 64 KiB is written in pieces under one prefix. The launcher's
// peak RSS is a correctness property here (a bound, not a speed target): it is read with
// wait4 from the launcher process itself and compared with a run that prints nothing.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "support/build_paths.h"
#include "support/child_process.h"
#include "support/test_util.h"
#include "tessera/distributed/launch/launcher.h"

using tessera::testing::Measured;
using tessera::testing::read_bytes;
using tessera::testing::run_measured;
using tessera::testing::temp_dir;

namespace {

struct Launched {
  int status = -1;     // exit code, or 128 + signal
  long maxrss_kb = 0;  // the launcher's peak resident set (its own; its children are small)
  std::string out, err;
};

// `tessera run -n 1 -- sh -c SCRIPT`, stdout and stderr to files (not a terminal).
Launched run_launcher(const std::string& script) {
  const std::string dir = temp_dir("tessera-launcher-out");
  const std::string out = dir + "/out", err = dir + "/err";
  const Measured m = run_measured({TESSERA_CLI, "run", "-n", "1", "--", "/bin/sh", "-c", script}, out, err);
  Launched r;
  r.status = m.status;
  r.maxrss_kb = m.maxrss_kb;
  r.out = read_bytes(out);
  r.err = read_bytes(err);
  return r;
}

// Above the peak of a launch that prints nothing: the 64 KiB pending line, one 64 KiB
// read and what is written for it leave room; the unbounded relay took 50 MB and more.
// Under AddressSanitizer (make test-asan) freed memory stays resident in its quarantine,
// so the launcher's peak says nothing of the relay's buffer: no bound there.
#if defined(__SANITIZE_ADDRESS__)
constexpr long kExtraKb = 1L << 40;
#else
// 40 MiB: against the libtorch of a torch 2.x wheel the launcher's peak rose ~20 MiB over an
// idle launch on the 2M-update case (2 MiB with Debian's libtorch); the unbounded relay took
// 50 MiB more on both cases.
constexpr long kExtraKb = 40 * 1024;
#endif

}  // namespace

TEST(LauncherOutput, LongLineAndCarriageReturnUpdatesKeepTheLauncherSmall) {
  const Launched base = run_launcher("true");
  ASSERT_EQ(base.status, 0) << base.err;
  ASSERT_GT(base.maxrss_kb, 0);

  // One 20 MB line without a newline: written complete, under one prefix, the line
  // ended at the rank's end of output.
  const size_t n = 20'000'000;
  const Launched line = run_launcher("head -c " + std::to_string(n) + " /dev/zero | tr '\\0' x");
  ASSERT_EQ(line.status, 0) << line.err;
  ASSERT_EQ(line.out.size(), n + 10) << line.err;
  EXPECT_EQ(line.out.compare(0, 9, "[rank 0] "), 0);
  EXPECT_EQ(line.out.find_first_not_of('x', 9), n + 9) << "prefixes or other bytes inside the line";
  EXPECT_EQ(line.out.back(), '\n');
  EXPECT_LT(line.maxrss_kb, base.maxrss_kb + kExtraKb) << "launcher peak RSS " << line.maxrss_kb << " KiB (a run "
                                                       << "printing nothing: " << base.maxrss_kb << " KiB)";

  // 2,000,000 progress updates with '\r' and no newline, then "done\n": each update is
  // written with the prefix and its '\r', none lost; "\r\n" stays one line end.
  const int updates = 2'000'000;
  const Launched cr = run_launcher("seq 1 " + std::to_string(updates) + " | tr '\\n' '\\r'; printf 'done\\r\\nend'");
  ASSERT_EQ(cr.status, 0) << cr.err;
  std::string want;
  want.reserve(cr.out.size());
  for (int i = 1; i <= updates; ++i) want += "[rank 0] " + std::to_string(i) + "\r";
  want += "[rank 0] done\r\n[rank 0] end\n";
  EXPECT_EQ(cr.out.size(), want.size());
  EXPECT_TRUE(cr.out == want) << "first difference at byte "
                              << std::mismatch(want.begin(), want.end(), cr.out.begin(), cr.out.end()).first -
                                     want.begin();
  EXPECT_LT(cr.maxrss_kb, base.maxrss_kb + kExtraKb) << "launcher peak RSS " << cr.maxrss_kb << " KiB (a run "
                                                     << "printing nothing: " << base.maxrss_kb << " KiB)";
}

// LaunchOptions::on_line gets a long line in pieces of 64 KiB, and '\r' ends a line.
TEST(LauncherOutput, OnLineGetsLongLinesInPieces) {
  tessera::distributed::LaunchOptions o;
  o.command = {"/bin/sh", "-c", "head -c 150000 /dev/zero | tr '\\0' y; printf '\\na\\rb\\r\\nc'"};
  o.forward_signals = false;
  std::vector<std::string> lines;
  o.on_line = [&](int, bool is_err, const std::string& l) {
    if (!is_err) lines.push_back(l);
  };
  const auto r = tessera::distributed::launch(o);
  ASSERT_EQ(r.exit_code, 0) << r.message;
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[0], std::string(65536, 'y'));
  EXPECT_EQ(lines[1], std::string(65536, 'y'));
  EXPECT_EQ(lines[2], std::string(150000 - 2 * 65536, 'y'));
  EXPECT_EQ(lines[3], "a");
  EXPECT_EQ(lines[4], "b");
  EXPECT_EQ(lines[5], "c");
}
