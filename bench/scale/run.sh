#!/usr/bin/env bash
# Checkpoints at scale (issue 33 item 5): the save and load planning of format-2 sharded
# checkpoints for 8 to 16,384 virtual ranks of GPT-2-124M, Llama-3-8B and Llama-3-70B
# with AdamW state, Tessera's (build/bin/scale_bench, the real planning code) against
# PyTorch DCP's (dcp_scale.py, DCP's own planners, torch 2.x) in the same run; and the 2-D
# cases (issue 47 item 5, format 3): Llama-3-70B under FSDP x TP and HSDP x TP to 16,384
# ranks, the (2,048 x 8) -> (1,024 x 16) reshard, against DCP's FSDP2 + TP.
#   bench/scale/run.sh [BUILD]                     -> bench/results/scale.json
#   SCALE_RANKS=8,64,...      world sizes (default 8,64,512,1024,4096,16384)
#   SCALE_MODELS=a,b          models (default gpt2-124m,llama3-8b,llama3-70b)
#   SCALE_MESHES=...          2-D meshes of Llama-3-70B, DPxTP (FSDP x TP) or RxSxTP (HSDP x
#                             TP) (default 2x8,8x8,16x8,128x8,512x8,2048x8,8x16x8,32x16x8,128x16x8;
#                             empty: no 2-D cases); SCALE_RESHARD_2D (default 2048x8:1024x16)
#   DCP_MESHES_2D=...         DCP's FSDP2 + TP meshes (default 2x8,8x8,16x8,32x8,64x8, each run
#                             when N x items <= DCP_SCALE_MAX_ITEMS: up to 16x8 by default, 64x8
#                             at 1500000), DCP_RESHARD_2D (default 16x8:8x16)
#   SCALE_REPEATS=K           timed repeats per sampled rank, median (default 3)
#   DCP_SCALE_MAX_ITEMS=K     DCP configurations up to N x items-per-rank <= K (default
#                             400000: about three minutes; 1500000 needs ~5 GiB and ~25 min)
#   SCALE_BENCH_PY=PYTHON     the torch 2.x python (default .venv-torch2/bin/python)
#   SCALE_OUT=FILE            result file (default bench/results/scale.json)
set -euo pipefail
BUILD=${1:-build}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
RANKS=${SCALE_RANKS:-8,64,512,1024,4096,16384}
MODELS=${SCALE_MODELS:-gpt2-124m,llama3-8b,llama3-70b}
OUT=${SCALE_OUT:-$ROOT/bench/results/scale.json}
PY=${SCALE_BENCH_PY:-$ROOT/.venv-torch2/bin/python}
WORK=$(mktemp -d /tmp/tessera-scale-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
MESHES=${SCALE_MESHES-2x8,8x8,16x8,128x8,512x8,2048x8,8x16x8,32x16x8,128x16x8}
"$BUILD/bin/scale_bench" --ranks "$RANKS" --models "$MODELS" --repeats "${SCALE_REPEATS:-3}" \
  --meshes "$MESHES" --reshard-2d "${SCALE_RESHARD_2D-2048x8:1024x16}" \
  --work "$WORK/tessera" --out "$WORK/tessera.json"
DCP=()
if [ -x "$PY" ] && "$PY" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null; then
  "$PY" bench/scale/dcp_scale.py run --models "$MODELS" --ranks "$RANKS" --work "$WORK" --out "$WORK/dcp.json" \
    --meshes-2d "${DCP_MESHES_2D-2x8,8x8,16x8,32x8,64x8}" --reshard-2d "${DCP_RESHARD_2D-16x8:8x16}"
  DCP=("$WORK/dcp.json")
else
  echo "bench/scale: DCP side skipped: $PY is not a torch 2.x python (make test-torch2 creates .venv-torch2)" >&2
fi
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
/usr/bin/python3 bench/scale/summarize.py "$WORK/tessera.json" "${DCP[@]}" --out "$OUT" \
  --load "start $LOAD_START, end $LOAD_END"
