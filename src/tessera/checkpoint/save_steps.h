// Steps of a collective save that every rank takes together (internal to the checkpoint
// layer; save.cpp, save_full.cpp): every rank learning every rank's outcome, the check
// that the ranks agree on what they save, and the read-back of written bytes before a
// commit; and what the sharded and the consolidated save share (describing an entry,
// preparing the target, removing rank 0's temporary).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/stream_writer.h"
#include "tessera/distributed/communicator.h"
#include "tessera/state/state_dict.h"

namespace tessera::checkpoint {

// The two kinds of save, behind save() and save_async() (save_async.cpp): sharded
// (save.cpp) and consolidated (save_full.cpp).
void save_sharded(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm);
void save_full(const state::StateDict& sd, const std::string& path, distributed::Communicator& comm);

// The entry describing value `v` of key `fqn`: its kind, and a tensor's dtype and global
// shape, or the value itself. Throws for an undefined tensor or a dtype the format cannot
// store.
EntryInfo describe_entry(const std::string& fqn, const state::Value& v);

// Rank 0's preparation of the target `path` of a save, before anything is written:
// recovers what an interrupted save left beside it, checks that it may be replaced, and
// names in `tmp` the temporary sibling the save writes (created here as a directory when
// `dir`). Returns the error ("" on success) rather than throwing, for rank 0 to hand to
// the other ranks.
std::string prepare_target(const std::string& path, bool dir, std::string& tmp);

// Rank 0 removes the temporary it created on every way out of a save but the commit,
// an exception from a collective included.
struct TempGuard {
  std::string tmp;
  bool committed = false;
  ~TempGuard();
};

// Byte strings packed with explicit lengths (paths and messages may hold any byte, so
// nothing is sent as ad-hoc text with separators).
class Packer {
 public:
  Packer& u64(uint64_t v);
  Packer& str(const std::string& v);
  const std::string& bytes() const { return s_; }

 private:
  std::string s_;
};
class Unpacker {
 public:
  // `what` names the bytes in errors ("rank 2's status").
  Unpacker(const std::string& bytes, std::string what) : s_(bytes), what_(std::move(what)) {}
  Unpacker(std::string&& bytes, std::string what) = delete;  // reads `bytes` in place: keep it alive
  uint64_t u64();
  std::string str();
  bool done() const { return pos_ == s_.size(); }

 private:
  void need(uint64_t n) const;
  const std::string& s_;
  std::string what_;
  size_t pos_ = 0;
};

// What one rank tells the others at a step of a collective save: its error ("" when it
// succeeded) and what it has to say when it succeeded (any bytes).
struct RankOutcome {
  std::string error;
  std::string payload;
};

// Every rank's outcome, in rank order, learned by every rank with one all-gather: all
// then decide alike (fail together, or go on together) and nobody waits for a rank
// that gave up.
struct AllOutcomes {
  std::vector<RankOutcome> ranks;
  bool ok() const;
  // "rank 1: ...; rank 3: ..." ("" when every rank succeeded): the same text everywhere.
  std::string errors() const;
};
AllOutcomes exchange_status(distributed::Communicator& comm, const RankOutcome& mine);
// The same, throwing tessera::Error("<what>: rank r: ...") on every rank when any rank
// failed; else every rank's payload.
std::vector<std::string> exchange_or_throw(distributed::Communicator& comm, const std::string& error,
                                           const std::string& payload, const std::string& what);
// The outcome of a step every rank takes together, learned by every rank for O(1) bytes
// each (one all-reduce of three integers; a broadcast of the message only when a rank
// failed), whatever the world size: whether every rank succeeded, the lowest rank that
// failed and its error, and whether every rank passed the same digest.
struct Agreement {
  int failed_rank = -1;  // the lowest rank that failed; -1 when none did
  std::string error;     // its error
  bool same_digest = true;
  bool ok() const { return failed_rank < 0; }
  // "rank 3: <error>" ("" when ok): the same text on every rank.
  std::string message() const;
};
Agreement agree(distributed::Communicator& comm, const std::string& error, uint64_t digest = 0);
// The same, throwing tessera::Error("<what>: rank r: <error>") on every rank when a rank failed.
Agreement agree_or_throw(distributed::Communicator& comm, const std::string& error, const std::string& what,
                         uint64_t digest = 0);

// 64-bit FNV-1a of `bytes`.
uint64_t fnv1a64(const std::string& bytes);

// Rank 0's outcome (its error, or its payload) on every rank: throws
// tessera::Error("<what>: <error>") everywhere when rank 0 failed, else returns the payload.
std::string broadcast_or_throw(distributed::Communicator& comm, const std::string& rank0_error,
                               const std::string& rank0_payload, const std::string& what);

// What the ranks of a save must agree on, as (key, description) records in save order.
// A consolidated save's ranks write their bytes at offsets each computes from its own
// list of entries, matched by position: the description is the kind, dtype, shape and,
// for sharded tensors, every shard's box and rank. A sharded save's: the entry's JSON
// without a plain value's value (kind, dtype, shape, layout). Plain values are not
// compared: ranks may hold different ones (a per-rank metric), and rank 0's are written.
// The path is not among them: every rank writes into what rank 0 names.
struct SaveLayout {
  std::vector<std::pair<std::string, std::string>> records;
  std::string packed() const;
  // 64-bit FNV-1a of packed(), exchanged instead of the records themselves.
  uint64_t digest() const;
};
// What the ranks of a sharded save must agree on: each entry's JSON as format 2 writes it,
// but a plain value's kind only. Not the value: ranks may hold different plain values (a
// per-rank metric), as they may in a consolidated save, and rank 0's are written.
SaveLayout structure_of(const CheckpointMetadata& m);

// Refuses, on every rank alike, when the digests (`digests[r]`, one per rank, already
// exchanged) differ: the ranks then exchange their records (only then) and the error
// names the first rank that differs from rank 0, the first entry where it does, and
// what a save of `mode` needs. Collective when (and only when) the digests differ,
// which every rank sees alike.
void check_same_layout(distributed::Communicator& comm, const SaveLayout& mine, const std::vector<uint64_t>& digests,
                       const std::string& path, SaveMode mode);

// A byte range of a file and the checksum of the bytes written there.
struct WrittenRange {
  uint64_t at = 0;
  uint64_t len = 0;
  uint32_t crc = 0;
};
std::string pack_ranges(const std::vector<WrittenRange>& ranges);
std::vector<WrittenRange> unpack_ranges(const std::string& bytes, const std::string& what);

// One rank's part of a consolidated file that several ranks write at once: runs of
// bytes of tensors, each at its offset, checksummed per block of its tensor as it is
// copied (the pieces rank 0 joins into the header's block checksums). It also records
// the checksum of each run's bytes in the run's first and last page (io_page_size()):
// the pages it may share with another writer, where an incoherent filesystem or a
// wrong page size loses bytes.
class RunWriter {
 public:
  // `tensors`: each tensor's (file offset, byte size).
  RunWriter(const std::string& path, std::vector<std::pair<uint64_t, uint64_t>> tensors);
  // Writes `t` (any device, layout) at byte `off` of tensor `ti`.
  void write(size_t ti, uint64_t off, const at::Tensor& t);
  void finish();
  const std::vector<CrcPiece>& pieces() const { return pieces_; }
  const std::vector<WrittenRange>& edges() const { return edges_; }

 private:
  void note_edges(uint64_t at, const unsigned char* p, uint64_t n);
  void close_run();
  StreamWriter out_;
  std::vector<std::pair<uint64_t, uint64_t>> tensors_;
  std::vector<CrcPiece> pieces_;
  std::vector<WrittenRange> edges_;
  uint64_t page_;
  bool in_run_ = false;
  uint64_t run_start_ = 0, run_end_ = 0;
  WrittenRange head_, tail_;
};

// The ranges of `pieces` (bytes of tensors) in the file: piece p is at
// tensor_offsets[p.tensor] + p.begin.
std::vector<WrittenRange> piece_ranges(const std::vector<CrcPiece>& pieces, const std::vector<uint64_t>& tensor_offsets);

// Reads back `ranges` of `path`, which `writer` ("rank 1") wrote, and checks each against
// the checksum it was written with. Reads past this host's page cache: O_DIRECT where the
// filesystem allows (DirectReader), else after dropping the cached pages. `tensors`: each
// tensor's (file offset, key), in file order, to name the key in the error. Throws
// tessera::Error naming the file, the bytes, the key and the writer at the first range
// that differs.
void verify_read_back(const std::string& path, std::vector<WrittenRange> ranges,
                      const std::vector<std::pair<uint64_t, std::string>>& tensors, const std::string& writer);

// Which kernel (and so which page cache) this process runs on: the boot id, and the host
// name where there is none. Ranks that print the same share a page cache.
std::string kernel_identity();

// Test fault "flip" (below): inverts the byte at `at` of `path` and fsyncs.
void flip_byte(const std::string& path, uint64_t at);

// Tests only (issue 35): whether TESSERA_TEST_SAVE_FAULT is "<rank>:<what>" for this
// rank and fault. save_full.cpp reads it to make a consolidated save fail on one rank:
// "write" throws where the rank hands a piece to its writer (as a failed narrow, copy or
// thread start would), "flip" inverts a byte the rank wrote after its fsync (as a write
// lost on an incoherent filesystem would). Not set in any real run.
bool test_fault(int rank, const char* what);

// Tests only: each later save_async's background thread calls `hook` before it writes
// anything (an exception from it fails that save); tests block in it to see that
// save_async returned while the write had not begun. Empty: no hook (the default).
// Here, not in checkpoint.h, so that it is not part of the installed interface.
void set_async_save_hook_for_tests(std::function<void()> hook);

}  // namespace tessera::checkpoint
