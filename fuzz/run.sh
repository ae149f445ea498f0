#!/usr/bin/env bash
# make fuzz: builds the libFuzzer targets with clang (ASan + UBSan) and runs each for
# FUZZ_SECONDS (default 60). The committed corpus seeds every run; new inputs go to a
# scratch corpus, crashes to fuzz/artifacts/ (fix them, then add the input to
# fuzz/corpus/<target>/ as a regression seed).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${FUZZ_BUILD:-$ROOT/build-fuzz}
SECONDS_EACH=${FUZZ_SECONDS:-60}
TESSERA_SETUP_EXTRA=fuzz bash "$ROOT/scripts/setup.sh"
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DTESSERA_FUZZ=ON \
    -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCH=OFF -DTESSERA_BUILD_EXAMPLES=OFF -DTESSERA_USE_PCH=OFF
fi
cmake --build "$BUILD" --target fuzz_safetensors fuzz_metadata fuzz_torch_import fuzz_pickle fuzz_dcp fuzz_xla fuzz_hf
mkdir -p "$ROOT/fuzz/artifacts"
status=0
for t in safetensors metadata torch_import pickle dcp xla hf; do
  seeds="$ROOT/fuzz/corpus/${t%%_import}"
  work=$(mktemp -d)
  echo "== fuzz_$t for ${SECONDS_EACH}s (seeds: $seeds) =="
  if ! ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 "$BUILD/bin/fuzz_$t" "$work" "$seeds" \
      -max_total_time="$SECONDS_EACH" -max_len=65536 -rss_limit_mb=4096 -timeout=10 \
      -artifact_prefix="$ROOT/fuzz/artifacts/$t-" -print_final_stats=1 2>&1 | tail -n 15; then
    status=1
  fi
  rm -rf "$work"
done
exit $status
