#!/usr/bin/env bash
# make demo: the runtime on 3 local ranks through `tessera run`.
set -euo pipefail
BUILD=${1:-build}
echo "== tessera run -n 3 -- runtime_demo =="
"$BUILD/bin/tessera" run -n 3 -- "$BUILD/bin/runtime_demo"
