#!/usr/bin/env bash
# The device check, for a machine with one or more NVIDIA GPUs and a Python whose torch
# 2.x is a CUDA build (the lent H200 machine: python3 with torch, CMake, ninja, nvcc).
# Under 8 minutes:
#   1. configures build-gpu against that torch's libtorch (CUDA + NCCL compiled), builds
#      the library, the CLI, the test programs and the GPT example;
#   2. runs the CUDA tests (ctest -R '^Cuda\.'): NCCL collectives, DDP/FSDP parity with one
#      GPU in fp32 and bf16, GPU checkpoint -> CPU -> GPU bit for bit;
#   3. on 2+ GPUs, tensor parallelism: gpt --devices 2 --tp 2 (NCCL, sequence parallel)
#      against one GPU, 10 fp32 steps, losses within 1e-3 (a failure fails the check);
#   4. the GPU benchmark: a 124M GPT (12 layers, d_model 768, sequence 1024, bf16 mixed)
#      trained by Tessera FSDP on one GPU and by Lightning Fabric (its single-device
#      strategy, what Lightning picks for one GPU) in the same run: tokens/s, MFU, peak
#      memory, and Tessera's sharded checkpoint save and load time.
# Writes bench/results/gpu.json (and copies it to $OUT when set, for the device tool).
#
#   bash scripts/gpu-check.sh            (PYTHON=python3, GPU_BENCH_STEPS=20)
# Dependencies without Debian packages there come from .gpu-deps (scripts/gpu-pack-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=${GPU_BENCH_STEPS:-20}
start=$(date +%s)
stamp() { echo "gpu-check: [$(( $(date +%s) - start )) s] $*"; }
TORCH=$("$PY" -c 'import os, torch; assert torch.cuda.is_available(), "torch sees no GPU"; print(os.path.dirname(torch.__file__))')
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
ARCH=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
PREFIX="$TORCH"
[[ -d .gpu-deps ]] && PREFIX="$PREFIX;$PWD/.gpu-deps"
stamp "torch $("$PY" -c 'import torch; print(torch.__version__)') at $TORCH; GPU sm_$ARCH; CUDA at $CUDA_HOME"

cmake -S . -B build-gpu -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" -DTESSERA_PYTHON="$(command -v "$PY")" \
  -DTESSERA_BUILD_BENCH=OFF -DTORCH_CUDA_ARCH_LIST="$ARCH" -DCUDAToolkit_ROOT="$CUDA_HOME" \
  -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" > build-gpu.configure.log 2>&1 || { tail -40 build-gpu.configure.log; exit 1; }
grep -q 'TESSERA_HAS_NCCL 1' build-gpu/generated/tessera/config.h || { echo "gpu-check: NCCL not compiled in"; exit 1; }
cmake --build build-gpu -j "$(nproc)" --target tessera_tests tessera_test_worker tessera_cli gpt > build-gpu.build.log 2>&1 ||
  { grep -m 20 -A5 'error' build-gpu.build.log; exit 1; }
stamp "built"

set +e
(cd build-gpu && ctest -R '^Cuda\.' --output-on-failure --timeout 300) | tee build-gpu.ctest.log
tests_rc=${PIPESTATUS[0]}
set -e
stamp "CUDA tests exit $tests_rc"

# ---- tensor parallelism on 2+ GPUs: gpt --tp 2 (NCCL, sequence parallel) against one GPU ----
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
TP_RUN=$(mktemp -d /tmp/tessera-gpu-tp-XXXXXX)
if (( GPUS >= 2 )); then
  TP_FLAGS=(--accelerator cuda --n-layer 2 --n-head 4 --d-model 128 --seq-len 64 --batch-size 8 --max-steps 10
            --log-every 1 --val-every 0 --ckpt-every 0 --no-progress-bar --seed 7)
  set +e
  build-gpu/bin/gpt train --devices 1 --strategy single "${TP_FLAGS[@]}" --out "$TP_RUN/one" > "$TP_RUN/one.log" 2>&1
  build-gpu/bin/gpt train --devices 2 --tp 2 --strategy fsdp "${TP_FLAGS[@]}" --out "$TP_RUN/tp2" > "$TP_RUN/tp2.log" 2>&1
  tp_rc=$?
  set -e
  "$PY" - "$TP_RUN" "$tp_rc" <<'PYEOF' | tee "$TP_RUN/compare.log"
import csv, json, sys
run, rc = sys.argv[1], int(sys.argv[2])
def losses(d):
    try:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(open(f"{run}/{d}/metrics.csv")) if r.get("train_loss")}
    except OSError:
        return {}
one, tp = losses("one"), losses("tp2")
worst = max((abs(tp[s] - one[s]) / abs(one[s]) for s in one if s in tp), default=float("inf"))
print(json.dumps({"tp2_rc": rc, "steps": len(tp), "max_rel_loss_diff_vs_one_gpu": worst, "ok": rc == 0 and worst < 1e-3}))
PYEOF
  stamp "tensor parallel on 2 GPUs: $(tail -1 "$TP_RUN/compare.log")"
  grep -q '"ok": true' "$TP_RUN/compare.log" || tests_rc=1
else
  stamp "tensor parallel: skipped (1 GPU)"
fi
# ---- benchmark: Tessera FSDP vs Lightning Fabric on one GPU, same model and batch ----
RUN=$(mktemp -d /tmp/tessera-gpu-XXXXXX)
MODEL=(--n-layer 12 --n-head 12 --d-model 768 --seq-len 1024)
BATCH=${GPU_BENCH_BATCH:-8}
build-gpu/bin/gpt train --accelerator cuda --devices 1 --strategy fsdp --precision bf16-mixed "${MODEL[@]}" \
  --batch-size "$BATCH" --max-steps "$STEPS" --val-fraction 0.01 --val-every 0 --ckpt-every "$STEPS" \
  --state-dict sharded --no-progress-bar --out "$RUN/tessera" | tee "$RUN/tessera.log"
t0=$(date +%s.%N)
build-gpu/bin/tessera ckpt verify "$RUN/tessera/checkpoints/last.ckpt" > /dev/null
t1=$(date +%s.%N)
# Resume = load the sharded checkpoint onto the GPU (one step more, so the load is timed in-process).
build-gpu/bin/gpt train --accelerator cuda --devices 1 --strategy fsdp --precision bf16-mixed "${MODEL[@]}" \
  --batch-size "$BATCH" --max-steps $((STEPS + 1)) --val-fraction 0.01 --val-every 0 --ckpt-every 0 \
  --state-dict sharded --no-progress-bar --out "$RUN/tessera" --resume last | tee "$RUN/resume.log"
set +e
"$PY" bench/peers/gpt_lightning_gpu.py 12 12 768 1024 "$BATCH" "$STEPS" | tee "$RUN/lightning.log"
set -e
"$PY" - "$RUN" "$t0" "$t1" <<'PYEOF'
import json, os, re, sys
run, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
def fields(path):
    text = open(path).read() if os.path.exists(path) else ""
    lines = [l for l in text.splitlines() if l.startswith("gpt: done")]
    return dict(re.findall(r"(\w+)=([^ ]+)", lines[-1])) if lines else {}
light = {}
for l in open(os.path.join(run, "lightning.log")).read().splitlines() if os.path.exists(os.path.join(run, "lightning.log")) else []:
    if l.startswith("{"):
        light = json.loads(l)
res = {"tessera_fsdp": fields(os.path.join(run, "tessera.log")), "tessera_resume": fields(os.path.join(run, "resume.log")),
       "verify_seconds": round(t1 - t0, 3), "lightning": light}
os.makedirs("bench/results", exist_ok=True)
json.dump(res, open("bench/results/gpu.json", "w"), indent=1)
print(json.dumps(res, indent=1))
PYEOF
[[ -n "${OUT:-}" ]] && cp bench/results/gpu.json build-gpu.*.log "$OUT/" 2>/dev/null || true
stamp "done"
exit "$tests_rc"
