// Issue 44 items 3, 4 and 5: hostile metadata within the documented limits, verify's output,
// and the C++ and Python readers' agreement.
//  - Item 5: a table of crafted metadata files (every field of a version-2 checkpoint at and
//    past its bounds, and of version 3's tp rule and interleaved replica groups (issue 47), each re-checksummed as docs/checkpoint-format.md §3 describes) run
//    through `tessera ckpt verify` and `python -m tessera_ckpt verify`, and through both
//    readers' inspect: the same verdict and the same message in both (files.shift = 2^63-1
//    was refused by every C++ command and accepted by Python's verify; files.first and
//    files.step were bounded differently and said so in other words).
//  - Item 3: metadata at the 256 MiB size limit built to cost the most to parse (the red team's
//    list of millions of empty pieces, and a member no reader uses holding millions of empty
//    objects) is refused by both CLIs in under 1 GB and 10 s of CPU (48 MB of it took 1.5 GB
//    and 9.6 s in C++, 2.1 GB and 20 s in Python).
//  - Item 4: verify reports 100 problems, then "and K more problem(s)"; a world_size of 2^20
//    over one data file is one problem found from the directory listing, not a million opens.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <sstream>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/offline/offline.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
using ojson = nlohmann::ordered_json;

namespace {

const std::string kMeta = "/tessera-checkpoint.json";
constexpr uint64_t kMaxItems = 1ull << 22;  // kMaxMetadataItems (metadata.cpp), MAX_METADATA_ITEMS (_format_metadata.py)
const std::string kBig = "18446744073709551616";  // 2^64: no int64 or uint64 (a float to nlohmann)

std::string python() { return std::string(TESSERA_PYTHON); }
std::string pkg_env() { return std::string("env PYTHONPATH=") + TESSERA_SOURCE_DIR + "/python "; }

// `text` (compact JSON without metadata_crc32c) as version-2 metadata: the checksum member
// appended last and computed as docs/checkpoint-format.md §3 says. "@BIG@" strings become 2^64.
std::string with_checksum(std::string text) {
  for (size_t at; (at = text.find("\"@BIG@\"")) != std::string::npos;) text.replace(at, 7, kBig);
  text.pop_back();
  text += ",\"metadata_crc32c\":\"00000000\"}";
  text.replace(text.size() - 10, 8, ck::crc_hex(ck::crc32c(text.data(), text.size())));
  return text;
}

ojson read_metadata(const std::string& dir) {
  ojson j = ojson::parse(read_bytes(dir + kMeta));
  j.erase("metadata_crc32c");
  return j;
}

// Values and member names, as both readers count them.
uint64_t items_of(const ojson& j) {
  uint64_t n = 1;
  if (j.is_object())
    for (const auto& [k, v] : j.items()) n += 1 + items_of(v);
  if (j.is_array())
    for (const auto& v : j) n += items_of(v);
  return n;
}

// A checkpoint saved at world size 1 ("w" and "step" in data-rank00000) whose metadata then
// claims world size 4 and adds a tensor of each layout: parsed and checked alike by both readers
// (inspect reads no data file); verify finds the missing files and pieces.
ojson base_metadata(const std::string& dir) {
  ck::save(state_of(4, 1.0), dir, *solo());
  ojson j = read_metadata(dir);
  j["world_size"] = 4;
  auto add = [&](const std::string& k, const std::vector<int64_t>& shape, ojson layout) {
    j["keys"].push_back(k);
    j["entries"][k] = ojson{{"kind", "sharded"}, {"dtype", "F32"}, {"shape", shape}, {"layout", std::move(layout)}};
  };
  add("c", {8, 2}, {{"rule", "chunk"}, {"dim", 0}, {"pieces", 4}, {"files", {{"first", 0}, {"step", 1}}}});
  add("f", {6, 3}, {{"rule", "flat"}, {"numel", 40}, {"offset", 2}, {"pieces", 4}, {"files", {{"first", 0}, {"step", 1}}}});
  add("h", {4, 2},
      {{"rule", "chunk"},
       {"dim", 0},
       {"pieces", 2},
       {"files", {{"first", 0}, {"step", 1}, {"replicas", 2}, {"replica_step", 2}, {"shift", 1}}}});
  add("l", {4, 2}, {{"rule", "list"}, {"pieces", ojson::array({ojson::array({0, {0, 0}, {2, 2}}), ojson::array({3, {2, 0}, {2, 2}})})}});
  add("s", {}, {{"rule", "whole"}, {"file", 3}});
  return j;
}

struct Verdict {
  bool ok = false;
  std::string message;  // the error, or the first problem verify reports
};

// `tessera ckpt verify` and `python -m tessera_ckpt verify`: exit status and first problem.
Verdict cli_verify(const std::string& dir, bool cxx) {
  const std::string cmd = cxx ? concat(TESSERA_CLI, " ckpt verify ", dir)
                              : concat(pkg_env(), python(), " -m tessera_ckpt verify ", dir);
  auto [rc, out] = run_command(cmd);
  Verdict v;
  v.ok = rc == 0;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("CORRUPT: ", 0) == 0 && std::getline(in, line)) {
      v.message = line.rfind("  ", 0) == 0 ? line.substr(2) : line;
      break;
    }
  if (!v.ok && v.message.empty()) v.message = "(no CORRUPT line, exit " + std::to_string(rc) + "): " + out;
  return v;
}

// The Python package's inspect() of each directory (one process for all of them).
std::map<std::string, Verdict> python_inspect(const std::vector<std::string>& dirs) {
  std::string cmd = python() + " " + TESSERA_SOURCE_DIR + "/tests/python/tessera_ckpt_verdicts.py";
  for (const auto& d : dirs) cmd += " " + d;
  auto [rc, out] = run_command(cmd);
  EXPECT_EQ(rc, 0) << out;
  std::map<std::string, Verdict> got;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    const size_t t1 = line.find('\t');
    if (t1 == std::string::npos) continue;
    Verdict v;
    v.ok = line.compare(t1 + 1, 2, "OK") == 0;
    if (!v.ok) v.message = line.substr(line.find('\t', t1 + 1) + 1);
    got[line.substr(0, t1)] = v;
  }
  return got;
}

// Peak RSS (bytes), CPU seconds and output of `cmd` under /usr/bin/time.
struct Measured {
  int rc;
  uint64_t peak_bytes;
  double cpu_s;
  std::string out;
};
Measured measure(const std::string& cmd) {
  auto [rc, out] = run_command("/usr/bin/time -f 'MEASURED %M %U %S' " + cmd);
  Measured m{rc, 0, 0, out};
  const size_t at = out.rfind("MEASURED ");
  if (at != std::string::npos) {
    std::istringstream in(out.substr(at + 9));
    uint64_t kib = 0;
    double u = 0, s = 0;
    in >> kib >> u >> s;
    m.peak_bytes = kib * 1024;
    m.cpu_s = u + s;
  }
  return m;
}

}  // namespace

// Item 5: every field of the metadata at and past its bounds, through both readers.
TEST(MetadataAgreement, BothReadersGiveEveryCraftedFileTheSameVerdictInTheSameWords) {
  const std::string d = temp_dir("meta-agree");
  const ojson base = base_metadata(d + "/base");
  const uint64_t base_items = items_of(base) + 2;  // + "metadata_crc32c" and its value
  using Edit = std::function<void(ojson&)>;
  auto set = [](const std::string& ptr, ojson v) -> Edit {
    return [ptr, v](ojson& j) { j[ojson::json_pointer(ptr)] = v; };
  };
  auto drop = [](const std::string& ptr, const std::string& key) -> Edit {
    return [ptr, key](ojson& j) { j[ojson::json_pointer(ptr)].erase(key); };
  };
  const int64_t i64max = std::numeric_limits<int64_t>::max();
  const uint64_t two63 = uint64_t(1) << 63;
  const std::string C = "/entries/c/layout", F = "/entries/f/layout", H = "/entries/h/layout", L = "/entries/l/layout";
  // Version 3 (issue 47): the base at version 3 with a tp entry "t" (qkv-like: 3 stripes of 4
  // rows, tp 2, FSDP's flat cut over 2 of each 6x4 TP piece), then `edits`; version 2 keeps the
  // entry, which that version refuses.
  const std::string T = "/entries/t/layout";
  const ojson tp_layout = {{"rule", "tp"},
                           {"dim", 0},
                           {"stripes", 3},
                           {"tp", 2},
                           {"inner", {{"rule", "flat"}, {"numel", 60}, {"offset", 4}, {"pieces", 2}}},
                           {"files", {{"first", 0}, {"step", 1}}}};
  auto v3 = [tp_layout](std::vector<Edit> edits = {}, int version = 3) -> Edit {
    return [tp_layout, edits, version](ojson& j) {
      j["version"] = version;
      j["keys"].push_back("t");
      j["entries"]["t"] =
          ojson{{"kind", "sharded"}, {"dtype", "F32"}, {"shape", ojson::array({12, 4})}, {"layout", tp_layout}};
      for (const auto& e : edits) e(j);
    };
  };
  const ojson interleaved = {{"first", 0}, {"step", 2}, {"replicas", 2}, {"replica_step", 1}, {"shift", 1}};
  struct Case {
    std::string name;
    Edit edit;
    std::string want;  // a part of the message both readers give; "" when both accept the metadata
  };
  const std::vector<Case> cases = {
      {"base", [](ojson&) {}, ""},
      // top level
      {"world0", set("/world_size", 0), "world_size is 0, outside [1, 1048576]"},
      {"world_max", set("/world_size", 1 << 20), ""},
      {"world_over", set("/world_size", (1 << 20) + 1), "world_size is 1048577, outside [1, 1048576]"},
      {"world_neg", set("/world_size", -1), "world_size is -1, outside [1, 1048576]"},
      {"world_float", set("/world_size", 1.5), "world_size: expected an integer, got 1.5"},
      {"world_text", set("/world_size", "4"), "world_size: expected an integer, got \"4\""},
      {"world_2p64", set("/world_size", "@BIG@"), "world_size: expected an integer, got 1.8446744073709552e+19"},
      {"version0", set("/version", 0), "format version 0 is not supported (this reader reads versions 1..3)"},
      {"version3", set("/version", 3), ""},
      {"version4", set("/version", 4), "format version 4 is not supported (this reader reads versions 1..3)"},
      {"version_wrap", set("/version", (int64_t(1) << 32) + 2), "format version 4294967298 is not supported"},
      {"version_2p63", set("/version", two63), "format version 9223372036854775808 is not supported"},
      {"version_2p64", set("/version", "@BIG@"), "no integer version"},
      {"block0", set("/crc32c_block", 0), "crc32c_block: checksum block size 0 is not a multiple of 8"},
      {"block12", set("/crc32c_block", 12), "checksum block size 12"},
      {"block_max", set("/crc32c_block", 1 << 30), ""},
      {"block_over", set("/crc32c_block", (1 << 30) + 8), "checksum block size 1073741832"},
      {"block_neg", set("/crc32c_block", -8), "crc32c_block: expected a non-negative integer, got -8"},
      {"block_2p64", set("/crc32c_block", "@BIG@"), "expected a non-negative integer, got 1.8446744073709552e+19"},
      {"save_id_upper", set("/save_id", "0123456789ABCDEF"), "save_id \"0123456789ABCDEF\" is not 16 lowercase hex"},
      {"save_id_none", drop("", "save_id"), "save_id null is not 16 lowercase hex digits"},
      // entries
      {"dtype", set("/entries/c/dtype", "F8"), "key 'c': unknown dtype \"F8\" (known: F64 F32 F16 BF16 I64 I32"},
      {"dtype_none", drop("/entries/c", "dtype"), "key 'c': unknown dtype null"},
      {"shape_huge", set("/entries/s/shape", ojson::array({int64_t(1) << 61})), "key 's': shape [2305843009213693952]: shape too large"},
      {"shape_neg", set("/entries/s/shape", ojson::array({-1})), "key 's' shape: bad dimension -1"},
      {"int_max", set("/entries/step/value", i64max), ""},
      {"int_over", set("/entries/step/value", two63), "key 'step' value is 9223372036854775808, outside"},
      {"no_layout", drop("/entries/c", "layout"), "key 'c': layout is not an object"},
      {"rule", set(C + "/rule", "rows"),
       "key 'c': unknown layout rule \"rows\" (known: whole, chunk, flat, list; tp needs format version 3)"},
      {"rule_none", drop(C, "rule"), "unknown layout rule null"},
      // whole
      {"whole_last", set("/entries/s/layout/file", 3), ""},
      {"whole_out", set("/entries/s/layout/file", 4), "key 's' layout.file is 4, outside [0, 3]"},
      {"whole_neg", set("/entries/s/layout/file", -1), "layout.file is -1, outside [0, 3]"},
      {"chunk_scalar", set("/entries/s/layout", {{"rule", "chunk"}, {"dim", 0}, {"pieces", 1}, {"files", {{"first", 0}, {"step", 1}}}}),
       "key 's': a chunk layout needs a tensor of at least one dimension"},
      // chunk
      {"dim_last", set(C + "/dim", 1), ""},
      {"dim_out", set(C + "/dim", 2), "key 'c' layout.dim is 2, outside [0, 1]"},
      {"dim_neg", set(C + "/dim", -1), "layout.dim is -1, outside [0, 1]"},
      {"pieces0", set(C + "/pieces", 0), "key 'c' layout.pieces is 0, outside [1, 4]"},
      {"pieces_over", set(C + "/pieces", 5), "layout.pieces is 5, outside [1, 4]"},
      {"pieces_text", set(C + "/pieces", "4"), "layout.pieces: expected an integer, got \"4\""},
      {"files_form", set(C + "/files", {0, 1}), "key 'c': layout.files is not an object"},
      {"first_neg", set(C + "/files/first", -1), "layout.files.first is -1, outside [0, 3]"},
      {"first_out", set(C + "/files/first", 4), "layout.files.first is 4, outside [0, 3]"},
      {"first_big", set(C + "/files/first", i64max), "layout.files.first is 9223372036854775807, outside [0, 3]"},
      {"first_reach", set(C + "/files/first", 1), "key 'c': layout.files reach data file 4, outside [0, 3]"},
      {"first_none", drop(C + "/files", "first"), "layout.files.first: expected an integer, got null"},
      {"step0", set(C + "/files/step", 0), "layout.files.step is 0, outside [1, 4]"},
      {"step_out", set(C + "/files/step", 5), "layout.files.step is 5, outside [1, 4]"},
      {"step_big", set(C + "/files/step", i64max), "layout.files.step is 9223372036854775807, outside [1, 4]"},
      {"step_reach", set(C + "/files/step", 2), "layout.files reach data file 6, outside [0, 3]"},
      // hybrid files
      {"replicas0", set(H + "/files/replicas", 0), "key 'h' layout.files.replicas is 0, outside [1, 4]"},
      {"replicas_out", set(H + "/files/replicas", 5), "layout.files.replicas is 5, outside [1, 4]"},
      {"replicas_reach", set(H + "/files/replicas", 3), "layout.files reach data file 5, outside [0, 3]"},
      {"replica_step_neg", set(H + "/files/replica_step", -1), "layout.files.replica_step is -1, outside [0, 3]"},
      {"replica_step_out", set(H + "/files/replica_step", 4), "layout.files.replica_step is 4, outside [0, 3]"},
      {"replica_step_low", set(H + "/files/replica_step", 1),
       "key 'h': layout.files.replica_step 1 is below layout.pieces * layout.files.step = 2 (two pieces would share a file)"},
      {"replica_step_none", drop(H + "/files", "replica_step"), "layout.files.replica_step: expected an integer, got null"},
      {"shift0", set(H + "/files/shift", 0), ""},
      {"shift_max", set(H + "/files/shift", i64max), ""},  // the red team's: C++ refused it, Python took it
      {"shift_2p63", set(H + "/files/shift", two63), "layout.files.shift is 9223372036854775808, outside [0, 9223372036854775807]"},
      {"shift_2p64", set(H + "/files/shift", "@BIG@"), "layout.files.shift: expected an integer, got 1.8446744073709552e+19"},
      {"shift_neg", set(H + "/files/shift", -1), "layout.files.shift is -1, outside [0, 9223372036854775807]"},
      // flat
      {"numel_fits", set(F + "/numel", 20), ""},
      {"numel_short", set(F + "/numel", 19), "key 'f': layout.offset 2 + the tensor's 18 elements exceed layout.numel 19"},
      {"numel_neg", set(F + "/numel", -1), "layout.numel is -1, outside [0, 9223372036854775807]"},
      {"offset_big", set(F + "/offset", i64max), "layout.offset 9223372036854775807 + the tensor's 18 elements exceed"},
      {"flat_pieces0", set(F + "/pieces", 0), "key 'f' layout.pieces is 0, outside [1, 4]"},
      // list
      {"list_form", set(L + "/pieces/1", {3, {2, 0}}), "key 'l' layout.pieces[1] is not [file, offsets, sizes]"},
      {"list_file", set(L + "/pieces/1/0", 4), "key 'l' layout.pieces[1] file is 4, outside [0, 3]"},
      {"list_offsets", set(L + "/pieces/1/1", {2, -1}), "key 'l' layout.pieces[1] offsets: bad dimension -1"},
      {"list_rank", set(L + "/pieces/1/2", ojson::array({2})), "key 'l': layout.pieces[1] has 2 offsets and 1 sizes for a shape of rank 2"},
      {"list_outside", set(L + "/pieces/1/1", {i64max, 0}),
       "key 'l': layout.pieces[1] (offsets [9223372036854775807, 0], sizes [2, 2]) lies outside the shape [4, 2]"},
      {"list_empty",
       [](ojson& j) { j["entries"]["l"]["layout"]["pieces"].push_back(ojson::array({1, {4, 0}, {0, 2}})); },
       "key 'l': layout.pieces[2] [4:4, 0:2] is empty (a list layout names only the pieces its data files store)"},
      {"list_overlap", set(L + "/pieces/1/1", {1, 0}), "key 'l': pieces [0:2, 0:2] and [1:3, 0:2] overlap"},
      {"list_gap", set(L + "/pieces/1/2", {1, 2}), "key 'l': the pieces cover 6 of 8 elements (incomplete checkpoint)"},
      {"list_most",
       [](ojson& j) {
         ojson ps = ojson::array();
         for (int i = 0; i < 256; ++i) ps.push_back(ojson::array({i % 4, {i, 0}, {1, 1}}));
         j["entries"]["l"]["shape"] = {256, 1};
         j["entries"]["l"]["layout"]["pieces"] = ps;
       },
       ""},
      {"list_too_many",
       [](ojson& j) {
         ojson ps = ojson::array();
         for (int i = 0; i < 257; ++i) ps.push_back(ojson::array({i % 4, {i, 0}, {1, 1}}));
         j["entries"]["l"]["shape"] = {257, 1};
         j["entries"]["l"]["layout"]["pieces"] = ps;
       },
       "key 'l': layout.pieces lists 257 pieces, more than 64 per data file (256 for world_size 4)"},
      // version 3: the tp rule, every field at and past its bounds, in the words of
      // metadata.cpp tp_layout_from_json and Layout::validate_tp
      {"v3_rule", v3({set(C + "/rule", "rows")}), "key 'c': unknown layout rule \"rows\" (known: whole, chunk, flat, list, tp)"},
      {"tp_v2", v3({}, 2), "key 't': unknown layout rule \"tp\" (known: whole, chunk, flat, list; tp needs format version 3)"},
      {"tp_flat", v3(), ""},
      {"tp_flat_arrays", v3({set(T + "/inner/numel", ojson::array({30, 40})), set(T + "/inner/offset", ojson::array({0, 16}))}), ""},
      {"tp_chunk", v3({set(T + "/inner", {{"rule", "chunk"}, {"dim", 1}, {"pieces", 2}})}), ""},
      {"tp_whole", v3({set(T + "/inner", {{"rule", "whole"}}), set(T + "/files/step", 2)}), ""},
      {"tp_dim1", v3({set(T + "/dim", 1), set(T + "/stripes", 2)}), ""},
      {"tp_scalar", v3({set("/entries/t/shape", ojson::array())}), "key 't': a tp layout needs a tensor of at least one dimension"},
      {"tp_dim_out", v3({set(T + "/dim", 2)}), "key 't' layout.dim is 2, outside [0, 1]"},
      {"tp_dim_neg", v3({set(T + "/dim", -1)}), "key 't' layout.dim is -1, outside [0, 1]"},
      {"tp_stripes0", v3({set(T + "/stripes", 0)}), "key 't' layout.stripes is 0, outside [1, 64]"},
      {"tp_stripes64", v3({set(T + "/stripes", 64), set("/entries/t/shape", ojson::array({128, 4})), set(T + "/inner/numel", 1000)}), ""},
      {"tp_stripes65", v3({set(T + "/stripes", 65)}), "key 't' layout.stripes is 65, outside [1, 64]"},
      {"tp_stripes_split", v3({set(T + "/stripes", 5)}), "key 't': layout.stripes 5 does not divide dimension 0 of shape [12, 4] (12)"},
      {"tp_tp0", v3({set(T + "/tp", 0)}), "key 't' layout.tp is 0, outside [1, 4]"},
      {"tp_tp_max", v3({set(T + "/tp", 4), set(T + "/inner/pieces", 1)}), ""},
      {"tp_tp_over", v3({set(T + "/tp", 5)}), "key 't' layout.tp is 5, outside [1, 4]"},
      {"tp_inner_form", v3({set(T + "/inner", ojson::array({1}))}), "key 't': layout.inner is not an object"},
      {"tp_inner_rule", v3({set(T + "/inner/rule", "list")}), "key 't': unknown layout.inner.rule \"list\" (known: whole, chunk, flat)"},
      {"tp_inner_rule_none", v3({drop(T + "/inner", "rule")}), "key 't': unknown layout.inner.rule null (known: whole, chunk, flat)"},
      {"tp_inner_dim_out", v3({set(T + "/inner", {{"rule", "chunk"}, {"dim", 2}, {"pieces", 2}})}), "key 't' layout.inner.dim is 2, outside [0, 1]"},
      {"tp_inner_pieces0", v3({set(T + "/inner/pieces", 0)}), "key 't' layout.inner.pieces is 0, outside [1, 4]"},
      {"tp_inner_pieces_over", v3({set(T + "/inner/pieces", 5)}), "key 't' layout.inner.pieces is 5, outside [1, 4]"},
      {"tp_holders_over", v3({set(T + "/inner/pieces", 3)}), "key 't': layout.inner.pieces 3 x layout.tp 2 holders exceed world_size 4"},
      {"tp_numel_len", v3({set(T + "/inner/numel", ojson::array({60, 60, 60}))}), "key 't' layout.inner.numel holds 3 values (1, or layout.tp = 2)"},
      {"tp_offset_len", v3({set(T + "/inner/offset", ojson::array({4}))}), "key 't' layout.inner.offset holds 1 values (1, or layout.tp = 2)"},
      {"tp_numel_neg", v3({set(T + "/inner/numel", ojson::array({60, -1}))}), "key 't' layout.inner.numel[1] is -1, outside [0, 9223372036854775807]"},
      {"tp_numel_none", v3({drop(T + "/inner", "numel")}), "key 't' layout.inner.numel: expected an integer, got null"},
      {"tp_numel_fits", v3({set(T + "/inner/numel", 28)}), ""},
      {"tp_numel_short", v3({set(T + "/inner/numel", 27)}),
       "key 't': layout.inner.offset 4 + the 24 elements of tensor-parallel piece 0 exceed layout.inner.numel 27"},
      {"tp_numel_short_1", v3({set(T + "/inner/numel", ojson::array({60, 40})), set(T + "/inner/offset", ojson::array({0, 17}))}),
       "key 't': layout.inner.offset 17 + the 24 elements of tensor-parallel piece 1 exceed layout.inner.numel 40"},
      {"tp_offset_big", v3({set(T + "/inner/offset", i64max)}),
       "key 't': layout.inner.offset 9223372036854775807 + the 24 elements of tensor-parallel piece 0 exceed layout.inner.numel 60"},
      {"tp_files_reach", v3({set(T + "/files/first", 1)}), "key 't': layout.files reach data file 4, outside [0, 3]"},
      {"tp_files_step_reach", v3({set(T + "/files/step", 2)}), "key 't': layout.files reach data file 6, outside [0, 3]"},
      {"tp_files_hybrid",
       v3({set(T + "/inner", {{"rule", "whole"}}),
           set(T + "/files", {{"first", 0}, {"step", 1}, {"replicas", 2}, {"replica_step", 2}, {"shift", 0}})}),
       ""},
      // interleaved replica groups: valid at version 3, refused at 2, and colliding ones at 3
      {"tp_interleaved", v3({set(T + "/inner", {{"rule", "whole"}}), set(T + "/files", interleaved)}), ""},
      {"tp_interleaved_collide", v3({set(T + "/inner", {{"rule", "whole"}}), set(T + "/files", interleaved), set(T + "/files/replica_step", 2)}),
       "key 't': layout.files.replica_step 2 is below layout.inner.pieces * layout.tp * layout.files.step = 4 (two pieces would share a file)"},
      {"tp_interleaved_reach", v3({set(T + "/files", interleaved)}), "key 't': layout.files reach data file 7, outside [0, 3]"},
      {"interleaved_v3", v3({set(H + "/files", interleaved)}), ""},
      {"interleaved_v2", set(H + "/files", interleaved),
       "key 'h': layout.files.replica_step 1 is below layout.pieces * layout.files.step = 4 (two pieces would share a file); "
       "interleaved replica groups need format version 3"},
      {"interleaved_collide_v3", v3({set(H + "/files", interleaved), set(H + "/files/replicas", 3)}),
       "key 'h': layout.files.replica_step 1 is below layout.pieces * layout.files.step = 4 (two pieces would share a file)"},
      // the item bound, exactly at it and one past (a member no reader uses)
      {"items_at", [&](ojson& j) { j["junk"] = ojson::array(); j["junk"].get_ref<ojson::array_t&>().resize(kMaxItems - base_items - 2, 0); }, ""},
      {"items_past", [&](ojson& j) { j["junk"] = ojson::array(); j["junk"].get_ref<ojson::array_t&>().resize(kMaxItems - base_items - 1, 0); },
       "metadata holds more than 4194304 JSON values and keys, the bound every reader enforces (corrupt or hostile)"},
  };
  std::vector<std::string> dirs;
  for (const auto& c : cases) {
    const std::string dir = d + "/case-" + c.name;
    ASSERT_EQ(std::system(("cp -r " + d + "/base " + dir).c_str()), 0);
    ojson j = base;
    c.edit(j);
    write_bytes(dir + kMeta, with_checksum(j.dump()));
    dirs.push_back(dir);
  }
  const auto py = python_inspect(dirs);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string& dir = dirs[i];
    SCOPED_TRACE(c.name);
    // inspect: the metadata parsed and checked, no data read.
    const std::string cxx = error_of([&] { ck::inspect(dir); });
    ASSERT_TRUE(py.count(dir)) << "no Python verdict";
    const Verdict& p = py.at(dir);
    const bool parse_ok = c.want.empty();
    EXPECT_EQ(cxx == "(no error)", parse_ok) << cxx;
    EXPECT_EQ(p.ok, parse_ok) << p.message;
    if (!parse_ok) {
      EXPECT_EQ(cxx, p.message) << "C++ and Python words differ";
      EXPECT_CONTAINS(cxx, c.want);
      EXPECT_CONTAINS(cxx, dir + kMeta);  // the file at fault is named
    }
    // verify, through both command-line tools: the same verdict and the same first problem
    // (for metadata both accept: the data files of ranks 1-3 the directory lacks).
    const Verdict vc = cli_verify(dir, true), vp = cli_verify(dir, false);
    EXPECT_FALSE(vc.ok);
    EXPECT_FALSE(vp.ok);
    EXPECT_EQ(vc.message, vp.message) << "C++ and Python verify differ";
    if (!parse_ok) EXPECT_EQ(vc.message, cxx);
    else EXPECT_CONTAINS(vc.message, "of its data files are missing ('data-rank00001.safetensors'");
  }
}

// Item 3: metadata at the size limit that costs the most per byte to parse.
TEST(MetadataAgreement, HostileMetadataAtTheSizeLimitIsRefusedInUnderAGigabyte) {
  const std::string d = temp_dir("meta-hostile");
  const ojson base = base_metadata(d + "/base");
  struct Shape {
    std::string name, where, unit;  // `unit` repeated inside `where`'s array until the size limit
  };
  const std::vector<Shape> shapes = {
      {"empty-pieces", "l", "[0,[0,0],[0,0]],"},  // the red team's rng.cpu list, at 256 MiB
      {"empty-objects", "junk", "{},"},          // the costliest value per byte, in a member no reader uses
  };
  for (const auto& s : shapes) {
    SCOPED_TRACE(s.name);
    const std::string dir = d + "/" + s.name;
    ASSERT_EQ(std::system(("cp -r " + d + "/base " + dir).c_str()), 0);
    ojson j = base;
    if (s.where == "l") j["entries"]["l"]["layout"]["pieces"] = "@FILL@";
    else j["junk"] = "@FILL@";
    std::string text = j.dump();
    const size_t at = text.find("\"@FILL@\"");
    const size_t room = ck::kMaxMetadataBytes - (text.size() - 8) - 2 - 30;  // the brackets, the checksum member
    std::string fill = "[";
    fill.reserve(room);
    while (fill.size() + s.unit.size() <= room) fill += s.unit;
    fill.back() = ']';
    text.replace(at, 8, fill);
    fill.clear();
    fill.shrink_to_fit();
    text = with_checksum(std::move(text));
    ASSERT_LE(text.size(), ck::kMaxMetadataBytes);
    ASSERT_GT(text.size(), ck::kMaxMetadataBytes - 64);
    write_bytes(dir + kMeta, text);
    text.clear();
    text.shrink_to_fit();
    const std::string want = "metadata holds more than 4194304 JSON values and keys";
    for (const bool cxx : {true, false}) {
      SCOPED_TRACE(cxx ? "tessera ckpt verify" : "python -m tessera_ckpt verify");
      const Measured m = measure(cxx ? concat(TESSERA_CLI, " ckpt verify ", dir)
                                     : concat(pkg_env(), python(), " -m tessera_ckpt verify ", dir));
      EXPECT_EQ(m.rc, 1) << m.out;
      EXPECT_CONTAINS(m.out, want);
      EXPECT_GT(m.peak_bytes, 0u) << m.out;
      EXPECT_LT(m.peak_bytes, 1000u * 1000 * 1000) << "peak RSS";
      EXPECT_LT(m.cpu_s, 10.0) << "CPU seconds";
    }
  }
}

// Item 4: at most 100 problems are listed, then how many more; a world size far above the data
// files present is one problem, found without opening them.
TEST(MetadataAgreement, VerifyListsAHundredProblemsThenCountsTheRest) {
  const std::string d = temp_dir("meta-verify");
  state::StateDict sd;
  for (int i = 0; i < 150; ++i) sd.set(concat("t", 1000 + i), at::full({4}, float(i), at::kFloat));
  const std::string dir = d + "/many";
  ck::save(sd, dir, *solo());
  // Every tensor's bytes damaged: 150 checksum mismatches.
  const std::string file = dir + "/data-rank00000.safetensors";
  std::string bytes = read_bytes(file);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  for (size_t i = 8 + n; i < bytes.size(); ++i) bytes[i] = static_cast<char>(~bytes[i]);
  write_bytes(file, bytes);
  const ck::VerifyReport r = ck::verify(dir);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.problems.size(), 100u);
  EXPECT_EQ(r.more_problems, 50);
  for (const bool cxx : {true, false}) {
    SCOPED_TRACE(cxx ? "tessera ckpt verify" : "python -m tessera_ckpt verify");
    auto [rc, out] = run_command(cxx ? concat(TESSERA_CLI, " ckpt verify ", dir)
                                     : concat(pkg_env(), python(), " -m tessera_ckpt verify ", dir));
    EXPECT_EQ(rc, 1);
    EXPECT_CONTAINS(out, "CORRUPT: " + dir + ": 150 problem(s)\n");
    size_t lines = 0, mismatches = 0;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      ++lines;
      mismatches += line.find("checksum mismatch") != std::string::npos;
    }
    EXPECT_EQ(mismatches, 100u) << out;
    EXPECT_EQ(lines, 102u) << out;  // CORRUPT, 100 problems, the count of the rest
    EXPECT_NE(out.find("and 50 more problem(s)\n"), std::string::npos) << out;
  }

  // world_size 2^20 over the one data file: one problem each, in the same words, quickly.
  const std::string wide = d + "/wide";
  ck::save(state_of(4, 1.0), wide, *solo());
  ojson j = read_metadata(wide);
  j["world_size"] = 1 << 20;
  write_bytes(wide + kMeta, with_checksum(j.dump()));
  std::string first[2];
  for (const bool cxx : {true, false}) {
    SCOPED_TRACE(cxx ? "tessera ckpt verify" : "python -m tessera_ckpt verify");
    const Measured m = measure(cxx ? concat(TESSERA_CLI, " ckpt verify ", wide)
                                   : concat(pkg_env(), python(), " -m tessera_ckpt verify ", wide));
    EXPECT_EQ(m.rc, 1) << m.out;
    EXPECT_CONTAINS(m.out, "CORRUPT: " + wide + ": 1 problem(s)\n");
    const std::string line = concat("'", wide,
                                    "': world_size is 1048576, but 1048575 of its data files are missing "
                                    "('data-rank00001.safetensors', 'data-rank00002.safetensors', "
                                    "'data-rank00003.safetensors', ...)");
    EXPECT_CONTAINS(m.out, line);
    EXPECT_LT(m.out.size(), 2000u) << "one problem, not one per rank";
    EXPECT_LT(m.cpu_s, 10.0) << "CPU seconds";
  }
}
