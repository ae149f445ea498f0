"""The torch 2.x peers of examples/gpt: the same model (bench/peers/gpt_model.py, same
parameter names), data in the same order (bench/peers/gpt_data.py), AdamW with gpt's
hyper-parameters, gpt's warmup + cosine learning rate, global-norm clipping and global
batch, trained by PyTorch's FSDP2 (fully_shard), DDP, or Lightning Fabric (DDP, FSDP).

Run once per rank with the torch.distributed environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK), e.g. through Tessera's own launcher, as gpt itself is run:

  build-torch2/bin/tessera run -n 2 -- .venv-torch2/bin/python bench/peers/gpt_peer.py \\
      --mode fsdp2 --steps 30 --n-layer 4 --d-model 256 --n-head 4 --seq-len 128

Modes:
  fsdp2        torch.distributed.fsdp.fully_shard on each block and on the root (CPU device
               mesh, gloo); --init meta builds the model on the meta device and
               initialises each rank's shards (no rank holds the whole model), --init full
               (the default) builds it whole from --seed first, as gpt's single process would
  fsdp1        FullyShardedDataParallel with each block a unit (use_orig_params)
  ddp          torch.nn.parallel.DistributedDataParallel (gloo)
  fabric-ddp   lightning.fabric.Fabric(strategy="ddp")
  fabric-fsdp  lightning.fabric.Fabric(strategy=FSDPStrategy(auto_wrap_policy={Block}))
  fabric-mp    lightning.fabric.Fabric(strategy=ModelParallelStrategy(fully_shard per block))
  fsdp2-tp     tensor parallelism (DTensor, parallelize_module with a torchtitan-style plan,
               sequence parallelism and loss parallelism by default) over the "tp" dimension
               of a CPU device mesh (dp, tp) = (ranks / --tp, --tp), then fully_shard on each
               block and the root over "dp" (bench/peers/gpt_tp.py: the plan, and why the
               fused qkv is split or striped); gpt train --tp N --strategy fsdp's peer
One intra-op thread per rank (torch.set_num_threads(--threads), default 1; the launcher sets
OMP_NUM_THREADS=1 when ranks share the machine). Python's default CPU allocator.

gpt's defaults (examples/gpt/main.cpp) are the defaults here: --lr 2e-3, betas (0.9, 0.95),
weight decay 0.01 on every parameter, eps 1e-8, warmup min(30, decay/10) steps then cosine
to 0.1 x lr over --lr-decay-steps (default --steps), clipping at global norm 1.0, global
batch 16 split over the ranks, --seed 1234 for the weights and the data order.

Output: one JSON line on rank 0:
  {"impl", "world", "params", "tokens_per_s", "peak_rss_mib", "torch", "lightning", ...}
tokens/s from the end of the first --timing-skip steps (default 1, as gpt: the first batch
is warm-up) to the end of the last; peak RSS: the largest rank's ru_maxrss.
"""
import argparse
import json
import math
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpt_data import default_data_files, rank_batches, train_windows  # noqa: E402
from gpt_model import Block, Gpt, count_parameters, gpt2_init_, lm_loss  # noqa: E402

MODES = ("fsdp2", "fsdp1", "ddp", "fabric-ddp", "fabric-fsdp", "fabric-mp", "fsdp2-tp")
IMPL = {"fsdp2": "fsdp2", "fsdp1": "fsdp1", "ddp": "torch-ddp", "fabric-ddp": "fabric-ddp",
        "fabric-fsdp": "fabric-fsdp", "fabric-mp": "fabric-modelparallel", "fsdp2-tp": "fsdp2-tp"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (gpt's --max-steps)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch in sequences (split over the ranks)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=-1, help="default min(30, lr-decay-steps / 10)")
    p.add_argument("--lr-decay-steps", type=int, default=0, help="default --steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clipping (0: off)")
    p.add_argument("--seed", type=int, default=1234, help="initial weights and data order")
    p.add_argument("--init-seed", type=int, help="initial weights only (default --seed)")
    p.add_argument("--data", action="append", default=[], help="text file(s) (default: gpt's license texts)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--init", choices=("full", "meta"), default="full",
                   help="fsdp2/fabric-mp: build the whole model from --seed (full) or shards on each rank (meta)")
    p.add_argument("--init-from", help="initial weights: a safetensors file, keys FQNs or model.<FQN>")
    p.add_argument("--save-init", help="write the initial weights (bare FQNs) to this safetensors file")
    p.add_argument("--save-dcp", help="dcp.save {'model': state dict} of the initial model to this directory")
    p.add_argument("--adamw", choices=("default", "fused"), default="default",
                   help="torch.optim.AdamW as constructed by default (its for-loop implementation on CPU "
                        "tensors) or with fused=True (one kernel per parameter)")
    p.add_argument("--losses-out", help="rank 0 writes each step's loss (mean over the ranks), one per line")
    p.add_argument("--timing-skip", type=int, default=1, help="first steps left out of tokens/s")
    tp = p.add_argument_group("fsdp2-tp")
    tp.add_argument("--tp", type=int, default=1, help="tensor-parallel size (data-parallel size = ranks / N)")
    tp.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                    help="keep the whole sequence on every rank of a tensor-parallel group")
    tp.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                    help="all-gather the logits and take the plain cross-entropy (default: loss_parallel, "
                         "the logits stay sharded over the vocabulary)")
    tp.add_argument("--qkv", choices=("split", "striped"), default="split",
                    help="how the fused qkv is cut by heads: three ColwiseParallel q, k, v (torchtitan's) or one "
                         "ColwiseParallel qkv with its rows reordered [q_r; k_r; v_r] (bench/peers/gpt_tp.py)")
    tp.add_argument("--check-grads", action="store_true",
                    help="fsdp2-tp: compare the first step's gradients (before clipping) with one process's on "
                         "the whole global batch and print the largest relative difference (needs --init full)")
    a = p.parse_args(argv)
    if a.steps < 0:
        p.error(f"--steps must be >= 0, got {a.steps}")
    if a.d_model % a.n_head:
        p.error(f"--d-model {a.d_model} must be a multiple of --n-head {a.n_head}")
    if a.lr_decay_steps == 0:
        a.lr_decay_steps = max(a.steps, 1)
    if a.warmup_steps < 0:
        a.warmup_steps = min(30, a.lr_decay_steps // 10)
    if a.warmup_steps >= a.lr_decay_steps:
        p.error(f"--warmup-steps {a.warmup_steps} must be smaller than --lr-decay-steps {a.lr_decay_steps}")
    if a.init == "meta" and (a.init_from or a.save_init or a.check_grads):
        p.error("--init meta cannot be combined with --init-from / --save-init / --check-grads (they need the whole model)")
    if a.tp < 1:
        p.error(f"--tp must be >= 1, got {a.tp}")
    if a.mode != "fsdp2-tp" and (a.tp != 1 or a.check_grads):
        p.error("--tp and --check-grads are for --mode fsdp2-tp")
    if a.mode == "fsdp2-tp" and a.save_dcp:
        p.error("--save-dcp is not supported with --mode fsdp2-tp")
    if a.n_head % a.tp:
        p.error(f"--tp {a.tp} must divide --n-head {a.n_head} (each rank computes whole heads)")
    if a.tp > 1 and a.sequence_parallel and a.seq_len % a.tp:
        p.error(f"--seq-len {a.seq_len} must be a multiple of --tp {a.tp} under sequence parallelism")
    return a


def lr_at(a, count):
    """src/tessera/trainer/lr_scheduler.cpp WarmupCosineLR::lr_at."""
    if count < a.warmup_steps:
        return a.lr * (count + 1) / a.warmup_steps
    p = min(1.0, (count - a.warmup_steps) / (a.lr_decay_steps - a.warmup_steps))
    return a.lr * (a.min_lr_ratio + (1.0 - a.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


def env_int(name):
    v = os.environ.get(name)
    if v is None:
        sys.exit(f"gpt_peer: {name} is not set: start one process per rank with the torch.distributed "
                 "environment (e.g. tessera run -n N -- python gpt_peer.py ...)")
    return int(v)


def load_init(model, path):
    """Loads --init-from into the whole (unsharded) model, strictly by name."""
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        sys.exit(f"gpt_peer: --init-from: '{path}' does not exist")
    raw = load_file(path)
    prefixed = any(k.startswith("model.") for k in raw)
    sd = {k[len("model."):]: v for k, v in raw.items() if k.startswith("model.")} if prefixed else raw
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    extra = [k for k in sd if k not in own]
    bad = [f"{k} is {list(sd[k].shape)}, not {list(own[k].shape)}" for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or extra or bad:
        what = [f"missing {k}" for k in missing[:4]] + [f"unexpected {k}" for k in extra[:4]] + bad[:4]
        sys.exit(f"gpt_peer: --init-from '{path}' does not hold this model's weights: " + "; ".join(what))
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=True)


def save_init(model, path):
    from safetensors.torch import save_file
    tmp = path + ".tmp"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, path)


def init_shards(model, seed, rank):
    """--init meta: GPT-2 initialisation of each rank's local shards (same distributions as
    model.h; the values come from seed + rank, not from one whole-model stream)."""
    from torch.distributed.tensor import DTensor
    g = torch.Generator().manual_seed(seed + rank)
    resid_std = 0.02 / math.sqrt(2.0 * model.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            gpt2_init_(name, t, resid_std, g)


def setup_tp(a, model, world, rank):
    """--mode fsdp2-tp: the mesh (dp, tp), TpGpt with the plain model's weights (or on the
    meta device), parallelize_module over "tp" (skipped at --tp 1), fully_shard on each block
    and the root over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from gpt_tp import TpGpt, init_local_shards, plain_to_tp_state_dict, tp_plan
    mesh = init_device_mesh("cpu", (world // a.tp, a.tp), mesh_dim_names=("dp", "tp"))
    if a.tp > 1 and world > a.tp:
        # The flattened dimension lets DTensor reduce over both dimensions in one collective
        # (the clipping norm: one all-reduce instead of one per dimension), as torchtitan does.
        mesh[("dp", "tp")]._flatten("dp_tp")
    with torch.device("meta"):
        tpm = TpGpt(a.n_layer, a.n_head, a.d_model, a.seq_len, qkv=a.qkv)
    meta = a.init == "meta"
    if not meta:
        tpm.load_state_dict(plain_to_tp_state_dict(model.state_dict(), a.qkv, a.tp), strict=True, assign=True)
    if a.tp > 1:
        parallelize_module(tpm, mesh["tp"], tp_plan(tpm, a.sequence_parallel, a.loss_parallel))
    for b in tpm.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(tpm, mesh=mesh["dp"])
    if meta:
        tpm.to_empty(device="cpu")
        init_local_shards(tpm, a.seed if a.init_seed is None else a.init_seed, mesh)
    return tpm


def tp_step(a, net, x, y, step, reference, inputs, targets, dp_size):
    """One fsdp2-tp forward, backward and clipping; returns the local loss (a plain tensor)."""
    import contextlib
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    # loss_parallel: the cross-entropy of logits sharded over the vocabulary; its backward
    # must run inside the context too.
    ctx = loss_parallel() if a.tp > 1 and a.loss_parallel else contextlib.nullcontext()
    with ctx:
        loss = lm_loss(net(x), y)
        loss.backward()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if step == 0 and reference is not None:
        check_grads(a, net, reference, inputs, targets, dp_size, loss)
    if a.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(net.parameters(), a.grad_clip)
    return loss


def check_grads(a, net, reference, inputs, targets, dp_size, loss):
    """--check-grads: the first step's gradients, gathered whole, against one process's on
    the same global batch (every data-parallel rank's first batch) from the same weights.
    A gradient summed instead of averaged over "dp" (pytorch#162338 on Gloo) would be off by
    a factor dp; a sequence-parallel gradient not summed over "tp" by a factor near tp."""
    from torch.distributed.tensor import DTensor
    from gpt_tp import tp_to_plain_state_dict
    xs, ys = [], []
    for r in range(dp_size):
        idx = next(rank_batches(len(inputs), dp_size, r, a.batch_size // dp_size, a.seed))
        xs.append(torch.from_numpy(inputs[idx]))
        ys.append(torch.from_numpy(targets[idx]))
    ref_loss = lm_loss(reference(torch.cat(xs)), torch.cat(ys))
    ref_loss.backward()
    ref = {n: p.grad for n, p in reference.named_parameters()}
    mine = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in net.named_parameters()}
    mine = tp_to_plain_state_dict(mine, a.qkv, a.tp)
    assert set(mine) == set(ref), sorted(set(mine) ^ set(ref))
    worst, where = 0.0, ""
    for n, g in ref.items():
        rel = ((mine[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
        if rel > worst:
            worst, where = rel, n
    norm_mine = math.sqrt(sum(float(g.double().pow(2).sum()) for g in mine.values()))
    norm_ref = math.sqrt(sum(float(g.double().pow(2).sum()) for g in ref.values()))
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    if dist.get_rank() == 0:
        print(json.dumps({"check_grads": {"max_rel_diff": worst, "tensor": where, "grad_norm": norm_mine,
                                          "reference_grad_norm": norm_ref, "loss": mean_loss.item(),
                                          "reference_loss": ref_loss.item()}}), flush=True)


def main(argv):
    a = parse_args(argv)
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % a.tp:
        sys.exit(f"gpt_peer: --tp {a.tp} must divide the {world} ranks")
    dp_size, dp_rank = world // a.tp, rank // a.tp  # the mesh (dp, tp), tp innermost (as gpt's)
    if a.batch_size % dp_size:
        sys.exit(f"gpt_peer: --batch-size {a.batch_size} (the global batch) must be a multiple of the {dp_size} "
                 "data-parallel ranks")
    torch.set_num_threads(a.threads)
    mode = a.mode
    fabric = None
    lightning_version = None
    if mode.startswith("fabric"):
        import lightning
        from lightning.fabric import Fabric
        lightning_version = lightning.__version__
        if mode == "fabric-ddp":
            strategy = "ddp"
        elif mode == "fabric-fsdp":
            from lightning.fabric.strategies import FSDPStrategy
            strategy = FSDPStrategy(auto_wrap_policy={Block}, use_orig_params=True)
        else:
            from lightning.fabric.strategies import ModelParallelStrategy

            def parallelize(model, mesh):
                from torch.distributed.fsdp import fully_shard
                dp = mesh["data_parallel"]
                for b in model.blocks:
                    fully_shard(b, mesh=dp)
                fully_shard(model, mesh=dp)
                return model
            strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=world,
                                             tensor_parallel_size=1)
        # The launcher's processes: devices = ranks per node; Lightning sees LOCAL_RANK in the
        # environment and starts no processes of its own (checked below).
        fabric = Fabric(accelerator="cpu", devices=local_world, num_nodes=world // local_world, strategy=strategy)
        env = fabric._connector.cluster_environment
        if not env.creates_processes_externally:
            sys.exit(f"gpt_peer: Lightning would start its own processes ({type(env).__name__})")
        fabric.launch()
        if fabric.global_rank != rank or fabric.world_size != world:
            sys.exit(f"gpt_peer: Fabric sees rank {fabric.global_rank} of {fabric.world_size}, "
                     f"the launcher {rank} of {world}")
    else:
        dist.init_process_group("gloo")
    assert dist.get_rank() == rank and dist.get_world_size() == world

    files = a.data or default_data_files()
    inputs, targets = train_windows(files, a.seq_len, a.val_fraction)
    # The ranks of one tensor-parallel group see the same batch (gpt: the sampler over the
    # data-parallel ranks); without --tp dp_size is the world and dp_rank the rank.
    local_batch = a.batch_size // dp_size
    batches = rank_batches(len(inputs), dp_size, dp_rank, local_batch, a.seed)

    init_seed = a.seed if a.init_seed is None else a.init_seed
    torch.manual_seed(init_seed)  # gpt: at::manual_seed(seed) before building the model
    meta = a.init == "meta" and mode in ("fsdp2", "fabric-mp", "fsdp2-tp")
    if meta:
        with torch.device("meta"):
            model = Gpt(a.n_layer, a.n_head, a.d_model, a.seq_len)
    else:
        model = Gpt(a.n_layer, a.n_head, a.d_model, a.seq_len)
        if a.init_from:
            load_init(model, a.init_from)
        if a.save_init and rank == 0:
            save_init(model, a.save_init)
    params = count_parameters(a.n_layer, a.d_model, a.seq_len)
    if not meta:
        assert params == sum(p.numel() for p in model.parameters())

    def make_opt(ps):
        fused = {"fused": True} if a.adamw == "fused" else {}
        return torch.optim.AdamW(ps, lr=lr_at(a, 0), betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay,
                                 **fused)

    reference = None  # --check-grads: the whole model, for one process's gradients
    if mode == "fsdp2-tp":
        if a.check_grads:
            import copy
            reference = copy.deepcopy(model)
        net = model = setup_tp(a, model, world, rank)
        opt = make_opt(model.parameters())
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if meta:
            model.to_empty(device="cpu")
            init_shards(model, init_seed, rank)
        net, opt = model, make_opt(model.parameters())
    elif mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        net = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
        opt = make_opt(net.parameters())
    elif mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = make_opt(net.parameters())
    else:
        if mode == "fabric-ddp":
            net, opt = fabric.setup(model, make_opt(model.parameters()))
        else:
            # Sharding replaces the parameters: the optimizer is made after setup_module.
            net = fabric.setup_module(model)
            if meta:
                init_shards(model, init_seed, rank)  # Lightning materialised the meta model on the CPU
            opt = fabric.setup_optimizers(make_opt(model.parameters()))

    if a.save_dcp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=a.save_dcp)

    losses = []
    t_first = None
    dist.barrier()
    for step in range(a.steps):
        lr = lr_at(a, step)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = next(batches)
        x = torch.from_numpy(inputs[idx])
        y = torch.from_numpy(targets[idx])
        if mode == "fsdp2-tp":
            loss = tp_step(a, net, x, y, step, reference, inputs, targets, dp_size)
        elif fabric is not None:
            loss = lm_loss(net(x), y)
            fabric.backward(loss)
            if a.grad_clip > 0:
                fabric.clip_gradients(net, opt, max_norm=a.grad_clip)
        else:
            loss = lm_loss(net(x), y)
            loss.backward()
            if a.grad_clip > 0:
                if mode == "fsdp1":
                    net.clip_grad_norm_(a.grad_clip)
                else:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), a.grad_clip)
        opt.step()
        opt.zero_grad()
        # gpt all-reduces each step's loss for its log: the same here.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        losses.append(mean_loss.item())
        if step + 1 == a.timing_skip:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    timed = a.steps - a.timing_skip
    tokens_per_s = timed * a.batch_size * a.seq_len / (t_end - t_first) if timed > 0 and t_first else 0.0

    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        if a.losses_out:
            with open(a.losses_out + ".tmp", "w") as f:
                f.write("".join(f"{v!r}\n" for v in losses))
            os.replace(a.losses_out + ".tmp", a.losses_out)
        out = {"impl": IMPL[mode], "world": world, "params": params, "tokens_per_s": round(tokens_per_s, 1),
               "peak_rss_mib": round(rss.item(), 1), "torch": torch.__version__, "lightning": lightning_version,
               "steps": a.steps, "timed_steps": max(timed, 0), "threads": torch.get_num_threads(),
               "init": "meta" if meta else ("file" if a.init_from else "full"),
               "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}
        if mode == "fsdp2-tp":
            out.update({"dp": dp_size, "tp": a.tp, "sequence_parallel": a.tp > 1 and a.sequence_parallel,
                        "loss_parallel": a.tp > 1 and a.loss_parallel, "qkv": a.qkv})
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
