// safetensors reader/writer, CRC32C and the file-level helpers of the checkpoint layer.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <fstream>
#include <tuple>

#include "support/test_util.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/stream_writer.h"
#include "tessera/core/error.h"

using namespace tessera;
using namespace tessera::checkpoint;
using namespace tessera::core;

using namespace tessera::testing;

namespace {



// A safetensors file from a header JSON text and a data section.
std::string make_file(const std::string& header, const std::string& data) {
  std::string s(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i, n >>= 8) s[i] = static_cast<char>(n & 0xff);
  return s + header + data;
}


}  // namespace

TEST(Crc32c, KnownVectorsAndBothImplementationsAgree) {
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8a9136aau);  // RFC 3720 B.4
  std::string ones(32, '\xff');
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62a8ab43u);
  std::string data(100003, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  for (size_t off : {0, 1, 3, 7}) {
    for (size_t n : {0, 1, 5, 8, 9, 63, 1000, 99990}) {
      EXPECT_EQ(crc32c(data.data() + off, n), crc32c_extend_portable(0, data.data() + off, n)) << off << " " << n;
    }
  }
  // Long inputs take the three-stream path of the hardware implementation (rounds of
  // 3 x 4 KiB joined by shift tables): lengths around round boundaries, odd starts.
  std::string big(3 * 3 * 4096 + 4096 + 13, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 40503u) >> 7);
  for (size_t off : {0, 5}) {
    for (size_t n : {size_t{3 * 4096 - 1}, size_t{3 * 4096}, size_t{3 * 4096 + 8}, size_t{6 * 4096 + 3},
                     big.size() - off}) {
      EXPECT_EQ(crc32c(big.data() + off, n), crc32c_extend_portable(0, big.data() + off, n)) << off << " " << n;
      EXPECT_EQ(crc32c_extend(0x12345678u, big.data() + off, n), crc32c_extend_portable(0x12345678u, big.data() + off, n))
          << "extended, " << off << " " << n;
    }
  }
  // Extending in pieces equals one pass.
  uint32_t c = crc32c_extend(0, data.data(), 777);
  c = crc32c_extend(c, data.data() + 777, data.size() - 777);
  EXPECT_EQ(c, crc32c(data.data(), data.size()));
  // Combining the checksums of two parts equals one pass, at every split (an empty part included).
  for (size_t split : {size_t{0}, size_t{1}, size_t{777}, size_t{4096}, data.size() - 1, data.size()}) {
    const uint32_t a = crc32c(data.data(), split), b = crc32c(data.data() + split, data.size() - split);
    EXPECT_EQ(crc32c_combine(a, b, data.size() - split), crc32c(data.data(), data.size())) << split;
  }
  EXPECT_EQ(crc32c_combine(0xe3069283u, 0, 0), 0xe3069283u);
  EXPECT_NE(crc32c_combine(0xe3069283u, 0, 1), crc32c_combine(0xe3069283u, 0, 2));
  EXPECT_EQ(crc_hex(0xe3069283u), "e3069283");
  EXPECT_EQ(parse_crc_hex("E3069283", "x"), 0xe3069283u);
  EXPECT_THROW(parse_crc_hex("e306928", "x"), Error);
  EXPECT_THROW(parse_crc_hex("e306928g", "x"), Error);
}

// A tensor streamed as uneven runs of rows (crossing checksum-block boundaries) gives
// the same file, byte for byte, as writing it whole; bad parts are refused.
TEST(Safetensors, WritePartMatchesWholeWrite) {
  const std::string dir = temp_dir();
  // 10 MiB + 12 bytes: three 4 MiB checksum blocks, the last one short.
  const int64_t rows = (10 << 20) / 12 + 1;
  at::Tensor big = at::arange(rows * 3, at::kFloat).reshape({rows, 3});
  at::Tensor small = at::arange(6, at::kInt).reshape({2, 3});
  const std::vector<SafetensorsWriter::Spec> specs = {{"big", at::kFloat, {rows, 3}}, {"small", at::kInt, {2, 3}}};
  SafetensorsWriter whole(dir + "/whole.safetensors", specs, {});
  whole.write(big);
  whole.write(small);
  auto w1 = whole.finish();
  SafetensorsWriter parts(dir + "/parts.safetensors", specs, {});
  EXPECT_THROW(parts.write_part(at::zeros({1, 4}, at::kFloat)), Error);  // wrong row shape
  EXPECT_THROW(parts.write_part(at::zeros({1, 3}, at::kInt)), Error);    // wrong dtype
  const int64_t cuts[] = {0, 1, 349525, 700000, rows - 1, rows};          // 349525 rows ~ 4 MiB
  for (size_t i = 0; i + 1 < std::size(cuts); ++i) parts.write_part(big.narrow(0, cuts[i], cuts[i + 1] - cuts[i]));
  EXPECT_EQ(parts.next_index(), 1u);
  EXPECT_THROW(parts.write_part(at::zeros({3, 3}, at::kInt)), Error);  // more rows than declared
  parts.write_part(small.narrow(0, 0, 1));
  parts.write_part(small.narrow(0, 1, 1));
  auto w2 = parts.finish();
  ASSERT_EQ(w1.size(), w2.size());
  EXPECT_EQ(w1[0].crcs.size(), 3u);
  for (size_t i = 0; i < w1.size(); ++i) EXPECT_EQ(w1[i].crcs, w2[i].crcs) << w1[i].name;
  EXPECT_TRUE(read_bytes(dir + "/whole.safetensors") == read_bytes(dir + "/parts.safetensors"));
  SafetensorsReader r(dir + "/parts.safetensors");
  EXPECT_TRUE(at::equal(r.read("big"), big));
}

TEST(Safetensors, WriterOutputIsValidAndRoundTrips) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/a.safetensors";
  at::Tensor a = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor b = (at::arange(5, at::kFloat) * 0.5).to(at::kBFloat16);
  at::Tensor e = at::empty({0, 3}, at::kLong);
  at::Tensor s = at::scalar_tensor(2.5, at::kDouble);
  at::Tensor nc = at::arange(20, at::kInt).reshape({4, 5}).t();  // non-contiguous
  SafetensorsWriter w(path,
                      {{"a", at::kFloat, {3, 4}}, {"b", at::kBFloat16, {5}}, {"e", at::kLong, {0, 3}},
                       {"s", at::kDouble, {}}, {"nc", at::kInt, {5, 4}}},
                      {{"user", "value"}});
  w.write(a);
  w.write(b);
  EXPECT_THROW(w.write(at::zeros({2}, at::kLong)), Error);  // wrong shape for "e"
  w.write(e);
  w.write(s);
  w.write(nc);
  auto written = w.finish();
  ASSERT_EQ(written.size(), 5u);

  // The header is plain safetensors: length, JSON, offsets relative to the data start.
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  auto h = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(h["a"]["dtype"], "F32");
  EXPECT_EQ(h["b"]["dtype"], "BF16");
  EXPECT_EQ(h["a"]["data_offsets"][0], 0);
  EXPECT_EQ(h["a"]["data_offsets"][1], 48);
  EXPECT_EQ(h["__metadata__"]["user"], "value");
  EXPECT_EQ(h["__metadata__"]["tessera.crc32c"].get<std::string>().size(), 8u * 4);  // a, b, s, nc
  EXPECT_EQ(bytes.size(), 8 + n + 48 + 10 + 0 + 8 + 80);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, a.data_ptr(), 48), 0);

  SafetensorsReader r(path);
  EXPECT_TRUE(at::equal(r.read("a"), a));
  EXPECT_TRUE(at::equal(r.read("b"), b));
  EXPECT_EQ(r.read("e").sizes(), e.sizes());
  EXPECT_TRUE(at::equal(r.read("s"), s));
  EXPECT_TRUE(at::equal(r.read("nc"), nc));
  EXPECT_EQ(r.meta("user"), "value");
  ASSERT_NE(r.crcs("a"), nullptr);
  EXPECT_EQ((*r.crcs("a"))[0], crc32c(a.data_ptr(), 48));
  EXPECT_NE(error_of([&] { r.read("nope"); }).find("has no tensor 'nope'"), std::string::npos);
}

TEST(Safetensors, FlippedDataByteIsACheckumErrorNamingTheTensor) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/a.safetensors";
  {
    SafetensorsWriter w(path, {{"x", at::kFloat, {100}}, {"y", at::kFloat, {10}}}, {});
    w.write(at::arange(100, at::kFloat));
    w.write(at::arange(10, at::kFloat));
    w.finish();
  }
  std::string bytes = read_bytes(path);
  bytes[bytes.size() - 50] ^= 0x01;  // inside "x" (last 40 bytes are "y")
  write_bytes(path, bytes);
  SafetensorsReader r(path);  // the header is fine
  EXPECT_TRUE(at::equal(r.read("y"), at::arange(10, at::kFloat)));
  const std::string err = error_of([&] { r.read("x"); });
  EXPECT_NE(err.find("tensor 'x': checksum mismatch"), std::string::npos) << err;
}

TEST(Safetensors, StrictValidationOfHeaders) {
  const std::string dir = temp_dir();
  const std::string p = dir + "/bad.safetensors";
  auto expect_error = [&](const std::string& file_bytes, const std::string& needle) {
    write_bytes(p, file_bytes);
    const std::string err = error_of([&] { SafetensorsReader r(p); });
    EXPECT_NE(err.find(needle), std::string::npos) << "want '" << needle << "', got: " << err;
    EXPECT_NE(err.find(p), std::string::npos) << err;
  };
  const std::string d8(8, '\0');
  expect_error("abc", "shorter than the 8-byte header length");
  expect_error(std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "exceeds the limit");
  expect_error(make_file("{}", "").substr(0, 9), "does not fit");
  expect_error(make_file("{\"a\": ", ""), "not valid JSON");
  expect_error(make_file("[1,2]", ""), "not a JSON object");
  expect_error(make_file(R"({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})", d8), "unknown dtype 'F33'");
  expect_error(make_file(R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", d8), "bad dimension");
  expect_error(make_file(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", d8),
               "the shape and dtype need 12");
  expect_error(make_file(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", d8),
               "outside the data section");
  expect_error(make_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", d8 + "1234"),
               "overlaps");
  expect_error(make_file(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", d8), "gap");
  expect_error(make_file(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", d8), "not covered");
  expect_error(make_file(R"({"a": {"dtype": "F32", "shape": [2]}})", d8), "needs dtype, shape and data_offsets");
  expect_error(make_file(R"({"__metadata__": {"k": 3}})", ""), "is not a string");
  // A foreign but valid file (no Tessera metadata) opens and reads, without checksums.
  write_bytes(p, make_file(R"({"__metadata__": {"format": "pt"}, "a": {"dtype": "I16", "shape": [2, 2], "data_offsets": [0, 8]}})",
                           std::string("\x01\x00\x02\x00\x03\x00\x04\x00", 8)));
  SafetensorsReader r(p);
  EXPECT_EQ(r.crcs("a"), nullptr);
  EXPECT_TRUE(at::equal(r.read("a"), at::arange(1, 5, at::kShort).reshape({2, 2})));
}

TEST(Safetensors, TruncatedFileIsDetected) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/t.safetensors";
  {
    SafetensorsWriter w(path, {{"x", at::kFloat, {64}}}, {});
    w.write(at::ones({64}));
    w.finish();
  }
  std::string bytes = read_bytes(path);
  write_bytes(path, bytes.substr(0, bytes.size() - 3));
  const std::string err = error_of([&] { SafetensorsReader r(path); });
  EXPECT_NE(err.find("tensor 'x'"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
}

TEST(CommitRename, ReplacesDirectoriesAtomicallyAndCleansUp) {
  const std::string dir = temp_dir();
  const std::string dest = dir + "/ckpt";
  for (int i = 0; i < 3; ++i) {
    const std::string tmp = temp_sibling(dest);
    make_dir(tmp);
    write_bytes(tmp + "/v", std::to_string(i));
    commit_rename(tmp, dest);
    EXPECT_EQ(read_bytes(dest + "/v"), std::to_string(i));
  }
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ckpt"});  // nothing left beside it
  // A stale temporary sibling is removed by recover_siblings; an aside copy is restored.
  make_dir(temp_sibling(dest));
  const std::string aside = dir + "/.ckpt.tessera-old-1-0";
  ASSERT_EQ(::rename(dest.c_str(), aside.c_str()), 0);
  write_bytes(aside + "/tessera-checkpoint.json", "{}");
  EXPECT_EQ(aside_sibling(dest), aside);
  recover_siblings(dest);
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ckpt"});
  EXPECT_EQ(read_bytes(dest + "/v"), "2");
}

// The stream writer behind every data file: appends of odd sizes across many staging
// buffers (4 KiB here), a tail that is not a whole block, patches of bytes already
// written, with O_DIRECT where the filesystem takes it and through the page cache
// otherwise (TESSERA_NO_DIRECT_IO, and /dev/shm: tmpfs refuses O_DIRECT on older
// kernels). The file holds exactly the bytes appended, patches applied.
TEST(StreamWriter, WritesExactlyTheAppendedBytesInBothModes) {
  std::string want(3 * 4096 * 5 + 1234, '\0');
  for (size_t i = 0; i < want.size(); ++i) want[i] = static_cast<char>((i * 2654435761u) >> 11);
  std::vector<std::string> dirs = {temp_dir()};
  if (is_directory("/dev/shm") && ::access("/dev/shm", W_OK) == 0) {
    try {
      dirs.push_back(temp_dir("tessera-stream", "/dev/shm"));
    } catch (const std::runtime_error&) {  // none there: the test covers /tmp only
    }
  }
  for (const std::string& dir : dirs) {
    for (bool no_direct : {false, true}) {
      if (no_direct) ::setenv("TESSERA_NO_DIRECT_IO", "1", 1);
      const std::string path = dir + (no_direct ? "/buffered.bin" : "/direct.bin");
      std::string expect = want;
      bool direct = false;
      {
        StreamWriter w(path, 4096);
        direct = w.direct();
        size_t off = 0, step = 1;
        while (off < want.size()) {
          const size_t n = std::min(want.size() - off, step);
          w.append(want.data() + off, n);
          off += n;
          step = step * 3 + 1;  // 1, 4, 13, 40, ... bytes: crosses buffers at odd places
        }
        EXPECT_EQ(w.size(), want.size());
        w.patch(5, "PATCH", 5);
        w.patch(want.size() - 3, "end", 3);
        expect.replace(5, 5, "PATCH");
        expect.replace(want.size() - 3, 3, "end");
        EXPECT_THROW(w.patch(want.size() - 2, "xyz", 3), Error);  // past what was written
        w.finish();
        EXPECT_THROW(w.append("x", 1), Error);
      }
      ::unsetenv("TESSERA_NO_DIRECT_IO");
      if (no_direct) EXPECT_FALSE(direct) << path;
      EXPECT_TRUE(read_bytes(path) == expect) << path << (direct ? " (O_DIRECT)" : " (page cache)");
    }
  }
  if (dirs.size() > 1) remove_all(dirs[1]);
}

// Two writers fill one file of a given size at the same time, each its own runs at
// unaligned offsets (as the ranks of a consolidated save do): runs that share a page,
// seeks forward and back, runs longer than a buffer. With O_DIRECT the shared pages go
// through the page cache; nothing either writer wrote is lost, and bytes nobody wrote
// stay zero. In both modes, on /tmp.
TEST(StreamWriter, TwoWritersFillOneFileAtOffsets) {
  const uint64_t size = 9 * 4096 + 77;
  std::string src(size, '\0');
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(1 + (i * 2654435761u) % 251);
  // (offset, length, writer); bytes 20000..20100 are written by nobody.
  const std::vector<std::tuple<uint64_t, uint64_t, int>> runs = {
      {0, 100, 0},       {100, 5000, 1},  {5100, 3, 0},     {5103, 9000, 1},  {14103, 5897, 0},
      {20100, 4000, 1},  {24100, 1, 0},   {24101, 12840, 1}, {36941, 0, 0}};
  for (bool no_direct : {false, true}) {
    if (no_direct) ::setenv("TESSERA_NO_DIRECT_IO", "1", 1);
    const std::string path = temp_dir() + (no_direct ? "/shared-buffered.bin" : "/shared-direct.bin");
    {
      File f(path, "w");
      f.resize(size);
    }
    {
      StreamWriter w0(path, 8192, StreamWriter::Open::Existing), w1(path, 8192, StreamWriter::Open::Existing);
      EXPECT_EQ(w0.direct(), !no_direct);
      StreamWriter* w[2] = {&w0, &w1};
      // Turn about: writer 0 goes through its runs front to back, writer 1 back to front
      // (seeking backwards).
      for (size_t k = 0; k < runs.size(); ++k)
        for (int turn = 0; turn < 2; ++turn) {
          const auto& [off, len, who] = turn == 0 ? runs[k] : runs[runs.size() - 1 - k];
          if (who != turn) continue;
          w[who]->seek(off);
          w[who]->append(src.data() + off, len);
        }
      w0.finish();
      w1.finish();
    }
    ::unsetenv("TESSERA_NO_DIRECT_IO");
    std::string want = src;
    std::fill(want.begin() + 20000, want.begin() + 20100, '\0');
    const std::string got = read_bytes(path);
    ASSERT_EQ(got.size(), size) << path;
    for (size_t i = 0; i < size; ++i)
      ASSERT_EQ(got[i], want[i]) << path << ": byte " << i << (no_direct ? " (page cache)" : " (O_DIRECT)");
  }
  EXPECT_THROW(StreamWriter(temp_dir() + "/absent.bin", 8192, StreamWriter::Open::Existing), Error);
}

// Block checksums joined from pieces written by several writers equal one pass over the
// data; a gap, an overlap, a piece across a block boundary or past a tensor's end is an
// error naming the file, the tensor and the bytes.
TEST(Checksums, AssembleBlockCrcsFromPiecesOfSeveralWriters) {
  std::string a(10 * 1000 + 7, '\0'), b(2500, '\0');
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<char>(i * 7 + 3);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(i * 13 + 1);
  const uint64_t block = 4096;
  const std::vector<std::pair<std::string, uint64_t>> tensors = {{"a", a.size()}, {"empty", 0}, {"b", b.size()}};
  auto piece = [&](uint32_t t, uint64_t begin, uint64_t len) {
    const std::string& d = t == 0 ? a : b;
    return CrcPiece{t, begin, len, crc32c(d.data() + begin, len)};
  };
  // Cut at 1000, 4096 (a block boundary), 5000, 8192, 9999; b in one piece per block.
  std::vector<CrcPiece> pieces = {piece(0, 9999, a.size() - 9999), piece(0, 0, 1000), piece(0, 5000, 8192 - 5000),
                                  piece(0, 1000, 4096 - 1000),     piece(2, 0, 2500),  piece(0, 4096, 5000 - 4096),
                                  piece(0, 8192, 9999 - 8192)};
  const auto got = assemble_block_crcs(pieces, tensors, "f.safetensors", block);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], block_crcs(a.data(), a.size(), block));
  EXPECT_TRUE(got[1].empty());
  EXPECT_EQ(got[2], block_crcs(b.data(), b.size(), block));
  // The binary form round-trips.
  const auto back = unpack_crc_pieces(pack_crc_pieces(pieces), "x");
  ASSERT_EQ(back.size(), pieces.size());
  EXPECT_EQ(assemble_block_crcs(back, tensors, "f", block), got);
  EXPECT_THROW(unpack_crc_pieces("abc", "rank 1"), Error);

  auto error_of = [&](std::vector<CrcPiece> p) -> std::string {
    try {
      assemble_block_crcs(std::move(p), tensors, "f.safetensors", block);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  auto without = [&](size_t i) {
    auto p = pieces;
    p.erase(p.begin() + static_cast<long>(i));
    return p;
  };
  const std::string gap = error_of(without(2));  // bytes 5000..8192 of a
  EXPECT_NE(gap.find("'f.safetensors' tensor 'a': bytes 5000..8192 were written by no writer"), std::string::npos)
      << gap;
  const std::string tail = error_of(without(0));  // a's last piece
  EXPECT_NE(tail.find("tensor 'a': bytes 9999..10007 were written by no writer"), std::string::npos) << tail;
  auto twice = pieces;
  twice.push_back(piece(0, 4500, 100));
  EXPECT_NE(error_of(twice).find("tensor 'a': bytes 4500..5000 were written twice"), std::string::npos)
      << error_of(twice);
  auto across = pieces;
  across[3] = piece(0, 1000, 4096);  // crosses the block boundary at 4096
  EXPECT_NE(error_of(across).find("crosses a block boundary"), std::string::npos) << error_of(across);
  auto past = pieces;
  past.push_back(CrcPiece{1, 0, 4, 0});  // the empty tensor has no bytes
  EXPECT_NE(error_of(past).find("tensor 'empty'"), std::string::npos) << error_of(past);
}
