#!/usr/bin/env bash
# GPT training throughput and memory, one run: tokens/s and per-rank peak RSS of
# examples/gpt (single, DDP, FSDP at 1 and 2 ranks) against the same model under
# PyTorch's own DDP (bench/gpt/py_gpt.py, /usr/bin/python3, gloo) at 1 and 2 ranks, for
# three model sizes, interleaved; Tessera under its default CPU memory policy (the caching
# allocator, core/cpu_allocator.h) and under the alternatives (c10's default allocator on
# glibc malloc; that plus Debian's tcmalloc preloaded, when installed); model FLOPs
# utilisation against this machine's one-thread sgemm peak measured in the same run; then
# the wall time of `make demo`'s job (scripts/demo.sh). One intra-op thread per rank (the
# ranks share the machine). Writes bench/results/gpt.json.
#
#   bench/gpt/run.sh BUILD_DIR
#     GPT_BENCH_STEPS    timed steps per run (default 30)
#     GPT_BENCH_SIZES    "L:H:D:T ..." (default "4:4:128:64 4:4:256:128 8:8:512:64")
#     GPT_BENCH_RANKS    "1 2" (default) or a subset
#     GPT_BENCH_DEMO=0   skips the demo
#     GPT_BENCH_ALLOCATORS  Tessera's CPU memory policies to run (default "caching system",
#                        plus tcmalloc when installed)
#     GPT_BENCH_OUT, GPT_BENCH_NAME  result file and its table's name (default
#                        bench/results/gpt.json, "gpt"): a partial run keeps its own table
set -euo pipefail
BUILD=${1:-build}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${GPT_BENCH_OUT:-"$ROOT/bench/results/gpt.json"}
GPT="$BUILD/bin/gpt"
PY=/usr/bin/python3
STEPS=${GPT_BENCH_STEPS:-30}
SIZES=${GPT_BENCH_SIZES:-"4:4:128:64 4:4:256:128 8:8:512:64"}
BATCH=16  # global
TCMALLOC=$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1 || true)
source "$HERE/../common/run_env.sh"
bench_run_env gpt-bench

# tessera STRATEGY RANKS ALLOCATOR L H D T -> "tokens/s peak_rss_mib params" (steady state: from
# the end of the first batch; RSS: the largest rank's peak)
tessera() {
  local s=$1 n=$2 alloc=$3 L=$4 H=$5 D=$6 T=$7 out pre=() envs=()
  case $alloc in
    caching) ;;
    system) envs=(TESSERA_CPU_ALLOCATOR=system) ;;
    tcmalloc) envs=(TESSERA_CPU_ALLOCATOR=system "LD_PRELOAD=$TCMALLOC") ;;
  esac
  out=$(env "${envs[@]}" "$GPT" train --strategy "$s" --devices "$n" --max-steps $((STEPS + 1)) \
        --batch-size $BATCH --seq-len "$T" --n-layer "$L" --n-head "$H" --d-model "$D" --val-fraction 0 \
        --threads 1 --no-progress-bar --out "$TMP/$s-$n-$alloc-$L-$D")
  rm -rf "$TMP/$s-$n-$alloc-$L-$D"
  echo "$(echo "$out" | grep -o 'tokens_per_s=[0-9.e+]*' | tail -1 | cut -d= -f2)" \
       "$(echo "$out" | grep -o 'peak_rss_mib=[0-9.e+]*' | tail -1 | cut -d= -f2)" \
       "$(echo "$out" | grep -o 'params=[0-9]*' | tail -1 | cut -d= -f2)"
}
# python_ddp RANKS L H D T -> "tokens/s peak_rss_mib params"; ranks spawned with the
# torch.distributed environment
python_ddp() {
  local n=$1 port pids=() r
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for ((r = 0; r < n; r++)); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=$n \
      "$PY" "$HERE/py_gpt.py" "$2" "$3" "$4" "$5" $BATCH "$STEPS" > "$TMP/py-$n-$r.out" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  "$PY" -c 'import json,sys; d=json.loads(open(sys.argv[1]).read()); print(d["tokens_per_s"], d["peak_rss_mib"], d["params"])' \
    "$TMP/py-$n-0.out"
}

# The BLAS kernels Tessera's programs choose here (tessera/core/blas.h): Python torch runs
# with the same OPENBLAS_CORETYPE, so that both sides use the same kernels (Python's own
# default on a CPU that OpenBLAS does not know is its generic kernels, 3-4x slower).
source "$HERE/../common/blas.sh"
tessera_blas_env "$BUILD" "$TMP"

# The machine's limit for one rank: a large fp32 matmul on one thread through the same
# libtorch/BLAS that Python torch 1.13 and Debian's libtorch share (best of 5).
SGEMM=$("$PY" - <<'EOF'
import time, torch
torch.set_num_threads(1)
n = 1536
a, b = torch.randn(n, n), torch.randn(n, n)
torch.mm(a, b)
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    torch.mm(a, b)
    best = min(best, time.perf_counter() - t0)
print(2 * n ** 3 / best / 1e9)
EOF
)
echo "-- sgemm peak, one thread: $SGEMM GFLOP/s" >&2

allocs="caching system"
[ -n "$TCMALLOC" ] && allocs="$allocs tcmalloc"
allocs=${GPT_BENCH_ALLOCATORS:-$allocs}
# Interleaved so that machine noise hits every implementation alike.
for size in $SIZES; do
  IFS=: read -r L H D T <<< "$size"
  for n in ${GPT_BENCH_RANKS:-1 2}; do
    echo "-- L$L d$D T$T, $n rank(s)" >&2
    echo "$L $H $D $T python-ddp ddp $n glibc $(python_ddp $n "$L" "$H" "$D" "$T")" >> "$ROWS"
    for s in single ddp fsdp; do
      [ "$s" = single ] && [ "$n" -gt 1 ] && continue
      [ "$s" != single ] && [ "$n" -eq 1 ] && continue
      for a in $allocs; do
        echo "$L $H $D $T tessera $s $n $a $(tessera $s $n $a "$L" "$H" "$D" "$T")" >> "$ROWS"
      done
    done
  done
done

demo_s=null
if [ "${GPT_BENCH_DEMO:-1}" != 0 ]; then
  echo "-- make demo's job (scripts/demo.sh)" >&2
  t0=$(date +%s.%N)
  DEMO_OUT="$TMP/demo" bash "$ROOT/scripts/demo.sh" "$BUILD" > "$TMP/demo.log"
  demo_s=$(echo "$(date +%s.%N) - $t0" | bc)
fi

"$PY" - "$OUT" "$demo_s" "$STEPS" "$SGEMM" "$ROWS" "$(nproc --all)" "$BLAS" <<'EOF'
import json, os, sys
out, demo_s, steps, sgemm, rows_path, cores, blas = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], int(sys.argv[6]), sys.argv[7]
raw = [l.split() for l in open(rows_path) if l.strip()]
py = {}
for L, H, D, T, impl, strat, n, alloc, tps, rss, params in raw:
    if impl == "python-ddp":
        py[(L, D, T, n)] = float(tps)
rows = []
for L, H, D, T, impl, strat, n, alloc, tps, rss, params in raw:
    L_, D_, T_, params = int(L), int(D), int(T), int(params)  # params as each program counts them
    flops_per_token = 6 * params + 12 * L_ * D_ * T_
    ranks = int(n)
    mfu = float(tps) * flops_per_token / ranks / (sgemm * 1e9)  # per rank: one core each
    rows.append({"model": f"L{L} d{D} T{T}", "params_M": round(params / 1e6, 2), "implementation": impl,
                 "strategy": strat, "ranks": ranks, "cpu_allocator": alloc, "tokens/s": float(tps),
                 "vs Python DDP": round(float(tps) / py[(L, D, T, n)], 2),
                 "peak_rss_mib": float(rss), "mfu": round(mfu, 3)})
doc = {"benchmark": os.environ.get("GPT_BENCH_NAME", "gpt"), "rows": rows,
       "batch": "16 sequences global (split over the ranks), AdamW (Tessera: tessera::optim::AdamW, gpt's default; "
                "Python: torch.optim.AdamW's default), clipping 1.0, fp32",
       "threads": f"one intra-op thread per rank, {cores} cores",
       "sgemm_gflops_one_thread": round(sgemm, 1),
       "blas": blas + "; Python torch and the sgemm probe run with the same OPENBLAS_CORETYPE",
       "mfu": "(6 N + 12 L d T) FLOPs per token x tokens/s per rank / one-thread sgemm peak",
       "cpu_allocator": "caching: Tessera's default (core/cpu_allocator.h); system: TESSERA_CPU_ALLOCATOR=system (glibc malloc); "
                        "tcmalloc: system + LD_PRELOAD of Debian's libtcmalloc_minimal; Python: glibc malloc",
       "peak_rss_mib": "the largest rank's peak resident set (getrusage ru_maxrss)",
       "timed_steps": steps,
       "make_demo_job_wall_s": None if demo_s == "null" else round(float(demo_s), 1)}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(doc, indent=1))
EOF
