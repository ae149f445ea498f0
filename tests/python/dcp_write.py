"""PyTorch Distributed Checkpoint (torch 2.x) files for test_dcp_import.cpp.

  write OUTDIR       (2 ranks: tessera run -n 2 -- python dcp_write.py write OUTDIR)
      OUTDIR/dcp/                  dcp.save of DTensors sharded on dim 0 (uneven, one with an
                                   empty shard) and dim 1, replicated DTensors, plain tensors,
                                   f32/f64/f16/bf16/i64/i32/u8/bool, NaN/inf/-0/denormals,
                                   plain values, and a small model's AdamW state
      OUTDIR/dcp_object/           a small one holding a datetime.date value
      OUTDIR/dcp_threads/          some of the tensors, saved with FileSystemWriter(thread_count=2)
      OUTDIR/expected.pt           rank 0: {flattened key: full tensor}
      OUTDIR/expected_values.json  rank 0: {flattened key: [kind, value]} of the plain values
  evil SRC DST MARKER
      copies the DCP directory SRC to DST with a .metadata whose pickle calls os.system
      (it would create MARKER if anything ran it)
  check-threads OUTDIR EXPORT.pt
      the same for an export of the import of dcp_threads (tensors only)
  check OUTDIR EXPORT.pt CONSOLIDATED.safetensors
      compares a `tessera ckpt export --format torch` of the import (torch.load) and its
      `tessera ckpt consolidate` (safetensors' own reader, plain values from its header)
      with the expectations, bit for bit
"""
import datetime
import json
import os
import pickle
import shutil
import struct
import sys

import torch


THREADED = ("sharded.f32", "sharded.bf16", "sharded.i64", "sharded.cols", "repl.f32", "plain.tensor")


def plain_items(key, v, out):
    """Tessera's flattening of a non-tensor value (dcp_import.h)."""
    if v is None:
        return
    if isinstance(v, bool):
        out[key] = ["bool", v]
    elif isinstance(v, int):
        out[key] = ["int", v]
    elif isinstance(v, float):
        out[key] = ["float", v.hex()]
    elif isinstance(v, str):
        out[key] = ["string", v]
    elif isinstance(v, bytes):
        out[key] = ["bytes", v.hex()]
    elif isinstance(v, (list, tuple)):
        if not v:
            out[key] = ["dict", None]
        for i, x in enumerate(v):
            plain_items(f"{key}.{i}", x, out)
    elif isinstance(v, dict):
        if not v:
            out[key] = ["dict", None]
        for k, x in v.items():
            plain_items(f"{key}.{k}", x, out)
    else:
        raise TypeError(f"{key}: {type(v)}")


def write(outdir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same values on every rank
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38])
    full = {
        "sharded.f32": torch.randn(5, 3),  # dim 0 over 2 ranks: 3 + 2 rows
        "sharded.bf16": torch.randn(7, 4).to(torch.bfloat16),
        "sharded.i64": (torch.arange(22) - 9).reshape(11, 2) * 3_000_000_007,
        "sharded.one_row": torch.randn(1, 6),  # rank 1's shard is empty
        "sharded.cols": torch.randn(4, 5),  # dim 1: 3 + 2 columns
        "sharded.special": special.clone(),
        "repl.f32": torch.randn(4, 4),
        "repl.f64": torch.randn(3, dtype=torch.float64),
        "repl.f16": torch.randn(2, 3).half(),
        "repl.u8": torch.randint(0, 256, (6,), dtype=torch.uint8),
        "repl.bool": torch.rand(5) > 0.5,
        "repl.i32": torch.randint(-1000, 1000, (3, 2), dtype=torch.int32),
        "plain.scalar": torch.tensor(2.5),
        "plain.tensor": torch.randn(3, 2),  # a plain tensor: replicated for DCP (written once)
    }
    sd = {}
    for k, t in full.items():
        if k == "sharded.cols":
            sd[k] = distribute_tensor(t, mesh, [Shard(1)])
        elif k.startswith("sharded."):
            sd[k] = distribute_tensor(t, mesh, [Shard(0)])
        elif k.startswith("repl."):
            sd[k] = distribute_tensor(t, mesh, [Replicate()])
        else:
            sd[k] = t
    sd.update({"step": 7, "neg": -5, "big": 2**40, "lr": 1e-3, "third": 1.0 / 3.0, "name": "gpt-run",
               "flag": True, "blob": b"\x00\xff\x80ab", "items": [1, "x", 2.5, None], "nested": {"a": 1, "b": "two"}})
    # A small model's AdamW state after one step (tensors and param_groups' plain values).
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.GELU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    sd["model"] = msd
    sd["optim"] = osd
    dcp.save(sd, checkpoint_id=os.path.join(outdir, "dcp"))
    # The same with a value that is no plain Python data (a datetime.date object).
    dcp.save({"w": sd["plain.tensor"], "step": 7, "when": datetime.date(2026, 12, 2)},
             checkpoint_id=os.path.join(outdir, "dcp_object"))
    # Some of the same tensors written by 2 threads per rank (__<rank>_0 and __<rank>_1.distcp).
    dcp.save({k: sd[k] for k in THREADED}, storage_writer=dcp.FileSystemWriter(os.path.join(outdir, "dcp_threads"),
                                                                                thread_count=2))

    flat, _ = flatten_state_dict(sd)
    tensors, values = {}, {}
    for k, v in flat.items():
        if isinstance(v, DTensor):
            tensors[k] = v.full_tensor()
        elif isinstance(v, torch.Tensor):
            tensors[k] = v.clone()
        else:
            plain_items(k, v, values)
    if rank == 0:
        torch.save(tensors, os.path.join(outdir, "expected.pt"))
        with open(os.path.join(outdir, "expected_values.json"), "w") as f:
            json.dump(values, f, indent=1)
        print(f"dcp_write: {len(tensors)} tensors, {len(values)} plain values")
    dist.barrier()
    dist.destroy_process_group()


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def evil(src, dst, marker):
    shutil.copytree(src, dst)
    with open(os.path.join(dst, ".metadata"), "wb") as f:
        pickle.dump({"state_dict_metadata": Evil(marker)}, f)


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def check(outdir, export_pt, consolidated):
    from safetensors import safe_open

    want = torch.load(os.path.join(outdir, "expected.pt"))
    with open(os.path.join(outdir, "expected_values.json")) as f:
        want_values = json.load(f)
    got = torch.load(export_pt, weights_only=True)
    assert sorted(got) == sorted(want), f"export keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        assert same_bits(got[k], w), f"{export_pt} {k}: {got[k].dtype} {list(got[k].shape)} differs from what " \
                                     f"Python saved: {w.dtype} {list(w.shape)}\n{got[k]}\n{w}"
    with safe_open(consolidated, framework="pt") as f:
        meta = f.metadata()
        names = [n for n in f.keys()]
        assert sorted(names) == sorted(want), f"consolidated keys {sorted(names)}"
        for k in names:
            assert same_bits(f.get_tensor(k), want[k]), f"{consolidated} {k} differs"
    values = json.loads(meta["tessera.values"])
    got_values = {}
    for k, v in values.items():
        kind = v["kind"]
        if kind == "float":
            x = struct.unpack(">d", bytes.fromhex(v["bits"]))[0]  # the bits are authoritative
            got_values[k] = ["float", x.hex()]
        elif kind == "bytes":
            got_values[k] = ["bytes", v["hex"]]
        elif kind == "dict":
            got_values[k] = ["dict", None]
        else:
            got_values[k] = [kind, v["value"]]
    assert got_values == want_values, f"plain values:\n{json.dumps(got_values, indent=1)}\n" \
                                      f"want:\n{json.dumps(want_values, indent=1)}"
    print(f"dcp check: {len(want)} tensors and {len(want_values)} plain values bit-exact")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "write":
        write(sys.argv[2])
    elif cmd == "evil":
        evil(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "check-threads":
        want = torch.load(os.path.join(sys.argv[2], "expected.pt"))
        got = torch.load(sys.argv[3], weights_only=True)
        assert sorted(got) == sorted(THREADED), f"keys {sorted(got)}"
        for k in THREADED:
            assert same_bits(got[k], want[k]), f"{k} differs"
        print(f"dcp check: {len(got)} tensors bit-exact")
    elif cmd == "check":
        check(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown command {cmd}")
