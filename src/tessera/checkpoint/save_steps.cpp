#include "tessera/checkpoint/save_steps.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/direct_reader.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/stream_writer.h"
#include "tessera/checkpoint/writer.h"
#include "tessera/core/env.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {

// ------------------------------------------------------------------ packing

Packer& Packer::u64(uint64_t v) {
  for (int i = 0; i < 8; ++i) s_ += static_cast<char>((v >> (8 * i)) & 0xff);
  return *this;
}
Packer& Packer::str(const std::string& v) {
  u64(v.size());
  s_ += v;
  return *this;
}

void Unpacker::need(uint64_t n) const {
  TESSERA_CHECK(n <= s_.size() - pos_, "internal: ", what_, " is truncated (", s_.size(), " bytes)");
}
uint64_t Unpacker::u64() {
  need(8);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s_[pos_ + i])) << (8 * i);
  pos_ += 8;
  return v;
}
std::string Unpacker::str() {
  const uint64_t n = u64();
  need(n);
  std::string v = s_.substr(pos_, n);
  pos_ += n;
  return v;
}

// ------------------------------------------------------------------ what both saves share

EntryInfo describe_entry(const std::string& fqn, const state::Value& v) {
  EntryInfo e;
  if (auto t = std::get_if<at::Tensor>(&v)) {
    TESSERA_CHECK(t->defined(), "cannot save key '", fqn, "': undefined tensor");
    e.kind = kTensorKind;
    e.dtype = t->scalar_type();
    e.shape = t->sizes().vec();
    dtype_name(e.dtype);  // throws for unsupported dtypes
  } else if (auto s = std::get_if<sharding::ShardedTensor>(&v)) {
    TESSERA_CHECK(s->defined(), "cannot save key '", fqn, "': undefined sharded tensor");
    e.kind = kShardedKind;
    e.dtype = s->dtype();
    e.shape = s->shape();
    dtype_name(e.dtype);
  } else {
    e.kind = state::kind_name(v);
    e.value = v;
  }
  return e;
}

std::string prepare_target(const std::string& path, bool dir, std::string& tmp) {
  try {
    recover_siblings(path);
    check_replaceable(path);
    tmp = temp_sibling(path);
    if (dir) make_dir(tmp);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

TempGuard::~TempGuard() {
  if (committed || tmp.empty()) return;
  try {
    remove_all(tmp);
  } catch (const std::exception&) {
  }
}

// ------------------------------------------------------------------ outcomes

bool AllOutcomes::ok() const {
  return std::all_of(ranks.begin(), ranks.end(), [](const RankOutcome& s) { return s.error.empty(); });
}

std::string AllOutcomes::errors() const {
  std::string out;
  for (size_t r = 0; r < ranks.size(); ++r)
    if (!ranks[r].error.empty()) out += concat(out.empty() ? "" : "; ", "rank ", r, ": ", ranks[r].error);
  return out;
}

AllOutcomes exchange_status(distributed::Communicator& comm, const RankOutcome& mine) {
  // An error is sent without the payload: a failed rank has nothing to say.
  const auto all = comm.all_gather_bytes(Packer().str(mine.error).str(mine.error.empty() ? mine.payload : "").bytes());
  AllOutcomes out;
  out.ranks.resize(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    Unpacker in(all[r], concat("rank ", r, "'s status"));
    out.ranks[r].error = in.str();
    out.ranks[r].payload = in.str();
  }
  return out;
}

std::vector<std::string> exchange_or_throw(distributed::Communicator& comm, const std::string& error,
                                           const std::string& payload, const std::string& what) {
  AllOutcomes s = exchange_status(comm, {error, payload});
  TESSERA_CHECK(s.ok(), what, ": ", s.errors());
  std::vector<std::string> out;
  out.reserve(s.ranks.size());
  for (auto& r : s.ranks) out.push_back(std::move(r.payload));
  return out;
}

std::string Agreement::message() const { return ok() ? std::string() : concat("rank ", failed_rank, ": ", error); }

Agreement agree(distributed::Communicator& comm, const std::string& error, uint64_t digest) {
  const int64_t n = comm.size();
  const int64_t d = static_cast<int64_t>(digest >> 2);  // 62 bits: both d and -d fit
  at::Tensor t = at::tensor({error.empty() ? n : static_cast<int64_t>(comm.rank()), d, -d}, at::kLong);
  comm.all_reduce(t, distributed::ReduceOp::Min);
  const int64_t* v = t.data_ptr<int64_t>();
  Agreement a;
  a.same_digest = v[1] == -v[2];
  if (v[0] < n) {
    a.failed_rank = static_cast<int>(v[0]);
    a.error = comm.broadcast_bytes(comm.rank() == a.failed_rank ? error : std::string(), a.failed_rank);
  }
  return a;
}

Agreement agree_or_throw(distributed::Communicator& comm, const std::string& error, const std::string& what,
                         uint64_t digest) {
  Agreement a = agree(comm, error, digest);
  TESSERA_CHECK(a.ok(), what, ": ", a.message());
  return a;
}

uint64_t fnv1a64(const std::string& bytes) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string broadcast_or_throw(distributed::Communicator& comm, const std::string& rank0_error,
                               const std::string& rank0_payload, const std::string& what) {
  const std::string b = comm.broadcast_bytes(
      comm.rank() == 0 ? Packer().str(rank0_error).str(rank0_payload).bytes() : std::string(), 0);
  Unpacker in(b, "rank 0's status");
  const std::string e = in.str();
  TESSERA_CHECK(e.empty(), what, ": ", e);
  return in.str();
}

// ------------------------------------------------------------------ layout agreement

std::string SaveLayout::packed() const {
  Packer p;
  p.u64(records.size());
  for (const auto& [k, d] : records) p.str(k).str(d);
  return p.bytes();
}

uint64_t SaveLayout::digest() const { return fnv1a64(packed()); }

SaveLayout structure_of(const CheckpointMetadata& m) {
  SaveLayout out;
  out.records.reserve(m.keys.size());
  for (const auto& k : m.keys) {
    const EntryInfo& e = m.entries.at(k);
    out.records.emplace_back(k, e.is_tensor() ? entry_json(e) : e.kind);
  }
  return out;
}

void check_same_layout(distributed::Communicator& comm, const SaveLayout& mine, const std::vector<uint64_t>& digests,
                       const std::string& path, SaveMode mode) {
  std::vector<size_t> differ;
  for (size_t r = 1; r < digests.size(); ++r)
    if (digests[r] != digests[0]) differ.push_back(r);
  if (differ.empty()) return;
  // Every rank saw the same digests, so every rank takes this exchange.
  const auto all = comm.all_gather_bytes(mine.packed());
  auto records = [&](size_t r) {
    Unpacker in(all[r], concat("rank ", r, "'s list of entries"));
    const uint64_t n = in.u64();
    TESSERA_CHECK(n <= all[r].size() / 16, "internal: rank ", r, "'s list of entries is truncated");
    std::vector<std::pair<std::string, std::string>> out(n);
    for (auto& [k, d] : out) {
      k = in.str();
      d = in.str();
    }
    return out;
  };
  const size_t r = differ[0];
  const auto a = records(0), b = records(r);
  std::string where;
  for (size_t i = 0; i < std::max(a.size(), b.size()) && where.empty(); ++i) {
    if (i < a.size() && i < b.size() && a[i] == b[i]) continue;
    auto show = [&](const std::vector<std::pair<std::string, std::string>>& v) {
      return i < v.size() ? concat("'", escape_path(v[i].first), "' (", v[i].second, ")") : std::string("none");
    };
    where = concat("entry ", i, " is ", show(a), " on rank 0, ", show(b), " on rank ", r);
  }
  if (where.empty()) where = "in the same entries (a digest collision)";
  std::string others;
  for (size_t i = 1; i < differ.size(); ++i) others += concat(i == 1 ? "" : ", ", differ[i]);
  throw Error(concat("saving '", path, "': rank ", r, " differs from rank 0 in what it saves: ", where,
                     others.empty() ? "" : concat(" (", differ.size() == 2 ? "rank " : "ranks ", others,
                                                  differ.size() == 2 ? " differs" : " differ", " too)"),
                     mode == SaveMode::Full
                         ? ". A consolidated save needs the same keys, in the same order, with the same kinds, dtypes, "
                           "shapes and shards on every rank; nothing was written"
                         : ". A sharded save needs the same keys, in the same order, with the same kinds, dtypes, "
                           "shapes and layouts on every rank (plain values may differ: rank 0's are written); "
                           "nothing was written"));
}

// ------------------------------------------------------------------ writing

std::string pack_ranges(const std::vector<WrittenRange>& ranges) {
  Packer p;
  p.u64(ranges.size());
  for (const auto& r : ranges) p.u64(r.at).u64(r.len).u64(r.crc);
  return p.bytes();
}

std::vector<WrittenRange> unpack_ranges(const std::string& bytes, const std::string& what) {
  Unpacker in(bytes, what);
  const uint64_t n = in.u64();
  TESSERA_CHECK(n <= bytes.size() / 24, "internal: ", what, " is truncated");
  std::vector<WrittenRange> out(n);
  for (auto& r : out) {
    r.at = in.u64();
    r.len = in.u64();
    r.crc = static_cast<uint32_t>(in.u64());
  }
  return out;
}

RunWriter::RunWriter(const std::string& path, std::vector<std::pair<uint64_t, uint64_t>> tensors)
    : out_(path, 16u << 20, StreamWriter::Open::Existing), tensors_(std::move(tensors)), page_(io_page_size()) {}

void RunWriter::write(size_t ti, uint64_t off, const at::Tensor& t) {
  const at::Tensor c = dense_cpu(t);
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  uint64_t n = static_cast<uint64_t>(c.numel()) * c.element_size();
  TESSERA_CHECK(off + n <= tensors_.at(ti).second, "internal: bytes ", off, "..", off + n, " of tensor ", ti,
                " past its ", tensors_[ti].second);
  out_.seek(tensors_[ti].first + off);
  note_edges(tensors_[ti].first + off, p, n);
  // Checksummed in 256 KiB steps just before each step is copied, while it is in cache.
  CrcPiece cur{static_cast<uint32_t>(ti), off, 0, 0};
  while (n > 0) {
    const uint64_t take = std::min<uint64_t>({n, kCrcBlock - off % kCrcBlock, 256u << 10});
    cur.crc = crc32c_extend(cur.crc, p, static_cast<size_t>(take));
    out_.append(p, take);
    cur.len += take;
    p += take;
    off += take;
    n -= take;
    if (off % kCrcBlock == 0 || n == 0) {
      pieces_.push_back(cur);
      cur = CrcPiece{static_cast<uint32_t>(ti), off, 0, 0};
    }
  }
}

// A run is what this writer writes without a gap; a write elsewhere starts a new one.
void RunWriter::note_edges(uint64_t at, const unsigned char* p, uint64_t n) {
  if (n == 0) return;
  if (!in_run_ || at != run_end_) {
    close_run();
    in_run_ = true;
    run_start_ = run_end_ = at;
    head_ = tail_ = WrittenRange{at, 0, 0};
  }
  const uint64_t end = at + n;
  // The run's bytes in its first page.
  const uint64_t head_limit = (run_start_ / page_ + 1) * page_;
  if (run_end_ < head_limit) {
    const uint64_t take = std::min(end, head_limit) - run_end_;
    head_.crc = crc32c_extend(head_.crc, p, static_cast<size_t>(take));
    head_.len += take;
  }
  // The run's bytes in the page of its last byte: that page began in this write, or
  // (a write shorter than a page) in an earlier one, where tail_ already starts.
  const uint64_t tail_start = std::max(run_start_, (end - 1) / page_ * page_);
  if (tail_start >= at) {
    tail_ = WrittenRange{tail_start, end - tail_start, crc32c(p + (tail_start - at), static_cast<size_t>(end - tail_start))};
  } else {
    tail_.crc = crc32c_extend(tail_.crc, p, static_cast<size_t>(n));
    tail_.len += n;
  }
  run_end_ = end;
}

void RunWriter::close_run() {
  if (!in_run_) return;
  edges_.push_back(head_);
  if (tail_.at != head_.at) edges_.push_back(tail_);
  in_run_ = false;
}

void RunWriter::finish() {
  close_run();
  out_.finish();
}

// ------------------------------------------------------------------ read-back

std::vector<WrittenRange> piece_ranges(const std::vector<CrcPiece>& pieces, const std::vector<uint64_t>& tensor_offsets) {
  std::vector<WrittenRange> out;
  out.reserve(pieces.size());
  for (const auto& p : pieces) {
    TESSERA_CHECK(p.tensor < tensor_offsets.size(), "internal: a piece of tensor ", p.tensor, " of ",
                  tensor_offsets.size());
    out.push_back({tensor_offsets[p.tensor] + p.begin, p.len, p.crc});
  }
  return out;
}

void verify_read_back(const std::string& path, std::vector<WrittenRange> ranges,
                      const std::vector<std::pair<uint64_t, std::string>>& tensors, const std::string& writer) {
  if (ranges.empty()) return;
  std::sort(ranges.begin(), ranges.end(), [](const WrittenRange& x, const WrittenRange& y) { return x.at < y.at; });
  File f(path, "r");
  DirectReader reader;
  // Without O_DIRECT, this host's cached copy goes first (clean pages: all is fsync'ed).
  if (!reader.direct(f)) (void)::posix_fadvise(f.fd(), 0, 0, POSIX_FADV_DONTNEED);
  // Windows of adjacent ranges (a writer's run of rows), at most 32 MiB plus one range.
  constexpr uint64_t kWindow = 32u << 20;
  std::unique_ptr<char[]> buf;
  uint64_t cap = 0;
  for (size_t i = 0; i < ranges.size();) {
    const uint64_t start = ranges[i].at;
    uint64_t end = start + ranges[i].len;
    size_t j = i + 1;
    while (j < ranges.size() && ranges[j].at == end && end - start < kWindow) end += ranges[j++].len;
    const uint64_t n = end - start;
    if (n > cap) {
      buf.reset(new char[n]);
      cap = n;
    }
    reader.read(f, start, buf.get(), n, kDirectAlign, {});
    for (; i < j; ++i) {
      const WrittenRange& r = ranges[i];
      const uint32_t got = crc32c(buf.get() + (r.at - start), static_cast<size_t>(r.len));
      if (got == r.crc) continue;
      // The keys the range touches (tensors lie end to end: one ends where the next starts).
      std::string key;
      auto t = std::upper_bound(tensors.begin(), tensors.end(), r.at,
                                [](uint64_t at, const std::pair<uint64_t, std::string>& x) { return at < x.first; });
      if (t != tensors.begin()) --t;
      for (; t != tensors.end() && t->first < r.at + r.len; ++t) {
        const uint64_t t_end = t + 1 != tensors.end() ? (t + 1)->first : UINT64_MAX;
        if (t_end <= r.at || t_end == t->first) continue;  // before the range, or empty
        const uint64_t b = std::max(r.at, t->first), e = std::min(r.at + r.len, t_end);
        key += concat(key.empty() ? " (" : ", ", "key '", t->second, "' bytes ", b - t->first, "..", e - t->first);
      }
      if (!key.empty()) key += ")";
      throw Error(concat("read-back of '", path, "' before the commit: file bytes ", r.at, "..", r.at + r.len, key,
                         ", written by ", writer, ", read back with checksum ", crc_hex(got), ", not the ",
                         crc_hex(r.crc), " they were written with: the filesystem lost or mixed up a write (writers "
                         "on several hosts of a filesystem that does not keep their byte ranges apart?)"));
    }
  }
}

std::string kernel_identity() {
  std::string id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> id;  // a /proc file has no size to read by
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = 0;
  return id + "@" + host;
}

void flip_byte(const std::string& path, uint64_t at) {
  char c = 0;
  File(path, "r").pread_exact(at, &c, 1);
  c = static_cast<char>(~c);
  File f(path, "u");
  f.pwrite_exact(at, &c, 1);
  f.fsync();
}

bool test_fault(int rank, const char* what) {
  return env::get("TESSERA_TEST_SAVE_FAULT") == concat(rank, ":", what);
}

}  // namespace tessera::checkpoint
