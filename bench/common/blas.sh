# Sourced by the benchmarks: exports OPENBLAS_CORETYPE as Tessera's programs choose it on
# this machine (tessera/core/blas.h), so that the Python peers use the same BLAS kernels,
# and sets BLAS to gpt's one-line report of them.   tessera_blas_env BUILD_DIR TMP_DIR
tessera_blas_env() {
  local probe
  probe=$(env -u OPENBLAS_CORETYPE "$1/bin/gpt" train --strategy single --max-steps 1 --batch-size 2 --seq-len 8 \
          --n-layer 1 --n-head 1 --d-model 8 --val-fraction 0 --no-progress-bar --out "$2/blas-probe" 2>&1)
  rm -rf "$2/blas-probe"
  BLAS=$(echo "$probe" | grep -o 'blas="[^"]*"' | head -1 | cut -d'"' -f2)
  local coretype
  coretype=$(echo "$BLAS" | grep -o 'OPENBLAS_CORETYPE=[A-Za-z0-9]*' | cut -d= -f2 || true)
  if [ -n "$coretype" ]; then export OPENBLAS_CORETYPE=$coretype; fi
  echo "-- BLAS: $BLAS" >&2
}
