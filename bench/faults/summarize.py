#!/usr/bin/env python3
"""bench/faults: the chaos driver's reports (chaos.py --json, one per checkpoint mode)
-> bench/results/faults.json (one row per mode) and bench/results/faults-failures.json
(one row per injected failure).

  summarize.py --out FAULTS.json --failures-out FAILURES.json --process-start-s S REPORT...
"""
import argparse
import json
import statistics


def mean(xs):
    return statistics.mean(xs) if xs else None


def r3(x):
    return None if x is None else round(x, 3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--failures-out", required=True)
    p.add_argument("--process-start-s", type=float, default=None,
                   help="wall time of `gpt --help` (exec + libtorch load), the floor of any restart")
    p.add_argument("--grace-s", type=float, default=5.0)
    p.add_argument("reports", nargs="+")
    a = p.parse_args()
    rows, failure_rows, problems = [], [], {}
    meta = {}
    for path in a.reports:
        r = json.load(open(path))
        mode = ("async" if r["async_ckpt"] else "sync") + ("-2nodes" if r.get("nodes", 1) > 1 else "")
        if r["batch_size"] != 16:
            mode += "-batch%d" % r["batch_size"]
        clean, chaos = r["clean"], r["chaos"]
        fs = [f for f in chaos["failures"] if "first_step_s" in f]
        step_s = clean["wall_s"] / r["steps"]  # includes the clean run's start
        clean_train_s = clean["wall_s"] - (clean["first_step_s"] or 0)
        step_train_s = clean_train_s / max(1, r["steps"] - 1)
        crash = [f for f in fs if f["signal"] in ("KILL", "SEGV")]
        stop = [f for f in fs if f["signal"] == "STOP"]
        lost = [f["lost_steps"] for f in fs]
        restart_to_first = [f["first_step_s"] - f["restart_s"] for f in fs if "restart_s" in f]
        overhead = (chaos["wall_s"] - clean["wall_s"]) / max(1, len(chaos["failures"]))
        rows.append({
            "checkpoints": mode,
            "nodes": r.get("nodes", 1),
            "steps": r["steps"],
            "ckpt_every": r["ckpt_every"],
            "injected": r["injected"],
            "recovered": r["recovered"],
            "exit_code": chaos["exit_code"],
            "restarts": chaos["restarts"],
            "bit_identical": r["bit_identical"],
            "tensors_compared": r.get("compared_tensors"),
            "lost_steps_mean": r3(mean(lost)),
            "lost_steps_max": max(lost) if lost else None,
            "lost_bound": r["lost_bound_steps"],
            "kill_segv_to_first_step_s_mean": r3(mean([f["first_step_s"] for f in crash])),
            "kill_segv_to_first_step_s_max": r3(max([f["first_step_s"] for f in crash], default=None)),
            "stop_to_first_step_s_mean": r3(mean([f["first_step_s"] for f in stop])),
            "restart_to_first_step_s_mean": r3(mean(restart_to_first)),
            "restart_to_first_step_s_max": r3(max(restart_to_first, default=None)),
            "clean_wall_s": r3(clean["wall_s"]),
            "chaos_wall_s": r3(chaos["wall_s"]),
            "goodput_vs_clean": r3(clean["wall_s"] / chaos["wall_s"]) if chaos["wall_s"] else None,
            # What goodput can be at most with this failure rate and checkpoint interval: the
            # steps a failure loses are done again, so G <= gap / (gap + lost), restarts free.
            "gap_steps": round(r["steps"] / (len(chaos["failures"]) + 1), 1),
            "goodput_bound_from_lost_work": r3(
                (r["steps"] / (len(chaos["failures"]) + 1)) / (r["steps"] / (len(chaos["failures"]) + 1) + mean(lost)))
            if lost else None,
            "batch_size": r["batch_size"],
        })
        # Where a failure's time goes (means over the failures of this mode): detection
        # (signal -> the launcher's report of the failed rank; for SIGSTOP the survivor's
        # collective timeout), teardown (report -> restart line: stopping the other ranks;
        # a SIGSTOPped rank ignores SIGTERM and goes at SIGKILL after --grace), start
        # (restart line -> "resuming from": exec, libtorch load, rendezvous, finding and
        # verifying the checkpoint), load + first step (-> the first metrics row), and the
        # re-done steps (lost steps at the clean run's step time).
        def phase(fsel, a_key, b_key):
            xs = [f[b_key] - (f[a_key] if a_key else 0) for f in fsel if b_key in f and (not a_key or a_key in f)]
            return r3(mean(xs))
        meta[mode] = {
            "seed": r["seed"],
            "clean_step_s": r3(step_train_s),
            "clean_launch_to_first_step_s": r3(clean["first_step_s"]),
            "wall_overhead_per_failure_s": r3(overhead),
            "redone_steps_per_failure_s": r3((mean(lost) or 0) * step_train_s),
            "kill_segv_detect_s": phase(crash, None, "failure_report_s"),
            "kill_segv_teardown_s": phase(crash, "failure_report_s", "restart_s"),
            "stop_detect_s": phase(stop, None, "failure_report_s"),
            "stop_teardown_s": phase(stop, "failure_report_s", "restart_s"),
            "start_to_resume_line_s": phase(fs, "restart_s", "resume_s"),
            "load_and_first_step_s": phase(fs, "resume_s", "first_step_s"),
            "leftovers_at_end": {k: (v if isinstance(v, str) else len(v)) for k, v in chaos["leftovers"].items()},
        }
        if r["problems"]:
            problems[mode] = r["problems"]
        for f in chaos["failures"]:
            failure_rows.append({
                "checkpoints": mode, "n": f["index"] + 1, "signal": f["signal"], "rank": f["rank"],
                "step_reached": f["step_reached"], "resumed_from": f.get("resumed_from"),
                "lost_steps": f.get("lost_steps"), "detect_s": f.get("failure_report_s"),
                "restart_line_s": f.get("restart_s"), "resume_line_s": f.get("resume_s"),
                "first_step_s": f.get("first_step_s"),
                "left_after_restart": len(f.get("orphans_after_restart", [])) +
                len(f.get("dead_ranks_shm_after_restart", [])),
                "temporaries_after_restart": len(f.get("temporaries_after_restart", [])),
            })
    first = json.load(open(a.reports[0]))
    doc = {
        "benchmark": "faults",
        "rows": rows,
        "setup": {
            "model": first["model"], "batch_size": first["batch_size"], "ranks": 2,
            "comm_timeout_s": first["comm_timeout_s"], "launcher_grace_s": a.grace_s,
            "max_restarts": first["max_restarts"],
            "process_start_s": r3(a.process_start_s),
        },
        "phases": meta,
        "problems": problems or "none",
    }
    json.dump(doc, open(a.out, "w"), indent=1)
    json.dump({"benchmark": "faults-failures", "rows": failure_rows}, open(a.failures_out, "w"), indent=1)
    for row in rows:
        print("faults %s: %d/%d recovered, bit-identical %s, lost mean %s max %s (interval %d), restart to first "
              "step mean %s s, goodput %s" % (row["checkpoints"], row["recovered"], row["injected"],
                                            row["bit_identical"], row["lost_steps_mean"], row["lost_steps_max"],
                                            row["ckpt_every"], row["restart_to_first_step_s_mean"],
                                            row["goodput_vs_clean"]))
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
