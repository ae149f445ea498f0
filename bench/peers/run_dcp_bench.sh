#!/usr/bin/env bash
# Tessera's sharded checkpoints vs PyTorch Distributed Checkpoint (DCP, torch 2.x from
# .venv-torch2), the same state in the same run: the model + AdamW state of a GPT-like
# model of ~MIB MiB at 2 ranks, every tensor sharded along dim 0 (checkpoint_bench.cpp's
# gpt-* modes; bench/peers/dcp_bench.py builds the same tensors as DTensors).
#   bench/peers/run_dcp_bench.sh [MIB] [WORK_DIR]      -> bench/results/dcp.json
#   DCP_BENCH_ROUNDS=N   rounds (default 3)
#   DCP_BENCH_BUILD=DIR  Tessera build (default build-torch2, the build against the same
#                        torch; build when build-torch2 has no checkpoint_bench)
#
# Each round measures, in an order that rotates from round to round:
#   tessera      checkpoint_bench gpt-save, then (a later job) gpt-load
#   dcp          dcp.save with FileSystemWriter defaults, then dcp.load
#   dcp_t2       dcp.save with FileSystemWriter(thread_count=2), then dcp.load
#   tessera_async / dcp_async   two async saves each (save_async / dcp.async_save)
# then both consolidations (alternating which goes first): `tessera ckpt consolidate` of
# Tessera's save and format_utils.dcp_to_torch_save of DCP's (default) save, each a
# process of its own under /usr/bin/time (wall, peak RSS). Before every load and
# consolidation the input files' pages are dropped (dd iflag=nocache, i.e.
# posix_fadvise DONTNEED) and fincore records how much of them was still cached (after
# the save and after the drop): the loads' starting points are in the JSON.
# Every ratio is the median of per-round ratios (> 1: Tessera better), with min and max.
set -euo pipefail
shopt -s inherit_errexit
MIB=${1:-1024}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${2:-$(mktemp -d /tmp/tessera-dcp-bench-XXXXXX)}
ROUNDS=${DCP_BENCH_ROUNDS:-3}
OUT="$ROOT/bench/results/dcp.json"
PY="$ROOT/.venv-torch2/bin/python"
PEER="$ROOT/bench/peers/dcp_bench.py"
BUILD=${DCP_BENCH_BUILD:-build-torch2}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
BUILD_NOTE="$(basename "$BUILD")"
if [ ! -x "$BUILD/bin/checkpoint_bench" ] && [ -z "${DCP_BENCH_BUILD:-}" ] && [ -x "$ROOT/build/bin/checkpoint_bench" ]; then
  echo "run_dcp_bench: build-torch2 has no checkpoint_bench (make test-torch2 builds it); Tessera side from build/ (libtorch 1.13)" >&2
  BUILD="$ROOT/build"
  BUILD_NOTE="build (build-torch2 missing)"
fi
grep -q gpt-async "$BUILD/bin/checkpoint_bench" ||
  { echo "run_dcp_bench: $BUILD/bin/checkpoint_bench predates its gpt-* modes; rebuild it (cmake --build $BUILD --target checkpoint_bench)" >&2; exit 1; }
[ -x "$PY" ] || { echo "run_dcp_bench: $PY missing (make test-torch2 creates .venv-torch2)" >&2; exit 1; }
mkdir -p "$(dirname "$OUT")" "$WORK/bin"
trap 'rm -rf "$WORK"' EXIT
# Copies of the binaries (their library paths are absolute): a rebuild during the run
# cannot replace them halfway through.
cp "$BUILD/bin/tessera" "$WORK/bin/tessera"
cp "$BUILD/bin/checkpoint_bench" "$WORK/bin/checkpoint_bench"
TESSERA="$WORK/bin/tessera"
BENCH="$WORK/bin/checkpoint_bench"
CPU_TESSERA=""
if [ -x "$ROOT/build/bin/tessera" ] && [ "$BUILD" != "$ROOT/build" ]; then
  cp "$ROOT/build/bin/tessera" "$WORK/bin/tessera-cpu"
  CPU_TESSERA="$WORK/bin/tessera-cpu"
fi
# Default settings, as a user gets them (bench/common/run_env.sh's prelude): one OpenMP
# thread per rank on both sides, no launcher environment inherited.
export OMP_NUM_THREADS=1
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TESSERA_LAUNCHED \
  TESSERA_CPU_ALLOCATOR TESSERA_CPU_CACHE_MIB TESSERA_NO_DIRECT_IO || true
LOG="$WORK/stderr.log"
now() { date +%s.%N; }
since() { awk -v a="$2" -v b="$1" 'BEGIN { printf "%.4f", a - b }'; }  # since T0 T1 -> T1 - T0

# Rank 0's JSON line of a 2-rank job.
ranks2() {
  local out
  if ! out=$("$TESSERA" run -n 2 -- "$@" 2>>"$LOG"); then
    echo "run_dcp_bench: failed: $*" >&2; tail -30 "$LOG" >&2; exit 1
  fi
  echo "$out" | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //'
}
# MiB of the files under $1 resident in the page cache.
cached_mib() {
  find "$1" -type f -print0 | xargs -0 fincore -b -n -o RES 2>/dev/null |
    awk '{ s += $1 } END { printf "%.1f", s / 1048576 }'
}
# Drops the pages of every file under $1 (posix_fadvise DONTNEED through dd).
drop_cache() {
  find "$1" -type f -print0 | while IFS= read -r -d '' f; do dd if="$f" iflag=nocache count=0 status=none; done
}
# A save job, then a cold load job of the same checkpoint -> one JSON object.
save_load() {  # save_load DIR SAVE_CMD... -- LOAD_CMD...
  local dir=$1 s l after drop
  shift
  local save=() load=()
  while [ "$1" != -- ]; do save+=("$1"); shift; done
  shift
  load=("$@")
  s=$(ranks2 "${save[@]}")
  after=$(cached_mib "$dir")
  drop_cache "$dir"
  drop=$(cached_mib "$dir")
  l=$(ranks2 "${load[@]}")
  echo "{\"save\": $s, \"load\": $l, \"cached_after_save_mib\": $after, \"cached_before_load_mib\": $drop}"
}
# Wall time and peak RSS of one command -> {"wall_s", "kib"}.
rss_of() {
  /usr/bin/time -f '%e %M' -o "$WORK/rss" "$@" >/dev/null 2>>"$LOG"
  tail -1 "$WORK/rss" | awk '{ printf "{\"wall_s\": %s, \"kib\": %s}", $1, $2 }'
}
measure() {
  case $1 in
    startup)
      # Each side's runtime doing nothing (the consolidations' floor, in wall time and
      # peak RSS): the Tessera CLI printing its help, Python importing format_utils.
      local c='{"wall_s": 0, "kib": 0}'
      [ -z "$CPU_TESSERA" ] || c=$(rss_of "$CPU_TESSERA" --help)
      echo "{\"tessera\": $(rss_of "$TESSERA" --help), \"dcp\": $(rss_of "$PY" -c "import torch.distributed.checkpoint.format_utils"), \"tessera_cpu\": $c}" ;;
    tessera)
      save_load "$RD/tessera" "$BENCH" gpt-save "$RD/tessera" "$MIB" -- "$BENCH" gpt-load "$RD/tessera" "$MIB" ;;
    dcp)
      save_load "$RD/dcp" "$PY" "$PEER" save "$RD/dcp" "$MIB" -- "$PY" "$PEER" load "$RD/dcp" "$MIB" ;;
    dcp_t2)
      save_load "$RD/dcp_t2" "$PY" "$PEER" save "$RD/dcp_t2" "$MIB" 2 -- "$PY" "$PEER" load "$RD/dcp_t2" "$MIB" ;;
    tessera_async)
      ranks2 "$BENCH" gpt-async "$RD/tessera_async" "$MIB" ;;
    dcp_async)
      ranks2 "$PY" "$PEER" async "$RD/dcp_async" "$MIB" ;;
    consolidate_tessera)
      local t0 t1 before
      drop_cache "$RD/tessera"; before=$(cached_mib "$RD/tessera")
      t0=$(now)
      /usr/bin/time -f %M -o "$WORK/rss" "$TESSERA" ckpt consolidate "$RD/tessera" -o "$RD/tessera.safetensors" >/dev/null 2>>"$LOG"
      t1=$(now)
      echo "{\"wall_s\": $(since "$t0" "$t1"), \"peak_rss_kib\": $(tail -1 "$WORK/rss"), \"cached_before_mib\": $before}" ;;
    consolidate_tessera_cpu)
      # The same consolidation by the CLI of the build against Debian's CPU-only libtorch
      # 1.13 (when there is one): the CUDA wheel's libraries alone take ~300 MiB more RSS.
      local t0 t1
      drop_cache "$RD/tessera"
      t0=$(now)
      /usr/bin/time -f %M -o "$WORK/rss" "$CPU_TESSERA" ckpt consolidate "$RD/tessera" -o "$RD/tessera-cpu.safetensors" >/dev/null 2>>"$LOG"
      t1=$(now)
      echo "{\"wall_s\": $(since "$t0" "$t1"), \"peak_rss_kib\": $(tail -1 "$WORK/rss")}" ;;
    consolidate_dcp)
      local t0 t1 before j
      drop_cache "$RD/dcp"; before=$(cached_mib "$RD/dcp")
      t0=$(now)
      j=$(/usr/bin/time -f %M -o "$WORK/rss" "$PY" "$PEER" consolidate "$RD/dcp" "$RD/dcp.pt" 2>>"$LOG")
      t1=$(now)
      echo "{\"wall_s\": $(since "$t0" "$t1"), \"peak_rss_kib\": $(tail -1 "$WORK/rss"), \"cached_before_mib\": $before, \"in_process\": $j}" ;;
  esac
}

CPU_CLI=()
[ -z "$CPU_TESSERA" ] || CPU_CLI=(consolidate_tessera_cpu)
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
peers=(tessera dcp dcp_t2 tessera_async dcp_async)
: > "$WORK/rounds.jsonl"
for ((r = 0; r < ROUNDS; r++)); do
  order=()
  for ((k = 0; k < ${#peers[@]}; k++)); do order+=("${peers[(k + r) % ${#peers[@]}]}"); done
  if ((r % 2 == 0)); then order+=(consolidate_tessera consolidate_dcp); else order+=(consolidate_dcp consolidate_tessera); fi
  order+=("${CPU_CLI[@]}" startup)
  echo "-- dcp round $((r + 1))/$ROUNDS: ${order[*]}" >&2
  RD="$WORK/round$r"  # removed when the round ends (see run_checkpoint_bench.sh: TRIM)
  mkdir -p "$RD"
  for p in "${order[@]}"; do
    res=$(measure "$p")
    echo "{\"round\": $r, \"peer\": \"$p\", \"result\": $res}" >> "$WORK/rounds.jsonl"
  done
  rm -rf "$RD"
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

"$PY" - "$OUT" "$WORK/rounds.jsonl" "$BUILD_NOTE" "$LOAD_START" "$LOAD_END" "$MIB" <<'PYEOF'
import json, math, os, statistics, sys, torch
out, path, build, load_start, load_end, mib = sys.argv[1:7]
sys.path.insert(0, os.path.join(os.path.dirname(out), "..", "peers"))
from dcp_bench import gpt_layout
largest_mib = max(4 * math.prod(shape) for _, shape in gpt_layout(int(mib))) / (1 << 20)
rounds = {}
for line in open(path):
    e = json.loads(line)
    rounds.setdefault(e["round"], {})[e["peer"]] = e["result"]
R = [rounds[k] for k in sorted(rounds)]
med = statistics.median
def col(f):
    return [f(r) for r in R]
t_save, t_load = col(lambda r: r["tessera"]["save"]["save_s"]), col(lambda r: r["tessera"]["load"]["load_s"])
d_save, d_load = col(lambda r: r["dcp"]["save"]["save_s"]), col(lambda r: r["dcp"]["load"]["load_s"])
d2_save, d2_load = col(lambda r: r["dcp_t2"]["save"]["save_s"]), col(lambda r: r["dcp_t2"]["load"]["load_s"])
ta, da = col(lambda r: r["tessera_async"]), col(lambda r: r["dcp_async"])
ct, cd = col(lambda r: r["consolidate_tessera"]), col(lambda r: r["consolidate_dcp"])
nbytes = R[0]["tessera"]["save"]["bytes"]
assert nbytes == R[0]["dcp"]["save"]["bytes"], "the two sides built different states"
gib = nbytes / (1 << 30)
def row(name, target, num, den):
    rs = [n / d for n, d in zip(num, den)]
    return {"ratio (per round; > 1: Tessera better)": name, "target": target,
            "median": med(rs), "min": min(rs), "max": max(rs)}
cd_wall = [c["wall_s"] for c in cd]
cd_nofsync = [c["wall_s"] - c["in_process"]["fsync_s"] for c in cd]
cd_convert = [c["in_process"]["convert_s"] for c in cd]
ct_wall = [c["wall_s"] for c in ct]
rows = [
    row("save vs dcp.save (FileSystemWriter defaults)", ">= 1.5", d_save, t_save),
    row("save vs dcp.save (thread_count=2)", ">= 1.5", d2_save, t_save),
    row("load vs dcp.load (of the defaults' save)", ">= 1.5", d_load, t_load),
    row("load vs dcp.load (of the thread_count=2 save)", ">= 1.5", d2_load, t_load),
    row("async save, blocking part vs dcp.async_save's (2nd save)", ">= 1", [a["blocking_s"] for a in da],
        [a["blocking_s"] for a in ta]),
    row("async save, blocking part vs dcp.async_save's (1st save)", "", [a["first_blocking_s"] for a in da],
        [a["first_blocking_s"] for a in ta]),
    row("async save, total until committed vs dcp.async_save's (2nd)", "", [a["total_s"] for a in da],
        [a["total_s"] for a in ta]),
    row("consolidate vs dcp_to_torch_save + fsync (wall of each process)", ">= 2", cd_wall, ct_wall),
    row("consolidate vs dcp_to_torch_save, no fsync (format_utils' CLI)", ">= 2", cd_nofsync, ct_wall),
    row("consolidate vs dcp_to_torch_save, work only (each minus its start-up; DCP without fsync)", "", cd_convert, [c["wall_s"] - r["startup"]["tessera"]["wall_s"] for c, r in zip(ct, R)]),
    row("consolidate peak RSS: dcp_to_torch_save's / Tessera's", ">= 4", [c["peak_rss_kib"] for c in cd],
        [c["peak_rss_kib"] for c in ct]),
    row("consolidate peak RSS above each runtime's start-up RSS", "",
        [c["peak_rss_kib"] - r["startup"]["dcp"]["kib"] for c, r in zip(cd, R)],
        [c["peak_rss_kib"] - r["startup"]["tessera"]["kib"] for c, r in zip(ct, R)]),
]
cpu = [r["consolidate_tessera_cpu"] for r in R if "consolidate_tessera_cpu" in r]
if cpu:
    rows.append(row("consolidate peak RSS, Tessera CLI on CPU libtorch 1.13 (build/)", "",
                    [c["peak_rss_kib"] for c in cd], [c["peak_rss_kib"] for c in cpu]))
res = {
    "benchmark": "dcp",
    "rows": rows,
    "state": {"bytes": nbytes, "tensors (each side)": R[0]["tessera"]["save"]["tensors"], "ranks": 2,
              "largest tensor MiB": largest_mib, "rounds": len(R)},
    "versions": {"torch (DCP)": torch.__version__, "tessera build": build},
    "median_seconds": {
        "tessera save": med(t_save), "dcp.save (defaults)": med(d_save), "dcp.save (thread_count=2)": med(d2_save),
        "tessera load": med(t_load), "dcp.load (defaults' save)": med(d_load),
        "dcp.load (thread_count=2 save)": med(d2_load),
        "tessera save_async blocking (2nd)": med([a["blocking_s"] for a in ta]),
        "dcp.async_save blocking (2nd)": med([a["blocking_s"] for a in da]),
        "tessera save_async blocking (1st)": med([a["first_blocking_s"] for a in ta]),
        "dcp.async_save blocking (1st)": med([a["first_blocking_s"] for a in da]),
        "tessera save_async total (2nd)": med([a["total_s"] for a in ta]),
        "dcp.async_save total (2nd)": med([a["total_s"] for a in da]),
        "tessera ckpt consolidate (wall)": med(ct_wall), "dcp_to_torch_save + fsync (wall)": med(cd_wall),
        "dcp_to_torch_save call alone": med(cd_convert),
        "dcp_to_torch_save: reading into memory": med([c["in_process"]["read_s"] for c in cd]),
        "dcp_to_torch_save: torch.save": med([c["in_process"]["torch_save_s"] for c in cd]),
        "dcp output fsync": med([c["in_process"]["fsync_s"] for c in cd]),
    },
    "median_gib_per_s": {
        "tessera save": gib / med(t_save), "dcp.save (defaults)": gib / med(d_save),
        "tessera load": gib / med(t_load), "dcp.load (defaults' save)": gib / med(d_load),
    },
    "consolidate_peak_rss_mib (max over rounds)": {
        "tessera": max(c["peak_rss_kib"] for c in ct) / 1024, "dcp_to_torch_save": max(c["peak_rss_kib"] for c in cd) / 1024,
        **({"tessera, CPU libtorch 1.13 build": max(c["peak_rss_kib"] for c in cpu) / 1024} if cpu else {}),
    },
    # Peak RSS of each runtime doing nothing: `tessera --help`, Python importing format_utils.
    "startup_peak_rss_mib (max over rounds)": {
        "tessera (this build)": max(r["startup"]["tessera"]["kib"] for r in R) / 1024,
        "python + torch DCP": max(r["startup"]["dcp"]["kib"] for r in R) / 1024,
        **({"tessera, CPU libtorch 1.13 build": max(r["startup"]["tessera_cpu"]["kib"] for r in R) / 1024} if cpu else {})},
    "startup_wall_s (median)": {"tessera --help": med([r["startup"]["tessera"]["wall_s"] for r in R]),
                                "python import format_utils": med([r["startup"]["dcp"]["wall_s"] for r in R])},
    # How the loads started: MiB of the checkpoint's files in the page cache right after
    # the save and after dropping them (max over rounds).
    "page_cache_mib (max over rounds)": {
        "tessera after save": max(r["tessera"]["cached_after_save_mib"] for r in R),
        "tessera before load": max(r["tessera"]["cached_before_load_mib"] for r in R),
        "dcp after save": max(r["dcp"]["cached_after_save_mib"] for r in R),
        "dcp before load": max(r["dcp"]["cached_before_load_mib"] for r in R),
        "dcp_t2 before load": max(r["dcp_t2"]["cached_before_load_mib"] for r in R),
        "before consolidate (tessera, dcp)": [max(c["cached_before_mib"] for c in ct), max(c["cached_before_mib"] for c in cd)],
    },
    "load average (start, end)": [load_start, load_end],
    "per_round seconds": {
        "tessera save": t_save, "dcp.save": d_save, "dcp.save thread_count=2": d2_save,
        "tessera load": t_load, "dcp.load": d_load, "dcp.load (thread_count=2 save)": d2_load,
        "tessera async blocking (2nd)": [a["blocking_s"] for a in ta],
        "dcp async blocking (2nd)": [a["blocking_s"] for a in da],
        "tessera consolidate": ct_wall, "dcp_to_torch_save + fsync": cd_wall,
    },
}
json.dump(res, open(out, "w"), indent=2)
print(json.dumps(res, indent=2))
PYEOF
