// TensorBoardLogger: event files parsed back by the independent TFRecord + protobuf reader
// in trainer_test_util.h (with its own bitwise CRC32C), ranks other than 0, and TensorBoard.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/trainer/tensorboard_logger.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

TEST(TensorBoardLogger, IndependentReaderChecksItself) {
  EXPECT_EQ(crc32c_bitwise("123456789"), 0xe3069283u);  // the CRC32C check value
  EXPECT_EQ(trainer::tfevents::masked_crc32c("123456789", 9), masked(0xe3069283u));
  size_t pos = 0;
  EXPECT_EQ(varint(std::string("\xac\x02", 2), pos), 300u);
}

TEST(TensorBoardLogger, EventFileReadBackByIndependentReader) {
  const std::string root = temp_dir("tessera-loggers");
  trainer::TensorBoardLogger tb(root, "tb");
  tb.setup(true, {});
  EXPECT_EQ(tb.name(), "tensorboard");
  EXPECT_EQ(tb.log_dir(), root + "/tb/version_0");
  const double before = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  tb.log_hyperparams({{"lr", "0.1"}, {"note", "a|b"}});
  tb.log_metrics({{"train_loss", 0.5}, {"epoch", 0}}, 1);
  tb.log_metrics({{"train_loss", -0.25}}, 2);
  tb.log_metrics({{"val_loss", 1.5e-7}}, int64_t{5} << 33);  // multi-byte varint step
  tb.save();  // flushed, not closed: a running TensorBoard must see all of it

  const auto files = event_files(tb.log_dir());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0], tb.events_path());
  EXPECT_EQ(fs::path(files[0]).filename().string().rfind("events.out.tfevents.", 0), 0u);
  EXPECT_TRUE(fs::exists(tb.log_dir() + "/hparams.yaml"));
  std::string bytes = read_bytes(files[0]);
  Records rec = read_tfrecords(bytes);
  ASSERT_EQ(rec.error, "");
  ASSERT_EQ(rec.data.size(), 6u);  // version, hparams text, 4 scalars

  Event v = decode_event(rec.data[0]);
  EXPECT_EQ(v.file_version, "brain.Event:2");
  EXPECT_GE(v.wall_time, before - 1);
  EXPECT_LE(v.wall_time, before + 600);
  Event h = decode_event(rec.data[1]);
  ASSERT_EQ(h.values.size(), 1u);
  EXPECT_EQ(h.values[0].tag, "hparams");
  EXPECT_EQ(h.values[0].plugin, "text");
  EXPECT_CONTAINS(h.values[0].text, "| lr | 0.1 |");
  EXPECT_CONTAINS(h.values[0].text, "| note | a\\|b |");

  struct Want {
    int64_t step;
    std::string tag;
    float value;
  };
  const std::vector<Want> want = {{1, "epoch", 0.f},
                                  {1, "train_loss", 0.5f},
                                  {2, "train_loss", -0.25f},
                                  {int64_t{5} << 33, "val_loss", 1.5e-7f}};
  for (size_t i = 0; i < want.size(); ++i) {
    Event e = decode_event(rec.data[2 + i]);
    SCOPED_TRACE(want[i].tag);
    EXPECT_EQ(e.step, want[i].step);
    ASSERT_EQ(e.values.size(), 1u);
    EXPECT_EQ(e.values[0].tag, want[i].tag);
    ASSERT_TRUE(e.values[0].simple_value.has_value());
    EXPECT_EQ(*e.values[0].simple_value, want[i].value);
    EXPECT_GE(e.wall_time, v.wall_time);
  }

  // More records after a save keep the file valid; finalize closes it.
  tb.log_metrics({{"train_loss", 0.125}}, 3);
  tb.finalize();
  Records more = read_tfrecords(read_bytes(files[0]));
  EXPECT_EQ(more.error, "");
  ASSERT_EQ(more.data.size(), 7u);
  EXPECT_EQ(decode_event(more.data[6]).step, 3);

  // The reader notices a cut-off last record, and a flipped bit in data or length.
  const std::string full = read_bytes(files[0]);
  const size_t last_start = full.size() - (12 + more.data[6].size() + 4);
  Records cut = read_tfrecords(full.substr(0, full.size() - 3));
  EXPECT_EQ(cut.error, "truncated record at offset " + std::to_string(last_start));
  EXPECT_EQ(cut.data.size(), 6u);
  EXPECT_EQ(read_tfrecords(full.substr(0, last_start + 5)).error, "truncated header at offset " + std::to_string(last_start));
  std::string flipped = full;
  flipped[last_start + 14] ^= 0x10;
  EXPECT_EQ(read_tfrecords(flipped).error, "data crc mismatch at offset " + std::to_string(last_start));
  flipped = full;
  flipped[last_start] ^= 0x01;
  EXPECT_EQ(read_tfrecords(flipped).error, "length crc mismatch at offset " + std::to_string(last_start));
}

TEST(TensorBoardLogger, RankOtherThanZeroWritesNothing) {
  const std::string root = temp_dir("tessera-loggers");
  trainer::TensorBoardLogger tb(root);
  tb.setup(false, [&](const std::string&) { return root + "/shared"; });
  tb.log_hyperparams({{"a", "b"}});
  tb.log_metrics({{"x", 1}}, 1);
  tb.save();
  tb.finalize();
  EXPECT_EQ(tb.log_dir(), root + "/shared");
  EXPECT_EQ(tb.events_path(), "");
  EXPECT_FALSE(fs::exists(root + "/shared"));
}

TEST(TensorBoardLogger, ReadByTensorBoard) {
  auto [rc, out] = run_command(std::string(TESSERA_PYTHON) + " -c 'import tensorboard'");
  ASSERT_EQ(rc, 0) << TESSERA_PYTHON << " has no tensorboard package (make test installs the project environment "
                   << "with scripts/setup-python.sh): " << out;
  const std::string root = temp_dir("tessera-loggers");
  auto tb = trainer::TensorBoardLogger::flat(root);
  tb->log_metrics({{"loss", 0.75}}, 4);
  tb->finalize();
  const std::string script =
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as A\n"
      "a = A('" + root + "'); a.Reload()\n"
      "s = a.Scalars('loss'); print(len(s), s[0].step, s[0].value)\n";
  write_bytes(root + "/check.py", script);
  auto [rc2, out2] = run_command(std::string(TESSERA_PYTHON) + " " + root + "/check.py");
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_CONTAINS(out2, "1 4 0.75");
}
