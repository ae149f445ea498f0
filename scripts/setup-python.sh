#!/usr/bin/env bash
# The project's Python environments, made and kept up to date from python/requirements-*.txt.
#
#   bash scripts/setup-python.sh base     .venv: Debian's python3 (with its python3-torch 1.13,
#                                         the peer of the Debian libtorch build) plus the real
#                                         safetensors and tensorboard readers and huggingface_hub's
#                                         writer of Hugging Face model directories from PyPI
#   bash scripts/setup-python.sh torch2   .venv-torch2: torch 2.x from PyPI (a CUDA build that
#                                         carries libtorch), safetensors, tensorboard, huggingface_hub
#
# Prints the environment's python on stdout. Re-runs are no-ops while the requirements file
# is unchanged (a stamp in the venv holds its hash); a half-made venv is removed and made again.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-base}
case "$kind" in
  base)   venv=.venv;        req=python/requirements-base.txt;   flags=(--system-site-packages) ;;
  torch2) venv=.venv-torch2; req=python/requirements-torch2.txt; flags=() ;;
  *) echo "setup-python: unknown environment '$kind' (base or torch2)" >&2; exit 2 ;;
esac
PY=/usr/bin/python3   # Debian's, so that the base venv sees python3-torch (scripts/setup.sh)
want=$(sha256sum "$req" | cut -d' ' -f1)
stamp="$venv/.tessera-requirements"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
  echo "$PWD/$venv/bin/python"
  exit 0
fi
echo "setup-python: making $venv from $req" >&2
rm -rf "$venv"
"$PY" -m venv "${flags[@]}" "$venv" >&2
# No wheel cache: torch 2.x's CUDA wheels are ~3 GiB that would stay on disk beside the
# installed venv (a CI machine ran out of disk in this step).
"$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --progress-bar off -q -r "$req" >&2
echo "$want" > "$stamp"
echo "$PWD/$venv/bin/python"
