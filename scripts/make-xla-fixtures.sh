#!/usr/bin/env bash
# Makes the torch_xla FSDP fixtures of `tessera ckpt import-xla` (tests/checkpoint/fixtures/xla/)
# with the real torch_xla, in an environment of their own that `make test` never needs:
#
#   bash scripts/make-xla-fixtures.sh            # writes tests/checkpoint/fixtures/xla
#   bash scripts/make-xla-fixtures.sh OUTDIR     # or somewhere else
#
# .venv-xla (ignored by git) gets torch and torch_xla 2.9.0 from PyPI (torch_xla pairs with
# the torch of its own version). The torch wheel on PyPI is the CUDA build: `import torch`
# loads libtorch_cuda and so needs the nvidia-* wheels even on a machine without a GPU, and
# pip installs them with it (about 3 GB of downloads, 7 GB installed; 4 minutes here). torch_xla runs on the
# PJRT CPU device (PJRT_DEVICE=CPU); scripts/xla_fixtures.py says what it writes and how.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-tests/checkpoint/fixtures/xla}
venv=.venv-xla
PY=${PYTHON:-/usr/bin/python3}
pins=(torch==2.9.0 torch_xla==2.9.0)
if ! "$venv/bin/python" -c "import torch, torch_xla; assert torch.__version__.startswith('2.9.0') and torch_xla.__version__ == '2.9.0'" 2>/dev/null; then
  echo "make-xla-fixtures: making $venv (${pins[*]})" >&2
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q "${pins[@]}"
fi
mkdir -p "$out"
PJRT_DEVICE=CPU "$venv/bin/python" scripts/xla_fixtures.py "$out"
