// The restricted unpickler against hostile files (issue 35, items 3, 12 and 13): pickles
// nested a million deep, memo references that double a value 60 times, lists that hold
// themselves, millions of Nones, and tensor views whose storage offset, stride or storage
// size overflow 64-bit arithmetic. Each is refused with an error naming the file and the
// limit, in bounded memory, and never crashes; the crash-prone ones go through the real
// `tessera` binary so that a regression shows as a signal, not as a dead test binary.
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <memory>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "support/child_process.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/offline/dcp_import.h"
#include "tessera/checkpoint/interop/pickle_reader.h"
#include "tessera/checkpoint/interop/torch_file.h"
#include "tessera/checkpoint/storage/file.h"

extern char** environ;

using tessera::testing::error_of;
using tessera::testing::Measured;
using tessera::testing::run_measured;
using tessera::testing::run_command;
using tessera::testing::temp_dir;
using tessera::testing::write_bytes;
namespace ck = tessera::checkpoint;
namespace pk = tessera::checkpoint::pickle;

namespace {

// ---- writing pickles and torch.save archives by hand

std::string le(uint64_t v, int n) {
  std::string s;
  for (int k = 0; k < n; ++k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
  return s;
}
std::string str(const std::string& s) { return "X" + le(s.size(), 4) + s; }
std::string i64(int64_t v) { return "\x8a\x08" + le(static_cast<uint64_t>(v), 8); }
std::string glob(const std::string& mod, const std::string& name) { return "c" + mod + "\n" + name + "\n"; }
std::string put(uint32_t k) { return "r" + le(k, 4); }  // LONG_BINPUT
std::string get(uint32_t k) { return "j" + le(k, 4); }  // LONG_BINGET
std::string tuple_of(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (auto x : v) s += i64(x);
  return s + "t";
}

// torch.save's pickle of a tensor over storage record data/0 of `storage_numel`
// elements of `storage_class`, with the view's geometry as given.
std::string tensor_pickle(const std::string& storage_class, int64_t storage_numel, int64_t offset,
                          const std::vector<int64_t>& size, const std::vector<int64_t>& stride) {
  return glob("torch._utils", "_rebuild_tensor_v2") + "((" + str("storage") + glob("torch", storage_class) +
         str("0") + str("cpu") + i64(storage_numel) + "tQ" + i64(offset) + tuple_of(size) + tuple_of(stride) +
         "\x89" + glob("collections", "OrderedDict") + ")RtR";
}

// A torch.save archive (zip) of `pkl` and its storage records, as bytes.
std::string archive(const std::string& pkl, const std::vector<std::pair<std::string, std::string>>& records = {}) {
  std::string out;
  {
    caffe2::serialize::PyTorchStreamWriter w([&](const void* p, size_t n) {
      out.append(static_cast<const char*>(p), n);
      return n;
    });
    w.writeRecord("data.pkl", pkl.data(), pkl.size());
    for (const auto& [name, bytes] : records) w.writeRecord(name, bytes.data(), bytes.size());
    w.writeRecord("byteorder", "little", 6);
    w.writeEndOfFile();
  }
  return out;
}

std::string write_pt(const std::string& path, const std::string& pkl,
                     const std::vector<std::pair<std::string, std::string>>& records = {}) {
  write_bytes(path, archive(pkl, records));
  return path;
}

// A list nested `levels` deep: `]` x levels, `a` x (levels - 1).
std::string deep_list(size_t levels) {
  return "\x80\x02" + std::string(levels, ']') + std::string(levels - 1, 'a') + ".";
}

// L[0] = 1; L[k] = {"a": L[k-1], "b": L[k-1]} through the memo; the state dict {"x": L[n]}:
// a few bytes per level, 2^n leaves.
std::string doubling_dicts(int n) {
  std::string p = "\x80\x02}" + str("x") + "K\x01" + put(0) + "0";
  for (int k = 1; k <= n; ++k) p += "}(" + str("a") + get(k - 1) + str("b") + get(k - 1) + "u" + put(k) + "0";
  return p + get(n) + "s.";
}

// The same with lists: L[k] = [L[k-1], L[k-1]].
std::string doubling_lists(int n) {
  std::string p = "\x80\x02}" + str("x") + "]" + put(0) + "0";
  for (int k = 1; k <= n; ++k) p += "](" + get(k - 1) + get(k - 1) + "e" + put(k) + "0";
  return p + get(n) + "s.";
}

// The 4-element storage record of the heap-offset files (issue 35 item 12).
const std::string kFourFloats(16, '\0');
constexpr int64_t kHeapOffset = INT64_MAX - 99998;  // 2^63 - 99999

// The state dict {"w": tensor} with that geometry over a 4-float storage.
std::string leak_pt(const std::string& path, int64_t offset, const std::vector<int64_t>& size,
                    const std::vector<int64_t>& stride, const std::string& storage_class = "FloatStorage",
                    int64_t storage_numel = 4) {
  return write_pt(path, "\x80\x02}(" + str("w") + tensor_pickle(storage_class, storage_numel, offset, size, stride) + "u.",
                  {{"data/0", kFourFloats}});
}

// ---- the real binary

using tessera::testing::CliRun;
using tessera::testing::run_cli;

// An input error or a refusal (exit 1 or 2) with a message, never a signal or success.
#define EXPECT_REFUSED(run, ...)                                                               \
  do {                                                                                        \
    const CliRun& r_ = (run);                                                                    \
    EXPECT_TRUE(r_.code == 1 || r_.code == 2) << "exit " << r_.code << "\n" << r_.out;       \
    for (const std::string& part_ : std::vector<std::string>{__VA_ARGS__}) EXPECT_CONTAINS(r_.out, part_); \
  } while (0)

// Runs the binary with `args` and returns its peak resident set in MiB (wait4's rusage of
// that child alone); its output goes to the file `log`.
long peak_rss_mib(const std::vector<std::string>& args, const std::string& log, int* status) {
  std::vector<std::string> argv{TESSERA_CLI};
  argv.insert(argv.end(), args.begin(), args.end());
  const Measured m = run_measured(argv, log, log);
  if (m.status < 0) return -1;
  *status = m.wait_status;
  return m.maxrss_kb / 1024;
}

}  // namespace

// ---- item 3 / 13: nesting

// 200,000 and 1,000,000 levels: the unfixed reader died with SIGSEGV (a recursive
// destructor) in `inspect` and in `import-dcp`; now a clean error naming file and limit.
TEST(PickleHardening, DeepListIsRefusedByTheCli) {
  const std::string dir = temp_dir("tessera-pickle");
  for (size_t levels : {200000u, 1000000u}) {
    const std::string pt = write_pt(dir + "/deep" + std::to_string(levels) + ".pt", deep_list(levels));
    EXPECT_REFUSED(run_cli({"ckpt", "inspect", pt}), pt, "nest deeper than 1000 levels");
  }
  // The same as DCP's .metadata.
  ck::make_dir(dir + "/dcp");
  write_bytes(dir + "/dcp/.metadata", deep_list(1000000));
  write_bytes(dir + "/dcp/__0_0.distcp", "");
  EXPECT_REFUSED(run_cli({"ckpt", "import-dcp", dir + "/dcp", "-o", dir + "/out"}), dir + "/dcp/.metadata",
                 "nest deeper than 1000 levels");
  EXPECT_FALSE(ck::path_exists(dir + "/out"));
}

TEST(PickleHardening, DepthLimitIsExactAndSeesContainersFilledLater) {
  const std::set<std::string> none;
  // 1000 levels (the innermost list empty) read; 1002 are refused while building.
  EXPECT_EQ(pk::unpickle("ok", deep_list(1000), none)->kind, pk::Py::List);
  EXPECT_CONTAINS(error_of([&] { pk::unpickle("'deep.pkl'", deep_list(5000), none); }), "'deep.pkl'");
  EXPECT_CONTAINS(error_of([&] { pk::unpickle("'deep.pkl'", deep_list(1002), none); }), "deeper than 1000");
  // 3000 empty lists in the memo, then each put into the one before it: every APPEND sees an
  // empty list, so only the check of the finished graph sees 3000 levels.
  std::string p = "\x80\x02";
  for (uint32_t k = 0; k < 3000; ++k) p += "]" + put(k) + "0";
  for (uint32_t k = 0; k + 1 < 3000; ++k) p += get(k) + get(k + 1) + "a0";
  p += get(0) + ".";
  EXPECT_CONTAINS(error_of([&] { pk::unpickle("'late.pkl'", p, none); }), "'late.pkl'");
  EXPECT_CONTAINS(error_of([&] { pk::unpickle("'late.pkl'", p, none); }), "nest deeper than 1000 levels");
}

// A list that holds itself: refused (the unfixed reader returned it and leaked it), and
// nothing leaks after an error either. The persistent-id callback sees the tuple that
// closes the cycle, so the test can watch it being freed.
TEST(PickleHardening, SelfReferenceIsRefusedAndFreed) {
  const std::set<std::string> none;
  EXPECT_CONTAINS(error_of([&] { pk::unpickle("'self.pkl'", std::string("\x80\x02]q\x00h\x00" "a.", 9), none); }),
                  "contains itself");
  // L = []; T = (L,); persistent(T); L.append(T) -> L -> T -> L; then STOP, or a truncation.
  const std::string cycle = std::string("\x80\x02]") + put(0) + "(" + get(0) + "t" + put(1) + "Q0" + get(1) + "a";
  for (const std::string& tail : {std::string("."), std::string("N")}) {
    std::weak_ptr<pk::Py> seen;
    bool reached = false;
    const std::string why = error_of([&] {
      pk::unpickle("'cycle.pkl'", cycle + tail, none, [&](const pk::PyPtr& pid) {
        seen = pid;
        reached = true;
        return pk::make(pk::Py::None);
      });
    });
    EXPECT_CONTAINS(why, "'cycle.pkl'");
    EXPECT_TRUE(reached);
    EXPECT_TRUE(seen.expired()) << "the cycle leaked (" << why << ")";
  }
}

// ---- item 3 / 13: amplification through the memo

// 60 doubled dicts or lists (2^60 leaves in ~1.5 KB): the unfixed walk never ended, RSS
// growing; now `inspect` and the import refuse them, naming the file.
TEST(PickleHardening, MemoDoublingIsRefused) {
  const std::string dir = temp_dir("tessera-pickle");
  const std::string dicts = write_pt(dir + "/dicts.pt", doubling_dicts(60));
  const std::string lists = write_pt(dir + "/lists.pt", doubling_lists(60));
  for (const std::string& pt : {dicts, lists}) {
    const std::string why = error_of([&] { ck::import_torch_file(pt); });
    EXPECT_CONTAINS(why, pt);
    EXPECT_CONTAINS(why, "refused as an amplification");
  }
  EXPECT_REFUSED(run_cli({"ckpt", "inspect", dicts}), dicts, "amplification");
  // Sharing that does not multiply much still reads: a dict put under two keys.
  const std::string twice = write_pt(dir + "/twice.pt", doubling_dicts(3));
  EXPECT_EQ(ck::import_torch_file(twice).keys.size(), 8u);
}

// The unpickler's memory follows the input: 5 MB of `N` (None) as DCP .metadata cost 1 GB
// in the unfixed reader (one object per None); now Nones are one object and the rest is
// bounded by the budget. Peak RSS of the real binary, against the same binary on a tiny file.
TEST(PickleHardening, MillionsOfNonesStayWithinTheBudget) {
  const std::string dir = temp_dir("tessera-pickle");
  ck::make_dir(dir + "/small");
  ck::make_dir(dir + "/nones");
  write_bytes(dir + "/small/.metadata", "\x80\x02N");
  write_bytes(dir + "/nones/.metadata", "\x80\x02" + std::string(5u << 20, 'N') + ".");
  int st = 0;
  const long base = peak_rss_mib({"ckpt", "import-dcp", dir + "/small", "-o", dir + "/o1"}, dir + "/log1", &st);
  ASSERT_GE(base, 0);
  const long nones = peak_rss_mib({"ckpt", "import-dcp", dir + "/nones", "-o", dir + "/o2"}, dir + "/log2", &st);
  const std::string log = tessera::testing::read_bytes(dir + "/log2");
  ASSERT_TRUE(WIFEXITED(st)) << "signal " << WTERMSIG(st) << "\n" << log;
  EXPECT_TRUE(WEXITSTATUS(st) == 1 || WEXITSTATUS(st) == 2) << log;
  EXPECT_CONTAINS(log, dir + "/nones/.metadata");
  EXPECT_LT(nones - base, 600) << "peak RSS " << nones << " MiB, " << base << " MiB on a tiny file";
  // A pickle that builds more than its budget: 600,000 empty lists (`]`).
  const std::string lists = "\x80\x02" + std::string(600000, ']') + ".";
  const std::string why = error_of([&] { pk::unpickle("'lists.pkl'", lists, {}); });
  EXPECT_CONTAINS(why, "'lists.pkl'");
  EXPECT_CONTAINS(why, "bytes per byte of input");
}

// ---- item 12: tensor views outside their storage

// storage_offset 2^63 - 99999 on a 4-element record: offset + extent overflowed, and the
// unfixed export wrote 800,000 bytes of heap into a file that then verified.
TEST(PickleHardening, HeapOffsetIsRefusedByImportAndExport) {
  const std::string dir = temp_dir("tessera-pickle");
  const std::string leak = leak_pt(dir + "/leak.pt", kHeapOffset, {200000}, {1});
  EXPECT_CONTAINS(error_of([&] { ck::import_torch_file(leak); }), leak);
  EXPECT_CONTAINS(error_of([&] { ck::import_torch_file(leak); }), "storage offset 9223372036854675809");
  const std::string out = dir + "/leak.safetensors";
  EXPECT_REFUSED(run_cli({"ckpt", "export", leak, "--format", "safetensors", "-o", out}), leak, "overflows");
  EXPECT_FALSE(ck::path_exists(out));

  // The other overflows: a stride whose extent wraps (the unfixed reader: SIGSEGV), a
  // storage whose byte size wraps (2^61 doubles "fit" in 8 bytes), an offset just past the end.
  struct Case {
    std::string name;
    int64_t offset;
    std::vector<int64_t> size, stride;
    std::string storage;
    int64_t numel;
    std::string why;
  };
  const std::vector<Case> cases = {
      {"stride", 0, {3}, {int64_t{1} << 62}, "FloatStorage", 4, "extent overflows"},
      {"numel", 1000, {1}, {1}, "DoubleStorage", int64_t{1} << 61, "too few for the 2305843009213693952 elements"},
      {"past", 3, {2}, {1}, "FloatStorage", 4, "reaches past its storage"},
      {"huge", 0, {int64_t{1} << 32, int64_t{1} << 32}, {0, 0}, "FloatStorage", 4, "element count overflows"},
  };
  for (const auto& c : cases) {
    const std::string pt = leak_pt(dir + "/" + c.name + ".pt", c.offset, c.size, c.stride, c.storage, c.numel);
    EXPECT_CONTAINS(error_of([&] { ck::import_torch_file(pt); }), pt);
    EXPECT_CONTAINS(error_of([&] { ck::import_torch_file(pt); }), c.why);
    if (c.name == "stride")  // the SIGSEGV one
      EXPECT_REFUSED(run_cli({"ckpt", "export", pt, "--format", "safetensors", "-o", dir + "/s.safetensors"}), pt, c.why);
  }
  // A state dict with a proper view still reads (offset 1, [2] over 4 floats).
  EXPECT_EQ(ck::import_torch_file(leak_pt(dir + "/fine.pt", 1, {2}, {1})).keys.size(), 1u);
}

namespace {

// A DCP checkpoint by hand: .metadata of one float tensor "w" of shape [n] in one chunk,
// stored as item [0, item.size()) of __0_0.distcp.
std::string obj(const std::string& mod, const std::string& name, const std::string& state) {
  return glob(mod, name) + ")\x81" + state + "b";
}
std::string info_of(uint64_t offset, uint64_t length) {
  return obj("torch.distributed.checkpoint.filesystem", "_StorageInfo",
             "}(" + str("relative_path") + str("__0_0.distcp") + str("offset") + i64(static_cast<int64_t>(offset)) +
                 str("length") + i64(static_cast<int64_t>(length)) + "u");
}
// .metadata of one plain value "v" (BytesStorageMetadata) stored as item [0, length).
std::string dcp_value_metadata(uint64_t length) {
  const std::string m = "torch.distributed.checkpoint.metadata";
  const std::string index =
      obj(m, "MetadataIndex", "}(" + str("fqn") + str("v") + str("offset") + "N" + str("index") + i64(0) + "u");
  return "\x80\x02" + obj(m, "Metadata", "}(" + str("state_dict_metadata") + "}" + str("v") +
                                             obj(m, "BytesStorageMetadata", "}") + "s" + str("storage_data") + "}" +
                                             index + info_of(0, length) + "s" + "u") + ".";
}
std::string dcp_metadata(int64_t n, uint64_t length) {
  const std::string m = "torch.distributed.checkpoint.metadata";
  const std::string props = obj(m, "TensorProperties",
                                "(" + glob("torch", "float32") + glob("torch", "strided") + "\x89" + "N" + "\x89" + "t");
  const std::string chunk = obj(m, "ChunkStorageMetadata", "}(" + str("offsets") + tuple_of({0}) + str("sizes") +
                                                               tuple_of({n}) + "u");
  const std::string tsm = obj(m, "TensorStorageMetadata", "}(" + str("properties") + props + str("size") +
                                                              tuple_of({n}) + str("chunks") + "]" + chunk + "au");
  const std::string index =
      obj(m, "MetadataIndex", "}(" + str("fqn") + str("w") + str("offset") + tuple_of({0}) + str("index") + i64(0) + "u");
  const std::string info = obj("torch.distributed.checkpoint.filesystem", "_StorageInfo",
                               "}(" + str("relative_path") + str("__0_0.distcp") + str("offset") + i64(0) +
                                   str("length") + i64(static_cast<int64_t>(length)) + "u");
  return "\x80\x02" + obj(m, "Metadata", "}(" + str("state_dict_metadata") + "}" + str("w") + tsm + "s" +
                                             str("storage_data") + "}" + index + info + "s" + "u") + ".";
}

}  // namespace

// The same item inside a .distcp file: the unfixed import-dcp copied heap bytes into a
// checkpoint that verified. Refused, naming the data file; nothing is written.
TEST(PickleHardening, HeapOffsetInDcpItemIsRefused) {
  const std::string dir = temp_dir("tessera-pickle");
  const int64_t n = 200000;
  const std::string item =
      archive("\x80\x02" + tensor_pickle("FloatStorage", 4, kHeapOffset, {n}, {1}) + ".", {{"data/0", kFourFloats}});
  ck::make_dir(dir + "/dcp");
  write_bytes(dir + "/dcp/.metadata", dcp_metadata(n, item.size()));
  write_bytes(dir + "/dcp/__0_0.distcp", item);
  const std::string why = error_of([&] { ck::import_dcp(dir + "/dcp", dir + "/in-process", false); });
  EXPECT_CONTAINS(why, dir + "/dcp/__0_0.distcp");
  EXPECT_CONTAINS(why, "overflows");
  EXPECT_REFUSED(run_cli({"ckpt", "import-dcp", dir + "/dcp", "-o", dir + "/out"}), dir + "/dcp/__0_0.distcp", "overflows");
  EXPECT_FALSE(ck::path_exists(dir + "/out"));
  EXPECT_FALSE(ck::path_exists(dir + "/in-process"));

  // The same directory with an honest item imports: the hand-written metadata is right.
  const std::string good = archive("\x80\x02" + tensor_pickle("FloatStorage", 4, 0, {4}, {1}) + ".",
                                   {{"data/0", kFourFloats}});
  ck::make_dir(dir + "/good");
  write_bytes(dir + "/good/.metadata", dcp_metadata(4, good.size()));
  write_bytes(dir + "/good/__0_0.distcp", good);
  const CliRun ok = run_cli({"ckpt", "import-dcp", dir + "/good", "-o", dir + "/good-out"});
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// A plain value of 60 doubled lists as a .distcp item (the unfixed import-dcp reached 7.8 GB
// in 20 s walking it): refused as an amplification, naming the data file and the key.
TEST(PickleHardening, DoublingValueInDcpItemIsRefused) {
  const std::string dir = temp_dir("tessera-pickle");
  const std::string item = archive(doubling_lists(60));
  ck::make_dir(dir + "/dcp");
  write_bytes(dir + "/dcp/.metadata", dcp_value_metadata(item.size()));
  write_bytes(dir + "/dcp/__0_0.distcp", item);
  const std::string why = error_of([&] { ck::import_dcp(dir + "/dcp", dir + "/out", false); });
  EXPECT_CONTAINS(why, dir + "/dcp/__0_0.distcp");
  EXPECT_CONTAINS(why, "'v'");
  EXPECT_CONTAINS(why, "refused as an amplification");
  EXPECT_FALSE(ck::path_exists(dir + "/out"));
}
