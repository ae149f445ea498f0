// `tessera ckpt` messages for inputs and outputs that are not what the command expects
// (issue 35, item 19): an output path that is a symbolic link is refused naming it (never
// replaced by a directory or a file, never written through); `verify` of a directory that is
// no checkpoint (a directory of safetensors files, a DCP checkpoint) says what it is and
// exits 2, not "CORRUPT" with 1 (a Hugging Face model directory is read since issue 36: a
// broken one is CORRUPT, tests/checkpoint/test_hf_dir.cpp); `import-dcp -o x.safetensors` is
// refused (the import is a directory); a legacy (non-zip) torch.save file is named as such
// by the C++ tool and the Python reader, not "safetensors header length 378233903972992".
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "checkpoint/dcp_fixture.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/offline/dcp_import.h"
#include "tessera/checkpoint/offline/offline.h"

using namespace tessera;
using namespace tessera::testing;
using namespace std::string_literals;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

const std::string kCli = TESSERA_CLI;

// The tests' Python (scripts/setup-python.sh); the package's file checks need only the
// standard library, so any python3 does where that environment is not made.
std::string python() { return fs::exists(TESSERA_PYTHON) ? std::string(TESSERA_PYTHON) : std::string("python3"); }

// What torch.save(obj, f, _use_new_zipfile_serialization=False) writes first: pickles of
// the magic number (protocol 2, LONG1), the protocol version 1001 and a sys_info dict.
std::string legacy_torch_save() {
  std::string s = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19."s;
  s += "\x80\x02M\xe9\x03."s;
  s += "\x80\x02}q\x00(X\x10\x00\x00\x00" "protocol_versionq\x01M\xe9\x03u."s;
  s += std::string(256, '\0');
  return s;
}

}  // namespace

// `export --force -o LINK` said "cannot remove empty 'hf/link': Not a directory" (a link to
// an empty directory) or replaced the link by the output; `consolidate --force` onto a link
// to a checkpoint file replaced the link. Both refused now, naming the link; link and
// target as they were.
TEST(CkptUntrustedCli, OutputThatIsASymlinkIsRefusedNamingIt) {
  const std::string dir = temp_dir("tessera-cli-outlink");
  const std::string src = dir + "/ck";
  ck::save(state_of(16, 2), src, *solo());
  fs::create_directory(dir + "/hf");
  fs::create_directory(dir + "/empty");
  fs::create_directory_symlink(dir + "/empty", dir + "/hf/link");
  auto [rc, text] = run_command(kCli + " ckpt export " + src + " --format hf --force -o " + dir + "/hf/link");
  EXPECT_EQ(rc, 2) << text;
  EXPECT_CONTAINS(text, "output '" + dir + "/hf/link' is a symbolic link (to '" + dir + "/empty')");
  EXPECT_EQ(text.find("cannot remove"), std::string::npos) << text;
  EXPECT_TRUE(fs::is_symlink(dir + "/hf/link"));
  EXPECT_TRUE(fs::is_empty(dir + "/empty"));

  const std::string file = dir + "/full.safetensors";
  ck::save(state_of(16, 5), file, *solo(), {ck::SaveMode::Full});
  const std::string before = read_bytes(file);
  fs::create_symlink(file, dir + "/alias.safetensors");
  auto [rcc, ctext] = run_command(kCli + " ckpt consolidate " + src + " --force -o " + dir + "/alias.safetensors");
  EXPECT_EQ(rcc, 2) << ctext;
  EXPECT_CONTAINS(ctext, "output '" + dir + "/alias.safetensors' is a symbolic link");
  EXPECT_TRUE(fs::is_symlink(dir + "/alias.safetensors"));
  EXPECT_EQ(read_bytes(file), before);

  // The library's import-dcp refuses one too (the CLI checks before it).
  const std::string dcp_dir = dir + "/dcp";
  fs::create_directory(dcp_dir);
  dcp::write_checkpoint(dcp_dir, {dcp::Tensor{"w", at::arange(4, at::kFloat), {{{0}, {4}, "__0_0.distcp"}}}});
  fs::create_directory_symlink(dir + "/empty", dir + "/dcp-link");
  EXPECT_CONTAINS(error_of([&] { ck::import_dcp(dcp_dir, dir + "/dcp-link", true); }),
                  "output '" + dir + "/dcp-link' is a symbolic link");
  EXPECT_TRUE(fs::is_empty(dir + "/empty"));

  // So do the library's consolidate, reshard and export (one check serves every command that
  // writes: checkpoint::check_output_path), with and without --force, naming the command.
  fs::create_directory_symlink(dir + "/empty", dir + "/dir-link");
  for (bool force : {false, true}) {
    EXPECT_CONTAINS(error_of([&] { ck::reshard(src, 3, dir + "/dir-link/", force); }),
                    "output '" + dir + "/dir-link/' is a symbolic link (to '" + dir + "/empty'): reshard neither");
    EXPECT_CONTAINS(error_of([&] { ck::consolidate(src, dir + "/alias.safetensors", force); }),
                    "consolidate neither replaces a link");
    EXPECT_CONTAINS(error_of([&] { ck::export_checkpoint(src, ck::ExportFormat::Safetensors,
                                                         dir + "/alias.safetensors", force); }),
                    "export neither replaces a link");
  }
  EXPECT_TRUE(fs::is_empty(dir + "/empty"));
  EXPECT_EQ(read_bytes(file), before);
  // A sharded output named like a file is refused as import-dcp's is.
  EXPECT_CONTAINS(error_of([&] { ck::reshard(src, 3, dir + "/r.safetensors", false); }),
                  "output '" + dir + "/r.safetensors' ends in .safetensors, but reshard writes a directory");
  EXPECT_FALSE(fs::exists(dir + "/r.safetensors"));
}

// `verify DIR` of a directory of safetensors files printed "CORRUPT" (exit 1); a directory
// that is no checkpoint at all is an input error (exit 2) saying what it is. A Tessera
// checkpoint that lost its metadata file is still corrupt (exit 1), and so is a Hugging Face
// model directory whose index and shards are broken (it is read as a checkpoint).
TEST(CkptUntrustedCli, VerifyOfAForeignDirectorySaysWhatItIs) {
  const std::string dir = temp_dir("tessera-cli-foreign");
  const std::string other = dir + "/other";
  fs::create_directory(other);
  write_bytes(other + "/consolidated.safetensors", "x");
  write_bytes(other + "/adapter.safetensors", "y");
  auto [rc, text] = run_command(kCli + " ckpt verify " + other);
  EXPECT_EQ(rc, 2) << text;
  EXPECT_CONTAINS(text, "'" + other + "' is not a Tessera checkpoint: it is a directory of 2 safetensors file(s) "
                        "(not a Hugging Face model directory: no model.safetensors.index.json or "
                        "model.safetensors)");
  EXPECT_CONTAINS(text, "tessera ckpt verify " + other + "/adapter.safetensors");
  EXPECT_EQ(text.find("CORRUPT"), std::string::npos) << text;

  const std::string hf = dir + "/hf";
  fs::create_directory(hf);
  write_bytes(hf + "/model.safetensors.index.json",
              "{\"metadata\": {}, \"weight_map\": {\"w\": \"model-00001-of-00002.safetensors\"}}");
  write_bytes(hf + "/model-00001-of-00002.safetensors", "x");
  auto [hrc, htext] = run_command(kCli + " ckpt verify " + hf);
  EXPECT_EQ(hrc, 1) << htext;
  EXPECT_CONTAINS(htext, "CORRUPT: " + hf + ": 1 problem(s)");
  EXPECT_CONTAINS(htext, "'" + hf + "/model-00001-of-00002.safetensors'");

  const std::string lost = dir + "/lost";
  ck::save(state_of(16, 2), lost, *solo());
  fs::remove(lost + "/tessera-checkpoint.json");
  auto [rcl, ltext] = run_command(kCli + " ckpt verify " + lost);
  EXPECT_EQ(rcl, 1) << ltext;
  EXPECT_CONTAINS(ltext, "CORRUPT");
}

// `import-dcp -o x.safetensors` wrote a directory of that name; the import is a sharded
// checkpoint, so such a name is refused, pointing to consolidate.
TEST(CkptUntrustedCli, ImportDcpToASafetensorsNameIsRefused) {
  const std::string dir = temp_dir("tessera-cli-dcp-name");
  const std::string src = dir + "/dcp";
  fs::create_directory(src);
  dcp::write_checkpoint(src, {dcp::Tensor{"w", at::arange(4, at::kFloat), {{{0}, {4}, "__0_0.distcp"}}}});
  auto [rc, text] = run_command(kCli + " ckpt import-dcp " + src + " -o " + dir + "/x.safetensors");
  EXPECT_EQ(rc, 2) << text;
  EXPECT_CONTAINS(text, "output '" + dir + "/x.safetensors' ends in .safetensors");
  EXPECT_CONTAINS(text, "tessera ckpt consolidate DIR -o x.safetensors");
  EXPECT_FALSE(fs::exists(dir + "/x.safetensors"));
  // A directory name works.
  const ck::DcpImportResult r = ck::import_dcp(src, dir + "/x", false);
  EXPECT_EQ(r.tensors, 1);
}

// A legacy (non-zip) torch.save file was "safetensors header length 378233903972992
// exceeds the limit" in C++ and in Python; now both name the format and how to re-save.
// A real safetensors file whose header length begins with the same two bytes (640 =
// 0x0280: 0x80 0x02) is still read.
TEST(CkptUntrustedCli, LegacyTorchSaveFileIsNamedAsSuch) {
  const std::string dir = temp_dir("tessera-cli-legacy");
  const std::string old = dir + "/old.pt";
  write_bytes(old, legacy_torch_save());
  const std::string want = "'" + old + "' is a Python pickle, not a zip archive or a safetensors file: the legacy "
                           "(non-zip) torch.save format is not supported; re-save it with torch.save(obj, path, "
                           "_use_new_zipfile_serialization=True)";
  auto [rc, text] = run_command(kCli + " ckpt inspect " + old);
  EXPECT_EQ(rc, 2) << text;
  EXPECT_CONTAINS(text, want);
  EXPECT_EQ(text.find("header length"), std::string::npos) << text;
  auto [rcv, vtext] = run_command(kCli + " ckpt verify " + old);
  EXPECT_EQ(rcv, 2) << vtext;
  EXPECT_CONTAINS(vtext, want);
  EXPECT_EQ(vtext.find("CORRUPT"), std::string::npos) << vtext;

  // pickle.dump of a dict (protocol 2), the red-team's file: the same.
  const std::string dumped = dir + "/dumped.pt";
  write_bytes(dumped, "\x80\x02}q\x00X\x01\x00\x00\x00" "aq\x01K\x01s."s + std::string(64, ' '));
  EXPECT_CONTAINS(error_of([&] { ck::inspect(dumped); }), "'" + dumped + "' is a Python pickle");

  // The Python reader.
  const std::string script = dir + "/check.py";
  write_bytes(script, "import sys\nsys.path.insert(0, sys.argv[1])\nimport tessera_ckpt\n"
                      "try:\n    tessera_ckpt.inspect(sys.argv[2])\n"
                      "except tessera_ckpt.CheckpointError as e:\n    print('refused:', e)\n    sys.exit(0)\n"
                      "print('accepted')\nsys.exit(1)\n");
  auto [prc, ptext] = run_command(python() + " " + script + " " + TESSERA_SOURCE_DIR + "/python " + old);
  EXPECT_EQ(prc, 0) << ptext;
  EXPECT_CONTAINS(ptext, want);

  // A safetensors file with a 640-byte header: read, in C++ and in Python.
  std::string header = "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
  header.resize(640, ' ');
  const std::string st = dir + "/ok.safetensors";
  write_bytes(st, "\x80\x02\0\0\0\0\0\0"s + header + "\0\0\x80\x3f"s);
  EXPECT_CONTAINS(ck::inspect(st), "w");
  auto [prc2, ptext2] = run_command(python() + " " + script + " " + TESSERA_SOURCE_DIR + "/python " + st);
  EXPECT_EQ(prc2, 1) << ptext2;
  EXPECT_CONTAINS(ptext2, "accepted");
}
