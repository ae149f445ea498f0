#!/usr/bin/env bash
# make bench: every benchmark, results as JSON under bench/results/, tables in
# docs/benchmarks.md regenerated from them.
set -euo pipefail
BUILD=${1:-build}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p bench/results
echo "== collectives (2 ranks, gloo) =="
"$BUILD/bin/tessera" run -n 2 -- "$BUILD/bin/bench_collectives" bench/results/collectives.json
# Area benchmarks add themselves as bench/*/run.sh.
for s in bench/*/run.sh; do
  [ -f "$s" ] || continue
  echo "== $s =="
  bash "$s" "$BUILD"
done
/usr/bin/python3 bench/report.py
