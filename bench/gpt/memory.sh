#!/usr/bin/env bash
# FSDP memory and checkpoint cost at default settings, on the GPT example
# (examples/gpt, one intra-op thread per rank, ranks sharing this machine):
#  1. per-rank peak RSS of FSDP on the 25.5M GPT (L8 d512 T64, AdamW, global batch 16) at
#     1, 2 and 4 ranks, as ratios to one rank's (goals: 2 ranks <= 0.72, 4 ranks <= 0.55);
#  2. a run that saves a Full (consolidated) checkpoint against the same run saving
#     Sharded, at 4 ranks: peak RSS difference (goal: <= 64 MiB);
#  3. checkpoint blocking time: the seconds the training loop spends in its checkpoint
#     saves, synchronous vs --async-ckpt, at 2 ranks, sharded and full, overall and
#     without the first save (goal: async blocking <= 10% of synchronous);
#  4. a ~400M-parameter GPT (L24 d1152 T64, batch 8) trained 3 steps with FSDP at 4
#     ranks: per-rank peak RSS against the arithmetic (16 bytes per parameter over 4
#     ranks for fp32 weights, gradients and AdamW's two moments, plus the runtime).
# Writes bench/results/gpt-memory.json.
#
#   bench/gpt/memory.sh BUILD_DIR
#     GPT_MEMORY_BIG=0   skips part 4 (several minutes on 2 cores)
#     GPT_MEMORY_OUT, GPT_MEMORY_NAME  result file and its table's name (default
#                        bench/results/gpt-memory.json, "gpt-memory"): a partial run keeps its own table
set -euo pipefail
BUILD=${1:-build}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${GPT_MEMORY_OUT:-"$ROOT/bench/results/gpt-memory.json"}
GPT="$BUILD/bin/gpt"
source "$HERE/../common/run_env.sh"
bench_run_env gpt-memory
MODEL="--n-layer 8 --n-head 8 --d-model 512 --seq-len 64 --batch-size 16"

# run NAME ARGS... -> appends "NAME peak_rss_mib saves blocking_s tokens_per_s params first_blocking_s
# cache_peak_in_use_mib" to ROWS (the last: the CPU allocator's peak of live blocks of 64 KiB and more)
run() {
  local name=$1 out
  shift
  out=$("$GPT" train --threads 1 --no-progress-bar --val-fraction 0.05 --out "$TMP/$name" "$@")
  rm -rf "$TMP/$name"
  echo "$name $(echo "$out" | grep -o 'peak_rss_mib=[0-9.e+]*' | tail -1 | cut -d= -f2)" \
       "$(echo "$out" | grep -o 'saves=[0-9]*' | tail -1 | cut -d= -f2)" \
       "$(echo "$out" | grep -o ' blocking_s=[0-9.e+-]*' | tail -1 | cut -d= -f2)" \
       "$(echo "$out" | grep -o 'tokens_per_s=[0-9.e+]*' | tail -1 | cut -d= -f2)" \
       "$(echo "$out" | grep -o 'params=[0-9]*' | tail -1 | cut -d= -f2)" \
       "$(echo "$out" | grep -o 'first_blocking_s=[0-9.e+-]*' | tail -1 | cut -d= -f2)" \
       "$(echo "$out" | grep -o 'cache_peak_in_use_mib=[0-9.e+-]*' | tail -1 | cut -d= -f2)" >> "$ROWS"
  tail -1 "$ROWS" >&2
}

echo "-- 1/2: FSDP peak RSS at 1, 2, 4 ranks; Full vs Sharded checkpoint at 4" >&2
for n in 1 2 4; do
  run "fsdp-$n-sharded" $MODEL --strategy fsdp --devices "$n" --max-steps 8 --val-every 0 --state-dict sharded
done
run "fsdp-4-full" $MODEL --strategy fsdp --devices 4 --max-steps 8 --val-every 0 --state-dict full

echo "-- 3: checkpoint blocking time, sync vs async, 2 ranks (a save every 4 steps)" >&2
for sd in sharded full; do
  for mode in sync async; do
    flag=""
    [ "$mode" = async ] && flag="--async-ckpt"
    run "ckpt-$sd-$mode" $MODEL --strategy fsdp --devices 2 --max-steps 24 --val-every 0 --ckpt-every 4 \
      --state-dict "$sd" $flag
  done
done

if [ "${GPT_MEMORY_BIG:-1}" != 0 ]; then
  echo "-- 4: ~400M GPT, FSDP, 4 ranks, 3 steps" >&2
  run "big-fsdp-4" --n-layer 24 --n-head 16 --d-model 1152 --seq-len 64 --batch-size 8 --strategy fsdp \
    --devices 4 --max-steps 3 --val-every 0 --warmup-steps 1 --state-dict sharded
fi

/usr/bin/python3 - "$OUT" "$ROWS" <<'EOF'
import json, os, sys
out, rows_path = sys.argv[1], sys.argv[2]
r = {}
for line in open(rows_path):
    name, rss, saves, blocking, tps, params, first, in_use = line.split()
    r[name] = {"peak_rss_mib": float(rss), "saves": int(saves), "blocking_s": float(blocking),
               "first_blocking_s": float(first), "tokens/s": float(tps), "params": int(params),
               "in_use_mib": float(in_use)}
one = r["fsdp-1-sharded"]["peak_rss_mib"]
rows = []
for n, goal in ((1, None), (2, 0.72), (4, 0.55)):
    x = r[f"fsdp-{n}-sharded"]
    rows.append({"measure": f"FSDP peak RSS, {n} rank(s), 25.5M GPT", "value": x["peak_rss_mib"], "unit": "MiB",
                 "vs one rank": round(x["peak_rss_mib"] / one, 3), "goal": f"<= {goal}x" if goal else ""})
full, sharded = r["fsdp-4-full"]["peak_rss_mib"], r["fsdp-4-sharded"]["peak_rss_mib"]
rows.append({"measure": "Full minus Sharded checkpoint run, 4 ranks", "value": round(full - sharded, 1), "unit": "MiB",
             "vs one rank": "", "goal": "<= 64 MiB"})
for sd in ("sharded", "full"):
    s, a = r[f"ckpt-{sd}-sync"], r[f"ckpt-{sd}-async"]
    per_s, per_a = s["blocking_s"] / max(s["saves"], 1), a["blocking_s"] / max(a["saves"], 1)
    # Later saves: without the first, which also creates the background process group
    # and faults in the copy's pages.
    later = lambda x: (x["blocking_s"] - x["first_blocking_s"]) / max(x["saves"] - 1, 1)
    rows.append({"measure": f"{sd} checkpoint, blocking s per save, sync", "value": round(per_s, 3), "unit": "s",
                 "vs one rank": "", "goal": ""})
    rows.append({"measure": f"{sd} checkpoint, blocking s per save, async", "value": round(per_a, 3), "unit": "s",
                 "vs one rank": "", "goal": f"<= 0.1x sync: {per_a / per_s:.3f}x"})
    rows.append({"measure": f"{sd} checkpoint, async, first save / later saves", "value":
                 f"{a['first_blocking_s']:.3f} / {later(a):.3f}", "unit": "s", "vs one rank": "",
                 "goal": f"later saves: {later(a) / later(s):.3f}x of sync's later saves"})
if "big-fsdp-4" in r:
    b = r["big-fsdp-4"]
    share = b["params"] * 16 / 4 / 2**20
    runtime = r["fsdp-1-sharded"]["peak_rss_mib"] - r["fsdp-1-sharded"]["params"] * 16 / 2**20
    rows.append({"measure": f"{b['params'] / 1e6:.0f}M GPT (L24 d1152), FSDP 4 ranks, 3 steps: peak RSS per rank",
                 "value": b["peak_rss_mib"], "unit": "MiB", "vs one rank": "",
                 "goal": f"arithmetic: {share:.0f} MiB of weights+grads+AdamW per rank "
                         f"(a single process would need {b['params'] * 16 / 2**20:.0f}); "
                         f"tensors of 64 KiB and more at their peak: {b['in_use_mib']:.0f} MiB"})
doc = {"benchmark": os.environ.get("GPT_MEMORY_NAME", "gpt-memory"), "rows": rows,
       "settings": "default settings (caching CPU allocator, one intra-op thread per rank), examples/gpt, "
                   "AdamW, global batch 16 (8 for the large model), ranks sharing this machine",
       "peak_rss_mib": "the largest rank's peak resident set (getrusage ru_maxrss)"}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(doc, indent=1))
EOF
