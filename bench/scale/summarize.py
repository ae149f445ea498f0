#!/usr/bin/env python3
"""Joins scale_bench's JSON (Tessera) and dcp_scale.py's (PyTorch DCP) into
bench/results/scale.json: one row per model, sharding and world size, DCP's figures
beside Tessera's (measured where DCP's Python objects fit, else a straight-line fit
a + b·N through the measured points, marked "fit"), the reshard rows, and the goals of
issue 33 (Llama-3-70B, 16,384 ranks, AdamW) each marked met or not with its number; the
2-D cases of issue 47 item 5 (FSDP x TP and HSDP x TP meshes, the (2,048 x 8) -> (1,024 x
16) reshard) likewise in rows_2d, reshard_2d and goals_2d (two_d).

  summarize.py TESSERA_JSON [DCP_JSON] --out bench/results/scale.json [--note TEXT]
"""
import argparse
import json
import math
import os
import platform
import time

MIB = 1 << 20
KIB = 1 << 10


def fit_line(points):
    """Least squares a + b·x through [(x, y)]; one point: through the origin's slope."""
    if len(points) == 1:
        x, y = points[0]
        return 0.0, y / x
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def log2c(n):
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def dcp_figures(c):
    """Per-configuration DCP figures from dcp_scale.py's save and load children."""
    s, l = c["save"], c["load"]
    n = c["ranks"]
    lp, gp, wr, md = s["local_plan_bytes"], s["global_plan_bytes"], s["write_results_bytes"], s["metadata_bytes"]
    sizes = 2 * 8 * n  # gather_object all-gathers every rank's object size, twice (plan, write results)
    # A rank other than the coordinator: its local plan and write results out (each padded
    # to the largest, as gather_object does), its global plan in (padded, scatter_object_list),
    # the pickled Metadata in (all_reduce's broadcast_object), the size exchanges.
    rank_bytes = lp["max"] + gp["max"] + wr["max"] + md + sizes + 16
    # The coordinator: every plan and write result in, every global plan out, and the
    # Metadata out once (chain) or log2 N times (binomial tree).
    coord_pipelined = (n - 1) * (lp["max"] + wr["max"] + gp["max"]) + md + sizes
    coord_tree = (n - 1) * (lp["max"] + wr["max"] + gp["max"]) + log2c(n) * md + sizes
    lrank = l["ranks_sampled"]
    load_plan_ms = max(r["local_plan_ms"] for r in lrank)
    lpb = max(r["load_plan_bytes"] for r in lrank)
    coord_s = (s["unpickle_local_plans_s"] + s["create_global_plan_s"] + s["prepare_global_plan_s"] +
               s["pickle_global_plans_s"] + s["finish_s"] + s["pickle_metadata_s"])
    return {
        "metadata_bytes": md,
        "save_rank_ms": max(s["local_plan_ms"].values()) + 1000 * s["unpickle_metadata_s"],
        "save_coordinator_s": coord_s + s["local_plans_s_total"] / n,
        "create_global_plan_s": s["create_global_plan_s"],
        "save_coordinator_peak_bytes": (s["peak_rss_kib"] - s["base_rss_kib"]) * KIB,
        "save_rank_bytes_held": l["metadata_rss_kib"] * KIB,
        "gathered_local_plans_bytes": lp["sum"],
        "gathered_local_plans_padded_bytes": n * lp["max"],
        "scattered_global_plans_bytes": gp["sum"],
        "gathered_write_results_bytes": wr["sum"],
        "coordination_rank_bytes": rank_bytes,
        "coordination_coordinator_bytes": max(coord_pipelined, coord_tree),
        "coordination_bytes_max": max(rank_bytes, coord_pipelined, coord_tree),
        "load_ms": 1000 * l["read_unpickle_metadata_s"] + load_plan_ms,
        "load_peak_bytes": (l["peak_rss_kib"] - l["base_rss_kib"]) * KIB,
        "load_files_max": max(r["files"] for r in lrank),
        "load_plan_bytes": lpb,
        "load_coordination_rank_bytes": 2 * lpb + 8 * n + 16,
    }


def two_d(T, D, log2c):
    """The 2-D cases (issue 47 item 5): rows per mesh with DCP's FSDP2 + TP figures beside
    Tessera's FSDP x TP ones (measured where they fit, else the line a + b·N through the
    measured points of the same tp), the reshard rows, and the goals for Llama-3-70B at
    16,384 ranks: metadata <= 16 MiB, save coordination <= 4 KiB per rank, load planning
    <= 100 ms and <= 64 MiB per rank (resume on both meshes and the (2,048 x 8) -> (1,024 x
    16) reshard), growth <= 1.4x from 1,024 to 16,384 ranks on each mesh family."""
    meas, fits, dcp_reshard = {}, {}, []
    for c in (D or {}).get("configs_2d", []):
        meas[(c["model"], c["tp"], c["ranks"])] = (dcp_figures(c), c["mesh"])
        for r in c.get("reshard", []):
            dcp_reshard.append({"model": c["model"], "from": r["mesh"], "to": r["target_mesh"],
                                "DCP load ms (measured)": 1000 * r["read_unpickle_metadata_s"] + max(
                                    x["local_plan_ms"] for x in r["ranks_sampled"]),
                                "DCP load MiB (measured)": (r["peak_rss_kib"] - r["base_rss_kib"]) / 1024,
                                "DCP files": max(x["files"] for x in r["ranks_sampled"])})
    for key in {(m, tp) for m, tp, _ in meas}:
        pts = sorted((n, f) for (m, tp, n), (f, _) in meas.items() if (m, tp) == key)
        fits[key] = {k: fit_line([(n, f[k]) for n, f in pts]) for k in pts[0][1]}
        fits[key]["_measured"] = [meas[(key[0], key[1], n)][1] for n, _ in pts]

    def dcp_at(model, tp, n):
        if (model, tp, n) in meas:
            return meas[(model, tp, n)][0], "measured"
        if (model, tp) in fits:
            return {k: v[0] + v[1] * n for k, v in fits[(model, tp)].items() if k != "_measured"}, "fit"
        return None, None

    rows = []
    for c in T["configs"]:
        if "mesh" not in c:
            continue
        row = {"model": c["model"], "sharding": c["sharding"], "mesh": c["mesh"]["text"], "ranks": c["ranks"],
               "metadata KiB": c["metadata_bytes"] / KIB,
               "save ms": c["save"]["ms_max"], "save MiB": c["save"]["peak_bytes_max"] / MIB,
               "coordination B/rank": c["coordination"]["bytes_per_rank"],
               "load ms": c["load"]["ms_max"], "load MiB": c["load"]["peak_bytes_max"] / MIB,
               "load files": c["load"]["files_max"]}
        # DCP's FSDP2 + TP beside FSDP x TP (HSDP x TP: not run on the DCP side).
        d, how = dcp_at(c["model"], c["mesh"]["tp"], c["ranks"]) if c["sharding"] == "fsdp+tp" else (None, None)
        if d:
            row.update({"DCP": how, "DCP metadata KiB": d["metadata_bytes"] / KIB,
                        "DCP coordinator save s": d["save_coordinator_s"],
                        "DCP save MiB (coordinator)": d["save_coordinator_peak_bytes"] / MIB,
                        "DCP coordination B/rank (max)": d["coordination_bytes_max"],
                        "DCP load ms": d["load_ms"], "DCP load MiB": d["load_peak_bytes"] / MIB,
                        "DCP load files": d["load_files_max"]})
        rows.append(row)
    reshard = []
    for r in T.get("reshard", []):
        if "from_mesh" not in r:
            continue
        reshard.append({"model": r["model"], "from": r["from_mesh"], "to": r["to_mesh"], "load ms": r["ms_max"],
                        "load MiB": r["peak_bytes_max"] / MIB, "files": r["files_max"],
                        "metadata KiB": r["metadata_bytes"] / KIB})
    reshard += dcp_reshard

    def cfg(model, mesh):
        for c in T["configs"]:
            if c["model"] == model and c.get("mesh", {}).get("text") == mesh:
                return c
        return None

    G = "llama3-70b"
    goals = []
    big = [c for c in (cfg(G, "2048x8"), cfg(G, "128x16x8")) if c]
    rs = [r for r in T.get("reshard", []) if r["model"] == G and r.get("from_mesh") == "2048x8" and
          r.get("to_mesh") == "1024x16"]
    if big:
        def worst(get):
            c = max(big, key=get)
            return get(c), c["mesh"]["text"]
        md, m1 = worst(lambda c: c["metadata_bytes"])
        co, m2 = worst(lambda c: c["coordination"]["bytes_per_rank"])
        lms, m3 = worst(lambda c: c["load"]["ms_max"])
        lmem, m4 = worst(lambda c: c["load"]["peak_bytes_max"])
        goals.append({"goal": "metadata <= 16 MiB (2048x8, 128x16x8)", "value": f"{md / MIB:.3f} MiB ({m1})",
                      "met": md <= 16 * MIB})
        goals.append({"goal": "save coordination <= 4 KiB sent+received per rank",
                      "value": f"{co:.0f} B (busiest rank, tree collectives; {m2})", "met": co <= 4 * KIB})
        goals.append({"goal": "resume load planning <= 100 ms per rank", "value": f"{lms:.1f} ms ({m3})",
                      "met": lms <= 100})
        goals.append({"goal": "resume load planning <= 64 MiB per rank", "value": f"{lmem / MIB:.2f} MiB ({m4})",
                      "met": lmem <= 64 * MIB})
    for r in rs:
        goals.append({"goal": "reshard (2048 x 8) -> (1024 x 16) load planning <= 100 ms per rank",
                      "value": f"{r['ms_max']:.1f} ms, {r['files_max']} files", "met": r["ms_max"] <= 100})
        goals.append({"goal": "reshard (2048 x 8) -> (1024 x 16) load planning <= 64 MiB per rank",
                      "value": f"{r['peak_bytes_max'] / MIB:.2f} MiB", "met": r["peak_bytes_max"] <= 64 * MIB})
    measures = [("metadata", lambda c: c["metadata_bytes"]),
                ("save planning time", lambda c: c["save"]["ms_max"]),
                ("save planning memory", lambda c: c["save"]["peak_bytes_max"]),
                ("coordination bytes", lambda c: c["coordination"]["bytes_per_rank"]),
                ("load planning time", lambda c: c["load"]["ms_max"]),
                ("load planning memory", lambda c: c["load"]["peak_bytes_max"]),
                ("data files a resuming rank opens", lambda c: c["load"]["files_max"])]
    for small, large in (("128x8", "2048x8"), ("8x16x8", "128x16x8")):
        a0, a1 = cfg(G, small), cfg(G, large)
        if not (a0 and a1):
            continue
        for name, get in measures:
            g = get(a1) / get(a0) if get(a0) else float("inf")
            goals.append({"goal": f"growth <= 1.4x from 1024 to 16384 ranks: {name} ({small} -> {large})",
                          "value": f"{g:.2f}x ({get(a0):.4g} -> {get(a1):.4g})", "met": g <= 1.4 + 1e-9})
    dcp = None
    if D and D.get("configs_2d") is not None:
        dcp = {"measured": {f"{m} tp {tp}": f["_measured"] for (m, tp), f in fits.items()},
               "skipped (N x items > max_items)": [f"{s['model']} {s['mesh']}" for s in D["skipped"] if "mesh" in s],
               "configs": {f"{m} {mesh}": f for (m, tp, n), (f, mesh) in sorted(meas.items())}}
    return rows, reshard, goals, dcp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tessera")
    ap.add_argument("dcp", nargs="?")
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", default="")
    ap.add_argument("--load", default="", help="load averages at start and end")
    a = ap.parse_args()
    T = json.load(open(a.tessera))
    D = json.load(open(a.dcp)) if a.dcp else None

    # DCP: measured figures per (model, N), then a line per model and figure.
    dcp_meas, dcp_fit, dcp_reshard = {}, {}, {}
    if D and D.get("benchmark") == "scale":
        # An earlier scale.json: its DCP side as it was summarized (DCP's run takes longest,
        # so a new Tessera run may be joined with it; the run notes say so).
        prev = D
        D = dict(prev["dcp_raw"]) if "dcp_raw" in prev else None
        if D is None:
            D = {"torch": prev["dcp"]["torch"], "check": prev["dcp"]["check"], "max_items": prev["dcp"]["max_items"],
                 "configs": [], "skipped": [], "from": prev["run"]}
            for key, f in prev["dcp_configs"].items():
                m, n = key.split(" N=")
                dcp_meas[(m, int(n))] = f
            for r in prev["reshard"]:
                if "DCP load ms (measured)" in r:
                    dcp_reshard[(r["model"], r["from"], r["to"])] = {
                        "read_unpickle_metadata_s": r["DCP load ms (measured)"] / 1000,
                        "ranks_sampled": [{"local_plan_ms": 0.0, "files": r["DCP files"]}]}
    if D:
        for c in D["configs"]:
            dcp_meas[(c["model"], c["ranks"])] = dcp_figures(c)
            for r in c.get("reshard", []):
                dcp_reshard[(c["model"], r["ranks"], r["target_ranks"])] = r
        for model in {m for m, _ in dcp_meas}:
            pts = sorted((n, f) for (m, n), f in dcp_meas.items() if m == model)
            dcp_fit[model] = {k: fit_line([(n, f[k]) for n, f in pts]) for k in pts[0][1]}
            dcp_fit[model]["_measured"] = [n for n, _ in pts]

    def dcp_at(model, n):
        if (model, n) in dcp_meas:
            return dcp_meas[(model, n)], "measured"
        if model in dcp_fit:
            f = dcp_fit[model]
            return {k: v[0] + v[1] * n for k, v in f.items() if k != "_measured"}, "fit"
        return None, None

    ONE_D = ("full", "hybrid")
    rows = []
    for c in T["configs"]:
        if c["sharding"] not in ONE_D:
            continue
        d, how = dcp_at(c["model"], c["ranks"])
        row = {
            "model": c["model"], "sharding": c["sharding"], "ranks": c["ranks"],
            "metadata KiB": c["metadata_bytes"] / KIB,
            "save ms": c["save"]["ms_max"], "save MiB": c["save"]["peak_bytes_max"] / MIB,
            "coordination B/rank": c["coordination"]["bytes_per_rank"],
            "load ms": c["load"]["ms_max"], "load MiB": c["load"]["peak_bytes_max"] / MIB,
            "load files": c["load"]["files_max"],
        }
        if d:
            row.update({
                "DCP": how,
                "DCP metadata KiB": d["metadata_bytes"] / KIB,
                "DCP coordinator save s": d["save_coordinator_s"],
                "DCP save MiB (coordinator)": d["save_coordinator_peak_bytes"] / MIB,
                "DCP coordination B/rank (max)": d["coordination_bytes_max"],
                "DCP load ms": d["load_ms"], "DCP load MiB": d["load_peak_bytes"] / MIB,
                "DCP load files": d["load_files_max"],
            })
        rows.append(row)

    reshard = []
    for r in T.get("reshard", []):
        if r["sharding"] not in ONE_D:
            continue
        e = {"model": r["model"], "sharding": r["sharding"], "from": r["from_ranks"], "to": r["to_ranks"],
             "load ms": r["ms_max"], "load MiB": r["peak_bytes_max"] / MIB, "files": r["files_max"]}
        dr = dcp_reshard.get((r["model"], r["from_ranks"], r["to_ranks"]))
        if dr:
            e["DCP load ms (measured)"] = 1000 * dr["read_unpickle_metadata_s"] + max(
                x["local_plan_ms"] for x in dr["ranks_sampled"])
            e["DCP files"] = max(x["files"] for x in dr["ranks_sampled"])
        reshard.append(e)

    # Goals (issue 33): Llama-3-70B, 16,384 ranks, AdamW; both shardings, the worse counts.
    goals = []

    def cfg(model, sharding, n):
        for c in T["configs"]:
            if c["model"] == model and c["sharding"] == sharding and c["ranks"] == n:
                return c
        return None

    rows_2d, reshard_2d, goals_2d, dcp_2d = two_d(T, D, log2c)

    G, N, N0 = "llama3-70b", 16384, 1024
    tc = [c for c in (cfg(G, s, N) for s in ("full", "hybrid")) if c]
    t0 = [c for c in (cfg(G, s, N0) for s in ("full", "hybrid")) if c]
    if tc:
        def worst(get, cs=tc):
            return max(get(c) for c in cs)
        md = worst(lambda c: c["metadata_bytes"])
        co = worst(lambda c: c["coordination"]["bytes_per_rank"])
        lms = worst(lambda c: c["load"]["ms_max"])
        lmem = worst(lambda c: c["load"]["peak_bytes_max"])
        goals.append({"goal": "metadata <= 16 MiB", "value": f"{md / MIB:.3f} MiB", "met": md <= 16 * MIB})
        goals.append({"goal": "save coordination <= 4 KiB sent+received per rank",
                      "value": f"{co:.0f} B (busiest rank, tree collectives)", "met": co <= 4 * KIB})
        goals.append({"goal": "load planning <= 100 ms per rank", "value": f"{lms:.1f} ms", "met": lms <= 100})
        goals.append({"goal": "load planning <= 64 MiB per rank", "value": f"{lmem / MIB:.2f} MiB",
                      "met": lmem <= 64 * MIB})
        d, how = dcp_at(G, N)
        if d:
            full = cfg(G, "full", N)
            for name, tv, dv in [
                ("metadata", md, d["metadata_bytes"]),
                ("save coordination bytes per rank (max)", co, d["coordination_bytes_max"]),
                ("load planning time per rank", lms, d["load_ms"]),
                ("load planning memory per rank", lmem, d["load_peak_bytes"]),
                ("save planning time per rank (DCP: its coordinator)", worst(lambda c: c["save"]["ms_max"]),
                 1000 * d["save_coordinator_s"]),
                ("save planning memory per rank (DCP: its coordinator)", worst(lambda c: c["save"]["peak_bytes_max"]),
                 d["save_coordinator_peak_bytes"]),
            ]:
                ratio = dv / tv if tv else float("inf")
                goals.append({"goal": f">= 20x better than DCP at 16384 ranks: {name}",
                              "value": f"{ratio:.0f}x (DCP {how}: measured at N = {dcp_fit[G]['_measured']}, "
                                       f"line a + b*N)", "met": ratio >= 20})
            del full
        if t0:
            for name, get in [("metadata", lambda c: c["metadata_bytes"]),
                              ("save planning time", lambda c: c["save"]["ms_max"]),
                              ("save planning memory", lambda c: c["save"]["peak_bytes_max"]),
                              ("coordination bytes", lambda c: c["coordination"]["bytes_per_rank"]),
                              ("load planning time", lambda c: c["load"]["ms_max"]),
                              ("load planning memory", lambda c: c["load"]["peak_bytes_max"]),
                              ("data files a resuming rank opens", lambda c: c["load"]["files_max"])]:
                for s in ("full", "hybrid"):
                    a1, a0 = cfg(G, s, N), cfg(G, s, N0)
                    if not (a1 and a0):
                        continue
                    g = get(a1) / get(a0) if get(a0) else float("inf")
                    goals.append({"goal": f"growth <= 2x from 1024 to 16384 ranks: {name} ({s})",
                                  "value": f"{g:.2f}x ({get(a0):.4g} -> {get(a1):.4g})", "met": g <= 2})

    out = {
        "benchmark": "scale",
        "rows": rows,
        "reshard": reshard,
        "goals": goals,
        "rows_2d": rows_2d,
        "reshard_2d": reshard_2d,
        "goals_2d": goals_2d,
        "dcp_2d": dcp_2d,
        "models": T["models"],
        "tessera_method": T["method"],
        "dcp": ({"torch": D["torch"], "check": D["check"], "max_items": D["max_items"],
                 "measured": {m: f["_measured"] for m, f in dcp_fit.items()}, "skipped (N x items > max_items)":
                     [f"{s['model']} N={s['ranks']}" for s in D["skipped"] if "mesh" not in s]} if D else "not run (no torch 2.x)"),
        "run": {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(), "tessera_wall_s": T["wall_s"], "load_average": a.load, "note": a.note},
        "tessera": T["configs"],
        "tessera_reshard": T.get("reshard", []),
        "dcp_configs": {f"{m} N={n}": f for (m, n), f in sorted(dcp_meas.items())},
    }
    if D and D.get("configs"):
        out["dcp_raw"] = D
    if D and D.get("from"):
        out["run"]["dcp_side"] = f"from the run of {D['from']['date']} (load average {D['from']['load_average']})"
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    # A short table on stdout.
    for r in rows:
        print(f"{r['model']:11s} {r['sharding']:6s} N={r['ranks']:<6d} meta {r['metadata KiB']:8.1f} KiB  "
              f"save {r['save ms']:7.2f} ms {r['save MiB']:5.2f} MiB  coord {r['coordination B/rank']:6.0f} B  "
              f"load {r['load ms']:7.2f} ms {r['load MiB']:5.2f} MiB {r['load files']:4d} files" +
              (f" | DCP ({r['DCP']}) meta {r['DCP metadata KiB'] / 1024:9.1f} MiB load {r['DCP load ms']:9.1f} ms "
               f"{r['DCP load MiB']:8.1f} MiB coord {r['DCP coordination B/rank (max)'] / MIB:9.1f} MiB"
               if "DCP" in r else ""))
    for g in goals:
        print(("MET     " if g["met"] else "NOT MET ") + g["goal"] + ": " + g["value"])
    for r in rows_2d:
        print(f"{r['model']:11s} {r['sharding']:7s} {r['mesh']:>9s} N={r['ranks']:<6d} meta {r['metadata KiB']:8.1f} KiB  "
              f"save {r['save ms']:7.2f} ms {r['save MiB']:5.2f} MiB  coord {r['coordination B/rank']:6.0f} B  "
              f"load {r['load ms']:7.2f} ms {r['load MiB']:5.2f} MiB {r['load files']:4d} files" +
              (f" | DCP ({r['DCP']}) meta {r['DCP metadata KiB'] / 1024:9.1f} MiB load {r['DCP load ms']:9.1f} ms "
               f"{r['DCP load MiB']:8.1f} MiB coord {r['DCP coordination B/rank (max)'] / MIB:9.1f} MiB"
               if "DCP" in r else ""))
    for r in reshard_2d:
        print(f"{r['model']:11s} reshard {r['from']} -> {r['to']}: " +
              (f"load {r['load ms']:.2f} ms {r['load MiB']:.2f} MiB {r['files']} files" if "load ms" in r else "") +
              (f" DCP (measured) {r['DCP load ms (measured)']:.1f} ms {r['DCP files']} files"
               if "DCP load ms (measured)" in r else ""))
    for g in goals_2d:
        print(("MET     " if g["met"] else "NOT MET ") + "2-D: " + g["goal"] + ": " + g["value"])


if __name__ == "__main__":
    main()
