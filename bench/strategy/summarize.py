"""Turns bench/strategy/run.sh's tagged JSON lines ("time {...}", "memory-<malloc> {...}") into
bench/results/strategy.json: one row per run plus the ratios the issue sets targets for."""
import json
import sys

out = sys.argv[1]
time_rows, mem_rows = [], []  # mem_rows: (malloc setting, row)
for line in sys.stdin:
    tag, _, js = line.strip().partition(" ")
    if not js:
        continue
    if tag == "time":
        time_rows.append(json.loads(js))
    else:
        mem_rows.append((tag.partition("-")[2], json.loads(js)))

rows, ratios = [], {}
for params in sorted({r["params"] for r in time_rows}):
    by = {(r["mode"], r["world"]): r for r in time_rows if r["params"] == params}
    label = f"{params / 1e6:.1f}M"
    for (mode, world), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows.append({"model": label, "run": f"{mode} x{world}", "step_ms": r["step_ms"],
                     "peak_rss_mib": r.get("peak_rss_mib", "")})
    def ratio(a, b):
        return by[a]["step_ms"] / by[b]["step_ms"] if a in by and b in by else None
    ratios[label] = {
        "fsdp1_vs_plain (target <= 1.05)": ratio(("fsdp", 1), ("plain", 1)),
        "ddp2_vs_py_ddp2 (target <= 0.85)": ratio(("ddp", 2), ("py_ddp", 2)),
        "fsdp2_vs_py_ddp2 (target <= 1.0)": ratio(("fsdp", 2), ("py_ddp", 2)),
    }
memory = {}
for malloc, r in mem_rows:
    key = f"{r['params'] / 1e6:.1f}M, malloc {malloc}"
    memory.setdefault(key, {})[f"{r['mode']} x{r['world']}"] = r["peak_rss_mib"]
    memory[key]["runtime before the model"] = r["base_rss_mib"]
for m in memory.values():
    for n in (1, 2, 4):
        d, f = m.get(f"ddp x{n}"), m.get(f"fsdp x{n}")
        if d and f:
            m[f"fsdp/ddp x{n}"] = f / d
res = {"benchmark": "strategy", "rows": rows, "ratios": ratios, "peak_rss_mib (largest rank)": memory,
       "setup": "batch 8x64 per rank, Adam, 1 intra-op thread per rank, gloo, all ranks on one 2-core machine"}
json.dump(res, open(out, "w"), indent=2)
print(json.dumps({"ratios": ratios, "peak_rss_mib": memory}, indent=2))
