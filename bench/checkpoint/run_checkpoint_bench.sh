#!/usr/bin/env bash
# Checkpoint save/load throughput of a ~1 GiB state vs the same run's `dd` (the disk
# limit) and Python torch.save/torch.load (/usr/bin/python3), plus consolidation
# throughput and peak RSS. Writes bench/results/checkpoint.json.
#   bench/checkpoint/run_checkpoint_bench.sh BUILD_DIR [MIB] [WORK_DIR]
set -euo pipefail
BUILD=${1:?usage: run_checkpoint_bench.sh BUILD_DIR [MIB] [WORK_DIR]}
MIB=${2:-1024}
WORK=${3:-$(mktemp -d /tmp/tessera-ckpt-bench-XXXXXX)}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT="$HERE/../results/checkpoint.json"
mkdir -p "$(dirname "$OUT")" "$WORK"
TESSERA="$BUILD/bin/tessera"
BENCH="$BUILD/bin/checkpoint_bench"
now() { date +%s.%N; }
trap 'rm -rf "$WORK"' EXIT

# The disk limit: dd write (fsync'ed) and read of the same number of bytes.
t0=$(now); dd if=/dev/zero of="$WORK/dd.bin" bs=1M count="$MIB" conv=fsync status=none; t1=$(now)
dd if="$WORK/dd.bin" of=/dev/null bs=1M status=none; t2=$(now)
rm -f "$WORK/dd.bin"
DD_W=$(echo "$t1 - $t0" | bc -l); DD_R=$(echo "$t2 - $t1" | bc -l)

SHARDED=$("$TESSERA" run -n 2 -- "$BENCH" sharded "$WORK/sharded" "$MIB" | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //')
FULL=$("$TESSERA" run -n 2 -- "$BENCH" full "$WORK/full.safetensors" "$MIB" | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //')

# Consolidation of the sharded checkpoint: throughput and peak RSS.
t0=$(now)
RSS_KB=$( { /usr/bin/time -f '%M' "$TESSERA" ckpt consolidate "$WORK/sharded" -o "$WORK/cons.safetensors" >/dev/null; } 2>&1 | tail -1 )
t1=$(now)
CONS_S=$(echo "$t1 - $t0" | bc -l)
rm -f "$WORK/cons.safetensors"

# Python torch.save / torch.load of the same tensors.
PY=$(/usr/bin/python3 - "$WORK/py.pt" "$MIB" <<'PYEOF'
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
d = torch.load(path)
t2 = time.perf_counter()
assert torch.equal(d["layer3.weight"], sd["layer3.weight"])
print(json.dumps({"save_s": t1 - t0, "load_s": t2 - t1}))
PYEOF
)
rm -f "$WORK/py.pt"

/usr/bin/python3 - "$OUT" "$MIB" "$DD_W" "$DD_R" "$SHARDED" "$FULL" "$CONS_S" "$RSS_KB" "$PY" <<'PYEOF'
import json, sys
out, mib, ddw, ddr, sh, full, cons_s, rss_kb, py = sys.argv[1:]
mib = int(mib); gib = mib / 1024
sh, full, py = json.loads(sh), json.loads(full), json.loads(py)
ddw, ddr, cons_s = float(ddw), float(ddr), float(cons_s)
res = {
    "bytes": sh["bytes"],
    "dd": {"write_s": ddw, "read_s": ddr, "write_gib_s": gib / ddw, "read_gib_s": gib / ddr},
    "tessera_sharded_2ranks": sh,
    "tessera_full_2ranks": full,
    "python_torch": {"save_s": py["save_s"], "load_s": py["load_s"]},
    "consolidate": {"seconds": cons_s, "gib_s": gib / cons_s, "peak_rss_mib": int(rss_kb) / 1024,
                    "largest_tensor_mib": mib / 16},
    "ratios": {
        "sharded_save_vs_dd_write": ddw / sh["save_s"],
        "sharded_load_vs_dd_read": ddr / sh["load_s"],
        "full_save_vs_dd_write": ddw / full["save_s"],
        "sharded_save_speedup_vs_torch_save": py["save_s"] / sh["save_s"],
        "sharded_load_speedup_vs_torch_load": py["load_s"] / sh["load_s"],
        "full_save_speedup_vs_torch_save": py["save_s"] / full["save_s"],
    },
}
json.dump(res, open(out, "w"), indent=2)
print(json.dumps(res, indent=2))
PYEOF
