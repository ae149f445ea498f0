"""Issue 47 item 4: 2-D (FSDP x TP) checkpoints both ways between Tessera and PyTorch 2.x
through tessera_ckpt.dcp, with real torch FSDP2 + DTensor TP models (Gloo, one process per
rank, rendezvous through a file: no port).

usage: python dcp_2d_check.py CKPT --tessera BUILD/bin/tessera --gpt BUILD/bin/gpt --work DIR
  CKPT   a sharded 2-D checkpoint of `gpt train --strategy fsdp --tp 2 --devices 4`
  --tessera, --gpt   the Tessera side of direction B; --work: a directory for the checkpoints

The torch model is the Gpt of bench/peers/gpt_model.py (examples/gpt's names, qkv fused) with a
tensor-parallel plan after torchtitan's (embedding RowwiseParallel, qkv / fc / head
ColwiseParallel, proj / fc_out RowwiseParallel, norms and pos whole), then fully_shard over
the mesh's dp dimension per block and at the root; its state dict
(get_model_state_dict) holds DTensors: on the (dp, tp) mesh (_StridedShard(0, sf=tp),
Shard(0)) for the row-cut weights (tok, qkv, fc, head), (Shard(0), Shard(1)) for the
column-cut ones (proj, fc_out), (Shard(0), Replicate()) for their biases; on the dp mesh
alone (Shard(0),) for the norms and pos. No forward is run: the plan's qkv cut (contiguous
rows) is not the attention's (each head's q, k, v); only the state dict matters here.

A. The Tessera checkpoint loaded by dcp.load(..., storage_reader=Reader(CKPT)) at meshes
   (dp, tp) = (2, 2), (1, 4), (4, 1), (1, 3) (tp 3: uneven pieces: 256 rows as 86, 86, 84,
   32 columns as 11, 11, 10): every full_tensor() equal to tessera_ckpt.load(CKPT); at
   (2, 2) also TrainerState.load with AdamW (weights, exp_avg, exp_avg_sq equal).
B. Random weights at (2, 2) and (1, 3) saved by dcp.save through Writer(OUT) and through
   DCP's FileSystemWriter: tessera_ckpt.load(OUT) and `tessera ckpt consolidate OUT` equal
   the weights; `tessera ckpt verify OUT`; `gpt train --init-from OUT` at --tp 2 --devices 4
   and at --devices 1 logs the same first loss; `tessera ckpt import-dcp` of the
   FileSystemWriter directory equals the weights. TrainerState.save at (2, 2) (AdamW state
   set, step 4) is resumed by `gpt train --resume` at --tp 2 --devices 4.
Stripes: a DTensor cut as Tessera cuts qkv (_StridedShard(0, split_factor=3) over tp) is one
   that torch's DCP describes wrongly; the Reader refuses its load naming the key, DCP's
   planner its save.
Prints "ok dcp_2d_check: ..." at the end.
"""
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)  # rank_processes, the launcher shared with the other multi-rank checks
from rank_processes import run_ranks  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))


def fail(msg):
    print(f"FAIL dcp_2d_check: {msg}", flush=True)
    sys.exit(1)


# ---------------------------------------------------------------- the torch model


def build(shape, dp, tp):
    """gpt_model.Gpt with random weights (the same on every rank), then TP over the mesh's
    tp dimension and FSDP2 over its dp dimension. Returns (model, whole weights)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gpt_model import Gpt

    torch.manual_seed(5)
    model = Gpt(*shape)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"tok": RowwiseParallel(), "head": ColwiseParallel()}
    for i in range(len(model.blocks)):
        for name in ("qkv", "fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("proj", "fc_out"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, whole


def placements(sd):
    out = {}
    for k, v in sd.items():
        out[k] = f"{tuple(v.placements)} local {list(v.to_local().shape)}" if hasattr(v, "placements") else "tensor"
    return out


def strided(sd):
    from torch.distributed.tensor.placement_types import _StridedShard
    return sum(any(isinstance(p, _StridedShard) for p in getattr(v, "placements", ())) for v in sd.values())


def check_equal(what, got_sd, want):
    import torch
    bad = []
    for k, v in got_sd.items():
        got = v.full_tensor() if hasattr(v, "full_tensor") else v
        if k not in want or not torch.equal(got, want[k]):
            bad.append(f"{k} {placements({k: v})[k]}")
    if bad:
        raise SystemExit(f"{what}: differs at " + "; ".join(bad))


def refused(fn):
    """The text of what fn raised, '' if nothing."""
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: B036
        return str(e)
    return ""


def stripes(where, dp, tp, path, shape, work):
    """Tessera's own cut of qkv as a DTensor, _StridedShard(0, split_factor=3) over tp (each
    rank one piece of each of q, k and v): DCP describes its local tensor as one box, wrongly.
    The Reader refuses the load naming the key (DCP's FileSystemReader fills it from the
    wrong rows); DCP's planner refuses the save (overlapping chunks), before the Writer
    publishes anything."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    import tessera_ckpt.dcp

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    d = shape[2]
    t = distribute_tensor(torch.randn(3 * d, d), mesh, [Replicate(), _StridedShard(0, split_factor=3)])
    key = "blocks.0.qkv.weight"
    # DCP's CheckpointException (each rank's error) is a BaseException.
    err = refused(lambda: dcp.load({"model": {key: t}}, storage_reader=tessera_ckpt.dcp.Reader(path)))
    if f"key 'model.{key}'" not in err or "3 stripes of dim 0" not in err:
        raise SystemExit(f"{where}: dcp.load of a _StridedShard(0, split_factor=3) DTensor: {err or 'not refused'}")
    out = os.path.join(work, "stripes-not-written")
    err = refused(lambda: dcp.save({"model": {key: t}}, storage_writer=tessera_ckpt.dcp.Writer(out)))
    if "validate global plan" not in err:
        raise SystemExit(f"{where}: dcp.save of a _StridedShard(0, split_factor=3) DTensor: {err or 'not refused'}")
    left = [n for n in os.listdir(work) if "stripes-not-written" in n]
    if left:
        raise SystemExit(f"{where}: the refused save left {left} in {work}")
    return (f"stripes: ({dp}, {tp}) a _StridedShard(0, split_factor=3) DTensor refused by the Reader (dcp.load) "
            "and by DCP's planner (dcp.save)")


def worker(argv):
    """Runs the steps of argv[2:] in one process group of argv[1] ranks: load:DPxTP:CKPT,
    save:DPxTP:OUT, trainer-load:DPxTP:CKPT, trainer-save:DPxTP:OUT."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    import tessera_ckpt
    import tessera_ckpt.dcp

    torch.set_num_threads(1)
    rdzv, world, shape = argv[0], int(argv[1]), tuple(int(x) for x in argv[2].split(","))
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=int(os.environ["RANK"]), world_size=world)
    rank = dist.get_rank()
    for step in argv[3:]:
        mode, mesh, path = step.split(":", 2)
        dp, tp = (int(x) for x in mesh.split("x"))
        where = f"rank {rank} {mode} at ({dp}, {tp})"
        if mode == "stripes":
            msg = stripes(where, dp, tp, path, shape, os.path.dirname(rdzv))
            dist.barrier()
            if rank == 0:
                print("  " + msg, flush=True)
            continue
        model, whole = build(shape, dp, tp)
        if mode in ("load", "save"):
            sd = get_model_state_dict(model)
            if rank == 0 and os.environ.get("DCP_2D_VERBOSE"):
                for k, v in placements(sd).items():
                    print(f"  ({dp}, {tp}) {k}: {v}", flush=True)
            n_strided = strided(sd)
            if tp > 1 and n_strided == 0:
                raise SystemExit(f"{where}: no _StridedShard placement in the state dict")
            if mode == "load":
                dcp.load({"model": sd}, storage_reader=tessera_ckpt.dcp.Reader(path))
                check_equal(where, sd, tessera_ckpt.load(path, prefix="model."))
                msg = (f"A: ({dp}, {tp}) dcp.load of {len(sd)} DTensors ({n_strided} _StridedShard) equal to "
                       "tessera_ckpt.load")
            else:
                dcp.save({"model": sd}, storage_writer=tessera_ckpt.dcp.Writer(os.path.join(path, "tessera")))
                dcp.save({"model": sd}, checkpoint_id=os.path.join(path, "dcp"))
                if rank == 0:
                    torch.save(whole, os.path.join(path, "whole.pt"))
                msg = f"B: ({dp}, {tp}) dcp.save through Writer and FileSystemWriter ({n_strided} _StridedShard)"
        else:
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            get_state_dict(model, optim)  # creates the AdamW state (zeros)
            if mode == "trainer-load":
                state = tessera_ckpt.dcp.TrainerState(model, optim)
                state.load(path)
                msd, osd = get_state_dict(model, optim)
                want = tessera_ckpt.load(path)
                check_equal(where, msd, {k[6:]: v for k, v in want.items() if k.startswith("model.")})
                for fqn, st in osd["state"].items():
                    for name in ("exp_avg", "exp_avg_sq"):
                        check_equal(where, {f"{fqn}.{name}": st[name]},
                                    {f"{fqn}.{name}": want[f"optimizer_0.state.{fqn}.{name}"]})
                msg = (f"A: ({dp}, {tp}) TrainerState.load: weights and AdamW state of {len(osd['state'])} "
                       f"parameters equal, global_step {state.global_step}")
            else:
                with torch.no_grad():
                    for p in model.parameters():
                        st = optim.state[p]
                        st["exp_avg"].copy_(p * 0.5)
                        st["exp_avg_sq"].copy_(p * p + 1.0)
                        st["step"].fill_(4.0)
                hp = dict(zip(("n_layer", "n_head", "d_model", "seq_len"), shape), tie_weights=False)
                tessera_ckpt.dcp.TrainerState(model, optim, global_step=4, hparams=hp).save(path)
                msg = f"B: ({dp}, {tp}) TrainerState.save of the weights and AdamW state"
        dist.barrier()
        if rank == 0:
            print("  " + msg, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- the driver


def launch(world, steps, shape, work, timeout=300):
    rdzv = tempfile.mktemp(prefix="rdzv-", dir=work)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, os.path.abspath(__file__), "--worker", rdzv, str(world), ",".join(map(str, shape))] + steps
    outs = run_ranks(args, world, env, timeout, f"{world} ranks {steps}", fail)
    sys.stdout.write("".join(l + "\n" for l in outs[0].splitlines() if l.startswith("  ")))


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        fail(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-4000:]}")
    return p.stdout


def first_loss(run_dir, step=1):
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = [r.split(",") for r in f.read().splitlines()]
    col = rows[0].index("train_loss")
    return float(next(r for r in rows[1:] if r[0] == str(step))[col])


def main(argv):
    import torch

    import tessera_ckpt

    ckpt = argv[0]
    tessera, gpt, work = (argv[argv.index(flag) + 1] for flag in ("--tessera", "--gpt", "--work"))
    os.makedirs(work, exist_ok=True)
    hp = tessera_ckpt.load(ckpt, prefix="hparams.")
    shape = tuple(int(hp[k]) for k in ("n_layer", "n_head", "d_model", "seq_len"))
    t0 = time.time()
    checks = 0

    # Both directions at (2, 2), (1, 4) and (4, 1) in one group of 4 processes, and at (1, 3)
    # in one of 3.
    outs = {m: os.path.join(work, f"save-{m}") for m in ("2x2", "1x3")}
    trainer = os.path.join(work, "trainer-2x2")
    for d in outs.values():
        os.makedirs(d, exist_ok=True)
    launch(4, [f"stripes:2x2:{ckpt}", f"load:2x2:{ckpt}", f"trainer-load:2x2:{ckpt}", f"save:2x2:{outs['2x2']}",
               f"trainer-save:2x2:{trainer}", f"load:1x4:{ckpt}", f"load:4x1:{ckpt}"], shape, work)
    launch(3, [f"load:1x3:{ckpt}", f"save:1x3:{outs['1x3']}"], shape, work)
    checks += 8

    # B, the Tessera side.
    text = os.path.join(work, "text.txt")
    with open(text, "w") as f:
        f.write("tensor parallel checkpoints both ways\n" * 200)
    model_flags = ["--n-layer", str(shape[0]), "--n-head", str(shape[1]), "--d-model", str(shape[2]),
                   "--seq-len", str(shape[3]), "--batch-size", "4", "--log-every", "1", "--val-every", "0",
                   "--threads", "1", "--no-progress-bar", "--data", text]
    for mesh, out in outs.items():
        dp, tp = (int(x) for x in mesh.split("x"))
        whole = torch.load(os.path.join(out, "whole.pt"))
        ours = os.path.join(out, "tessera")
        got = tessera_ckpt.load(ours, prefix="model.")
        bad = [k for k in whole if not torch.equal(got[k], whole[k])]
        if bad or set(got) != set(whole):
            fail(f"B ({dp}, {tp}): tessera_ckpt.load of the Writer's checkpoint differs at {bad}, keys "
                 f"{sorted(set(got) ^ set(whole))}")
        run([tessera, "ckpt", "verify", ours])
        cons = os.path.join(out, "consolidated.safetensors")
        run([tessera, "ckpt", "consolidate", ours, "-o", cons])
        got = tessera_ckpt.load(cons, prefix="model.")
        bad = [k for k in whole if not torch.equal(got[k], whole[k])]
        if bad:
            fail(f"B ({dp}, {tp}): tessera ckpt consolidate differs at {bad}")
        imp = os.path.join(out, "imported")
        run([tessera, "ckpt", "import-dcp", os.path.join(out, "dcp"), "-o", imp])
        got = tessera_ckpt.load(imp, prefix="model.")
        bad = [k for k in whole if not torch.equal(got[k], whole[k])]
        if bad:
            fail(f"B ({dp}, {tp}): tessera ckpt import-dcp differs at {bad}")
        checks += 3
        print(f"  B: ({dp}, {tp}) Writer checkpoint verified, loaded, consolidated; import-dcp equal", flush=True)
        if (dp, tp) != (2, 2):
            continue
        losses = {}
        for flags in (["--strategy", "fsdp", "--devices", "4", "--tp", "2"], ["--devices", "1"]):
            rd = os.path.join(out, "run-" + "-".join(flags[-2:]))
            log = run([gpt, "train", *flags, "--init-from", ours, "--max-steps", "1", *model_flags, "--out", rd])
            if "initial weights from" not in log:
                fail(f"gpt {' '.join(flags)} did not start from {ours}:\n{log[-3000:]}")
            losses[" ".join(flags)] = first_loss(rd)
        a, b = losses.values()
        if abs(a - b) > 1e-4 * abs(b):
            fail(f"B: gpt's first losses from the Writer's checkpoint differ: {losses}")
        checks += 1
        print(f"  B: gpt --init-from at --tp 2 --devices 4 and --devices 1: first loss {a:.6f} / {b:.6f}", flush=True)
    rd = os.path.join(work, "run-resume")
    log = run([gpt, "train", "--strategy", "fsdp", "--devices", "4", "--tp", "2", "--resume", trainer,
               "--max-steps", "5", *model_flags, "--out", rd])
    if "resuming at step 4" not in log:
        fail(f"gpt --resume {trainer} did not resume at step 4:\n{log[-3000:]}")
    checks += 1
    print(f"  B: gpt --resume of the TrainerState checkpoint at --tp 2 --devices 4: step 5 loss "
          f"{first_loss(rd, 5):.6f}", flush=True)
    print(f"ok dcp_2d_check: {checks} checks in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        main(sys.argv[1:])
