#!/usr/bin/env bash
# make demo: a byte-level GPT trained on 2 local ranks with FSDP, stopped part-way and
# resumed from its last sharded checkpoint, consolidated, verified and sampled.
#
#   bash scripts/demo.sh [BUILD_DIR]          (make demo runs it after setup + build)
#
# Environment: DEMO_OUT (run directory, default BUILD_DIR/demo-gpt), DEMO_STEPS_A /
# DEMO_STEPS_B (stop / final step, default 200 / 400), DEMO_ARGS (extra `gpt train` flags).
set -euo pipefail
BUILD=${1:-build}
BIN="$BUILD/bin"
OUT=${DEMO_OUT:-$BUILD/demo-gpt}
A=${DEMO_STEPS_A:-200}
B=${DEMO_STEPS_B:-400}
EXTRA=${DEMO_ARGS:-}
for exe in gpt tessera; do
  [[ -x "$BIN/$exe" ]] || { echo "demo: $BIN/$exe is not built (run 'make demo' or 'make build')" >&2; exit 1; }
done
# Runs started by this script are not ranks of an outer job.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TESSERA_LAUNCHED || true

rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s.%N)
# Same model, data and learning-rate schedule (cosine over B steps) in both stages.
TRAIN=(train --devices 2 --strategy fsdp --state-dict sharded --out "$OUT" --lr-decay-steps "$B"
       --ckpt-every 50 --val-every 50 --log-every 10)
# shellcheck disable=SC2206
TRAIN+=($EXTRA)

echo "== 1/5 gpt train: 2 ranks, FSDP (one unit per block), steps 0..$A =="
echo "   data: the license texts in /usr/share/common-licenses (last 10% held out for validation)"
"$BIN/gpt" "${TRAIN[@]}" --max-steps "$A" | tee "$OUT/train-1.log"

echo
echo "== 2/5 gpt train --resume last: from the sharded checkpoint at step $A to step $B =="
"$BIN/gpt" "${TRAIN[@]}" --max-steps "$B" --resume last | tee "$OUT/train-2.log"

echo
echo "== 3/5 tessera ckpt consolidate: sharded directory -> one safetensors file =="
"$BIN/tessera" ckpt consolidate "$OUT/checkpoints/last.ckpt" -o "$OUT/gpt.safetensors" --force

echo
echo "== 4/5 tessera ckpt verify =="
"$BIN/tessera" ckpt verify "$OUT/checkpoints/last.ckpt"
"$BIN/tessera" ckpt verify "$OUT/gpt.safetensors"

echo
echo "== 5/5 gpt sample (one process, from the consolidated file) =="
"$BIN/gpt" sample --ckpt "$OUT/gpt.safetensors" --prompt "This License" --tokens 300 --temperature 0.8 \
  --top-k 40 --seed 0 | tee "$OUT/sample.txt"
end=$(date +%s.%N)

# --- summary -------------------------------------------------------------------------
field() {  # field NAME FILE: the value of NAME=... on the "gpt: done" line
  grep -o "gpt: done .*" "$2" | tr ' ' '\n' | sed -n "s/^$1=//p" | tail -1
}
first_loss=$(awk -F, 'NR==1{for(i=1;i<=NF;i++) if($i=="train_loss") c=i; next} c && $c!="" {print $c; exit}' \
  "$OUT/metrics.csv")
last_loss=$(awk -F, 'NR==1{for(i=1;i<=NF;i++) if($i=="train_loss") c=i; next} c && $c!="" {v=$c} END{print v}' \
  "$OUT/metrics.csv")
echo
echo "== summary =="
printf '  steps              %s (stopped at %s, resumed to %s)\n' "$(field step "$OUT/train-2.log")" "$A" "$B"
printf '  train loss         %.3f (first logged) -> %.3f (last logged)\n' "$first_loss" "$last_loss"
printf '  final val loss     %.3f (nats per byte; uniform guess = 5.545)\n' "$(field val_loss "$OUT/train-2.log")"
printf '  tokens/s           %s (steps 0..%s), %s (steps %s..%s), 2 ranks on this machine\n' \
  "$(field tokens_per_s "$OUT/train-1.log")" "$A" "$(field tokens_per_s "$OUT/train-2.log")" "$A" "$B"
printf '  parameters         %s\n' "$(field params "$OUT/train-2.log")"
printf '  sharded checkpoint %s  (%s)\n' "$OUT/checkpoints/last.ckpt" "$(du -sh "$OUT/checkpoints/last.ckpt" | cut -f1)"
printf '  consolidated       %s  (%s)\n' "$OUT/gpt.safetensors" "$(du -sh "$OUT/gpt.safetensors" | cut -f1)"
printf '  metrics            %s\n' "$OUT/metrics.csv"
printf '  run directory      %s\n' "$OUT"
printf '  demo wall time     %.0f s\n' "$(echo "$end - $start" | bc)"
