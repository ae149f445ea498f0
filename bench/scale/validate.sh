#!/usr/bin/env bash
# The harness against reality (issue 33 item 5): real `gpt train` FSDP saves at 2, 8, 32
# and 64 ranks on this machine (a tiny model, real processes and c10d groups), each compared
# byte for byte with the metadata scale_bench --predict computes from the model's shapes
# with the same planning code (keys' order, plain values and the save id taken from the
# real file: what no planner can know). The 2-D cases (issue 47 item 5): real `gpt train
# --tp T` FSDP x TP saves (format 3) on (dp, tp) meshes of 4, 8, 16 and 32 ranks, tp 2 and
# 4 (dp 1 included: FSDP keeps the parameters whole there), likewise compared with
# scale_bench --predict --tp T. Results in bench/results/scale-validate.json.
#   bench/scale/validate.sh [BUILD] [RANKS...]   (default ranks: 2 8 32 64)
#   VALIDATE_MESHES="DPxTP ..."  the 2-D meshes (default 2x2 1x4 4x2 2x4 8x2 4x4 16x2 8x4;
#                                empty: none)
set -euo pipefail
BUILD=${1:-build}
shift || true
RANKS=("$@")
[ ${#RANKS[@]} -gt 0 ] || RANKS=(2 8 32 64)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
W=$(mktemp -d /tmp/tessera-scale-validate-XXXXXX)
trap 'rm -rf "$W"' EXIT
model=(--n-layer 2 --n-head 2 --d-model 32 --seq-len 16)
rows=()
mismatches=0
for n in "${RANKS[@]}"; do
  out="$W/run$n"
  "$BUILD/bin/tessera" run -n "$n" -- "$BUILD/bin/gpt" train "${model[@]}" --batch-size "$n" --max-steps 1 \
    --val-every 0 --limit-val-batches 0 --threads 1 --no-progress-bar --out "$out" > "$W/train$n.log" 2>&1 ||
    { tail -20 "$W/train$n.log"; exit 1; }
  meta="$out/checkpoints/last.ckpt/tessera-checkpoint.json"
  if "$BUILD/bin/scale_bench" --predict --model tiny-gpt "${model[@]}" --ranks "$n" --metadata "$meta" \
      > "$W/predict$n.log" 2>&1; then ok=true; else ok=false; mismatches=$((mismatches + 1)); fi
  echo "ranks $n: $(stat -c %s "$meta") metadata bytes, prediction: $(tail -1 "$W/predict$n.log")"
  rows+=("{\"ranks\": $n, \"metadata_bytes\": $(stat -c %s "$meta"), \"match\": $ok}")
done
# 2-D: the GPT's tensor-parallel plan (qkv in 3 stripes, fc and the vocabulary cut by rows,
# proj and fc_out by columns) under FSDP over dp; --n-head and --seq-len divide by tp.
model2=(--n-layer 2 --n-head 4 --d-model 32 --seq-len 16)
rows2=()
read -r -a MESHES <<< "${VALIDATE_MESHES-2x2 1x4 4x2 2x4 8x2 4x4 16x2 8x4}"
for mesh in "${MESHES[@]}"; do
  dp=${mesh%x*}
  tp=${mesh#*x}
  n=$((dp * tp))
  out="$W/run$mesh"
  "$BUILD/bin/tessera" run -n "$n" -- "$BUILD/bin/gpt" train "${model2[@]}" --tp "$tp" --batch-size "$n" \
    --max-steps 1 --val-every 0 --limit-val-batches 0 --threads 1 --no-progress-bar --out "$out" \
    > "$W/train$mesh.log" 2>&1 || { tail -20 "$W/train$mesh.log"; exit 1; }
  meta="$out/checkpoints/last.ckpt/tessera-checkpoint.json"
  if "$BUILD/bin/scale_bench" --predict --model tiny-gpt "${model2[@]}" --ranks "$n" --tp "$tp" --metadata "$meta" \
      > "$W/predict$mesh.log" 2>&1; then ok=true; else ok=false; mismatches=$((mismatches + 1)); fi
  echo "ranks $n (dp $dp x tp $tp): $(stat -c %s "$meta") metadata bytes, prediction: $(tail -1 "$W/predict$mesh.log")"
  rows2+=("{\"ranks\": $n, \"mesh\": \"$mesh\", \"dp\": $dp, \"tp\": $tp, \"metadata_bytes\": $(stat -c %s "$meta"), \"match\": $ok}")
done
mkdir -p bench/results
( IFS=,; echo "{\"benchmark\": \"scale-validate\", \"date\": \"$(date -u +%FT%TZ)\", \"runs\": [${rows[*]}], \"runs_2d\": [${rows2[*]}]}" ) \
  > bench/results/scale-validate.json
cat bench/results/scale-validate.json
# The harness's prediction must be exact: a mismatch fails make bench (the JSON keeps the rows).
if [ "$mismatches" -gt 0 ]; then
  echo "validate.sh: scale_bench --predict missed the real metadata at $mismatches world size(s) or mesh(es)" >&2
  exit 1
fi
