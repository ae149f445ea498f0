#include "tessera/checkpoint/rank_agreement.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "tessera/checkpoint/wire.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

bool AllOutcomes::ok() const {
  return std::all_of(ranks.begin(), ranks.end(), [](const RankOutcome& s) { return s.error.empty(); });
}

std::string AllOutcomes::errors() const {
  std::string out;
  for (size_t r = 0; r < ranks.size(); ++r)
    if (!ranks[r].error.empty()) out += concat(out.empty() ? "" : "; ", "rank ", r, ": ", ranks[r].error);
  return out;
}

std::string Agreement::message() const { return ok() ? std::string() : concat("rank ", failed_rank, ": ", error); }

Agreement RankAgreement::agree(const std::string& error, uint64_t digest) {
  const int64_t n = comm_.size();
  const int64_t d = static_cast<int64_t>(digest >> 2);  // 62 bits: both d and -d fit
  at::Tensor t = at::tensor({error.empty() ? n : static_cast<int64_t>(comm_.rank()), d, -d}, at::kLong);
  comm_.all_reduce(t, distributed::ReduceOp::Min);
  const int64_t* v = t.data_ptr<int64_t>();
  Agreement a;
  a.same_digest = v[1] == -v[2];
  if (v[0] < n) {
    a.failed_rank = static_cast<int>(v[0]);
    a.error = comm_.broadcast_bytes(comm_.rank() == a.failed_rank ? error : std::string(), a.failed_rank);
  }
  return a;
}

Agreement RankAgreement::agree_or_throw(const std::string& error, uint64_t digest) {
  Agreement a = agree(error, digest);
  TESSERA_CHECK(a.ok(), what_, ": ", a.message());
  return a;
}

AllOutcomes RankAgreement::gather(const std::string& error, const std::string& payload) {
  // An error is sent without the payload: a failed rank has nothing to say.
  const auto all = comm_.all_gather_bytes(Packer().str(error).str(error.empty() ? payload : "").bytes());
  AllOutcomes out;
  out.ranks.resize(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    Unpacker in(all[r], concat("rank ", r, "'s status"));
    out.ranks[r].error = in.str();
    out.ranks[r].payload = in.str();
  }
  return out;
}

std::vector<std::string> RankAgreement::gather_or_throw(const std::string& error, const std::string& payload) {
  AllOutcomes s = gather(error, payload);
  TESSERA_CHECK(s.ok(), what_, ": ", s.errors());
  std::vector<std::string> out;
  out.reserve(s.ranks.size());
  for (auto& r : s.ranks) out.push_back(std::move(r.payload));
  return out;
}

std::string RankAgreement::from_rank0_or_throw(const std::string& rank0_error, const std::string& rank0_payload) {
  const std::string b = comm_.broadcast_bytes(
      comm_.rank() == 0 ? Packer().str(rank0_error).str(rank0_payload).bytes() : std::string(), 0);
  Unpacker in(b, "rank 0's status");
  const std::string e = in.str();
  TESSERA_CHECK(e.empty(), what_, ": ", e);
  return in.str();
}

uint64_t fnv1a64(const std::string& bytes) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace tessera::checkpoint
