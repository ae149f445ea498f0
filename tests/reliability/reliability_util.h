// Shared by the reliability tests (test_reliability_*.cpp): the scale knob that selects
// the short `make test` counts or the long `make soak` ones and the base seed; child
// processes and free ports come from support/child_process.h.
#pragma once
#include <cstdint>

#include "support/child_process.h"
#include "tessera/core/env.h"

namespace tessera::testing {

// TESSERA_SOAK=1 (make soak): the long counts. Unset or 0: the short ones.
inline bool soak() { return env::get_int("TESSERA_SOAK", 0, 1).value_or(0) != 0; }
inline int scaled(int short_count, int soak_count) { return soak() ? soak_count : short_count; }
// TESSERA_SEED picks the base seed (every failure message prints the seed that failed).
inline uint64_t base_seed() { return static_cast<uint64_t>(env::get_int("TESSERA_SEED", 0).value_or(20261130)); }

}  // namespace tessera::testing
