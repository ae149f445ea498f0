// Issue 35, items 7 and 17: the files under a reader.
//  - 7: a reader that read a data file's header keeps reading that file (its inode), even
//    when a commit renames a new checkpoint over the path meanwhile; O_DIRECT reads used to
//    reopen the path and check the new bytes against the old checksums ("corrupt").
//  - 17: a checkpoint with more data files than the open-file limit verifies and loads (a
//    bounded number of descriptors); running out of descriptors is a ResourceError naming
//    RLIMIT_NOFILE, never "CORRUPT".
#include <ATen/ATen.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/sharding/sharded_tensor.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

const std::string kCli = TESSERA_CLI;

// The soft RLIMIT_NOFILE set to `soft` for the scope (the hard limit is kept).
struct FdLimit {
  rlimit old{};
  explicit FdLimit(rlim_t soft) {
    ::getrlimit(RLIMIT_NOFILE, &old);
    rlimit n = old;
    n.rlim_cur = soft;
    EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &n), 0);
  }
  ~FdLimit() { ::setrlimit(RLIMIT_NOFILE, &old); }
};

// The highest descriptor this process has open.
int highest_open_fd() {
  int high = 2;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') high = std::max(high, std::atoi(e->d_name));
    ::closedir(d);
  }
  return high;
}

// A sharded checkpoint of "w" = 0..n-1 (split in two) and "step", resharded to `ranks`
// ranks: `ranks` data files.
std::string many_files(const std::string& d, int ranks, int64_t n) {
  std::vector<sharding::ShardMetadata> shards;
  std::vector<sharding::Shard> local;
  const at::Tensor full = at::arange(n, at::kFloat);
  for (int i = 0; i < 2; ++i) {
    sharding::ShardMetadata m{sharding::chunk_box({n}, 0, 2, i), {0, c10::kCPU}};
    shards.push_back(m);
    local.push_back({sharding::narrow_to(full, sharding::full_box({n}), m.box).clone(), m});
  }
  state::StateDict sd;
  sd.set("w", sharding::ShardedTensor::from_parts(local, shards, {n}, at::kFloat, solo()));
  sd.set("step", int64_t(7));
  ck::save(sd, d + "/src", *solo(), {ck::SaveMode::Sharded});
  ck::reshard(d + "/src", ranks, d + "/many", false);
  return d + "/many";
}

}  // namespace

// Item 7.
TEST(FormatFiles, ReadsStayOnTheFileWhoseHeaderWasRead) {
  const std::string d = temp_dir("format-pin");
  const int64_t n = 1 << 20;  // 4 MiB: read with O_DIRECT (DirectReader::kMinBytes and more)
  for (const auto& [name, v] : {std::pair<std::string, double>{"ckpt", 1.0}, {"new", 2.0}}) {
    state::StateDict sd;
    sd.set("w", at::full({n}, v, at::kFloat));
    ck::save(sd, d + "/" + name, *solo(), {ck::SaveMode::Sharded});
  }
  const ck::CheckpointMetadata m = ck::open_checkpoint(d + "/ckpt");
  const auto& e = m.entries.at("w");
  ck::ChunkReader r(m);
  const std::vector<ck::ChunkInfo> chunks = r.chunks("w", e, sharding::full_box(e.shape));  // the header is read here
  const ck::File& f = r.reader(chunks.at(0).file).file();
  ck::DirectReader probe;
  if (!probe.direct(f)) GTEST_SKIP() << "O_DIRECT is refused under " << d << ": reads go through the pinned file";
  // A commit of a new checkpoint at the same path (the directories exchanged).
  fs::rename(d + "/ckpt", d + "/old");
  fs::rename(d + "/new", d + "/ckpt");
  at::Tensor t;
  ASSERT_NO_THROW(t = r.read_box("w", e, sharding::full_box(e.shape)));
  EXPECT_TRUE(at::equal(t, at::full({n}, 1.0, at::kFloat))) << "read the new file's bytes";
  EXPECT_NO_THROW(r.verify_chunk("w", e, chunks.at(0)));
  // A reader that closed its descriptor (too many files open) does not reopen another file.
  ck::SafetensorsReader sr(d + "/ckpt/" + chunks.at(0).file);
  sr.close_file();
  fs::rename(d + "/ckpt", d + "/newer");
  fs::rename(d + "/old", d + "/ckpt");
  EXPECT_CONTAINS(error_of([&] { sr.file(); }), "was replaced by another file after its header was read");
}

// Item 17: more data files than the open-file limit allows at once.
TEST(FormatFiles, CheckpointsWithMoreFilesThanTheDescriptorLimitVerifyAndLoad) {
  const std::string d = temp_dir("format-fds");
  const int ranks = 200;
  const std::string many = many_files(d, ranks, 2 * ranks);
  // The CLI under `ulimit -n 64`: OK, exit 0 (was "CORRUPT ... Too many open files", exit 1).
  auto [rc, out] = run_command("ulimit -n 64 && " + kCli + " ckpt verify " + many);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_CONTAINS(out, "OK: " + many);
  // A load in this process with 24 descriptors to spare.
  {
    FdLimit limit(static_cast<rlim_t>(highest_open_fd() + 1 + 24));
    state::StateDict t;
    t.set("w", at::zeros({2 * ranks}, at::kFloat));
    t.set("step", int64_t(0));
    ASSERT_NO_THROW(ck::load_local(t, many));
    EXPECT_TRUE(at::equal(t.tensor("w"), at::arange(2 * ranks, at::kFloat)));
    const ck::VerifyReport v = ck::verify(many);
    EXPECT_TRUE(v.ok) << (v.problems.empty() ? "" : v.problems.front());
  }
  // No descriptor left at all: an error naming the limit, not a corrupt checkpoint.
  std::string msg = "(no error)";
  bool resource = false;
  std::vector<int> filled;
  {
    FdLimit limit(static_cast<rlim_t>(highest_open_fd() + 1));
    for (int fd; (fd = ::dup(0)) >= 0;) filled.push_back(fd);  // every free slot below the limit
    try {
      ck::verify(many);
    } catch (const ck::ResourceError& e) {
      resource = true;
      msg = e.what();
    } catch (const std::exception& e) {
      msg = e.what();
    }
    for (int fd : filled) ::close(fd);
  }
  EXPECT_TRUE(resource) << msg;
  EXPECT_CONTAINS(msg, "RLIMIT_NOFILE");
  EXPECT_CONTAINS(msg, "not a fault of the checkpoint");
}
