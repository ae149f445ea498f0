// Every rank learning the outcome of a step that the ranks of a collective checkpoint
// operation take together, so that all decide alike (fail together, or go on together) and
// nobody waits for a rank that gave up: the role DCP's _DistWrapper plays for its planner.
// One family, by how much each rank learns:
//   agree     O(1) bytes a rank: whether every rank succeeded, the lowest rank that failed
//             and its error, and whether every rank passed the same digest;
//   gather    every rank's outcome (error or payload): O(ranks) bytes a rank;
//   from_rank0  rank 0's outcome only.
// Each has a form that throws tessera::Error("<what>: ...") on every rank alike when a rank
// failed. Internal to the checkpoint layer (and the Trainer's RNG state, which saves with it).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"

namespace tessera::checkpoint {

// What one rank tells the others at a step: its error ("" when it succeeded) and what it
// has to say when it succeeded (any bytes).
struct RankOutcome {
  std::string error;
  std::string payload;
};

// Every rank's outcome, in rank order.
struct AllOutcomes {
  std::vector<RankOutcome> ranks;
  bool ok() const;
  // "rank 1: ...; rank 3: ..." ("" when every rank succeeded): the same text everywhere.
  std::string errors() const;
};

// The O(1) outcome: one all-reduce of three integers, and a broadcast of the message only
// when a rank failed, whatever the world size.
struct Agreement {
  int failed_rank = -1;  // the lowest rank that failed; -1 when none did
  std::string error;     // its error
  bool same_digest = true;
  bool ok() const { return failed_rank < 0; }
  // "rank 3: <error>" ("" when ok): the same text on every rank.
  std::string message() const;
};

class RankAgreement {
 public:
  // `what` begins every error thrown ("saving 'PATH'").
  RankAgreement(distributed::Communicator& comm, std::string what) : comm_(comm), what_(std::move(what)) {}

  Agreement agree(const std::string& error, uint64_t digest = 0);
  // Throws "<what>: rank r: <error>" on every rank when a rank failed.
  Agreement agree_or_throw(const std::string& error, uint64_t digest = 0);

  AllOutcomes gather(const std::string& error, const std::string& payload);
  // Throws "<what>: rank r: ...; rank s: ..." on every rank when any rank failed; else
  // every rank's payload.
  std::vector<std::string> gather_or_throw(const std::string& error, const std::string& payload = "");

  // Rank 0's payload on every rank; throws "<what>: <error>" everywhere when rank 0 failed.
  // The other ranks' arguments are not read.
  std::string from_rank0_or_throw(const std::string& rank0_error, const std::string& rank0_payload = "");

 private:
  distributed::Communicator& comm_;
  std::string what_;
};

// 64-bit FNV-1a of `bytes` (the digests the ranks compare).
uint64_t fnv1a64(const std::string& bytes);

}  // namespace tessera::checkpoint
