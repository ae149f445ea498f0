#!/usr/bin/env bash
# The reliability suite at soak scale (make soak), with the checkpoint scale and crash
# tests (64 ranks, 40 kills): the same tests `make test` runs in their short form, with TESSERA_SOAK=1 selecting the long counts (>=100 SIGKILLed
# saves, >=1000 corruption cases). TESSERA_SEED=N changes the base seed; every failure
# prints the seed that failed. Results and figures: docs/reliability.md.
#   usage: scripts/soak.sh [BUILD_DIR]    (default: build)
set -euo pipefail
BUILD="${1:-build}"
BIN="$BUILD/bin/tessera_tests"
[ -x "$BIN" ] || { echo "soak: $BIN not found; build first (make build)" >&2; exit 2; }
export TESSERA_SOAK=1
start=$(date +%s)
# One test at a time: the kill timings and time-to-exit figures mean more on a quiet machine.
"$BIN" --gtest_filter='*Reliability*:CheckpointScale.*:CheckpointCrash.*' --gtest_color=no 2>&1 | tee "$BUILD/soak.log"
rc=${PIPESTATUS[0]}
echo "soak: $(( $(date +%s) - start )) s, exit $rc; figures:"
grep -E '^\[(corruption|crash|deadrank|twohosts)\]' "$BUILD/soak.log" || true
exit "$rc"
