#!/usr/bin/env python3
"""Chaos driver (issue 34, items 4 and 5): a 2-rank `gpt train` under
`tessera run --max-restarts K` hit at random moments by SIGKILL, SIGSEGV and SIGSTOP of
random ranks, against an uninterrupted run of the same command. With --nodes 2 the two
ranks are two nodes: one `tessera run --nnodes 2 --node-rank i` each, on this host, meeting
in node 0's store over TCP, their collectives on Gloo over TCP (TESSERA_SHM=0, as between
hosts), so a failure on one node restarts both.

Used by the chaos test (tests/reliability/test_reliability_chaos.cpp, short form) and the
chaos benchmark (bench/faults/run.sh, long form). Standard library only.

  chaos.py --build BUILD --work DIR --json FILE [--async-ckpt] [--steps N] [--ckpt-every S]
           [--failures F] [--gap G] [--signals KILL,SEGV,STOP] [--seed X] [--comm-timeout T]
           [--model L:H:D:T] [--batch-size B] [--data FILE] [--max-restarts K] [--nodes 1|2]

What it does:
 1. the clean run: `tessera run -n 2 --max-restarts K -- gpt train ... --resume auto` into
    WORK/clean, untouched;
 2. the chaos run: the same command into WORK/chaos; failure i is injected once the job's
    step (metrics.csv, one row per step) reaches a seeded random target near i*G, after a
    random fraction of a step: a random rank (a child of the launcher whose /proc/PID/exe is
    the gpt binary; the launcher's guard child is a fork of the launcher, not gpt) gets the
    failure's signal. Signals are the list given, shuffled, cycled. The next failure waits
    for the first step after the restart;
 3. per failure: the step the job had reached (the last metrics row written before the
    launcher announced the restart), the step it resumed from ("gpt: resuming from ...
    (step N)", 0 for "starting fresh"), the work lost (their difference), and the times
    from the signal to the launcher's failure report, to its restart line, to the rank's
    "resuming" line and to the first step after the restart (the next metrics.csv write);
    and what was left behind at that first step (processes of earlier rounds, shared-memory
    segments of dead ranks, temporary checkpoint directories);
 4. at the end: both final checkpoints compared tensor by tensor (every data file's
    tensors byte for byte, every plain entry of the metadata, run-directory paths
    replaced), and what is left behind: processes carrying the job's marker variable
    (TESSERA_CHAOS_TAG, inherited by everything the job starts), /dev/shm/tessera-<pid>-*
    segments of any rank pid the job had, ".*tessera-tmp*" entries under the run
    directory, and whether run.lock is still locked.

The JSON report has a "problems" list: empty when the job recovered from every failure,
ended by itself with exit 0, matches the clean run bit for bit, lost at most the bound per
failure and left nothing behind. Exit status: 0 when "problems" is empty, 1 otherwise, 2 on
a usage error.
"""
import argparse
import fcntl
import glob
import json
import os
import queue
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time

SIGNALS = {"KILL": signal.SIGKILL, "SEGV": signal.SIGSEGV, "STOP": signal.SIGSTOP}


def log(msg):
    print("chaos: " + msg, file=sys.stderr, flush=True)


# --- /proc --------------------------------------------------------------------------

def proc_stat(pid):
    """(ppid, state, starttime) of pid, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            s = f.read().decode("latin-1")
    except OSError:
        return None
    rest = s[s.rfind(")") + 2:].split()
    return int(rest[1]), rest[0], int(rest[19])


def proc_exe(pid):
    try:
        return os.readlink("/proc/%d/exe" % pid)
    except OSError:
        return ""


def proc_env(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode("latin-1")] = v.decode("latin-1")
    return env


def all_pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def tagged_processes(tag):
    """pid -> (ppid, state, exe) of every live process whose environment carries the tag."""
    out = {}
    for pid in all_pids():
        if proc_env(pid).get("TESSERA_CHAOS_TAG") != tag:
            continue
        st = proc_stat(pid)
        if st is None or st[1] == "Z":
            continue
        out[pid] = (st[0], st[1], proc_exe(pid))
    return out


def ranks_of(launcher_pids, gpt_exe):
    """rank -> pid of the launchers' children that run the gpt binary (not zombies)."""
    out = {}
    for pid in all_pids():
        st = proc_stat(pid)
        if st is None or st[0] not in launcher_pids or st[1] == "Z":
            continue
        if proc_exe(pid) != gpt_exe:
            continue
        rank = proc_env(pid).get("RANK")
        if rank is not None and rank.isdigit():
            out[int(rank)] = pid
    return out


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid):
    st = proc_stat(pid)
    return st is not None and st[1] != "Z"


# --- leftovers ---------------------------------------------------------------------

def shm_segments_of(pids):
    """/dev/shm/tessera-<pid>-* names whose pid is one of `pids`."""
    out = []
    for path in glob.glob("/dev/shm/tessera-*"):
        m = re.match(r"tessera-(\d+)-", os.path.basename(path))
        if m and int(m.group(1)) in pids:
            out.append(path)
    return sorted(out)


def temporaries_under(run_dir):
    out = []
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            if "tessera-tmp" in name:
                out.append(os.path.join(root, name))
    return sorted(out)


def lock_state(run_dir):
    """'absent', 'free' (the file is there, nobody holds its lock) or 'held by pid N'."""
    path = os.path.join(run_dir, "run.lock")
    if not os.path.exists(path):
        return "absent"
    with open(path, "r+b") as f:
        # F_GETLK through fcntl.fcntl: struct flock {short type, whence; off_t start, len; pid_t pid}
        req = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)
        res = fcntl.fcntl(f.fileno(), fcntl.F_GETLK, req + b"\0" * 4)
        ltype, _, _, _, pid = struct.unpack("hhqqi", res[:struct.calcsize("hhqqi")])
        return "free" if ltype == fcntl.F_UNLCK else "held by pid %d" % pid


# --- checkpoints -------------------------------------------------------------------

def read_safetensors(path):
    """name -> (dtype, shape, bytes) for every tensor, and the __metadata__ dict."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        meta = header.pop("__metadata__", {})
        out = {}
        for name, e in header.items():
            b, end = e["data_offsets"]
            f.seek(base + b)
            out[name] = (e["dtype"], tuple(e["shape"]), f.read(end - b))
    return out, meta


def normalize(value, run_dir):
    if isinstance(value, str):
        return value.replace(run_dir, "<OUT>")
    if isinstance(value, dict):
        return {k: normalize(v, run_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v, run_dir) for v in value]
    return value


def compare_checkpoints(a, a_run, b, b_run):
    """(tensors compared, bytes compared, differences) between two sharded checkpoints of
    the same world size: every tensor piece of every data file, and every plain entry."""
    diffs = []
    ma = json.load(open(os.path.join(a, "tessera-checkpoint.json")))
    mb = json.load(open(os.path.join(b, "tessera-checkpoint.json")))
    ea, eb = ma.get("entries", {}), mb.get("entries", {})
    if sorted(ea) != sorted(eb):
        diffs.append("entry names differ: only in clean %s, only in chaos %s" %
                     (sorted(set(ea) - set(eb))[:5], sorted(set(eb) - set(ea))[:5]))
    for k in sorted(set(ea) & set(eb)):
        if ea[k].get("kind") == "tensor":
            continue  # its bytes are compared below
        if normalize(ea[k], a_run) != normalize(eb[k], b_run):
            diffs.append("entry %s: %s vs %s" % (k, json.dumps(ea[k])[:120], json.dumps(eb[k])[:120]))
    files_a = sorted(os.path.basename(p) for p in glob.glob(os.path.join(a, "*.safetensors")))
    files_b = sorted(os.path.basename(p) for p in glob.glob(os.path.join(b, "*.safetensors")))
    if files_a != files_b:
        diffs.append("data files differ: %s vs %s" % (files_a, files_b))
    tensors = nbytes = 0
    for name in sorted(set(files_a) & set(files_b)):
        ta, _ = read_safetensors(os.path.join(a, name))
        tb, _ = read_safetensors(os.path.join(b, name))
        if sorted(ta) != sorted(tb):
            diffs.append("%s: tensor names differ" % name)
        for t in sorted(set(ta) & set(tb)):
            tensors += 1
            nbytes += len(ta[t][2])
            if ta[t] != tb[t]:
                diffs.append("%s: tensor %s differs (%s %s vs %s %s)" %
                             (name, t, ta[t][0], ta[t][1], tb[t][0], tb[t][1]))
    if tensors == 0:
        diffs.append("no tensors compared")
    return tensors, nbytes, diffs


# --- one job -------------------------------------------------------------------------

class Job:
    """`tessera run` with its output read line by line, timestamped, on a thread."""

    def __init__(self, cmd, env, log_path):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.lines = queue.Queue()
        self.log = open(log_path, "w")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            t = time.monotonic()
            self.log.write("%.3f %s\n" % (t - self.t0, line))
            self.log.flush()
            self.lines.put((t, line))
        self.lines.put((time.monotonic(), None))

    def take_lines(self):
        out = []
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                return out


class Nodes:
    """One launcher per node (Job each), seen as one job: lines of all in time order, each
    as (t, line, node); ended once every launcher's output has ended."""

    def __init__(self, jobs):
        self.jobs = jobs
        self.t0 = jobs[0].t0
        self.open = len(jobs)
        self.pids = [j.proc.pid for j in jobs]

    def take_lines(self):
        out = []
        for node, j in enumerate(self.jobs):
            for t, line in j.take_lines():
                if line is None:
                    self.open -= 1
                else:
                    out.append((t, line, node))
        out.sort(key=lambda x: x[0])
        return out

    def ended(self):
        return self.open == 0

    def kill(self):
        for j in self.jobs:
            try:
                os.killpg(j.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self):
        """Every launcher's exit status; the job's is the first non-zero one, else 0."""
        codes = [j.proc.wait() for j in self.jobs]
        for j in self.jobs:
            j.reader.join(timeout=5)
        return next((c for c in codes if c != 0), 0), codes


class Metrics:
    """Watches metrics.csv (rewritten whole, by rename, at every logged step)."""

    def __init__(self, path):
        self.path = path
        self.sig = None
        self.last_step = 0

    def poll(self):
        """True when the file changed since the last poll (last_step updated)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self.sig:
            return False
        self.sig = sig
        try:
            with open(self.path, "rb") as f:
                f.seek(max(0, st.st_size - 4096))
                tail = f.read().decode("latin-1").strip().split("\n")
            last = tail[-1].split(",")[0]
            if last.isdigit():
                self.last_step = int(last)
        except OSError:
            pass
        return True


RESUMED = re.compile(r"\[rank 0\] gpt: resuming from .* \(step (\d+)\)")
FRESH = re.compile(r"\[rank 0\] gpt: no checkpoint that verifies in .*: starting fresh")
FAILED = re.compile(r"tessera run: rank \d+ .*(killed by signal|exited with code)")
RESTART = re.compile(r"tessera run: restart (\d+) of at most")
DONE = re.compile(r"\[rank 0\] gpt: done step=(\d+).*seconds=([0-9.e+-]+)")
BLOCKING = re.compile(r"\[rank 0\] gpt: checkpoints saves=(\d+) blocking_s=([0-9.e+-]+)")


def run_job(a, name, plan, rng):
    """Runs one job; `plan` is a list of (target_step, signal_name) to inject (empty: the
    clean run). Returns its record."""
    run_dir = os.path.join(a.work, name)
    tag = "%s-%d-%d" % (name, os.getpid(), int(time.time() * 1e6))
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TESSERA_LAUNCHED", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        env.pop(k, None)
    env["TESSERA_CHAOS_TAG"] = tag
    L, H, D, T = a.model.split(":")
    launch = [[a.tessera, "run", "-n", "2", "--max-restarts", str(a.max_restarts)]]
    if a.nodes == 2:
        # Two launchers on one host would otherwise find each other's ranks on this host and
        # use the shared-memory channel: TESSERA_SHM=0 keeps the ranks on Gloo over TCP, as
        # between hosts.
        env["TESSERA_SHM"] = "0"
        port = str(free_port())
        launch = [[a.tessera, "run", "--nnodes", "2", "--node-rank", str(i), "-n", "1", "--master-addr", "127.0.0.1",
                   "--master-port", port, "--max-restarts", str(a.max_restarts), "--rdzv-timeout", "60"]
                  for i in range(2)]
    cmd = [
        "--", a.gpt, "train", "--strategy", "fsdp", "--max-steps", str(a.steps), "--ckpt-every", str(a.ckpt_every),
        "--resume", "auto", "--out", run_dir, "--comm-timeout", str(a.comm_timeout), "--n-layer", L, "--n-head", H,
        "--d-model", D, "--seq-len", T, "--batch-size", str(a.batch_size), "--seed", str(a.seed % 100000),
        "--log-every", "1", "--val-every", "0", "--limit-val-batches", "0", "--threads", "1", "--no-progress-bar"]
    if a.data:
        cmd += ["--data", a.data]
    if a.async_ckpt:
        cmd += ["--async-ckpt"]
    cmd += a.gpt_args
    cmds = [l + a.launcher_args + cmd for l in launch]
    for c in cmds:
        log("%s: %s" % (name, " ".join(c)))
    metrics = Metrics(os.path.join(run_dir, "metrics.csv"))
    job = Nodes([Job(c, env, os.path.join(a.work, name + (".log" if len(cmds) == 1 else ".node%d.log" % i)))
                 for i, c in enumerate(cmds)])
    rec = {"name": name, "command": cmds[0], "failures": [], "problems": []}
    if len(cmds) > 1:
        rec["node_commands"] = cmds
    failures = rec["failures"]
    rank_pids = set()
    pending = None          # the failure waiting for its first step after the restart
    next_i = 0              # index into plan
    first_step_t = None     # the run's first step
    restarts_seen = 0
    done = None
    blocking = None
    step_times = []         # (t, step) of metrics changes: the step time estimate
    last_ranks_scan = 0.0
    deadline = job.t0 + a.time_limit
    while True:
        now = time.monotonic()
        if now > deadline:
            rec["problems"].append("%s: still running after %.0f s: killed (a hang?)" % (name, a.time_limit))
            job.kill()
            break
        for t, line, node in job.take_lines():
            m = RESTART.search(line)
            if m and node == 0:  # every node's launcher announces each restart: count node 0's
                restarts_seen += 1
                if pending is not None and "restart_t" not in pending:
                    # Every rank of the failed round is gone: what metrics.csv holds now is
                    # the step the job had reached; its next change is the new round's first step.
                    metrics.poll()
                    pending["restart_t"] = t
                    pending["step_reached"] = max(pending["step_reached"], metrics.last_step)
            if pending is not None and "failure_report_t" not in pending and FAILED.search(line):
                pending["failure_report_t"] = t
                pending["failure_report"] = line
            if pending is not None and "restart_t" in pending and "resume_t" not in pending:
                m = RESUMED.search(line)
                if m or FRESH.search(line):
                    pending["resume_t"] = t
                    pending["resumed_from"] = int(m.group(1)) if m else 0
            m = DONE.search(line)
            if m:
                done = (int(m.group(1)), float(m.group(2)))
            m = BLOCKING.search(line)
            if m:
                blocking = (int(m.group(1)), float(m.group(2)))
        if metrics.poll():
            step_times.append((now, metrics.last_step))
            if first_step_t is None:
                first_step_t = now
            if pending is not None:
                if "restart_t" not in pending:
                    pending["step_reached"] = max(pending["step_reached"], metrics.last_step)
                elif "first_step_t" not in pending:
                    pending["first_step_t"] = now
                    pending["first_step"] = metrics.last_step
        if pending is not None and "first_step_t" in pending and "resume_t" in pending:
            finish_failure(pending, job, a, run_dir, tag, rank_pids)
            pending = None
        if now - last_ranks_scan > 0.2:
            last_ranks_scan = now
            rank_pids.update(ranks_of(job.pids, a.gpt_real).values())
        if job.ended():
            break
        # Inject the next failure once the step reached its target.
        if pending is None and next_i < len(plan) and first_step_t is not None and metrics.last_step >= plan[next_i][0]:
            target, sig_name = plan[next_i]
            ranks = ranks_of(job.pids, a.gpt_real)
            rank_pids.update(ranks.values())
            if len(ranks) == 2:
                # A random moment inside the step: up to one step time (recent median).
                recent = [b[0] - a_[0] for a_, b in zip(step_times[-12:], step_times[-11:]) if b[1] == a_[1] + 1]
                step_s = sorted(recent)[len(recent) // 2] if recent else 0.01
                time.sleep(rng.uniform(0, step_s))
                rank = rng.choice(sorted(ranks))
                pid = ranks[rank]
                metrics.poll()
                try:
                    os.kill(pid, SIGNALS[sig_name])
                    kill_t = time.monotonic()
                except ProcessLookupError:
                    kill_t = None
                if kill_t is not None:
                    pending = {"index": len(failures), "signal": sig_name, "rank": rank, "pid": pid,
                               "target_step": target, "kill_t": kill_t, "step_at_signal": metrics.last_step,
                               "step_reached": metrics.last_step}
                    failures.append(pending)
                    log("%s: failure %d: SIG%s to rank %d (pid %d) at step %d" %
                        (name, len(failures), sig_name, rank, pid, metrics.last_step))
                    next_i += 1
        time.sleep(0.003)
    rc, codes = job.wait()
    end_t = time.monotonic()
    rec["exit_code"] = rc
    if len(codes) > 1:
        rec["node_exit_codes"] = codes
    rec["wall_s"] = end_t - job.t0
    rec["first_step_s"] = (first_step_t - job.t0) if first_step_t else None
    rec["restarts"] = restarts_seen
    rec["done"] = {"step": done[0], "seconds_last_attempt": done[1]} if done else None
    if blocking:
        rec["checkpoint_saves_last_attempt"], rec["checkpoint_blocking_s_last_attempt"] = blocking
    rec["log"] = " ".join(j.log.name for j in job.jobs)
    if pending is not None:
        rec["problems"].append("%s: failure %d (SIG%s to rank %d) was not followed by a step after a restart" %
                               (name, pending["index"] + 1, pending["signal"], pending["rank"]))
    if next_i < len(plan):
        rec["problems"].append("%s: the run ended after %d of %d planned failures (steps too few for the plan)" %
                               (name, next_i, len(plan)))
    if rc != 0:
        rec["problems"].append("%s: tessera run exited %d (see %s)" % (name, rc, rec["log"]))
    if done is None or done[0] != a.steps:
        rec["problems"].append("%s: no 'gpt: done step=%d' line" % (name, a.steps))
    # Useful steps per wall second: the whole run from launch to exit.
    rec["steps_per_s"] = a.steps / rec["wall_s"]
    rec["leftovers"] = final_leftovers(rec, job, run_dir, tag, rank_pids)
    rec["rank_pids"] = sorted(rank_pids)
    return rec


def finish_failure(f, job, a, run_dir, tag, rank_pids):
    """Times and leftovers of one failure, at the first step after its restart."""
    k = f["kill_t"]
    for key in ("failure_report_t", "restart_t", "resume_t", "first_step_t"):
        if key in f:
            f[key.replace("_t", "_s")] = round(f.pop(key) - k, 4)
    f.pop("kill_t")
    f["lost_steps"] = f["step_reached"] - f["resumed_from"]
    # Left behind by the earlier rounds, seen at the new round's first step: processes of
    # the job other than the launcher, its guard and the current ranks; segments of ranks
    # that are gone; temporary checkpoint directories.
    ranks = ranks_of(job.pids, a.gpt_real)
    rank_pids.update(ranks.values())
    extra = []
    for pid, (ppid, state, exe) in tagged_processes(tag).items():
        if pid in job.pids or pid in ranks.values():
            continue
        if ppid in job.pids and exe == a.tessera_real:
            continue  # a launcher's guard
        extra.append("pid %d (%s, parent %d, state %s)" % (pid, exe, ppid, state))
    f["orphans_after_restart"] = extra
    f["dead_ranks_shm_after_restart"] = shm_segments_of({p for p in rank_pids if not alive(p)})
    f["temporaries_after_restart"] = [os.path.relpath(p, run_dir) for p in temporaries_under(run_dir)]
    log("failure %d: SIG%s rank %d: step %d -> resumed from %d (lost %d); signal to first step %.2f s "
        "(failure report %.2f, restart %.2f, resume line %.2f)" %
        (f["index"] + 1, f["signal"], f["rank"], f["step_reached"], f["resumed_from"], f["lost_steps"],
         f.get("first_step_s", -1), f.get("failure_report_s", -1), f.get("restart_s", -1), f.get("resume_s", -1)))


def final_leftovers(rec, job, run_dir, tag, rank_pids):
    # The guard and ranks may take a moment after the launcher's exit: up to 5 s.
    t_end = time.monotonic() + 5
    procs = tagged_processes(tag)
    while procs and time.monotonic() < t_end:
        time.sleep(0.05)
        procs = tagged_processes(tag)
    left = {
        "processes": ["pid %d (%s, parent %d, state %s)" % (pid, exe, ppid, st) for pid, (ppid, st, exe) in procs.items()],
        "shm_segments": shm_segments_of(rank_pids | set(job.pids)),
        "temporaries": [os.path.relpath(p, run_dir) for p in temporaries_under(run_dir)],
        "run_lock": lock_state(run_dir),
    }
    name = rec["name"]
    if left["processes"]:
        rec["problems"].append("%s: processes of the job still alive: %s" % (name, left["processes"]))
    if left["shm_segments"]:
        rec["problems"].append("%s: shared-memory segments left: %s" % (name, left["shm_segments"]))
    if left["temporaries"]:
        rec["problems"].append("%s: temporary checkpoint entries left: %s" % (name, left["temporaries"]))
    if left["run_lock"].startswith("held"):
        rec["problems"].append("%s: run.lock still %s" % (name, left["run_lock"]))
    return left


def make_plan(a, rng):
    names = [s.strip().upper() for s in a.signals.split(",") if s.strip()]
    for n in names:
        if n not in SIGNALS:
            raise SystemExit("chaos: unknown signal %s (KILL, SEGV, STOP)" % n)
    order = []
    while len(order) < a.failures:
        batch = list(names)
        rng.shuffle(batch)
        order += batch
    plan = []
    prev = 0
    for i in range(a.failures):
        # Near (i+1) * gap, jittered by up to 40% of the gap, strictly increasing.
        target = int(round((i + 1) * a.gap + rng.uniform(-0.4, 0.4) * a.gap))
        target = max(target, prev + 2)
        plan.append((target, order[i]))
        prev = target
    return plan


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--work", required=True, help="directory for both runs (created)")
    p.add_argument("--json", required=True, help="report file")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--failures", type=int, default=3)
    p.add_argument("--gap", type=float, default=0, help="steps between failures (default: steps / (failures + 1))")
    p.add_argument("--signals", default="KILL,SEGV,STOP")
    p.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    p.add_argument("--async-ckpt", action="store_true")
    p.add_argument("--comm-timeout", type=float, default=3)
    p.add_argument("--model", default="2:2:32:16", help="L:H:D:T (n-layer, n-head, d-model, seq-len)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--data", default="")
    p.add_argument("--max-restarts", type=int, default=-1, help="default: failures + 3")
    p.add_argument("--nodes", type=int, default=1, choices=(1, 2),
                   help="2: the two ranks are two nodes (tessera run --nnodes 2, one rank each, on this host)")
    p.add_argument("--time-limit", type=float, default=600, help="seconds per run before it counts as hung")
    p.add_argument("--skip-clean", default="", help="a clean run's report (JSON) to reuse instead of running one")
    p.add_argument("--launcher-arg", dest="launcher_args", action="append", default=[],
                   help="extra `tessera run` option (repeatable)")
    p.add_argument("--gpt-arg", dest="gpt_args", action="append", default=[], help="extra `gpt train` flag (repeatable)")
    a = p.parse_args()
    if a.seed is None:
        a.seed = int(time.time()) % 1000000
    if a.gap <= 0:
        a.gap = a.steps / (a.failures + 1)
    if a.max_restarts < 0:
        a.max_restarts = a.failures + 3
    a.tessera = os.path.abspath(os.path.join(a.build, "bin", "tessera"))
    a.gpt = os.path.abspath(os.path.join(a.build, "bin", "gpt"))
    a.tessera_real, a.gpt_real = os.path.realpath(a.tessera), os.path.realpath(a.gpt)
    for exe in (a.tessera, a.gpt):
        if not os.access(exe, os.X_OK):
            print("chaos: %s is not built" % exe, file=sys.stderr)
            return 2
    os.makedirs(a.work, exist_ok=True)
    a.work = os.path.abspath(a.work)
    log("seed %d (rerun with --seed %d)" % (a.seed, a.seed))
    rng = random.Random(a.seed)
    plan = make_plan(a, rng)
    log("plan: " + ", ".join("SIG%s at step ~%d" % (s, t) for t, s in plan))

    clean = run_job(a, "clean", [], rng)
    chaos = run_job(a, "chaos", plan, rng)
    report = {
        "seed": a.seed, "async_ckpt": a.async_ckpt, "steps": a.steps, "ckpt_every": a.ckpt_every,
        "model": a.model, "batch_size": a.batch_size, "comm_timeout_s": a.comm_timeout,
        "max_restarts": a.max_restarts, "nodes": a.nodes, "plan": [{"target_step": t, "signal": s} for t, s in plan],
        "clean": clean, "chaos": chaos,
    }
    problems = clean["problems"] + chaos["problems"]
    fails = chaos["failures"]
    recovered = [f for f in fails if "first_step_s" in f]
    report["injected"] = len(fails)
    report["recovered"] = len(recovered)
    # The bound on the work a failure loses: the steps since the newest committed
    # checkpoint. Sync saves commit at every multiple of S before the next step, so at most
    # S steps (a failure during the save of step k*S, after k*S was logged, resumes at
    # (k-1)*S). An async save of k*S commits in the background while steps go on, and the
    # save of (k+1)*S waits for it first: at most 2*S.
    bound = (2 if a.async_ckpt else 1) * a.ckpt_every
    report["lost_bound_steps"] = bound
    for f in recovered:
        if f["lost_steps"] > bound:
            problems.append("failure %d (SIG%s rank %d): lost %d steps (%d -> %d), more than %d" %
                            (f["index"] + 1, f["signal"], f["rank"], f["lost_steps"], f["step_reached"],
                             f["resumed_from"], bound))
        if f["orphans_after_restart"]:
            problems.append("failure %d: processes of earlier rounds alive after the restart: %s" %
                            (f["index"] + 1, f["orphans_after_restart"]))
        if f["dead_ranks_shm_after_restart"]:
            problems.append("failure %d: shared-memory segments of dead ranks after the restart: %s" %
                            (f["index"] + 1, f["dead_ranks_shm_after_restart"]))
    if chaos["restarts"] != len(fails):
        report["extra_restarts"] = chaos["restarts"] - len(fails)
    ck_a = os.path.join(a.work, "clean", "checkpoints", "last.ckpt")
    ck_b = os.path.join(a.work, "chaos", "checkpoints", "last.ckpt")
    if os.path.isdir(ck_a) and os.path.isdir(ck_b):
        n, nbytes, diffs = compare_checkpoints(ck_a, os.path.join(a.work, "clean"), ck_b, os.path.join(a.work, "chaos"))
        report["compared_tensors"], report["compared_bytes"] = n, nbytes
        report["bit_identical"] = not diffs
        report["differences"] = diffs[:20]
        if diffs:
            problems.append("final checkpoints differ: " + "; ".join(diffs[:5]))
    else:
        report["bit_identical"] = False
        problems.append("a final checkpoint is missing (%s, %s)" % (ck_a, ck_b))
    losses = [f["lost_steps"] for f in recovered]
    times = [f["first_step_s"] for f in recovered]
    report["summary"] = {
        "recovered_of_injected": "%d/%d" % (len(recovered), len(fails)),
        "bit_identical": report["bit_identical"],
        "lost_steps_max": max(losses) if losses else None,
        "lost_steps_mean": sum(losses) / len(losses) if losses else None,
        "signal_to_first_step_s_max": max(times) if times else None,
        "signal_to_first_step_s_mean": sum(times) / len(times) if times else None,
        "goodput_vs_clean": clean["wall_s"] / chaos["wall_s"] if chaos["wall_s"] else None,
        "clean_wall_s": clean["wall_s"], "chaos_wall_s": chaos["wall_s"],
    }
    report["problems"] = problems
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    log("seed %d: %s recovered, bit-identical %s, lost max %s steps (bound %d), signal to first step max %s s, "
        "goodput %.3f; %d problem(s)" % (a.seed, report["summary"]["recovered_of_injected"], report["bit_identical"],
                                         report["summary"]["lost_steps_max"], bound,
                                         report["summary"]["signal_to_first_step_s_max"],
                                         report["summary"]["goodput_vs_clean"] or 0, len(problems)))
    for pr in problems:
        log("problem: " + pr)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
