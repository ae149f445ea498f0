"""PyTorch Distributed Checkpoint (DCP) peer of bench/checkpoint/checkpoint_bench.cpp's
gpt-* modes: the same tensors (the model + AdamW state of a GPT-like model of about MIB
MiB, every tensor a DTensor on a CPU DeviceMesh, Shard(0), uneven where the rows are
odd; each step's count a plain replicated scalar tensor), saved and loaded with DCP.
One rank program, run under Tessera's launcher (gloo process group):

  tessera run -n 2 -- python dcp_bench.py save DIR MIB [THREADS]   dcp.save -> {"save_s"}
  tessera run -n 2 -- python dcp_bench.py load DIR MIB              dcp.load -> {"load_s"}
  tessera run -n 2 -- python dcp_bench.py async DIR MIB             two dcp.async_save
  python dcp_bench.py consolidate DCP_DIR OUT.pt                    dcp_to_torch_save + fsync

save: FileSystemWriter defaults (THREADS absent: dcp.save(checkpoint_id=DIR)) or
FileSystemWriter(DIR, thread_count=THREADS). async: dcp.async_save(checkpoint_id=DIR.1),
then DIR.2 once the first is committed; blocking = until async_save returns, total =
until its future's result() returns, each the maximum over the ranks. Each mode first
saves a one-tensor state to DIR.warmup (as checkpoint_bench does). Rank 0 prints one
JSON line. consolidate prints {"convert_s" (the conversion as format_utils' CLI runs it:
"read_s" into memory, then "torch_save_s"), "fsync_s" (of the output, which torch.save
does not do)}.
"""
import json
import math
import os
import shutil
import sys
import time

import torch


def gpt_layout(mib):
    """(fqn, shape) of the parameters; the same arithmetic as checkpoint_bench.cpp."""
    d = 64 * max(2, int(math.floor(16 * math.sqrt(mib / 1024) + 0.5)))  # llround
    layers, positions = 4, d
    budget = mib * (1 << 20) // 12
    vocab = (budget - positions * d - layers * (12 * d * d + 13 * d) - 2 * d) // (2 * d)
    if vocab % 2 == 0:
        vocab -= 1
    if vocab < 1:
        raise SystemExit("MIB too small for the GPT layout")
    out = [("tok_emb.weight", (vocab, d)), ("pos_emb.weight", (positions, d))]
    for l in range(layers):
        for name, shape in [("ln1.weight", (d,)), ("ln1.bias", (d,)), ("attn.qkv.weight", (3 * d, d)),
                            ("attn.qkv.bias", (3 * d,)), ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
                            ("ln2.weight", (d,)), ("ln2.bias", (d,)), ("mlp.fc.weight", (4 * d, d)),
                            ("mlp.fc.bias", (4 * d,)), ("mlp.proj.weight", (d, 4 * d)), ("mlp.proj.bias", (d,))]:
            out.append((f"blocks.{l}.{name}", shape))
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("head.weight", (vocab, d))]
    return out


def make_state(mesh, mib, zeros):
    """{"model": {fqn: DTensor}, "optim": {"state": {fqn: {exp_avg, exp_avg_sq, step}}}}
    with each local piece holding index + 1 + rank / 2 (as checkpoint_bench.cpp)."""
    from torch.distributed.tensor import DTensor, Shard
    rank, world = mesh.get_rank(), mesh.size()
    expect, nbytes, index = [], 0, 0

    def sharded(shape):
        nonlocal index, nbytes
        value = index + 1 + 0.5 * rank
        index += 1
        split = -(-shape[0] // world)  # torch.chunk: ceil(N / W) rows per rank
        rows = max(0, min(shape[0], (rank + 1) * split) - rank * split)
        local = torch.zeros((rows,) + shape[1:]) if zeros else torch.full((rows,) + shape[1:], value)
        t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                               stride=torch.empty(shape, device="meta").stride())
        expect.append((t, value))
        nbytes += 4 * math.prod(shape)
        return t

    layout = gpt_layout(mib)
    model = {fqn: sharded(shape) for fqn, shape in layout}
    state = {}
    for fqn, shape in layout:
        state[fqn] = {"exp_avg": sharded(shape), "exp_avg_sq": sharded(shape),
                      "step": torch.zeros(()) if zeros else torch.full((), 100.0)}
        nbytes += 4
    return {"model": model, "optim": {"state": state}}, expect, nbytes


def check(sd, expect):
    for t, value in expect:
        loc = t.to_local()
        if loc.numel() and (loc.min().item() != value or loc.max().item() != value):
            raise SystemExit("wrong values after load")
    for s in sd["optim"]["state"].values():
        if s["step"].item() != 100.0:
            raise SystemExit("wrong step after load")


def consolidate(src, out):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    # dcp_to_torch_save reads the whole checkpoint into memory, then calls torch.save;
    # a timing wrapper around torch.save splits the two (measurement only).
    save, spent = torch.save, []
    def timed_save(*a, **k):
        t = time.perf_counter()
        save(*a, **k)
        spent.append(time.perf_counter() - t)
    torch.save = timed_save
    t0 = time.perf_counter()
    dcp_to_torch_save(src, out)
    t1 = time.perf_counter()
    torch.save = save
    fd = os.open(out, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    t2 = time.perf_counter()
    print(json.dumps({"convert_s": round(t1 - t0, 4), "read_s": round(t1 - t0 - sum(spent), 4),
                      "torch_save_s": round(sum(spent), 4), "fsync_s": round(t2 - t1, 4)}))


def main():
    mode = sys.argv[1]
    if mode == "consolidate":
        return consolidate(sys.argv[2], sys.argv[3])
    path, mib = sys.argv[2], int(sys.argv[3])
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    # Warm-up: a small save of one DTensor, removed again by rank 0.
    w = DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False, shape=torch.Size([2 * world]),
                           stride=(1,))
    dcp.save({"warmup": w}, checkpoint_id=path + ".warmup")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path + ".warmup")

    sd, expect, nbytes = make_state(mesh, mib, zeros=(mode == "load"))
    tensors = len(sd["model"]) + 3 * len(sd["optim"]["state"])
    res = {"mode": mode, "ranks": world, "bytes": nbytes, "tensors": tensors, "torch": torch.__version__}

    def max_over_ranks(x):
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return round(t.item(), 4)

    if mode == "save":
        writer = dcp.FileSystemWriter(path, thread_count=threads) if threads else None
        res["thread_count"] = threads or "default (1)"
        dist.barrier()
        t0 = time.perf_counter()
        if writer is None:
            dcp.save(sd, checkpoint_id=path)
        else:
            dcp.save(sd, storage_writer=writer)
        dist.barrier()
        res["save_s"] = round(time.perf_counter() - t0, 4)
    elif mode == "load":
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=path)
        dist.barrier()
        res["load_s"] = round(time.perf_counter() - t0, 4)
        check(sd, expect)
    elif mode == "async":
        blocking, total = [], []
        for i in (1, 2):
            dist.barrier()
            t0 = time.perf_counter()
            f = dcp.async_save(sd, checkpoint_id=f"{path}.{i}")
            t1 = time.perf_counter()
            f.result()
            t2 = time.perf_counter()
            blocking.append(max_over_ranks(t1 - t0))
            total.append(max_over_ranks(t2 - t0))
        res.update(first_blocking_s=blocking[0], first_total_s=total[0], blocking_s=blocking[1], total_s=total[1])
    else:
        raise SystemExit(f"unknown mode {mode}")
    if rank == 0:
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
