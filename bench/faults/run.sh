#!/usr/bin/env bash
# The chaos benchmark (issue 34): the demo model (4 layers, d_model 128, seq 64, global
# batch 16) on 2 ranks under `tessera run -n 2 --max-restarts K -- gpt train --resume auto
# --ckpt-every 10`, hit by 20 failures (SIGKILL, SIGSEGV, SIGSTOP of random ranks, about
# one per 50 steps, seeded), with synchronous and with async checkpoints, each against an
# uninterrupted run of the same command (bench/faults/chaos.py, which the chaos test in
# `make test` also uses). Measures recovered/injected, bit-identical final state, work lost
# per failure against the interval, time from failure and from restart to the first step,
# and goodput (the uninterrupted run's wall time over the chaos run's, same steps).
# Mode "sync-2nodes": the same with synchronous saves and the two ranks as two nodes (one
# `tessera run --nnodes 2 --node-rank i` each, on this host, meeting over TCP in node 0's
# store), so a failure on one node restarts both launchers' ranks.
# Writes bench/results/faults.json (one row per mode) and faults-failures.json (one row
# per failure).
#
#   bench/faults/run.sh BUILD_DIR
#     FAULTS_FAILURES (20), FAULTS_GAP (50 steps between failures), FAULTS_CKPT_EVERY (10),
#     FAULTS_SEED (34), FAULTS_COMM_TIMEOUT (3 s: how long a rank waits for a stopped peer),
#     FAULTS_MODES ("sync async sync-2nodes sync-long"), FAULTS_GRACE (the launcher's --grace,
#     default 5 s as a user gets it), FAULTS_LONG_BATCH (256), FAULTS_LONG_FAILURES (6)
# Mode "sync-long": the same model at a global batch of FAULTS_LONG_BATCH, so that a step
# takes ~20x longer (a failure per 50 steps is then a failure every ~30 s of training, not
# every ~2 s) and fewer failures at the same rate: what goodput is when the restart is small
# against the work between failures, next to its bound (the work a failure loses, about half
# a checkpoint interval, is a fixed share of the interval between failures at any step time).
set -euo pipefail
BUILD=${1:-build}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=/usr/bin/python3
FAILURES=${FAULTS_FAILURES:-20}
GAP=${FAULTS_GAP:-50}
EVERY=${FAULTS_CKPT_EVERY:-10}
SEED=${FAULTS_SEED:-34}
TIMEOUT=${FAULTS_COMM_TIMEOUT:-3}
MODES=${FAULTS_MODES:-"sync async sync-2nodes sync-long"}
GRACE=${FAULTS_GRACE:-5}
LONG_BATCH=${FAULTS_LONG_BATCH:-256}
LONG_FAILURES=${FAULTS_LONG_FAILURES:-6}
source "$HERE/../common/run_env.sh"
bench_run_env faults

# The floor of any restart: starting the gpt binary (exec, libtorch's shared libraries),
# best of 3.
START_S=$("$PY" - "$BUILD/bin/gpt" <<'EOF'
import subprocess, sys, time
best = 1e9
for _ in range(3):
    t = time.monotonic()
    subprocess.run([sys.argv[1], "--help"], stdout=subprocess.DEVNULL, check=True)
    best = min(best, time.monotonic() - t)
print("%.3f" % best)
EOF
)
echo "faults: gpt process start (gpt --help, best of 3): ${START_S} s"

reports=()
for mode in $MODES; do
  extra=()
  failures=$FAILURES
  batch=16
  [[ $mode == async ]] && extra=(--async-ckpt)
  [[ $mode == sync-2nodes ]] && extra=(--nodes 2)
  if [[ $mode == sync-long ]]; then
    failures=$LONG_FAILURES
    batch=$LONG_BATCH
  fi
  steps=$((GAP * (failures + 1)))
  echo "== faults: $mode checkpoints: $failures failures over $steps steps (global batch $batch), a checkpoint every $EVERY =="
  "$PY" "$HERE/chaos.py" --build "$BUILD" --work "$TMP/$mode" --json "$TMP/$mode.json" --steps "$steps" \
    --ckpt-every "$EVERY" --failures "$failures" --gap "$GAP" --signals KILL,SEGV,STOP --seed "$SEED" \
    --model 4:4:128:64 --batch-size "$batch" --comm-timeout "$TIMEOUT" --time-limit 3600 \
    "--launcher-arg=--grace=$GRACE" "${extra[@]}" || echo "faults: $mode: the driver reported problems (kept in the results)"
  reports+=("$TMP/$mode.json")
done
"$PY" "$HERE/summarize.py" --out "$ROOT/bench/results/faults.json" \
  --failures-out "$ROOT/bench/results/faults-failures.json" --process-start-s "$START_S" --grace-s "$GRACE" \
  "${reports[@]}"
