"""Runs a test script's worker as `world` real processes (RANK = 0 .. world-1) and waits for
every one under one deadline: the launcher the multi-rank Python checks share
(dcp_backend_check.py, dcp_2d_check.py)."""
import subprocess
import time


def run_ranks(argv, world, env, timeout, label, fail, tail=4000):
    """Starts ``argv`` once per rank with ``env`` plus RANK and LOCAL_RANK, waits for all of them
    (``timeout`` seconds in all) and returns each rank's output (stdout and stderr together).
    A timeout kills every rank; a timeout or a non-zero exit is reported through ``fail`` (the
    script's own), naming ``label``, the failed ranks and the last ``tail`` characters of each."""
    procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs, bad, deadline = [], [], time.time() + timeout
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            fail(f"{label}: timed out after {timeout} s")
        outs.append(out)
        if p.returncode != 0:
            bad.append(r)
    if bad:
        fail(f"{label}: rank(s) {bad} failed:\n" + "\n".join(f"--- rank {r} ---\n{outs[r][-tail:]}" for r in bad))
    return outs
