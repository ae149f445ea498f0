#!/usr/bin/env bash
# Checkpoint save/load throughput of a ~1 GiB state vs the same run's `dd` (buffered, and
# with direct I/O: the disk's limit, one stream and one per rank; each Tessera run is also
# paired with a direct-I/O dd of its own I/O pattern measured just before it) and Python
# torch.save/torch.load (/usr/bin/python3), plus consolidation
# throughput and peak RSS. Writes bench/results/checkpoint.json.
#   bench/checkpoint/run_checkpoint_bench.sh BUILD_DIR [MIB] [WORK_DIR]
#   CKPT_BENCH_ROUNDS=N   rounds (default 5)
#
# The disk of a shared machine changes speed by 3x within minutes, so one measurement of
# each peer says little. Every round measures all peers once, in an order that rotates
# from round to round; the report gives each figure's median over the rounds and, for
# every ratio, the median of the per-round ratios (peers measured within seconds of each
# other), with its minimum and maximum.
set -euo pipefail
BUILD=${1:?usage: run_checkpoint_bench.sh BUILD_DIR [MIB] [WORK_DIR]}
MIB=${2:-1024}
WORK=${3:-$(mktemp -d /tmp/tessera-ckpt-bench-XXXXXX)}
ROUNDS=${CKPT_BENCH_ROUNDS:-5}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT="$HERE/../results/checkpoint.json"
mkdir -p "$(dirname "$OUT")" "$WORK"
TESSERA="$BUILD/bin/tessera"
BENCH="$BUILD/bin/checkpoint_bench"
now() { date +%s.%N; }
since() { awk -v a="$2" -v b="$1" 'BEGIN { printf "%.6f", a - b }'; }  # since T0 T1 -> T1 - T0
trap 'rm -rf "$WORK"' EXIT

# Python torch.save / torch.load of the same tensors (16 tensors of MIB/16 MiB, the
# shapes and values checkpoint_bench saves), fsync'ed like Tessera's files. Every load
# (Tessera's, torch.load, dd's read) is cold: the file's pages are dropped first.
cat > "$WORK/py_peer.py" <<'PYEOF'
import json, os, sys, time, torch
path, mib = sys.argv[1], int(sys.argv[2])
count, cols = 16, 1024
rows = mib * (1 << 20) // 4 // cols // count
sd = {f"layer{i}.weight": torch.full((rows, cols), float(i + 1)) for i in range(count)}
t0 = time.perf_counter()
with open(path, "wb") as f:
    torch.save(sd, f)
    f.flush(); os.fsync(f.fileno())
t1 = time.perf_counter()
# Cold load, like Tessera's: the file's pages leave the page cache first.
fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
d = torch.load(path)
t2 = time.perf_counter()
assert torch.equal(d["layer3.weight"], sd["layer3.weight"])
print(json.dumps({"save_s": t1 - t0, "load_s": t2 - t1}))
PYEOF

# The disk's limit for one I/O pattern, measured right before the Tessera run it is paired
# with (the disk's speed drifts from minute to minute, so a limit measured seconds apart
# is the fairer yardstick): direct-I/O dd, 16 MiB blocks, STREAMS files of MIB/STREAMS MiB
# written (fsync'ed) at once, then read back at once. Prints "WRITE_S READ_S". The files
# stay until the round ends, like every other file of the round: deleting them here sent
# the disk 1 GiB of TRIMs (the filesystem is mounted with `discard`) right before the
# Tessera run they are paired with.
dd_direct_pair() {
  local streams=$1 dir=$2 t0 t1 t2 j
  mkdir -p "$dir"
  t0=$(now)
  for ((j = 0; j < streams; j++)); do
    dd if=/dev/zero of="$dir/pair$j.bin" bs=16M count=$((MIB / 16 / streams)) oflag=direct conv=fsync status=none &
  done
  wait; t1=$(now)
  for ((j = 0; j < streams; j++)); do
    dd if="$dir/pair$j.bin" of=/dev/null bs=16M iflag=direct status=none &
  done
  wait; t2=$(now)
  echo "$(since "$t0" "$t1") $(since "$t1" "$t2")"
}

# One measurement of one peer -> one JSON line on stdout.
measure() {
  case $1 in
    dd)
      # dd write (fsync'ed) and read of the same number of bytes through the page cache
      # (the read's "cold" is not guaranteed: iflag=nocache is advice the kernel may
      # ignore; see dd_direct), then the disk's own limit with direct I/O, 16 MiB blocks,
      # one stream and two (one per rank, each half of the bytes, at once), and the two
      # streams' read again in 4 MiB blocks (the request size a virtio disk with
      # max_sectors_kb 4096 takes whole: faster there than 16 MiB, docs/benchmarks-history.md).
      local t0 t1 t2 t3 t4 t5 t6 t7 t8 t9 half=$((MIB / 32))
      t0=$(now); dd if=/dev/zero of="$RD/dd.bin" bs=1M count="$MIB" conv=fsync status=none; t1=$(now)
      dd if="$RD/dd.bin" iflag=nocache count=0 status=none  # cold read: drop the file's cached pages
      # ... which is advice: what stayed in this kernel's page cache is recorded (-1: no fincore).
      local cached
      cached=$(fincore -b -n -o RES "$RD/dd.bin" 2>/dev/null | tr -d ' ' || true)
      [ -n "$cached" ] || cached=-1
      t1=$(now); dd if="$RD/dd.bin" of=/dev/null bs=1M status=none; t2=$(now)
      t3=$(now); dd if=/dev/zero of="$RD/ddd.bin" bs=16M count=$((MIB / 16)) oflag=direct conv=fsync status=none; t4=$(now)
      dd if="$RD/ddd.bin" of=/dev/null bs=16M iflag=direct status=none; t5=$(now)
      dd if=/dev/zero of="$RD/ddp0.bin" bs=16M count=$half oflag=direct conv=fsync status=none &
      dd if=/dev/zero of="$RD/ddp1.bin" bs=16M count=$half oflag=direct conv=fsync status=none
      wait; t6=$(now)
      t7=$(now)
      dd if="$RD/ddp0.bin" of=/dev/null bs=16M iflag=direct status=none &
      dd if="$RD/ddp1.bin" of=/dev/null bs=16M iflag=direct status=none
      wait; t8=$(now)
      dd if="$RD/ddp0.bin" of=/dev/null bs=4M iflag=direct status=none &
      dd if="$RD/ddp1.bin" of=/dev/null bs=4M iflag=direct status=none
      wait; t9=$(now)
      echo "{\"write_s\": $(since "$t0" "$t1"), \"read_s\": $(since "$t1" "$t2"), \"read_cached_bytes\": $cached,"\
           "\"direct_write_s\": $(since "$t3" "$t4"), \"direct_read_s\": $(since "$t4" "$t5"),"\
           "\"direct2_write_s\": $(since "$t5" "$t6"), \"direct2_read_s\": $(since "$t7" "$t8"),"\
           "\"direct2_4m_read_s\": $(since "$t8" "$t9")}" ;;
    sharded|full)
      local target="$RD/$1" pair_w pair_r w_streams=2
      [ "$1" = full ] && target="$RD/full.safetensors"
      # The paired limit has Tessera's I/O pattern: both saves write from every rank at
      # once (2 streams; a full save each rank its rows of the one file), both loads read
      # with 2 ranks at once (2 streams).
      read -r pair_w _ <<<"$(dd_direct_pair "$w_streams" "$RD/pair-$1-write")"
      read -r _ pair_r <<<"$(dd_direct_pair 2 "$RD/pair-$1-read")"
      "$TESSERA" run -n 2 -- "$BENCH" "$1" "$target" "$MIB" | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //' |
        sed "s/}\$/, \"paired_direct_write_s\": $pair_w, \"paired_direct_read_s\": $pair_r}/"
      true ;;
    python)
      /usr/bin/python3 "$WORK/py_peer.py" "$RD/py.pt" "$MIB" ;;
    consolidate)
      # Consolidation of the sharded checkpoint (saved earlier in this round): time, peak RSS.
      local t0 t1 rss
      t0=$(now)
      rss=$( { /usr/bin/time -f '%M' "$TESSERA" ckpt consolidate "$RD/sharded" -o "$RD/cons.safetensors" >/dev/null; } 2>&1 | tail -1 )
      t1=$(now)
      echo "{\"seconds\": $(since "$t0" "$t1"), \"peak_rss_kib\": $rss}" ;;
  esac
}

# The machine the figures belong to (issue 21: runs on different days or machines are
# compared): when, which boot of which host, CPU, memory, and the disk under WORK_DIR.
machine_facts() {
  local src dev mnt
  src=$(df --output=source "$WORK" | tail -1)
  mnt=$(df --output=target "$WORK" | tail -1)
  dev=$(basename "$(readlink -f "$src")")
  /usr/bin/python3 - "$src" "$mnt" "$dev" <<'PYEOF'
import json, os, platform, socket, sys, time
src, mnt, dev = sys.argv[1:4]
def read(path, default=""):
    try:
        return open(path).read().strip()
    except OSError:
        return default
cpu = next((l.split(":", 1)[1].strip() for l in read("/proc/cpuinfo").splitlines() if l.startswith("model name")), "")
mem_kib = next((int(l.split()[1]) for l in read("/proc/meminfo").splitlines() if l.startswith("MemTotal")), 0)
opts = next((l.split()[3] for l in read("/proc/mounts").splitlines() if l.split()[1] == mnt), "")
q = f"/sys/block/{dev}/queue/"
st = os.statvfs(mnt)
print(json.dumps({
    "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "hostname": socket.gethostname(),
    "boot_id": read("/proc/sys/kernel/random/boot_id"), "kernel": platform.release(),
    "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
    "disk": {"device": src, "mount": mnt, "mount_options": opts,
             "size_gib": round(int(read(f"/sys/block/{dev}/size", "0")) * 512 / 2**30, 1),
             "free_gib": round(st.f_bavail * st.f_frsize / 2**30, 1),
             "rotational": read(q + "rotational"), "scheduler": read(q + "scheduler"),
             "max_sectors_kb": read(q + "max_sectors_kb")},
}))
PYEOF
}
machine_facts > "$WORK/machine.json"
echo "-- machine: $(cat "$WORK/machine.json")" >&2

peers=(dd sharded full python)
: > "$WORK/rounds.jsonl"
for ((r = 0; r < ROUNDS; r++)); do
  # Rotate the order so that no peer always runs first (or right after another).
  order=()
  for ((k = 0; k < ${#peers[@]}; k++)); do order+=("${peers[(k + r) % ${#peers[@]}]}"); done
  echo "-- round $((r + 1))/$ROUNDS: ${order[*]} consolidate" >&2
  # Every file of the round stays until the round ends. This filesystem may be mounted
  # with `discard`: deleting a GiB sends TRIMs that slow the next cold reads for a second
  # or two, so deleting after each peer would slow whichever peer came next.
  RD="$WORK/round$r"
  mkdir -p "$RD"
  for p in "${order[@]}" consolidate; do
    echo "{\"round\": $r, \"peer\": \"$p\", \"result\": $(measure "$p")}" >> "$WORK/rounds.jsonl"
  done
  rm -rf "$RD"
  sync  # the deletion's TRIMs go out now, not during the next round's first peer
done

# Consolidation memory vs model size: models of 4x to 32x the largest tensor (64 MiB tensors),
# saved sharded by 2 ranks and consolidated offline; peak RSS should follow the largest
# tensor, not the model.
: > "$WORK/sizes.jsonl"
for size in 256 1024 2048; do
  [ "$size" -le $((MIB * 2)) ] || continue
  "$TESSERA" run -n 2 -- "$BENCH" sharded "$WORK/size-$size" "$size" 64 > /dev/null
  t0=$(now)
  rss=$( { /usr/bin/time -f '%M' "$TESSERA" ckpt consolidate "$WORK/size-$size" -o "$WORK/size-$size.safetensors" >/dev/null; } 2>&1 | tail -1 )
  t1=$(now)
  echo "{\"model_mib\": $size, \"largest_tensor_mib\": 64, \"seconds\": $(since "$t0" "$t1"), \"peak_rss_kib\": $rss}" >> "$WORK/sizes.jsonl"
  rm -rf "$WORK/size-$size" "$WORK/size-$size.safetensors"
done

/usr/bin/python3 - "$OUT" "$MIB" "$WORK/rounds.jsonl" "$WORK/sizes.jsonl" "$WORK/machine.json" <<'PYEOF'
import json, statistics, sys
out, mib, path, sizes_path, machine_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
gib = mib / 1024
rounds = {}
for line in open(path):
    e = json.loads(line)
    rounds.setdefault(e["round"], {})[e["peer"]] = e["result"]
R = [rounds[k] for k in sorted(rounds)]
med = lambda xs: statistics.median(xs)
def spread(xs):
    return {"median": med(xs), "min": min(xs), "max": max(xs)}
def times(peer, key):
    return [r[peer][key] for r in R]
def ratio(num, den):
    # Per-round ratio num/den (> 1: the Tessera side is faster), then median/min/max.
    return spread([n / d for n, d in zip(num, den)])
dd_w, dd_r = times("dd", "write_s"), times("dd", "read_s")
# What of the buffered dd read's file this kernel still cached before it (DONTNEED is
# advice). Even with none cached that read is no limit for Tessera's loads: it reads back a
# file written through the page cache seconds earlier, which the development VM serves
# 2-4x faster than any direct read of the same round (docs/benchmarks-history.md, issue 21); the
# rows against it carry no target.
dd_cached = [r["dd"].get("read_cached_bytes", -1) for r in R]
# The disk's limit: the fastest of the round's direct-I/O dd runs (one and two streams of
# 16 MiB blocks; for reads also two streams of 4 MiB blocks).
dio_w = [min(a, b) for a, b in zip(times("dd", "direct_write_s"), times("dd", "direct2_write_s"))]
dio_r = [min(a, b, c) for a, b, c in zip(times("dd", "direct_read_s"), times("dd", "direct2_read_s"),
                                         times("dd", "direct2_4m_read_s"))]
sh_s, sh_l = times("sharded", "save_s"), times("sharded", "load_s")
# The paired limits: direct-I/O dd with the same I/O pattern, measured just before each run.
pw_sh, pr_sh = times("sharded", "paired_direct_write_s"), times("sharded", "paired_direct_read_s")
pw_fu, pr_fu = times("full", "paired_direct_write_s"), times("full", "paired_direct_read_s")
fu_s, fu_l = times("full", "save_s"), times("full", "load_s")
py_s, py_l = times("python", "save_s"), times("python", "load_s")
co_s = times("consolidate", "seconds")
res = {
    "benchmark": "checkpoint",
    "bytes": R[0]["sharded"]["bytes"],
    "rounds": len(R),
    "machine": json.load(open(machine_path)),
    "buffered dd read: MiB of its file in the page cache before it, per round (-1: unknown)":
        [c / 2**20 if c >= 0 else -1 for c in dd_cached],
    "median_seconds": {
        "dd write (fsync)": med(dd_w), "dd read": med(dd_r),
        "dd write, direct I/O, 16 MiB blocks": med(times("dd", "direct_write_s")),
        "dd read, direct I/O, 16 MiB blocks": med(times("dd", "direct_read_s")),
        "dd write, direct I/O, 2 streams": med(times("dd", "direct2_write_s")),
        "dd read, direct I/O, 2 streams": med(times("dd", "direct2_read_s")),
        "dd read, direct I/O, 2 streams, 4 MiB blocks": med(times("dd", "direct2_4m_read_s")),
        "paired direct-I/O dd write, 2 streams (before the sharded run)": med(pw_sh),
        "paired direct-I/O dd read, 2 streams (before the sharded run)": med(pr_sh),
        "paired direct-I/O dd write, 2 streams (before the full run)": med(pw_fu),
        "paired direct-I/O dd read, 2 streams (before the full run)": med(pr_fu),
        "tessera sharded save (2 ranks)": med(sh_s), "tessera sharded load (2 ranks)": med(sh_l),
        "tessera full save (2 ranks)": med(fu_s), "tessera full load (2 ranks)": med(fu_l),
        "torch.save (fsync)": med(py_s), "torch.load": med(py_l),
        "tessera ckpt consolidate": med(co_s),
    },
    "median_gib_per_s": {
        "dd write": gib / med(dd_w), "sharded save": gib / med(sh_s), "full save": gib / med(fu_s),
        "torch.save": gib / med(py_s), "sharded load": gib / med(sh_l), "consolidate": gib / med(co_s),
    },
    "per_round_seconds": {
        "dd write": dd_w, "sharded save": sh_s, "full save": fu_s, "torch.save": py_s,
        "dd read": dd_r, "sharded load": sh_l, "full load": fu_l, "torch.load": py_l, "consolidate": co_s,
        "paired dd write before sharded": pw_sh, "paired dd read before sharded": pr_sh,
        "paired dd write before full": pw_fu, "paired dd read before full": pr_fu,
        "direct dd write, 1 stream": times("dd", "direct_write_s"),
        "direct dd write, 2 streams": times("dd", "direct2_write_s"),
        "direct dd read, 1 stream": times("dd", "direct_read_s"),
        "direct dd read, 2 streams": times("dd", "direct2_read_s"),
        "direct dd read, 2 streams, 4 MiB blocks": times("dd", "direct2_4m_read_s"),
    },
    "consolidate_memory": {
        "peak_rss_mib (max over rounds)": max(r["consolidate"]["peak_rss_kib"] for r in R) / 1024,
        "largest_tensor_mib": mib / 16,
    },
    # Offline consolidation of models of growing size with 64 MiB tensors: seconds, peak RSS.
    "consolidate_vs_model_size": {
        f"{e['model_mib']} MiB model": {"seconds": e["seconds"], "peak_rss_mib": e["peak_rss_kib"] / 1024}
        for e in map(json.loads, open(sizes_path))
    },
}
# The ratios as table rows: per-round ratio (> 1: Tessera faster), median, min and max.
def row(name, target, num, den):
    r = ratio(num, den)
    return {"ratio (per round; > 1: Tessera faster)": name, "target": target,
            "median": r["median"], "min": r["min"], "max": r["max"]}
res["rows"] = [
    row("sharded save vs paired direct-I/O dd write (2 streams)", ">= 0.9", pw_sh, sh_s),
    row("full save vs paired direct-I/O dd write (2 streams)", ">= 0.9", pw_fu, fu_s),
    row("sharded load vs paired direct-I/O dd read (2 streams)", ">= 0.9", pr_sh, sh_l),
    row("full load vs paired direct-I/O dd read (2 streams)", ">= 0.9", pr_fu, fu_l),
    row("sharded save vs the faster direct-I/O dd write of the round", "", dio_w, sh_s),
    row("full save vs the faster direct-I/O dd write of the round", "", dio_w, fu_s),
    row("sharded load vs the faster direct-I/O dd read of the round", "", dio_r, sh_l),
    row("full load vs the faster direct-I/O dd read of the round", "", dio_r, fu_l),
    row("sharded save vs dd write", ">= 0.8", dd_w, sh_s),
    row("full save vs dd write", ">= 0.8", dd_w, fu_s),
    row("sharded save vs torch.save", "> 1", py_s, sh_s),
    row("full save vs torch.save", "> 1", py_s, fu_s),
    row("sharded load vs dd read (buffered, of a file written buffered)", "", dd_r, sh_l),
    row("full load vs dd read (buffered, of a file written buffered)", "", dd_r, fu_l),
    row("sharded load vs torch.load", "", py_l, sh_l),
    row("full load vs torch.load", "", py_l, fu_l),
]
json.dump(res, open(out, "w"), indent=2)
print(json.dumps(res, indent=2))
PYEOF
