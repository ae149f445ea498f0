// SyncQueue (storage/sync_queue.h): files handed over open are fsynced and closed off the
// caller's thread; wait() returns when all are, and reports the first failure by name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "support/test_util.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/stream_writer.h"
#include "tessera/checkpoint/storage/sync_queue.h"
#include "tessera/core/error.h"

using namespace tessera;
using namespace tessera::checkpoint;
using namespace tessera::testing;

// More files than may wait at once, on one thread: add() waits for room, every file ends
// with exactly its bytes, and wait() (twice) returns without an error.
TEST(SyncQueue, SyncsEveryFileHandedOver) {
  const std::string dir = temp_dir();
  SyncQueue q(1, 2);
  for (int i = 0; i < 9; ++i) {
    const std::string text = "file " + std::to_string(i) + std::string(static_cast<size_t>(i) * 1000, 'x');
    StreamWriter w(dir + "/f" + std::to_string(i), 4096);
    w.append(text.data(), text.size());
    File unsynced;
    w.finish(&unsynced);
    ASSERT_TRUE(unsynced.is_open());
    q.add(std::move(unsynced));
  }
  q.wait();
  q.wait();
  for (int i = 0; i < 9; ++i)
    EXPECT_EQ(read_bytes(dir + "/f" + std::to_string(i)),
              "file " + std::to_string(i) + std::string(static_cast<size_t>(i) * 1000, 'x'));
}

// A descriptor fsync refuses (a pipe): wait() throws an Error naming it, once; the other
// files are still synced.
TEST(SyncQueue, ReportsTheFailedFileByName) {
  const std::string dir = temp_dir();
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  ::close(p[1]);
  SyncQueue q(4);
  q.add(File(dir + "/ok", "w"));
  q.add(File::adopt(p[0], "the-pipe"));
  try {
    q.wait();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the-pipe"), std::string::npos) << e.what();
  }
  q.add(File(dir + "/ok2", "w"));
  EXPECT_NO_THROW(q.wait());
}
