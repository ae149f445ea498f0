#!/usr/bin/env bash
# GPT training throughput (issue 7's benchmark), one run: tokens/s of examples/gpt for
# single, DDP and FSDP at 1 and 2 ranks and of the same model under PyTorch's own DDP
# (bench/gpt/py_gpt.py, /usr/bin/python3, gloo) at 1 and 2 ranks; then the wall time of
# `make demo`'s job (scripts/demo.sh). One intra-op thread per rank (the ranks share the
# machine). Writes bench/results/gpt.json.
#
#   bench/gpt/run.sh BUILD_DIR      (GPT_BENCH_STEPS: timed steps, default 40;
#                                    GPT_BENCH_DEMO=0 skips the demo)
set -euo pipefail
BUILD=${1:-build}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT="$ROOT/bench/results/gpt.json"
GPT="$BUILD/bin/gpt"
TESSERA="$BUILD/bin/tessera"
PY=/usr/bin/python3
STEPS=${GPT_BENCH_STEPS:-40}
N_LAYER=4 N_HEAD=4 D_MODEL=128 SEQ=64 BATCH=16   # examples/gpt's defaults; BATCH is global
export OMP_NUM_THREADS=1
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TESSERA_LAUNCHED || true
TMP=$(mktemp -d /tmp/tessera-gpt-bench-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
rows=()

# tessera STRATEGY RANKS -> tokens/s (steady state: from the end of the first batch)
tessera() {
  local out
  out=$("$GPT" train --strategy "$1" --devices "$2" --max-steps $((STEPS + 1)) --batch-size $BATCH --seq-len $SEQ \
        --n-layer $N_LAYER --n-head $N_HEAD --d-model $D_MODEL --val-fraction 0 --threads 1 --no-progress-bar \
        --out "$TMP/$1-$2")
  echo "$out" | grep -o 'tokens_per_s=[0-9.e+]*' | tail -1 | cut -d= -f2
}
# python RANKS -> tokens/s; ranks spawned with the torch.distributed environment
python_ddp() {
  local n=$1 port pids=() r
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for ((r = 0; r < n; r++)); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=$n \
      "$PY" "$HERE/py_gpt.py" $N_LAYER $N_HEAD $D_MODEL $SEQ $BATCH "$STEPS" > "$TMP/py-$n-$r.out" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  "$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read())["tokens_per_s"])' "$TMP/py-$n-0.out"
}

# Interleaved so that machine noise hits every implementation alike.
for n in 1 2; do
  echo "-- $n rank(s)" >&2
  py=$(python_ddp $n)
  rows+=("python-ddp ddp $n $py $py")
  for s in single ddp fsdp; do
    [ "$s" = single ] && [ "$n" -gt 1 ] && continue
    rows+=("tessera $s $n $(tessera $s $n) $py")
  done
done

demo_s=null
if [ "${GPT_BENCH_DEMO:-1}" != 0 ]; then
  echo "-- make demo's job (scripts/demo.sh)" >&2
  t0=$(date +%s.%N)
  DEMO_OUT="$TMP/demo" bash "$ROOT/scripts/demo.sh" "$BUILD" > "$TMP/demo.log"
  demo_s=$(echo "$(date +%s.%N) - $t0" | bc)
fi

printf '%s\n' "${rows[@]}" | "$PY" -c '
import json, sys
out, demo_s, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
for line in sys.stdin:
    impl, strategy, ranks, tps, py = line.split()
    rows.append({"implementation": impl, "strategy": strategy, "ranks": int(ranks),
                 "tokens/s": float(tps), "vs Python DDP (same ranks)": round(float(tps) / float(py), 2)})
doc = {"benchmark": "gpt", "rows": rows,
       "model": "examples/gpt defaults: 4 layers, 4 heads, d_model 128, seq_len 64, 0.87M parameters",
       "batch": "16 sequences global (split over the ranks), AdamW, clipping 1.0, fp32",
       "threads": "one intra-op thread per rank",
       "timed_steps": steps,
       "make_demo_job_wall_s": None if demo_s == "null" else round(float(demo_s), 1)}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(doc, indent=1))
' "$OUT" "$demo_s" "$STEPS"
