#!/usr/bin/env bash
# Strategy step time and memory (issue 5's benchmark), ratios against peers measured in
# the same run:
#  - FSDP at world size 1 vs a plain libtorch loop of the same model (framework overhead);
#  - DDP and FSDP at world size 2 vs PyTorch's own Python DDP (/usr/bin/python3, gloo);
#  - per-rank peak RSS of FSDP vs DDP at N = 1, 2, 4 (the 25M model).
# For a GPT-style block stack of ~3M (dim 256, 4 blocks) and ~25M (dim 512, 8 blocks)
# parameters, batch 8x64 per rank, Adam, one intra-op thread per rank.
# Step times are measured in STRATEGY_BENCH_ROUNDS rounds (default 3); each round runs
# every peer once, in an order that rotates from round to round, and the ratios are
# taken inside each round (the machine's speed drifts by more than the differences).
# Writes bench/results/strategy.json.   bench/strategy/run.sh BUILD_DIR
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${STRATEGY_BENCH_ROUNDS:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT="$HERE/../results/strategy.json"
TESSERA="$BUILD/bin/tessera"
BENCH="$BUILD/bin/strategy_bench"
PY=/usr/bin/python3
export OMP_NUM_THREADS=1
unset TESSERA_CPU_ALLOCATOR TESSERA_CPU_CACHE_MIB || true
TMP=$(mktemp -d /tmp/tessera-strategy-bench-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
# The same BLAS kernels for Python as Tessera's programs choose (bench/common/blas.sh).
source "$HERE/../common/blas.sh"
tessera_blas_env "$BUILD" "$TMP"
rows=()
# run N MODE DIM LAYERS STEPS -> the rank-0 JSON line
run() {
  local n=$1 mode=$2
  shift 2
  if [ "$mode" = py_ddp ]; then
    "$TESSERA" run -n "$n" -- "$PY" "$HERE/py_ddp.py" "$@" | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //'
  else
    "$TESSERA" run -n "$n" -- "$BENCH" "$mode" "$@" | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //'
  fi
}
specs=("1 plain" "1 fsdp" "2 py_ddp" "2 ddp" "2 fsdp")
for size in "256 4 20" "512 8 6"; do
  set -- $size
  for round in $(seq "$ROUNDS"); do
    echo "-- model dim $1, $2 blocks, round $round of $ROUNDS" >&2
    for k in $(seq 0 $((${#specs[@]} - 1))); do
      spec=${specs[$(((k + round - 1) % ${#specs[@]}))]}
      rows+=("time-$round $(run $spec "$@")")
    done
  done
done
# Memory: FSDP vs DDP at 1, 2, 4 ranks on the 25M model (2 steps are enough for the peak),
# under each CPU memory policy: Tessera's caching allocator (the default,
# core/cpu_allocator.h), c10's default allocator on glibc malloc (TESSERA_CPU_ALLOCATOR=
# system), and that with glibc's mmap threshold fixed at 1 MiB (its dynamic threshold
# keeps freed large blocks in the heap, so the peak RSS counts memory no longer used).
for alloc in caching system system-mmap1m; do
  for n in 1 2 4; do
    for mode in ddp fsdp; do
      case $alloc in
        caching) rows+=("memory-$alloc $(run $n $mode 512 8 2)") ;;
        system) rows+=("memory-$alloc $(TESSERA_CPU_ALLOCATOR=system run $n $mode 512 8 2)") ;;
        system-mmap1m)
          rows+=("memory-$alloc $(TESSERA_CPU_ALLOCATOR=system MALLOC_MMAP_THRESHOLD_=1048576 run $n $mode 512 8 2)") ;;
      esac
    done
  done
done
printf '%s\n' "${rows[@]}" | "$PY" "$HERE/summarize.py" "$OUT"
