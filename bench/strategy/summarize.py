"""Turns bench/strategy/run.sh's tagged JSON lines ("time-<round> {...}", "memory-<allocator> {...}")
into bench/results/strategy.json: the median step time of each run over the rounds, and the
ratios the issue sets targets for, taken inside each round (median, min, max and every
round's value)."""
import json
import statistics
import sys

out = sys.argv[1]
time_rows, mem_rows = [], []  # time_rows: (round, row); mem_rows: (malloc setting, row)
for line in sys.stdin:
    tag, _, js = line.strip().partition(" ")
    if not js:
        continue
    kind, _, arg = tag.partition("-")
    if kind == "time":
        time_rows.append((int(arg or 1), json.loads(js)))
    else:
        mem_rows.append((arg, json.loads(js)))

TARGETS = {
    "fsdp1_vs_plain (target <= 1.05)": (("fsdp", 1), ("plain", 1)),
    "ddp2_vs_py_ddp2 (target <= 0.85)": (("ddp", 2), ("py_ddp", 2)),
    "fsdp2_vs_py_ddp2 (target <= 1.0)": (("fsdp", 2), ("py_ddp", 2)),
}
rows, ratios = [], {}
for params in sorted({r["params"] for _, r in time_rows}):
    label = f"{params / 1e6:.1f}M"
    runs = {}  # (mode, world) -> {round: row}
    for rnd, r in time_rows:
        if r["params"] == params:
            runs.setdefault((r["mode"], r["world"]), {})[rnd] = r
    for (mode, world), by_round in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        steps = [r["step_ms"] for r in by_round.values()]
        rows.append({"model": label, "run": f"{mode} x{world}", "step_ms": statistics.median(steps),
                     "step_ms_min": min(steps), "step_ms_max": max(steps),
                     "peak_rss_mib": max(r.get("peak_rss_mib", 0) for r in by_round.values()) or ""})
    ratios[label] = {}
    for name, (a, b) in TARGETS.items():
        if a not in runs or b not in runs:
            continue
        per_round = [round(runs[a][k]["step_ms"] / runs[b][k]["step_ms"], 3)
                     for k in sorted(runs[a]) if k in runs[b]]
        ratios[label][name] = {"median": statistics.median(per_round), "min": min(per_round),
                               "max": max(per_round), "per_round": per_round}
memory = {}
for malloc, r in mem_rows:
    key = f"{r['params'] / 1e6:.1f}M, allocator {malloc}"
    memory.setdefault(key, {})[f"{r['mode']} x{r['world']}"] = r["peak_rss_mib"]
    memory[key]["runtime before the model"] = r["base_rss_mib"]
for m in memory.values():
    for n in (1, 2, 4):
        d, f = m.get(f"ddp x{n}"), m.get(f"fsdp x{n}")
        if d and f:
            m[f"fsdp/ddp x{n}"] = f / d
res = {"benchmark": "strategy", "rows": rows, "ratios": ratios, "peak_rss_mib (largest rank)": memory,
       "setup": "batch 8x64 per rank, Adam, 1 intra-op thread per rank, all ranks on one 2-core machine; Tessera: CPU collectives over its shared-memory channel; Python DDP: gloo"}
json.dump(res, open(out, "w"), indent=2)
print(json.dumps({"ratios": ratios, "peak_rss_mib": memory}, indent=2))
