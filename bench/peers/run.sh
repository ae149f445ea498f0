#!/usr/bin/env bash
# Tessera's GPT example side by side with its torch 2.x peers (bench/peers/gpt_peer.py):
# PyTorch FSDP2 (fully_shard), PyTorch DDP, Lightning Fabric DDP, Fabric FSDP (FSDPStrategy:
# FSDP1, which Lightning refuses on the CPU: the refusal is recorded) and Fabric's
# ModelParallelStrategy (FSDP2 through Fabric, fully_shard per block), at 2 and
# 4 ranks, for three GPT sizes: tokens/s and per-rank peak RSS, median of PEERS_ROUNDS
# rounds, the order of the implementations alternating from round to round. Every
# implementation trains the same model (same parameter names and shapes), on the same
# data in the same order, with the same optimizer, schedule, clipping and global batch,
# started by the same launcher (`tessera run -n N`). Writes bench/results/peers.json.
#
# Settings, the same on both sides: one intra-op thread per rank (OMP_NUM_THREADS=1,
# gpt --threads 1, torch.set_num_threads(1)); each side's default CPU allocator (Tessera:
# its caching allocator, core/cpu_allocator.h; Python: c10's default on glibc malloc); the
# same libtorch kernels when BUILD is build-torch2 (the libtorch inside the peers' torch
# wheel). The ranks share this machine's cores: 4 ranks on 2 cores oversubscribe them.
# Tessera's rows include its end-of-run checkpoint save in the peak RSS (gpt always writes
# last.ckpt); the peers save nothing. FSDP2 builds its model on the meta device and
# initialises each rank's shards (--init meta), as its documentation advises for models
# that should not exist whole on one rank; Tessera builds each block sharded. AdamW:
# Tessera's gpt uses tessera::optim::AdamW (one pass over each parameter), the peers
# torch.optim.AdamW as constructed by default (for-loop on CPU tensors); torch-ddp-fused
# is PyTorch DDP with fused=True, the like-for-like comparison of the optimizer.
#
#   bench/peers/run.sh [BUILD]          (default build-torch2)
#     PEERS_ROUNDS   rounds (default 3; the median is reported)
#     PEERS_RANKS    "2 4" (default)
#     PEERS_SIZES    "L:H:D:T:STEPS ..." (default "4:4:256:128:40 8:8:512:64:20 12:12:768:32:6")
#     PEERS_IMPLS    subset of "tessera-fsdp fsdp2 tessera-ddp torch-ddp torch-ddp-fused fabric-ddp
#                    fabric-mp fabric-fsdp" (torch-ddp-fused: PyTorch DDP with AdamW(fused=True))
#     PEERS_BATCH    global batch (default 16, gpt's)
#     PEERS_PY       the peers' python (default .venv-torch2/bin/python)
#     PEERS_OUT, PEERS_NAME   result file and its table's name (default bench/results/peers.json,
#                    "peers"): a second run with other sizes or peers keeps its own table
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${1:-build-torch2}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
OUT=${PEERS_OUT:-$ROOT/bench/results/peers.json}
PY=${PEERS_PY:-$ROOT/.venv-torch2/bin/python}
ROUNDS=${PEERS_ROUNDS:-3}
RANKS=${PEERS_RANKS:-"2 4"}
SIZES=${PEERS_SIZES:-"4:4:256:128:40 8:8:512:64:20 12:12:768:32:6"}
IMPLS=${PEERS_IMPLS:-"tessera-fsdp fsdp2 tessera-ddp torch-ddp torch-ddp-fused fabric-ddp fabric-mp fabric-fsdp"}
BATCH=${PEERS_BATCH:-16}
GPT="$BUILD/bin/gpt"
LAUNCH="$BUILD/bin/tessera"
for f in "$GPT" "$LAUNCH" "$PY"; do
  [ -x "$f" ] || { echo "bench/peers: $f is missing (make build-torch2 makes the build and .venv-torch2)" >&2; exit 1; }
done
source "$ROOT/bench/common/run_env.sh"
bench_run_env peers
REFUSED="$TMP/refused" FAILS="$TMP/failures"
: > "$REFUSED"
: > "$FAILS"

# measure IMPL N L H D T STEPS -> "tokens/s peak_rss_mib params", or nothing when it failed
# (the failure's last lines go to $REFUSED, once per implementation).
measure() {
  local impl=$1 n=$2 L=$3 H=$4 D=$5 T=$6 steps=$7 out rc log="$TMP/run.log"
  local model=(--n-layer "$L" --n-head "$H" --d-model "$D" --seq-len "$T" --batch-size "$BATCH" --val-fraction 0)
  case $impl in
    tessera-fsdp|tessera-ddp)
      "$LAUNCH" run -n "$n" -- "$GPT" train --strategy "${impl#tessera-}" --max-steps "$steps" "${model[@]}" \
        --val-every 0 --threads 1 --no-progress-bar --out "$TMP/gpt-run" > "$log" 2>&1
      rc=$?
      rm -rf "$TMP/gpt-run"
      out=$(cat "$log")
      [ $rc = 0 ] && echo "$(echo "$out" | grep -o 'tokens_per_s=[0-9.e+]*' | tail -1 | cut -d= -f2)" \
        "$(echo "$out" | grep -o 'peak_rss_mib=[0-9.e+]*' | tail -1 | cut -d= -f2)" \
        "$(echo "$out" | grep -o 'params=[0-9]*' | tail -1 | cut -d= -f2)" ;;
    *)
      local mode=$impl extra=()
      [ "$impl" = torch-ddp ] && mode=ddp
      if [ "$impl" = torch-ddp-fused ]; then mode=ddp; extra=(--adamw fused); fi
      case $impl in fsdp2|fabric-mp) extra=(--init meta) ;; esac
      "$LAUNCH" run -n "$n" -- "$PY" "$HERE/gpt_peer.py" --mode "$mode" --steps "$steps" "${model[@]}" \
        --threads 1 "${extra[@]}" > "$log" 2>&1
      rc=$?
      out=$(cat "$log")
      [ $rc = 0 ] && echo "$out" | grep -o '{"impl".*}' | tail -1 | "$PY" -c \
        'import json,sys; d=json.loads(sys.stdin.read()); print(d["tokens_per_s"], d["peak_rss_mib"], d["params"])' ;;
  esac
  if [ $rc != 0 ]; then
    echo "-- $impl failed at $n ranks (exit $rc):" >&2
    tail -8 "$log" >&2
    # A Python exception raised before training (a strategy that refuses the CPU) is a
    # refusal: recorded once, and the implementation is not run again. Anything else (a
    # crash, a signal) is a failure of that run, recorded and retried in the next round.
    local why
    why=$(grep -E '^(\[rank [0-9]+\] )?(\[rank[0-9]+\]: )?[A-Za-z.]*(Error|Exception): ' "$log" | tail -1 | cut -c1-400)
    if [ -n "$why" ]; then
      grep -q "^$impl " "$REFUSED" || echo "$impl $why" >> "$REFUSED"
    else
      echo "$impl ranks $n exit $rc: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-300)" >> "$FAILS"
    fi
  fi
}

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
LIGHTNING_VERSION=$("$PY" -c 'import lightning; print(lightning.__version__)' 2>/dev/null || echo "not installed")
echo "-- peers: torch $TORCH_VERSION, lightning $LIGHTNING_VERSION; Tessera from $BUILD" >&2
failed=" "
for ((round = 0; round < ROUNDS; round++)); do
  order=($IMPLS)
  if ((round % 2 == 1)); then  # alternate the order: reversed on odd rounds
    rev=()
    for ((i = ${#order[@]} - 1; i >= 0; i--)); do rev+=("${order[i]}"); done
    order=("${rev[@]}")
  fi
  for size in $SIZES; do
    IFS=: read -r L H D T STEPS <<< "$size"
    for n in $RANKS; do
      for impl in "${order[@]}"; do
        # An implementation that refused to run (e.g. not supported on the CPU) is not retried.
        case $failed in *" $impl "*) continue ;; esac
        r=$(measure "$impl" "$n" "$L" "$H" "$D" "$T" "$STEPS")
        if [ -z "$r" ]; then
          grep -q "^$impl " "$REFUSED" && failed="$failed$impl "
          continue
        fi
        echo "$round $L $H $D $T $STEPS $n $impl $r" >> "$ROWS"
        echo "-- round $round L$L d$D T$T ranks $n $impl: $r" >&2
      done
    done
  done
done

"$PY" - "$OUT" "$ROWS" "$REFUSED" "$FAILS" "$ROUNDS" "$BATCH" "$TORCH_VERSION" "$LIGHTNING_VERSION" "$BUILD" "$(nproc --all)" \
  "$SIZES" <<'EOF'
import json, os, statistics, sys
out, rows_path, refused_path, fails_path, rounds, batch, torch_v, lightning_v, build, cores, sizes = sys.argv[1:12]
runs = {}
order = []
for line in open(rows_path):
    if not line.strip():
        continue
    rnd, L, H, D, T, steps, n, impl, tps, rss, params = line.split()
    key = (int(L), int(D), int(T), int(n))
    if key not in order:
        order.append(key)
    runs.setdefault((key, impl), {})[int(rnd)] = (float(tps), float(rss), int(params))
med = {k: (statistics.median(v[0] for v in vals.values()), statistics.median(v[1] for v in vals.values()),
           next(iter(vals.values()))[2]) for k, vals in runs.items()}


def paired(key, mine, peer, i):
    """Median over the rounds of mine / peer for field i, pairing the runs of one round
    (measured minutes apart), so that the machine's drift between rounds cancels."""
    a, b = runs[(key, mine)], runs[(key, peer)]
    both = sorted(set(a) & set(b))
    return statistics.median(a[r][i] / b[r][i] for r in both), len(both)
rows = []
comparisons = [("tessera-fsdp", "fsdp2"), ("tessera-ddp", "torch-ddp"), ("tessera-ddp", "torch-ddp-fused"),
               ("tessera-ddp", "fabric-ddp"),
               ("tessera-fsdp", "fabric-mp"), ("tessera-fsdp", "fabric-fsdp")]
for key in order:
    L, D, T, n = key
    for mine, peer in comparisons:
        if (key, mine) not in med or (key, peer) not in med:
            continue
        mt, mr, params = med[(key, mine)]
        pt, pr, _ = med[(key, peer)]
        tr, k = paired(key, mine, peer, 0)
        rr, _ = paired(key, mine, peer, 1)
        goal, met = "", ""
        if peer == "fsdp2":
            want = 1.0 if params >= 50e6 else 1.15  # the issue's goals: 1.15x at 3.3M and 25M, 1.0x at 85-125M
            goal = f"tokens/s >= {want}x, RSS <= 1x"
            met = "yes" if tr >= want and rr <= 1.0 else "no"
        elif peer == "torch-ddp":
            goal = "tokens/s >= 1.1x"
            met = "yes" if tr >= 1.1 else "no"
        rows.append({"model": f"L{L} d{D} T{T}", "params_M": round(params / 1e6, 2), "ranks": n,
                     "tessera": mine, "tessera tokens/s": round(mt, 1), "tessera RSS MiB": round(mr, 1),
                     "peer": peer, "peer tokens/s": round(pt, 1), "peer RSS MiB": round(pr, 1),
                     "tokens/s ratio": round(tr, 3), "RSS ratio": round(rr, 3), "goal": goal, "met": met,
                     "rounds": k})
refused = {}
for line in open(refused_path):
    if line.strip():
        impl, _, msg = line.strip().partition(" ")
        refused[impl] = msg
doc = {"benchmark": os.environ.get("PEERS_NAME", "peers"), "rows": rows,
       "medians": "tokens/s and RSS: the median of each implementation's runs; ratios: the median of the per-round ratios (order of the implementations reversed every other round)",
       "rounds": int(rounds), "sizes (L:H:D:T:steps)": sizes,
       "batch": f"{batch} sequences global (split over the ranks), AdamW (0.9, 0.95, wd 0.01), warmup + cosine lr 2e-3, clipping 1.0, fp32",
       "threads": f"one intra-op thread per rank; {cores} cores (4 ranks oversubscribe them)",
       "launcher": "tessera run -n N for both sides (torch.distributed environment; Fabric uses it, no processes of its own)",
       "cpu_allocator": "Tessera: its caching allocator (default); Python: c10's default (glibc malloc)",
       "adamw": "Tessera: tessera::optim::AdamW (gpt's default: one pass over each parameter); the peers: torch.optim.AdamW as constructed by default (its for-loop implementation on CPU tensors), torch-ddp-fused: with fused=True",
       "tokens/s": "from the end of the first step to the end of the last",
       "peak_rss_mib": "the largest rank's peak resident set (getrusage ru_maxrss); Tessera's includes its end-of-run checkpoint save",
       "fsdp2": "fully_shard on each block and the root, CPU device mesh, gloo, model built on the meta device",
       "fabric-mp": "Lightning Fabric ModelParallelStrategy (data parallel = ranks, tensor parallel 1) whose parallelize_fn applies fully_shard to each block and the root; meta-device model",
       "versions": {"torch": torch_v, "lightning": lightning_v, "tessera build": os.path.basename(build.rstrip("/"))},
       "refused": refused or "none",
       "failed runs": [l.strip() for l in open(fails_path) if l.strip()] or "none"}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(doc, indent=1))
EOF
