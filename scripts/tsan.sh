#!/usr/bin/env bash
# make test-tsan: the threaded parts of Tessera under ThreadSanitizer. Runs rank programs of
# the TSan build (BUILD_DIR, default build-tsan: library, `tessera` CLI and test worker built
# with -fsanitize=thread) through the TSan-built launcher:
#   1. async saves overlapping the caller's collectives (checkpoint::save_async's thread and
#      its split communicator), 2 ranks;
#   2. a rank SIGKILLed in a collective: the launcher's reaper, output and shutdown paths
#      (expects exit 137), and the survivors' error path, 3 ranks;
#   3. an FSDP training run with saves through Fabric, 2 ranks.
# Any TSan report fails the run; reports land in OUT/tsan.* (printed). libtorch, Gloo and
# libgomp are not instrumented: scripts/tsan.supp and docs/development.md, "ThreadSanitizer",
# say what that hides.
set -uo pipefail
BUILD="${1:-build-tsan}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CLI="$BUILD/bin/tessera"
W="$BUILD/bin/tessera_test_worker"
for b in "$CLI" "$W"; do [ -x "$b" ] || { echo "tsan: $b not built" >&2; exit 2; }; done
OUT="$(mktemp -d /tmp/tessera-tsan-XXXXXX)"
export TSAN_OPTIONS="suppressions=$ROOT/scripts/tsan.supp log_path=$OUT/tsan second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
export TESSERA_TEST_TIMEOUT_MS=20000
# TSan needs the address space layout it expects; turn off ASLR for the run where allowed.
NORAND=""
if setarch "$(uname -m)" -R true 2>/dev/null; then NORAND="setarch $(uname -m) -R"; fi
fail=0
mkdir -p "$OUT/async" "$OUT/dead" "$OUT/train"
step() {  # step NAME EXPECTED_EXIT CMD...
  local name="$1" want="$2"; shift 2
  local t0=$(date +%s)
  $NORAND "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "tsan: $name: exit $rc (want $want), $(( $(date +%s) - t0 )) s"
  if [ "$rc" != "$want" ]; then fail=1; tail -20 "$OUT/$name.log"; fi
}
step async_save 0 "$CLI" run -n 2 -- "$W" ckpt_async "$OUT/async/c"
step dead_rank 137 "$CLI" run -n 3 --grace 2 -- "$W" rel_train collective 1 "$OUT/dead" 6
step fsdp_train 0 "$CLI" run -n 2 -- "$W" rel_train none 1 "$OUT/train" 6
reports=$(ls "$OUT"/tsan.* 2>/dev/null | wc -l)
if [ "$reports" -gt 0 ]; then
  fail=1
  echo "tsan: $reports report file(s):"
  for f in "$OUT"/tsan.*; do echo "== $f"; head -60 "$f"; done
fi
echo "tsan: $([ $fail = 0 ] && echo clean || echo FAILED); logs in $OUT"
exit $fail
