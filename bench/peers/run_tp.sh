#!/usr/bin/env bash
# Tessera's tensor + sequence parallelism composed with FSDP (`gpt train --tp 2 --strategy
# fsdp` on 4 ranks: mesh dp 2 x tp 2) against its torch 2.x peer (issue 46): PyTorch FSDP2 +
# DTensor tensor parallelism (bench/peers/gpt_peer.py --mode fsdp2-tp: parallelize_module
# with a torchtitan-style plan, sequence and loss parallelism, on a CPU gloo mesh (dp, tp),
# fully_shard on each block and the root over dp), on the same GPT, data order, AdamW,
# schedule, clipping and global batch, both started by `tessera run -n 4`.
#
# 1. Loss check first (FSDP2 on Gloo once averaged gradients wrongly, pytorch#162338, and
#    AdamW with clipping hides a gradient scale from the losses): on each check size the
#    peer draws its initial weights (--init-seed 7, not gpt's seed), saves them and trains,
#    gpt starts from that file (--init-from); each step's loss must agree within
#    PEERS_TP_TOL relative. The peer also compares its first step's gradients, gathered
#    whole, with one process's on the same global batch (--check-grads).
# 2. Speed: tokens/s and the largest rank's peak RSS (ru_maxrss), median of PEERS_TP_ROUNDS
#    rounds, the order of the two sides reversed every other round; ratios are the median of
#    the per-round ratios. The peer builds its model on the meta device and initialises its
#    shards (--init meta), as run.sh's FSDP2 does; gpt builds each module whole and keeps its
#    piece. gpt's peak RSS includes its end-of-run checkpoint save (under --tp a full state
#    dict); the peer saves nothing. One intra-op thread per rank; 4 ranks on this machine's
#    cores may oversubscribe them.
# Writes PEERS_TP_OUT (default: peers-tp.json in bench/results/, made by the first run).
#
#   bench/peers/run_tp.sh [BUILD]      (default build-torch2: the same libtorch as the peer's
#                                       wheel; another build, e.g. Debian's libtorch 1.13
#                                       in build/, is run and recorded as such)
#     PEERS_TP_ROUNDS   rounds (default 3)
#     PEERS_TP_SIZES    "L:H:D:T:STEPS ..." (default "8:8:512:64:20", the issue's GPT)
#     PEERS_TP          tensor-parallel size (default 2); PEERS_TP_RANKS ranks (default 4)
#     PEERS_TP_QKV      the peer's cut of the fused qkv: split (default, torchtitan's q/k/v)
#                       or striped (bench/peers/gpt_tp.py)
#     PEERS_TP_CHECKS   loss checks "L:H:D:T:STEPS:TP ..." (default "2:4:64:32:20:2 2:4:64:32:20:1",
#                       tp 1: gpt --strategy fsdp on all ranks against the peer at (ranks, 1));
#                       each speed size is also checked for PEERS_TP_CHECK_STEPS steps (default
#                       3; 0: not)
#     PEERS_TP_TOL      relative tolerance of the loss check (default 1e-4)
#     PEERS_BATCH       global batch (default 16)
#     PEERS_PY          the peer's python (default .venv-torch2/bin/python)
#     PEERS_TP_OUT, PEERS_TP_NAME   result file and its table's name (default
#                       peers-tp.json in bench/results/, "peers-tp")
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${1:-build-torch2}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
OUT=${PEERS_TP_OUT:-$ROOT/bench/results/peers-tp.json}
PY=${PEERS_PY:-$ROOT/.venv-torch2/bin/python}
ROUNDS=${PEERS_TP_ROUNDS:-3}
SIZES=${PEERS_TP_SIZES:-"8:8:512:64:20"}
TP=${PEERS_TP:-2}
N=${PEERS_TP_RANKS:-4}
QKV=${PEERS_TP_QKV:-split}
CHECKS=${PEERS_TP_CHECKS:-"2:4:64:32:20:$TP 2:4:64:32:20:1"}
CHECK_STEPS=${PEERS_TP_CHECK_STEPS:-3}
TOL=${PEERS_TP_TOL:-1e-4}
BATCH=${PEERS_BATCH:-16}
GPT="$BUILD/bin/gpt"
LAUNCH="$BUILD/bin/tessera"
for f in "$GPT" "$LAUNCH" "$PY"; do
  [ -x "$f" ] || { echo "bench/peers/run_tp.sh: $f is missing (make build-torch2 makes the build and .venv-torch2)" >&2; exit 1; }
done
source "$ROOT/bench/common/run_env.sh"
bench_run_env peers-tp
CHECKED="$TMP/checks" FAILS="$TMP/failures"
: > "$CHECKED"
: > "$FAILS"

model_args() {  # L H D T -> the model and data flags, the same on both sides
  echo --n-layer "$1" --n-head "$2" --d-model "$3" --seq-len "$4" --batch-size "$BATCH" --val-fraction 0
}

# check L H D T STEPS TP: one loss check; appends a JSON line to $CHECKED.
check() {
  local L=$1 H=$2 D=$3 T=$4 steps=$5 tp=$6 dir="$TMP/check" rc grc=
  rm -rf "$dir" && mkdir -p "$dir"
  local model=($(model_args "$L" "$H" "$D" "$T"))
  "$LAUNCH" run -n "$N" -- "$PY" "$HERE/gpt_peer.py" --mode fsdp2-tp --tp "$tp" --qkv "$QKV" --steps "$steps" \
    "${model[@]}" --threads 1 --init-seed 7 --save-init "$dir/init.safetensors" --losses-out "$dir/peer.txt" \
    --check-grads > "$dir/peer.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    "$LAUNCH" run -n "$N" -- "$GPT" train --tp "$tp" --strategy fsdp --max-steps "$steps" "${model[@]}" \
      --init-from "$dir/init.safetensors" --log-every 1 --val-every 0 --threads 1 --no-progress-bar \
      --out "$dir/gpt" > "$dir/gpt.log" 2>&1
    grc=$?
    # A gpt that fails after its last step (e.g. in its end-of-run save) still wrote every
    # step's loss: compared, and its exit recorded.
    [ $grc = 0 ] || { echo "-- loss check: gpt failed (exit $grc):" >&2; tail -4 "$dir/gpt.log" >&2; }
  else
    echo "-- loss check: the peer failed (exit $rc):" >&2
    tail -8 "$dir/peer.log" >&2
  fi
  "$PY" - "$dir" "$L" "$D" "$T" "$steps" "$N" "$tp" "$TOL" "$rc" "$grc" >> "$CHECKED" <<'EOF'
import csv, json, os, sys
d, L, D, T, steps, n, tp, tol, rc, grc = sys.argv[1:11]
row = {"model": f"L{L} d{D} T{T}", "steps": int(steps), "mesh": f"dp {int(n) // int(tp)} x tp {tp}"}
if grc not in ("", "0"):
    errs = [l.strip() for l in open(os.path.join(d, "gpt.log")) if "error" in l]
    row["gpt exit"] = f"{grc}: {errs[-1][:300] if errs else ''}"
if rc != "0":
    row.update(agree=False, error=f"the peer exited {rc}")
elif not os.path.exists(os.path.join(d, "gpt", "metrics.csv")):
    row.update(agree=False, error="gpt wrote no metrics.csv")
else:
    peer = [float(v) for v in open(os.path.join(d, "peer.txt")) if v.strip()]
    gpt = {}
    for r in csv.DictReader(open(os.path.join(d, "gpt", "metrics.csv"))):
        if r.get("train_loss"):
            gpt[int(r["step"])] = float(r["train_loss"])
    rel = [abs(p - gpt[k + 1]) / abs(gpt[k + 1]) if k + 1 in gpt else float("inf") for k, p in enumerate(peer)]
    grads = None
    for line in open(os.path.join(d, "peer.log")):
        i = line.find('{"check_grads"')
        if i >= 0:
            grads = json.loads(line[i:])["check_grads"]
    worst = max(rel) if rel else float("inf")
    row.update({"max_rel_loss_diff": worst, "first_loss": [peer[0], gpt.get(1)], "last_loss": [peer[-1], gpt.get(len(peer))],
                "grads_max_rel_diff": grads and grads["max_rel_diff"],
                "grad_norm": grads and [grads["grad_norm"], grads["reference_grad_norm"]],
                "agree": len(peer) == int(steps) and worst <= float(tol) and grads is not None and grads["max_rel_diff"] <= 1e-4})
print(json.dumps(row))
EOF
  echo "-- loss check $(tail -1 "$CHECKED")" >&2
}

# measure IMPL L H D T STEPS -> "tokens/s peak_rss_mib params", or nothing when it failed.
measure() {
  local impl=$1 L=$2 H=$3 D=$4 T=$5 steps=$6 rc log="$TMP/run.log"
  local model=($(model_args "$L" "$H" "$D" "$T"))
  if [ "$impl" = tessera-tp ]; then
    "$LAUNCH" run -n "$N" -- "$GPT" train --tp "$TP" --strategy fsdp --max-steps "$steps" "${model[@]}" \
      --val-every 0 --threads 1 --no-progress-bar --out "$TMP/gpt-run" > "$log" 2>&1
    rc=$?
    rm -rf "$TMP/gpt-run"
    [ $rc = 0 ] && echo "$(grep -o 'tokens_per_s=[0-9.e+]*' "$log" | tail -1 | cut -d= -f2)" \
      "$(grep -o 'peak_rss_mib=[0-9.e+]*' "$log" | tail -1 | cut -d= -f2)" \
      "$(grep -o 'params=[0-9]*' "$log" | tail -1 | cut -d= -f2)"
  else
    "$LAUNCH" run -n "$N" -- "$PY" "$HERE/gpt_peer.py" --mode fsdp2-tp --tp "$TP" --qkv "$QKV" --steps "$steps" \
      "${model[@]}" --threads 1 --init meta > "$log" 2>&1
    rc=$?
    [ $rc = 0 ] && grep -o '{"impl".*}' "$log" | tail -1 | "$PY" -c \
      'import json,sys; d=json.loads(sys.stdin.read()); print(d["tokens_per_s"], d["peak_rss_mib"], d["params"])'
  fi
  if [ $rc != 0 ]; then
    echo "-- $impl failed (exit $rc):" >&2
    tail -8 "$log" >&2
    echo "$impl L$L d$D T$T exit $rc: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-300)" >> "$FAILS"
  fi
}

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
# Which libtorch the Tessera build links: the peer's own wheel (build-torch2) or another.
TORCH_DIR=$(sed -n 's/^Torch_DIR:PATH=//p' "$BUILD/CMakeCache.txt" 2>/dev/null)
[ -n "$TORCH_DIR" ] && TORCH_DIR=$(realpath -m "$TORCH_DIR")
PEER_TORCH_DIR=$("$PY" -c 'import os, torch; print(os.path.realpath(os.path.dirname(torch.__file__)))')
TORCH_DIR_VERSION=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")/\1/p' "$TORCH_DIR/TorchConfigVersion.cmake" 2>/dev/null)
case $TORCH_DIR in
  "$PEER_TORCH_DIR"/*) SAME=true; LIBTORCH="the peer's wheel, torch $TORCH_VERSION" ;;
  *) SAME=false; LIBTORCH="libtorch ${TORCH_DIR_VERSION:-?} from ${TORCH_DIR:-unknown} (not the peer's torch $TORCH_VERSION: the kernels differ)" ;;
esac
echo "-- peers-tp: torch $TORCH_VERSION; Tessera from $BUILD, libtorch: $LIBTORCH" >&2
[ $SAME = true ] || echo "-- peers-tp: NOTE: Tessera's build does not link the peer's libtorch, so the two sides run different kernels; the figures are not the issue's comparison" >&2

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
for c in $CHECKS; do
  IFS=: read -r L H D T STEPS CTP <<< "$c"
  check "$L" "$H" "$D" "$T" "$STEPS" "$CTP"
done
if [ "$CHECK_STEPS" -gt 0 ]; then
  for size in $SIZES; do
    IFS=: read -r L H D T STEPS <<< "$size"
    check "$L" "$H" "$D" "$T" "$CHECK_STEPS" "$TP"
  done
fi

for ((round = 0; round < ROUNDS; round++)); do
  order=(tessera-tp fsdp2-tp)
  ((round % 2 == 1)) && order=(fsdp2-tp tessera-tp)
  for size in $SIZES; do
    IFS=: read -r L H D T STEPS <<< "$size"
    for impl in "${order[@]}"; do
      r=$(measure "$impl" "$L" "$H" "$D" "$T" "$STEPS")
      [ -n "$r" ] || continue
      echo "$round $L $H $D $T $STEPS $impl $r" >> "$ROWS"
      echo "-- round $round L$L d$D T$T $impl: $r" >&2
    done
  done
done

LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
"$PY" - "$OUT" "$ROWS" "$CHECKED" "$FAILS" "$ROUNDS" "$BATCH" "$TORCH_VERSION" "$BUILD" "$LIBTORCH" "$SAME" \
  "$(nproc --all)" "$SIZES" "$N" "$TP" "$QKV" "$TOL" "$LOAD_START" "$LOAD_END" <<'EOF'
import json, os, statistics, sys
(out, rows_path, checks_path, fails_path, rounds, batch, torch_v, build, libtorch, same, cores, sizes, n, tp, qkv,
 tol, load_start, load_end) = sys.argv[1:19]
runs, order = {}, []
for line in open(rows_path):
    if not line.strip():
        continue
    rnd, L, H, D, T, steps, impl, tps, rss, params = line.split()
    key = (int(L), int(D), int(T))
    if key not in order:
        order.append(key)
    runs.setdefault((key, impl), {})[int(rnd)] = (float(tps), float(rss), int(params))
checks = [json.loads(l) for l in open(checks_path) if l.strip()]
agreed = bool(checks) and all(c.get("agree") for c in checks)
rows = []
for key in order:
    a, b = runs.get((key, "tessera-tp"), {}), runs.get((key, "fsdp2-tp"), {})
    both = sorted(set(a) & set(b))
    if not both:
        continue
    tratios = [a[r][0] / b[r][0] for r in both]
    rratios = [a[r][1] / b[r][1] for r in both]
    tr, rr = statistics.median(tratios), statistics.median(rratios)
    L, D, T = key
    rows.append({"model": f"L{L} d{D} T{T}", "params_M": round(a[both[0]][2] / 1e6, 2), "mesh": f"dp {int(n) // int(tp)} x tp {tp}",
                 "tessera tokens/s": round(statistics.median(v[0] for v in a.values()), 1),
                 "tessera RSS MiB": round(statistics.median(v[1] for v in a.values()), 1),
                 "peer tokens/s": round(statistics.median(v[0] for v in b.values()), 1),
                 "peer RSS MiB": round(statistics.median(v[1] for v in b.values()), 1),
                 "tokens/s ratio": round(tr, 3), "tokens/s ratio min-max": f"{min(tratios):.3g}-{max(tratios):.3g}",
                 "RSS ratio": round(rr, 3), "RSS ratio min-max": f"{min(rratios):.3g}-{max(rratios):.3g}",
                 "goal": "tokens/s >= 1.5x, RSS <= 0.6x",
                 "met": ("yes" if tr >= 1.5 and rr <= 0.6 else "no") if agreed else "not compared: losses disagree",
                 "rounds": len(both)})
doc = {"benchmark": os.environ.get("PEERS_TP_NAME", "peers-tp"), "rows": rows,
       "losses agree": agreed, "loss checks": checks,
       "loss check": f"the peer's initial weights (--init-seed 7) given to gpt by --init-from; every step's loss within {tol} relative, and the peer's first-step gradients within 1e-4 of one process's on the same global batch",
       "tessera": f"gpt train --tp {tp} --strategy fsdp on {n} ranks (tessera run -n {n})",
       "peer": f"gpt_peer.py --mode fsdp2-tp --tp {tp} --qkv {qkv} --init meta: parallelize_module (torchtitan-style plan, SequenceParallel, loss_parallel) over tp of init_device_mesh('cpu', (dp, tp)), fully_shard per block and root over dp, gloo",
       "medians": "tokens/s and RSS: the median of each side's runs; ratios: the median of the per-round ratios (order reversed every other round)",
       "rounds": int(rounds), "sizes (L:H:D:T:steps)": sizes,
       "batch": f"{batch} sequences global (split over the dp ranks), AdamW (0.9, 0.95, wd 0.01), warmup + cosine lr 2e-3, clipping 1.0, fp32",
       "threads": f"one intra-op thread per rank; {cores} cores",
       "load average (1, 5, 15 min) at start / end": f"{load_start} / {load_end}",
       "peak_rss_mib": "the largest rank's peak resident set (ru_maxrss); Tessera's includes its end-of-run checkpoint save (a full state dict under --tp); the peer saves nothing",
       "versions": {"torch (peer)": torch_v, "tessera build": build, "tessera libtorch": libtorch,
                    "same libtorch both sides": same == "true"},
       "failed runs": [l.strip() for l in open(fails_path) if l.strip()] or "none"}
if same != "true":
    doc["caveat"] = ("Tessera's build does not link the peer's libtorch: the two sides run different kernels "
                     f"(Tessera: {libtorch}), so these ratios are not the issue's like-for-like comparison "
                     "(bench/peers/run_tp.sh build-torch2 is)")
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(doc, indent=1))
EOF
