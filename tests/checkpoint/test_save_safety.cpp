// Saves that must not destroy data (issue 35): control characters in checkpoint paths
// (item 4), a consolidated save failing on one rank (item 5), ranks that disagree on what
// they save, or only on their plain values (item 6), and the read-back of an every-rank-writes save before its commit,
// the page size and the filesystems that get that path (item 10).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <regex>

#include "checkpoint/checkpoint_test_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/save_full_io.h"
#include "tessera/checkpoint/test_hooks.h"
#include "tessera/checkpoint/wire.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/state/state_dict.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

// The names in `dir` that are temporaries of a save.
std::vector<std::string> temporaries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().filename().string().find(".tessera-tmp") != std::string::npos) out.push_back(f.path().string());
  return out;
}

// The consolidated file of save_safety_scenarios.cpp holds ITER's values.
void expect_iter(const std::string& file, int64_t iter) {
  state::StateDict sd;
  sd.set("a", at::zeros({8, 3}));
  sd.set("b", at::zeros({8, 3}));
  sd.set("g", at::zeros({4, 6}));
  sd.set("step", int64_t(0));
  ck::load_local(sd, file);
  for (int64_t k = 0; k < 3; ++k) {
    const char* key = k == 0 ? "a" : k == 1 ? "b" : "g";
    const at::Tensor want = at::arange(24, at::kFloat).reshape(k == 2 ? std::vector<int64_t>{4, 6} : std::vector<int64_t>{8, 3}) +
                            float(1000 * k + 100 * iter);
    EXPECT_TRUE(at::equal(sd.tensor(key), want)) << key << " of '" << file << "' is not iteration " << iter;
  }
  EXPECT_EQ(sd.integer("step"), iter);
}

// Each rank's line for each step of the save_safety scenario: [step][rank] = (milliseconds,
// "ok" or "error: ...").
std::map<int, std::map<int, std::pair<long, std::string>>> save_lines(const RanksResult& r) {
  std::map<int, std::map<int, std::pair<long, std::string>>> out;
  const std::regex re("^save rank ([0-9]+) step ([0-9]+) ms ([0-9]+): (.*)$");
  for (const auto& [rank, lines] : r.out)
    for (const auto& l : lines) {
      std::smatch m;
      if (std::regex_match(l, m, re)) out[std::stoi(m[2])][std::stoi(m[1])] = {std::stol(m[3]), m[4]};
    }
  return out;
}

struct Failing {
  std::string step;                   // "VARIANT:2[:FAULT]" (save_safety_scenarios.cpp)
  std::vector<std::string> expected;  // in every rank's message
};

// At 2 ranks, with a 20 s communicator timeout: a good save of iteration 1 (`first`),
// then each of `failing`, which must fail on both ranks, quickly, with its expected text
// in the message, and leave iteration 1 in place and no temporary file. `name`: the
// checkpoint's (a directory for sharded saves).
void expect_fails_everywhere(const std::vector<Failing>& failing, const std::string& first = "base:1",
                             const std::string& name = "c.safetensors") {
  const std::string dir = temp_dir();
  const std::string file = dir + "/" + name;
  std::vector<std::string> args = {"save_safety", file, first};
  for (const auto& f : failing) args.push_back(f.step);
  auto r = run_ranks(2, args, 60, {{"TESSERA_TEST_TIMEOUT_MS", "20000"}});
  EXPECT_EQ(r.launch.exit_code, 0) << r.all_output();
  const auto lines = save_lines(r);
  ASSERT_EQ(lines.size(), failing.size() + 1) << r.all_output();
  ASSERT_EQ(lines.at(1).size(), 2u) << r.all_output();
  for (const auto& [rank, line] : lines.at(1)) ASSERT_EQ(line.second, "ok") << "rank " << rank;
  for (size_t i = 0; i < failing.size(); ++i) {
    const auto& step = lines.at(static_cast<int>(i) + 2);
    ASSERT_EQ(step.size(), 2u) << r.all_output();
    for (const auto& [rank, line] : step) {
      SCOPED_TRACE(failing[i].step + ", rank " + std::to_string(rank));
      EXPECT_EQ(line.second.rfind("error: ", 0), 0u) << line.second;
      for (const auto& e : failing[i].expected) EXPECT_CONTAINS(line.second, e);
      // Well under the 20 s communicator timeout: nobody waited for a rank that gave up.
      EXPECT_LT(line.first, 10000) << line.second;
    }
  }
  EXPECT_TRUE(temporaries(dir).empty()) << temporaries(dir)[0];
  EXPECT_TRUE(ck::verify(file).ok);
  expect_iter(file, 1);
}

}  // namespace

// ---------------------------------------------------------------- item 4

// A newline in the path once made rank 0 re-parse its temporary's name from text: for
// "D/run\n1.safetensors" it wrote, patched and renamed "D/.run" over the checkpoint (or
// removed it recursively when a directory). Now the path is refused before anything is
// touched, and the message shows it escaped.
TEST(SaveSafety, NewlineInThePathIsRefusedAndTheSiblingIsUntouched) {
  for (const bool full : {true, false}) {
    for (const bool sibling_is_dir : {false, true}) {
      const std::string d = temp_dir();
      const std::string sibling = d + "/.run";
      if (sibling_is_dir) {
        fs::create_directory(sibling);
        write_bytes(sibling + "/keep", "precious");
      } else {
        write_bytes(sibling, "precious");
      }
      const std::string path = d + "/run\n1.safetensors";
      const std::string e = error_of(
          [&] { ck::save(state_of(1000, 1), path, *solo(), {full ? ck::SaveMode::Full : ck::SaveMode::Sharded}); });
      EXPECT_CONTAINS(e, "control character");
      EXPECT_CONTAINS(e, d + "/run\\n1.safetensors");
      EXPECT_EQ(read_bytes(sibling_is_dir ? sibling + "/keep" : sibling), "precious") << (full ? "full" : "sharded");
      std::vector<std::string> names;
      for (const auto& f : fs::directory_iterator(d)) names.push_back(f.path().filename().string());
      EXPECT_EQ(names, std::vector<std::string>{".run"}) << "nothing else was created";
    }
  }
}

// Every entry point that takes a checkpoint or output path refuses control characters
// (bytes below 0x20 and 0x7f), naming the path escaped; other bytes (UTF-8) are fine.
TEST(SaveSafety, ControlCharactersAreRefusedAtEveryEntryPoint) {
  const std::string d = temp_dir();
  const std::string good = d + "/good";
  ck::save(state_of(10, 1), good, *solo());
  for (const std::string bad : {d + "/a\x01" "b", d + "/a\x7f" "b", d + "/a\tb", d + "/a\rb"}) {
    std::vector<std::string> errors;
    errors.push_back(error_of([&] { ck::save(state_of(10, 1), bad, *solo()); }));
    errors.push_back(error_of([&] { ck::save(state_of(10, 1), bad, *solo(), {ck::SaveMode::Full}); }));
    errors.push_back(error_of([&] { ck::save_async(state_of(10, 1), bad, solo()).wait(); }));
    errors.push_back(error_of([&] {
      auto sd = state_of(10, 0);
      ck::load(sd, bad, *solo());
    }));
    errors.push_back(error_of([&] { ck::consolidate(good, bad, false); }));
    errors.push_back(error_of([&] { ck::reshard(good, 2, bad, false); }));
    for (const auto& e : errors) {
      EXPECT_CONTAINS(e, "control character");
      EXPECT_CONTAINS(e, ck::escape_path(bad));
    }
    EXPECT_FALSE(ck::path_exists(bad));
  }
  EXPECT_EQ(ck::escape_path("a\nb\\c\x01\x7f"), "a\\nb\\\\c\\x01\\x7f");
  // Not control characters: saved and loaded as usual.
  const std::string utf8 = d + "/mod\xc3\xa8le \xe6\xa8\xa1\xe5\x9e\x8b.safetensors";
  ck::save(state_of(10, 3), utf8, *solo(), {ck::SaveMode::Full});
  auto sd = state_of(10, 0);
  ck::load(sd, utf8, *solo());
  EXPECT_EQ(sd.integer("step"), 3);
}

// A path is checked once, where it enters: CheckedPath::check is the only way to make
// one, and what takes one (the sibling helpers, the saves' phases, open_checkpoint) does
// not check it again. The refusal names the path escaped, with the wording of the
// layer it entered ("checkpoint path", "output path", "temporary path").
TEST(SaveSafety, CheckedPathIsCheckedOnceWhereItEnters) {
  const ck::CheckedPath ok = ck::CheckedPath::check("d/run-1.ckpt");
  EXPECT_EQ(ok.str(), "d/run-1.ckpt");
  const std::string& as_string = ok;  // reads as the string it holds
  EXPECT_EQ(&as_string, &ok.str());
  EXPECT_EQ(error_of([] { ck::CheckedPath::check("d/a\x01" "b"); }),
            "refusing the checkpoint path 'd/a\\x01b': it contains a control character ('\\x01' at byte 3); "
            "choose a name without one");
  EXPECT_EQ(error_of([] { ck::CheckedPath::check("o\nx", "output path"); }),
            "refusing the output path 'o\\nx': it contains a control character ('\\n' at byte 1); "
            "choose a name without one");
  // The sibling helpers' string forms check as before, each with its wording.
  EXPECT_CONTAINS(error_of([] { ck::temp_sibling("d/a\tb"); }), "refusing the checkpoint path 'd/a\\tb'");
  EXPECT_CONTAINS(error_of([] { ck::recover_siblings("d/a\tb"); }), "refusing the checkpoint path 'd/a\\tb'");
  EXPECT_CONTAINS(error_of([] { ck::remove_dead_temporaries("d/a\tb"); }), "refusing the output path 'd/a\\tb'");
  EXPECT_CONTAINS(error_of([] { ck::commit_rename("d/t\x7f", "d/a\tb"); }), "refusing the temporary path 'd/t\\x7f'");
  EXPECT_CONTAINS(error_of([] { ck::commit_rename("d/t", "d/a\tb"); }), "refusing the checkpoint path 'd/a\\tb'");
  // A checked destination's temporary is a checked path beside it.
  const std::string d = temp_dir();
  const ck::CheckedPath dest = ck::CheckedPath::check(d + "/ckpt");
  const ck::CheckedPath tmp = ck::temp_sibling(dest);
  EXPECT_EQ(ck::parent_dir(tmp), d);
  EXPECT_EQ(ck::base_name(tmp).rfind(".ckpt.tessera-tmp-", 0), 0u) << tmp.str();
  ck::make_dir(tmp);
  write_bytes(tmp.str() + "/x", "new");
  ck::commit_rename(tmp, dest);
  EXPECT_EQ(read_bytes(d + "/ckpt/x"), "new");
  // Refused once, at the entry, before any rank is involved: one refusal, not one per layer.
  const std::string bad = d + "/a\x01" "b";
  for (const bool full : {true, false}) {
    const std::string e =
        error_of([&] { ck::save(state_of(10, 1), bad, *solo(), {full ? ck::SaveMode::Full : ck::SaveMode::Sharded}); });
    EXPECT_EQ(e.rfind("refusing the checkpoint path '" + d + "/a\\x01b'", 0), 0u) << e;
    EXPECT_EQ(e.find("control character"), e.rfind("control character")) << e;
  }
}

// ---------------------------------------------------------------- item 5

// A rank that fails while writing its rows (the injected fault throws where a narrow, a
// copy or a thread start would) used to leave the other rank waiting in the next
// collective until the communicator's timeout, and the temporary file on disk. Rank 0
// failing with gathers still ahead (g is sharded on dim 1) keeps taking part in them, so
// rank 1 reaches the exchange where both learn the error.
TEST(SaveSafetyDist, WriteFailureOnOneRankFailsEveryRankFast) {
  expect_fails_everywhere({{"base:2:1:write", {"rank 1: test fault", "key 'a'"}},
                           {"base:2:0:write", {"rank 0: test fault", "key 'a'"}}});
}

// Failures of one rank before any writing: a dtype a safetensors file cannot hold, a
// shard with no data. Found before the first collective that needs every rank.
TEST(SaveSafetyDist, LocalErrorOnOneRankBeforeWritingFailsEveryRankFast) {
  expect_fails_everywhere({{"complex1:2", {"rank 1: ", "cannot be stored in a safetensors file"}},
                           {"meta1:2", {"rank 1: ", "key 'g'", "meta device"}}});
}

// ---------------------------------------------------------------- item 6

// Rank 1 lists b before a (same shapes): matched by position, its rows of b once went
// into a's place. Refused on every rank, naming the rank and the entry; nothing written.
TEST(SaveSafetyDist, RanksThatDisagreeOnTheEntriesAreRefused) {
  expect_fails_everywhere({{"swap:2",
                            {"rank 1 differs from rank 0", "entry 0 is 'a' (sharded Float [8, 3]", "on rank 0, 'b' (",
                             "on rank 1", "nothing was written"}}});
}

// A sharded save compares the ranks' structure (keys, order, kinds, dtypes, shapes and
// layouts), not their plain values: ranks that hold different ones (a per-rank metric;
// here the step too) save, and the checkpoint holds rank 0's, as a consolidated save
// does. Format 2's sharded save once compared a digest of the whole metadata text, plain
// values included, and refused such a save.
TEST(SaveSafetyDist, RanksWithDifferentPlainValuesSaveRankZerosValues) {
  const std::string dir = temp_dir();
  for (const std::string mode : {"sharded/", ""}) {
    const std::string path = dir + (mode.empty() ? "/c.safetensors" : "/c.ckpt");
    SCOPED_TRACE(path);
    auto r = run_ranks(2, {"save_safety", path, mode + "plain1:3"}, 60, {{"TESSERA_TEST_TIMEOUT_MS", "20000"}});
    EXPECT_EQ(r.launch.exit_code, 0) << r.all_output();
    const auto lines = save_lines(r);
    ASSERT_EQ(lines.size(), 1u) << r.all_output();
    ASSERT_EQ(lines.at(1).size(), 2u) << r.all_output();
    for (const auto& [rank, line] : lines.at(1)) EXPECT_EQ(line.second, "ok") << "rank " << rank;
    EXPECT_TRUE(ck::verify(path).ok);
    expect_iter(path, 3);  // step 3, rank 0's (rank 1's is 53)
    state::StateDict sd;
    sd.set("loss", 0.0);
    ck::LoadOptions lo;
    lo.strict = false;  // the tensors are expect_iter's
    ck::load_local(sd, path, lo);
    EXPECT_EQ(sd.number("loss"), 0.25) << "rank 0's loss";
  }
}

// Ranks that disagree on a shape are refused by a sharded save too, on every rank, naming
// the rank, the key and the save mode; nothing is written and the previous checkpoint
// stays.
TEST(SaveSafetyDist, ShardedSaveOfRanksThatDisagreeOnAShapeIsRefused) {
  expect_fails_everywhere({{"sharded/shape1:2",
                            {"rank 1 differs from rank 0", "entry 1 is 'b' (", "\"shape\":[8,3]", "on rank 0, 'b' (",
                             "\"shape\":[8,4]", "on rank 1", "A sharded save needs", "nothing was written"}}},
                          "sharded/base:1", "c.ckpt");
}

// ---------------------------------------------------------------- item 10

// A byte that changed after its writer's fsync (what an incoherent filesystem does to a
// shared page) is caught by the read-back before the rename, whichever rank wrote it:
// by the check of the pages writers share (the default on one host) and by the check
// of every byte (across hosts, or TESSERA_FULL_SAVE_READ_BACK=all).
TEST(SaveSafetyDist, CorruptedWriteIsCaughtBeforeTheCommit) {
  expect_fails_everywhere(
      {{"base:2:1:flip", {"rank 0: read-back of", "written by rank 1", "file bytes 648..696 (key 'a' bytes 48..96)"}},
       {"base:2:0:flip", {"rank 1: read-back of", "written by rank 0", "(key 'a' bytes 0..48)"}},
       {"base:2:1:flip+all", {"rank 0: read-back of", "written by rank 1", "(key 'a' bytes 48..96)"}},
       {"base:2:1:flip+bogus", {"TESSERA_FULL_SAVE_READ_BACK='bogus': expected 'all' or 'edges'"}}});
}

// RunWriter records, for each run it writes (bytes without a gap, across tensors and
// writes of any size), the checksums of the run's bytes in its first and last page; the
// read-back checks them against the file and names the key of a range that differs.
TEST(SaveSafety, RunWriterRecordsTheEdgePagesOfEachRunAndTheReadBackChecksThem) {
  const uint64_t page = ck::io_page_size();
  const std::string file = temp_dir() + "/f";
  // Two tensors: t0 at 100 (5 pages), t1 right after it (3 pages).
  const uint64_t t0 = 100, n0 = 5 * page, t1 = t0 + n0, n1 = 3 * page;
  {
    ck::File f(file, "w");
    f.resize(t1 + n1 + 50);
  }
  auto bytes = [](uint64_t n, int seed) { return at::arange(int64_t(n), at::kInt).remainder(251).add(seed).to(at::kByte); };
  struct W {
    size_t ti;
    uint64_t off, n;
  };
  // Run A: t0[0, 10) + t0[10, 10 + page + 7) + t0[.., +3) (writes shorter than a page go on
  // with the run); run B: t0[2 page + 5, end) + t1[0, 20) (a run across two tensors); run
  // C: t1[page + 1, +2) (inside one page).
  const std::vector<W> writes = {{0, 0, 10},        {0, 10, page + 7},    {0, page + 17, 3},
                                 {0, 2 * page + 5, n0 - 2 * page - 5},     {1, 0, 20}, {1, page + 1, 2}};
  std::vector<std::pair<uint64_t, uint64_t>> runs;  // expected [start, end)
  {
    ck::RunWriter w(file, {{t0, n0}, {t1, n1}});
    int seed = 0;
    for (const auto& x : writes) {
      w.write(x.ti, x.off, bytes(x.n, seed++));
      const uint64_t at = (x.ti == 0 ? t0 : t1) + x.off;
      if (!runs.empty() && runs.back().second == at) runs.back().second += x.n;
      else runs.emplace_back(at, at + x.n);
    }
    w.finish();
    std::vector<ck::WrittenRange> want;
    for (const auto& [s, e] : runs) {
      const uint64_t head_end = std::min(e, (s / page + 1) * page), tail_at = std::max(s, (e - 1) / page * page);
      want.push_back({s, head_end - s, 0});
      if (tail_at != s) want.push_back({tail_at, e - tail_at, 0});
    }
    ASSERT_EQ(w.edges().size(), want.size());
    const std::string content = read_bytes(file);
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(w.edges()[i].at, want[i].at) << i;
      EXPECT_EQ(w.edges()[i].len, want[i].len) << i;
      EXPECT_EQ(w.edges()[i].crc, ck::crc32c(content.data() + want[i].at, want[i].len)) << i;
    }
    const std::vector<std::pair<uint64_t, std::string>> keys = {{t0, "t0"}, {t1, "t1"}};
    const auto all = ck::piece_ranges(w.pieces(), {t0, t1});
    ck::verify_read_back(file, w.edges(), keys, "rank 3");
    ck::verify_read_back(file, all, keys, "rank 3");
    // A byte of run B's last page (in t1) changes: both checks name it.
    ck::flip_byte(file, t1 + 5);
    for (const auto& ranges : {w.edges(), all}) {
      const std::string e = error_of([&] { ck::verify_read_back(file, ranges, keys, "rank 3"); });
      EXPECT_CONTAINS(e, "read-back of '" + file + "' before the commit");
      EXPECT_CONTAINS(e, "key 't1' bytes 0..");
      EXPECT_CONTAINS(e, "written by rank 3");
    }
  }
}

// The steps' messages between ranks carry any bytes, with lengths; a truncated one is an
// error, not a read past its end.
TEST(SaveSafety, PackedFieldsRoundTripAndTruncationIsAnError) {
  const std::string nl = std::string("/d/run\n1.safetensors\0x", 22);
  const std::string b = ck::Packer().str(nl).u64(42).str("").bytes();
  ck::Unpacker in(b, "test bytes");
  EXPECT_EQ(in.str(), nl);
  EXPECT_EQ(in.u64(), 42u);
  EXPECT_EQ(in.str(), "");
  EXPECT_TRUE(in.done());
  const std::string cut = b.substr(0, 10);
  ck::Unpacker in2(cut, "test bytes");
  EXPECT_CONTAINS(error_of([&] { in2.str(); }), "test bytes is truncated");
}

TEST(SaveSafety, PageSizeIsTheSystems) {
  const long ps = ::sysconf(_SC_PAGESIZE);
  ASSERT_GT(ps, 0);
  EXPECT_EQ(ck::io_page_size(), std::max<uint64_t>(4096, static_cast<uint64_t>(ps)));
}

// With 64 KiB pages (as on some arm64 kernels) the pages two writers share are larger;
// the every-rank-writes save still produces the exact file.
TEST(SaveSafetyDist, SixtyFourKiBPagesWriteTheExactFile) {
  const std::string file = temp_dir() + "/big.safetensors";
  auto s = run_ranks(2, {"ckpt_full_big", file}, 120,
                     {{"TESSERA_TEST_IO_PAGE_SIZE", "65536"}, {"TESSERA_LOG_LEVEL", "debug"}});
  ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
  EXPECT_CONTAINS(s.all_output(), "(every rank writes)");
  EXPECT_TRUE(ck::verify(file).ok);
}

TEST(SaveSafety, IncoherentFilesystemsAreKnown) {
  EXPECT_STREQ(ck::incoherent_fs_name(0x6969), "NFS");
  EXPECT_STREQ(ck::incoherent_fs_name(0x65735546), "FUSE");
  EXPECT_STREQ(ck::incoherent_fs_name(0xFF534D42), "CIFS");
  EXPECT_EQ(ck::incoherent_fs_name(0xEF53), nullptr);      // ext4
  EXPECT_EQ(ck::incoherent_fs_name(0x01021994), nullptr);  // tmpfs
  EXPECT_EQ(ck::incoherent_fs_name(0x58465342), nullptr);  // XFS
  EXPECT_EQ(ck::shared_writes_refusal(temp_dir()), "") << "the tests' /tmp is local";
}

// On NFS (here: what statfs reports, replaced for the test) every rank but rank 0 stays
// out of the writing: rank 0 gathers and writes everything.
TEST(SaveSafetyDist, NfsFallsBackToOneWriter) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/c.safetensors";
  auto s = run_ranks(2, {"save_safety", file, "base:4"}, 60,
                     {{"TESSERA_TEST_FS_TYPE", "0x6969"}, {"TESSERA_LOG_LEVEL", "debug"}});
  ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
  EXPECT_CONTAINS(s.all_output(), "(rank 0 writes)");
  EXPECT_CONTAINS(s.all_output(), "is on NFS (statfs type 0x6969)");
  expect_iter(file, 4);
}
