"""tessera_ckpt.dcp against the real torch.distributed.checkpoint (torch 2.x, Gloo on the CPU).

    python tests/python/dcp_backend_check.py [--tessera build/bin/tessera] [--keep DIR]

(a) An FSDP2 model (fully_shard on a CPU DeviceMesh) after one AdamW step, plus DTensors of
    every safetensors dtype sharded on dim 0, dim 1 or replicated, a plain tensor, a 12 MiB
    tensor of three checksum blocks, a ShardedTensor of irregular boxes (a `list` layout, two
    pieces in one data file: FQN@k) and plain values (NaN, -0.0, int64 max, bytes, a tuple,
    None, an io.BytesIO), is saved with dcp.save(storage_writer=Writer) at N = 1, 2, 3 ranks and loaded with
    dcp.load(storage_reader=Reader) at M = 1, 2, 3 ranks into DTensors of other placements;
    model, optimizer state (through set_state_dict) and values must be bit-exact. A rank
    loading some rows of the 12 MiB tensor must read less than the whole of it.
(b) The Tessera version-1 fixture tests/checkpoint/fixtures/v1/fsdp3.ckpt and its consolidated
    copy, loaded through Reader into plain tensors (no process group) and into DTensors at
    M ranks, equal tessera_ckpt.load bit for bit, plain values included.
(c) Every Writer checkpoint passes tessera_ckpt.verify() and `tessera ckpt verify` (when the
    binary exists), and tessera_ckpt.load gives the saved tensors; the layouts are the rules
    expected (`chunk` for FSDP's dim-0 shards, `chunk` dim 1, `whole`, `list`);
    _load_state_dict_from_keys of some keys gives them nested as they were saved.
(d) DCP's storage contract through its own entry points (format_utils.dcp_to_torch_save,
    _load_state_dict_from_keys, dcp.save / dcp.load with checkpoint_id), one process, against
    DCP's own FileSystemWriter / FileSystemReader on the same nested state: the nesting
    survives the round trip, partial loads by key give what DCP's backend gives, checkpoints
    without the Writer's mapping come back flat (tessera_ckpt.load's keys), a malformed
    stored mapping is refused, and overwrite=False refuses an existing checkpoint where DCP's
    does (run first: it takes seconds).
Refusals: a value Tessera cannot hold and an unsupported dtype (naming the key, nothing left
at the path or beside it), a non-empty directory that is no checkpoint (untouched), a flipped
data byte (checksum mismatch naming the key); an existing checkpoint is replaced atomically.

Ranks are separate processes (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, a free port).
Prints "ok dcp_backend_check: ..." at the end.
"""
import datetime
import io
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)  # rank_processes, the launcher shared with the other multi-rank checks
from rank_processes import run_ranks  # noqa: E402
FIXTURE = os.path.join(ROOT, "tests", "checkpoint", "fixtures", "v1", "fsdp3.ckpt")
FIXTURE_CONSOLIDATED = os.path.join(ROOT, "tests", "checkpoint", "fixtures", "v1", "fsdp3-consolidated.safetensors")
BIG_ROWS, BIG_COLS = 3072, 1024  # 12 MiB of float32: three 4 MiB checksum blocks
WORLDS = (1, 2, 3)

warnings.filterwarnings("ignore")


def fail(msg):
    raise AssertionError(msg)


# ---------------------------------------------------------------- comparisons


def same_bits(a, b, what):
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        fail(f"{what}: expected two tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dtype != b.dtype or list(a.shape) != list(b.shape):
        fail(f"{what}: {a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)}")
    x = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    y = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(x, y):
        fail(f"{what}: tensors differ")


def same_value(a, b, what, ordered=True):
    """Plain values, bit for bit (floats by their bits, so NaN and -0.0 count); containers
    must keep their type (a tuple stays a tuple); dicts their key order unless ``ordered``
    is False."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return same_bits(a, b, what)
    if type(a) is not type(b):
        fail(f"{what}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})")
    if isinstance(a, io.BytesIO):
        a, b = a.getvalue(), b.getvalue()
    if isinstance(a, float):
        if struct.pack(">d", a) != struct.pack(">d", b):
            fail(f"{what}: {a!r} != {b!r}")
    elif isinstance(a, dict):
        if (list(a) != list(b)) if ordered else (sorted(a) != sorted(b)):
            fail(f"{what}: keys {list(a)} != {list(b)}")
        for k in a:
            same_value(a[k], b[k], f"{what}.{k}", ordered)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            fail(f"{what}: {len(a)} items != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            same_value(x, y, f"{what}.{i}", ordered)
    elif a != b:
        fail(f"{what}: {a!r} != {b!r}")


def flatten(obj, prefix="", out=None):
    """Tessera's flattening of a nested state: dicts and lists/tuples joined with '.', None left out."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        if not obj and prefix:
            out[prefix[:-1]] = {}
        for k, v in obj.items():
            flatten(v, f"{prefix}{k}.", out)
    elif isinstance(obj, (list, tuple)):
        if not obj and prefix:
            out[prefix[:-1]] = {}
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}{i}.", out)
    elif isinstance(obj, io.BytesIO):
        out[prefix[:-1]] = obj.getvalue()  # a Tessera bytes value
    elif obj is not None:
        out[prefix[:-1]] = obj
    return out


# ---------------------------------------------------------------- the state every rank builds


def build_model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 5), torch.nn.GELU(), torch.nn.Linear(5, 2))


def fsdp_model(world, seed):
    """The model sharded by FSDP2 over a CPU mesh of every rank, after one AdamW step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(seed)
    for m in (model[1], model[3]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95))
    torch.manual_seed(seed + 1)
    x = torch.randint(0, 7, (3, 2))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return mesh, model, opt


def extra_full():
    """Whole tensors of the extra entries (the same on every rank and in the checking process)."""
    import torch

    g = torch.Generator().manual_seed(5)
    f32 = torch.randn(5, 3, generator=g)
    f32[0, 0], f32[0, 1], f32[0, 2] = float("nan"), float("-inf"), -0.0
    return {
        "bf16_rows": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "f16_cols": torch.randn(3, 5, generator=g).to(torch.float16),
        "f64_rep": torch.randn(4, generator=g, dtype=torch.float64),
        "f32_special": f32,
        "i64_cols": torch.tensor([[-(2**63), 2**63 - 1, 0, 1, -1]] * 3, dtype=torch.int64),
        "i32": torch.arange(-6, 6, dtype=torch.int32).reshape(4, 3),
        "i16": torch.arange(-4, 4, dtype=torch.int16),
        "i8": torch.arange(-3, 3, dtype=torch.int8).reshape(2, 3),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "big": torch.arange(BIG_ROWS * BIG_COLS, dtype=torch.float32).reshape(BIG_ROWS, BIG_COLS),
        "plain": torch.arange(6, dtype=torch.int32).reshape(2, 3) * 7,
        "scalar": torch.tensor(3.25),
        "st": torch.arange(24, dtype=torch.float32).reshape(4, 6) - 10,
    }


# Saving placements (DTensor over the 1-D mesh) and, for loading, other ones.
SAVE_PLACE = {"bf16_rows": "S0", "f16_cols": "S1", "f64_rep": "R", "f32_special": "S0", "i64_cols": "S1", "i32": "S0",
              "i16": "S0", "i8": "S1", "u8": "S0", "bool": "R", "empty": "S0", "big": "S0"}
LOAD_PLACE = {"bf16_rows": "S1", "f16_cols": "S0", "f64_rep": "S0", "f32_special": "R", "i64_cols": "S0", "i32": "S1",
              "i16": "R", "i8": "S0", "u8": "S0", "bool": "S0", "empty": "S1", "big": "S0", "plain": "S0",
              "scalar": "R", "st": "S1"}


def st_boxes(world):
    """Irregular boxes of the 4x6 ShardedTensor (file/rank, offsets, sizes): never a rule."""
    if world == 1:
        return [(0, [0, 0], [1, 6]), (0, [1, 0], [3, 6])]
    if world == 2:
        return [(0, [0, 0], [1, 6]), (1, [1, 0], [2, 6]), (0, [3, 0], [1, 6])]
    return [(0, [0, 0], [1, 6]), (1, [1, 0], [3, 2]), (2, [1, 2], [3, 4])]


def placement(code):
    from torch.distributed.tensor import Replicate, Shard

    return {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}[code]


def local_part(full, code, rank, world):
    """This rank's part of ``full`` under placement ``code``: DTensor's torch.chunk rule
    (ranks past the last chunk hold an empty one)."""
    if code == "R":
        return full.clone()
    d = int(code[1])
    parts = list(full.chunk(world, dim=d)) if full.shape[d] else []
    if rank < len(parts):
        return parts[rank].contiguous()
    shape = list(full.shape)
    shape[d] = 0
    return full.new_empty(shape)


def dtensor(full, mesh, code):
    """A DTensor of ``full`` over the 1-D ``mesh`` built without communication
    (distribute_tensor scatters, which Gloo refuses for some dtypes)."""
    from torch.distributed.tensor import DTensor

    import torch.distributed as dist

    local = local_part(full, code, dist.get_rank(), dist.get_world_size())
    return DTensor.from_local(local, mesh, [placement(code)], run_check=False, shape=full.shape, stride=full.stride())


def values():
    return {"step": 3, "name": "dcp \u00e9", "blob": b"\x00\xff\x10", "nan": float("nan"), "negzero": -0.0,
            "inf": float("inf"), "flag": False, "big_int": 2**63 - 1, "pair": (1, "two", 3.5), "nothing": None,
            "nested": [(1, 2), [], {"a": 1.5}], "stream": io.BytesIO(b"\x00dcp\xffstream")}


def dummy_values():
    # the same structure (DCP plans the load from the target's keys), other contents
    return {"step": 0, "name": "", "blob": b"", "nan": 0.0, "negzero": 0.0, "inf": 0.0, "flag": True, "big_int": 0,
            "pair": (), "nothing": 1, "nested": [(0,), [7], {"a": 0.0}], "stream": io.BytesIO()}


# ---------------------------------------------------------------- workers (one process per rank)


def worker_save(out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard, init_from_local_shards
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import tessera_ckpt.dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh, model, opt = fsdp_model(world, seed=0)
    msd, osd = get_state_dict(model, opt)
    full = extra_full()
    extra = {k: dtensor(full[k], mesh, p) for k, p in SAVE_PLACE.items()}
    extra["plain"] = full["plain"]
    extra["scalar"] = full["scalar"]
    st = full["st"]
    shards = [STShard(st[o[0]:o[0] + s[0], o[1]:o[1] + s[1]].clone(), ShardMetadata(o, s, f"rank:{r}/cpu"))
              for r, o, s in st_boxes(world) if r == rank]
    extra["st"] = init_from_local_shards(shards, list(st.shape))
    state = {"model": msd, "optimizer": osd, "extra": extra, "values": values()}
    dcp.save(state, storage_writer=tessera_ckpt.dcp.Writer(out))

    # The reference: whole tensors (collectives: every rank), written by rank 0.
    def whole(v):
        if hasattr(v, "full_tensor"):
            return v.full_tensor()
        if isinstance(v, dict):
            return {k: whole(x) for k, x in v.items()}
        if isinstance(v, list):
            return [whole(x) for x in v]
        return v

    ref = {"model": whole(msd), "optimizer": whole(osd)}
    if rank == 0:
        torch.save(ref, out + ".ref.pt")
    dist.barrier()


def worker_load(v2, dirs):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    import tessera_ckpt
    import tessera_ckpt.dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    full = extra_full()
    checks = 0
    for d in dirs:
        # Another seed and input: every value differs from the saved one until loaded.
        mesh, model, opt = fsdp_model(world, seed=100 + world)
        msd, osd = get_state_dict(model, opt)
        extra = {k: dtensor(torch.zeros_like(full[k]), mesh, p) for k, p in LOAD_PLACE.items()}
        state = {"model": msd, "optimizer": osd, "extra": extra, "values": dummy_values()}
        dcp.load(state, storage_reader=tessera_ckpt.dcp.Reader(d))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(strict=True))
        ref = torch.load(d + ".ref.pt", weights_only=False)
        msd2, osd2 = get_state_dict(model, opt)  # what the model and optimizer now hold

        def whole(v):
            if isinstance(v, DTensor):
                return v.full_tensor()
            if isinstance(v, dict):
                return {k: whole(x) for k, x in v.items()}
            if isinstance(v, list):
                return [whole(x) for x in v]
            return v

        same_value(whole(msd2), ref["model"], f"{d} at {world} rank(s): model")
        same_value(whole(osd2), ref["optimizer"], f"{d} at {world} rank(s): optimizer")
        for k, code in LOAD_PLACE.items():
            same_bits(extra[k].to_local(), local_part(full[k], code, rank, world),
                      f"{d} at {world} rank(s), rank {rank}: extra.{k}")
        same_value(state["values"], values(), f"{d} at {world} rank(s): values")
        checks += 1

        # Byte ranges: the rows of `big` this rank holds, and only about them, are read.
        got = {"n": 0}
        orig = tessera_ckpt._reader.pread_into

        def counting(fd, view, offset, path):
            got["n"] += len(view)
            return orig(fd, view, offset, path)

        big = dtensor(torch.zeros(BIG_ROWS, BIG_COLS), mesh, "S0")
        tessera_ckpt._reader.pread_into = counting
        try:
            dcp.load({"extra": {"big": big}}, storage_reader=tessera_ckpt.dcp.Reader(d))
        finally:
            tessera_ckpt._reader.pread_into = orig
        same_bits(big.to_local(), local_part(full["big"], "S0", rank, world),
                  f"{d} at {world} rank(s), rank {rank}: extra.big alone")
        total = BIG_ROWS * BIG_COLS * 4
        share = big.to_local().numel() * 4
        if world > 1 and not share <= got["n"] < total:
            fail(f"{d} at {world} rank(s), rank {rank}: read {got['n']} bytes of extra.big for a share of {share} "
                 f"(the whole is {total})")

    # (b) at this world size: a version-2 checkpoint of every rule written by the format
    # test's own writer at 8 ranks (flat with replicas, chunk on dim 1, list with two pieces in
    # one file, 40-byte checksum blocks: partial blocks are read and verified).
    want = tessera_ckpt.load(v2)
    sd = {}
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            sd[k] = dtensor(torch.zeros_like(v), mesh, "S0" if v.dim() else "R")
            if v.dim() == 2 and k == "model.list":
                sd[k] = dtensor(torch.zeros_like(v), mesh, "S1")
    dcp.load(sd, storage_reader=tessera_ckpt.dcp.Reader(v2))
    for k, t in sd.items():
        code = "R" if t.dim() == 0 else ("S1" if k == "model.list" else "S0")
        same_bits(t.to_local(), local_part(want[k], code, rank, world), f"{v2} at {world} rank(s), rank {rank}: {k}")
    checks += 1

    # (b) at this world size: the version-1 fixture and its consolidation into DTensors.
    want = tessera_ckpt.load(FIXTURE)
    for path in (FIXTURE, FIXTURE_CONSOLIDATED):
        sd = {"model": {k[len("model."):]: dtensor(torch.zeros_like(v), mesh, "S0")
                        for k, v in want.items() if k.startswith("model.")}}
        dcp.load(sd, storage_reader=tessera_ckpt.dcp.Reader(path))
        for k, v in sd["model"].items():
            same_bits(v.to_local(), local_part(want["model." + k], "S0", rank, world),
                      f"{path} at {world} rank(s), rank {rank}: model.{k}")
        checks += 1
    if rank == 0:
        print(f"  load at {world} rank(s): {checks} checkpoints bit-exact", flush=True)
    dist.barrier()


def worker_main(argv):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if argv[0] == "save":
            worker_save(argv[1])
        else:
            worker_load(argv[1], argv[2:])
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every rank passed the closing barrier: leave without the interpreter's teardown, where
    # torch 2.15's Gloo process group sometimes aborts ("terminate called without an active
    # exception", seen once at 3 ranks in a CI run after every check had passed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- the driver


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world, args, timeout=600):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outs = run_ranks([sys.executable, os.path.abspath(__file__), "--worker"] + args, world, env, timeout,
                     f"{args[0]} at {world} rank(s)", fail, tail=6000)
    sys.stdout.write(outs[0])


def expect_error(fn, *needles):
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        msg = str(e)
        for n in needles:
            if n not in msg:
                fail(f"error without {n!r}: {msg}")
        return msg
    fail(f"no error (expected one mentioning {needles})")


def siblings(path):
    parent, base = os.path.dirname(path), os.path.basename(path)
    return sorted(n for n in os.listdir(parent) if n.startswith("." + base + ".tessera-"))


def check_fixture_plain(v2):
    """(b) without a process group: every key of the fixtures (and of the independent v2
    checkpoint) into plain tensors / values."""
    import torch
    import torch.distributed.checkpoint as dcp

    import tessera_ckpt
    import tessera_ckpt.dcp

    n = 0
    for path in (FIXTURE, FIXTURE_CONSOLIDATED, v2):
        want = tessera_ckpt.load(FIXTURE if path == FIXTURE_CONSOLIDATED else path)
        have = tessera_ckpt.load(path)
        # model.* nested (DCP flattens {"model": {...}} to the same keys), the rest flat
        sd = {"model": {}}
        for k, v in have.items():
            t = torch.full_like(v, 7) if isinstance(v, torch.Tensor) else None
            if k.startswith("model."):
                sd["model"][k[len("model."):]] = t
            else:
                sd[k] = t
        dcp.load(sd, storage_reader=tessera_ckpt.dcp.Reader(path), no_dist=True)
        for k, v in have.items():
            got = sd["model"][k[len("model."):]] if k.startswith("model.") else sd[k]
            same_value(got, want[k], f"{path} {k}")
            n += 1
    return n


def check_written(d, world, tessera):
    """(c) a Writer checkpoint: verify(), tessera_ckpt.load, the layouts, `tessera ckpt verify`."""
    import torch

    import tessera_ckpt

    res = tessera_ckpt.verify(d)
    if not res["checksummed"]:
        fail(f"{d}: not checksummed")
    info = tessera_ckpt.inspect(d)
    if info["version"] != 2 or info["world_size"] != world or len(info["files"]) != world:
        fail(f"{d}: version {info['version']}, world size {info['world_size']}")
    got = tessera_ckpt.load(d)
    ref = torch.load(d + ".ref.pt", weights_only=False)
    want = flatten({"model": ref["model"], "optimizer": ref["optimizer"], "extra": extra_full(), "values": values()})
    if set(got) != set(want):
        fail(f"{d}: keys differ: extra {sorted(set(got) - set(want))}, missing {sorted(set(want) - set(got))}")
    for k in want:
        same_value(got[k], want[k], f"{d} {k}")
    rules = {k: (v.get("layout"), v.get("chunks")) for k, v in info["keys"].items() if "dtype" in v}
    expect = {"model.1.weight": "chunk" if world > 1 else "whole", "extra.f16_cols": "chunk" if world > 1 else "whole",
              "extra.f64_rep": "whole", "extra.plain": "whole", "extra.scalar": "whole", "extra.st": "list",
              "optimizer.state.1.weight.exp_avg": "chunk" if world > 1 else "whole"}
    for k, rule in expect.items():
        if rules[k][0] != rule:
            fail(f"{d}: {k} has layout {rules[k][0]}, expected {rule}")
    if tessera:
        r = subprocess.run([tessera, "ckpt", "verify", d], capture_output=True, text=True)
        if r.returncode != 0 or not r.stdout.startswith("OK"):
            fail(f"`{tessera} ckpt verify {d}` exit {r.returncode}: {r.stdout}{r.stderr}")
    # the nesting every rank's plan contributed (DCP merges the ranks' flatten mappings)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    import tessera_ckpt.dcp

    nested = _load_state_dict_from_keys({"values", "extra.st", "model.1.weight"},
                                        storage_reader=tessera_ckpt.dcp.Reader(d))
    same_value(nested, {"model": {"1.weight": ref["model"]["1.weight"]}, "extra": {"st": extra_full()["st"]},
                        "values": values()}, f"{d} loaded by keys into an empty state dict", ordered=False)
    return len(want)


def check_trainer_state(work):
    """TrainerState's optimizer mapping for every kind Tessera has (torch.optim SGD with
    momentum, Adam with amsgrad, AdamW, Adagrad, RMSprop centered with momentum), one process:
    saved after two steps, loaded into a fresh model and optimizer of other values, the state
    dicts equal bit for bit, the layout the C++ optimizer reads (optimizer_0.optimizer, integer
    steps, beta1/beta2); an optimizer without a Tessera counterpart, or maximize=True, refused."""
    import torch
    import torch.distributed.checkpoint as dcp  # noqa: F401 (TrainerState.save/load)

    import tessera_ckpt
    import tessera_ckpt.dcp

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))

    kinds = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9), amsgrad=True),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.5),
        "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    }
    n = 0
    x = torch.randn(5, 4)
    for kind, make in kinds.items():
        m = model(1)
        o = make(m.parameters())
        for _ in range(2):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
        p = os.path.join(work, f"trainer-state-{kind}")
        tessera_ckpt.dcp.TrainerState(m, o, global_step=2, hparams={"width": 3, "tied": True}).save(p)
        with tessera_ckpt.Checkpoint(p) as ck:
            if ck.get("optimizer_0.optimizer") != kind or ck.get("global_step") != 2:
                fail(f"{p}: optimizer_0.optimizer {ck.get('optimizer_0.optimizer')!r}, global_step {ck.get('global_step')}")
            if ck.get("hparams.width") != "3" or ck.get("hparams.tied") != "true":
                fail(f"{p}: hparams {ck.get('hparams.width')!r} {ck.get('hparams.tied')!r}")
            if kind != "sgd" and ck.get("optimizer_0.state.0.weight.step") != 2:
                fail(f"{p}: step {ck.get('optimizer_0.state.0.weight.step')!r}, not the integer 2")
            if kind.startswith("adam") and ck.get("optimizer_0.param_groups.0.beta2") != o.param_groups[0]["betas"][1]:
                fail(f"{p}: beta2 {ck.get('optimizer_0.param_groups.0.beta2')!r}")
            if ck.get("optimizer_0.param_groups.0.params.3") != "2.bias":
                fail(f"{p}: params.3 is {ck.get('optimizer_0.param_groups.0.params.3')!r}")
        m2 = model(2)
        o2 = make(m2.parameters())
        ts = tessera_ckpt.dcp.TrainerState(m2, o2)
        ts.load(p)
        if ts.global_step != 2 or ts.hparams != {"width": "3", "tied": "true"}:
            fail(f"{p}: loaded global_step {ts.global_step}, hparams {ts.hparams}")
        for k, v in m.state_dict().items():
            same_bits(m2.state_dict()[k], v, f"{p} model {k}")
        a, b = o.state_dict(), o2.state_dict()
        same_value(b["param_groups"], a["param_groups"], f"{p} param_groups")
        for i, st in a["state"].items():
            for k, v in st.items():
                same_value(b["state"][i][k], v, f"{p} state {i}.{k}")
        n += 1
    m = model(1)
    expect_error(lambda: tessera_ckpt.dcp.TrainerState(m, torch.optim.LBFGS(m.parameters())), "torch.optim.LBFGS",
                 "no Tessera counterpart")
    expect_error(lambda: tessera_ckpt.dcp.TrainerState(m, torch.optim.SGD(m.parameters(), lr=0.1, maximize=True)),
                 "maximize")
    return n + 2


def check_refusals(work):
    """Refusals and replacement, in one process (dcp.save / dcp.load without a process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    import tessera_ckpt
    import tessera_ckpt.dcp

    n = 0
    p = os.path.join(work, "refused")
    expect_error(lambda: dcp.save({"model": {"w": torch.ones(2)}, "when": datetime.date(2026, 1, 1)},
                                  storage_writer=tessera_ckpt.dcp.Writer(p), no_dist=True), "'when'", "datetime.date")
    if os.path.exists(p) or siblings(p):
        fail(f"a refused save left {p} or {siblings(p)}")
    expect_error(lambda: dcp.save({"model": {"c": torch.ones(2, dtype=torch.complex64)}},
                                  storage_writer=tessera_ckpt.dcp.Writer(p), no_dist=True), "'model.c'", "complex64")
    if os.path.exists(p) or siblings(p):
        fail(f"a refused save left {p} or {siblings(p)}")
    expect_error(lambda: dcp.save({"x": {"k": [torch.ones(1)]}, "t": (torch.ones(1), 2)},
                                  storage_writer=tessera_ckpt.dcp.Writer(p), no_dist=True), "'t'")
    n += 3

    # a non-empty directory that is not a checkpoint stays untouched
    os.makedirs(p)
    with open(os.path.join(p, "notes.txt"), "w") as f:
        f.write("mine")
    expect_error(lambda: dcp.save({"w": torch.ones(2)}, storage_writer=tessera_ckpt.dcp.Writer(p), no_dist=True),
                 p, "not a Tessera checkpoint")
    if os.listdir(p) != ["notes.txt"] or siblings(p):
        fail(f"{p} was touched: {os.listdir(p)} {siblings(p)}")
    n += 1

    # an existing checkpoint is replaced, nothing left beside it
    q = os.path.join(work, "replaced")
    dcp.save({"w": torch.ones(3), "v": 1}, storage_writer=tessera_ckpt.dcp.Writer(q), no_dist=True)
    dcp.save({"w": torch.full((3,), 2.0), "v": 2}, storage_writer=tessera_ckpt.dcp.Writer(q), no_dist=True)
    sd = {"w": torch.zeros(3), "v": 0}
    dcp.load(sd, storage_reader=tessera_ckpt.dcp.Reader(q), no_dist=True)
    if sd["v"] != 2 or not torch.equal(sd["w"], torch.full((3,), 2.0)) or siblings(q):
        fail(f"{q}: not replaced ({sd}, {siblings(q)})")
    n += 1

    # a flipped data byte: the load fails naming the file, key and block
    from tessera_ckpt._format_safetensors import Safetensors

    c = os.path.join(work, "corrupt")
    shutil.copytree(q, c)
    f = os.path.join(c, "data-rank00000.safetensors")
    begin = Safetensors(f).tensors["w"][2]
    with open(f, "r+b") as fh:
        fh.seek(begin + 5)
        b = fh.read(1)
        fh.seek(begin + 5)
        fh.write(bytes([b[0] ^ 0x10]))
    expect_error(lambda: dcp.load({"w": torch.zeros(3)}, storage_reader=tessera_ckpt.dcp.Reader(c), no_dist=True),
                 "checksum mismatch", "'w'", "data-rank00000.safetensors")
    n += 1
    return n


def contract_state():
    """A nested state dict as a training job hands DCP: module state dicts (dotted names),
    an optimizer's (a list of param groups with a tuple, a list of names, None), a list of
    tensors (list indices in DCP's paths), top-level values."""
    import torch

    g = torch.Generator().manual_seed(11)
    return {"model": {"0.weight": torch.randn(3, 2, generator=g), "0.bias": torch.randn(3, generator=g),
                      "head": {"w": torch.randn(2, 3, generator=g).to(torch.bfloat16)}},
            "optimizer": {"state": {"0.weight": {"exp_avg": torch.randn(3, 2, generator=g), "step": torch.tensor(2.0)}},
                          "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["0.weight", "0.bias"],
                                            "foreach": None}]},
            "buffers": [torch.arange(3), torch.ones(2, dtype=torch.float16)],
            "step": 3, "values": values()}


def rewrite_metadata(d, change):
    """Applies ``change`` to the parsed metadata of checkpoint ``d`` and writes it back with a
    fresh metadata_crc32c (a writer that stored what ``change`` makes)."""
    import json

    from tessera_ckpt import _crc32c

    mf = os.path.join(d, "tessera-checkpoint.json")
    with open(mf, "rb") as f:
        j = json.loads(f.read())
    del j["metadata_crc32c"]
    change(j)
    text = json.dumps(j, separators=(",", ":")).encode()[:-1] + b',"metadata_crc32c":"00000000"}'
    text = text[:-10] + f"{_crc32c.crc32c(text):08x}".encode() + b'"}'
    with open(mf, "wb") as f:
        f.write(text)


def check_dcp_contract(work, v2):
    """DCP's storage contract through DCP's own entry points, in one process, Writer / Reader
    against DCP's own FileSystemWriter / FileSystemReader (the peer) on the same state:
    - the nesting survives the round trip: format_utils.dcp_to_torch_save (its reader swapped
      for Reader) and _load_state_dict_from_keys() give the nested state dict the peer gives;
    - partial loads by key (_load_state_dict_from_keys of top-level, nested and flat keys) give
      what the peer gives, and dcp.load of part of the keys loads those;
    - a checkpoint without the Writer's mapping (the v2 checkpoint of every rule, the v1
      fixture) comes back flat, with tessera_ckpt.load's keys, and loads by those keys;
    - a malformed stored mapping is refused naming it;
    - checkpoint_id given to dcp.save / _load_state_dict_from_keys goes through reset;
    - overwrite=False refuses an existing checkpoint where the peer does (the checkpoint
      stays, nothing is left beside it), and writes a new one where the peer does."""
    from unittest import mock

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, format_utils
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    import tessera_ckpt
    import tessera_ckpt.dcp

    n = 0
    state = contract_state()
    mine, peer = os.path.join(work, "contract-tessera"), os.path.join(work, "contract-fs")
    dcp.save(state, storage_writer=tessera_ckpt.dcp.Writer(mine), no_dist=True)
    dcp.save(state, storage_writer=FileSystemWriter(peer), no_dist=True)

    # the whole checkpoint into an empty state dict: the peer's nesting
    out_mine, out_peer = os.path.join(work, "contract-tessera.pt"), os.path.join(work, "contract-fs.pt")
    with mock.patch.object(format_utils, "FileSystemReader", tessera_ckpt.dcp.Reader):
        format_utils.dcp_to_torch_save(mine, out_mine)
    format_utils.dcp_to_torch_save(peer, out_peer)
    want = torch.load(out_peer, weights_only=False)
    if sorted(want) != ["buffers", "model", "optimizer", "step", "values"]:
        fail(f"the peer's dcp_to_torch_save gives {sorted(want)}")
    same_value(torch.load(out_mine, weights_only=False), want, f"dcp_to_torch_save of {mine}", ordered=False)
    same_value(_load_state_dict_from_keys(storage_reader=tessera_ckpt.dcp.Reader(mine)), want,
               f"_load_state_dict_from_keys() of {mine}", ordered=False)
    n += 2

    # partial loads by key
    for keys in ("model", "optimizer", "model.head", "optimizer.param_groups", "optimizer.state.0.weight", "buffers",
                 "values.nested", {"model.0.weight", "step"}, {"values.pair", "optimizer.param_groups.0.betas"}):
        want = _load_state_dict_from_keys(keys, storage_reader=FileSystemReader(peer))
        if not want:
            fail(f"the peer loads nothing for the keys {keys!r}")
        same_value(_load_state_dict_from_keys(keys, storage_reader=tessera_ckpt.dcp.Reader(mine)), want,
                   f"{mine} keys {keys!r}", ordered=False)
        n += 1
    part = {"model": {"head": {"w": torch.zeros(2, 3, dtype=torch.bfloat16)}}, "step": 0}
    dcp.load(part, storage_reader=tessera_ckpt.dcp.Reader(mine), no_dist=True)
    same_value(part, {"model": {"head": state["model"]["head"]}, "step": 3}, f"{mine} partial dcp.load")
    n += 1

    # without the Writer's mapping: flat, tessera_ckpt.load's keys
    for path in (v2, FIXTURE):
        want = tessera_ckpt.load(path)
        same_value(_load_state_dict_from_keys(storage_reader=tessera_ckpt.dcp.Reader(path)), want,
                   f"_load_state_dict_from_keys() of {path}", ordered=False)
        k = next(k for k in want if "." in k)
        same_value(_load_state_dict_from_keys({k}, storage_reader=tessera_ckpt.dcp.Reader(path)), {k: want[k]},
                   f"{path} key {k!r}")
        n += 2

    # a malformed mapping (a writer's bug: the metadata checksum holds) is refused, naming it
    bad = os.path.join(work, "contract-bad-nesting")
    for change, needles in (
            (lambda j: j["dcp_nesting"].__setitem__("model.0.weight", ["model", "weight"]), ("'model.0.weight'",)),
            (lambda j: j["dcp_nesting"].__setitem__("buffers.0", ["buffers", "0"]), ("buffers", "both a")),
            (lambda j: j["dcp_nesting"].__setitem__("no.such.key", ["no", "such.key"]), ("'no.such.key'",))):
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(mine, bad)
        rewrite_metadata(bad, change)
        expect_error(lambda: _load_state_dict_from_keys(storage_reader=tessera_ckpt.dcp.Reader(bad)), "dcp_nesting",
                     *needles)
        n += 1

    # checkpoint_id: DCP resets the storage to it
    by_id, elsewhere = os.path.join(work, "contract-by-id"), os.path.join(work, "contract-elsewhere")
    dcp.save({"model": state["model"]}, checkpoint_id=by_id, storage_writer=tessera_ckpt.dcp.Writer(elsewhere),
             no_dist=True)
    if os.path.exists(elsewhere):
        fail(f"dcp.save(checkpoint_id={by_id!r}) wrote to the Writer's first path {elsewhere}")
    same_value(_load_state_dict_from_keys("model", checkpoint_id=by_id,
                                          storage_reader=tessera_ckpt.dcp.Reader(elsewhere)),
               {"model": state["model"]}, f"{by_id} loaded by checkpoint_id", ordered=False)
    n += 1

    # overwrite=False: the peer refuses an existing checkpoint, and so must the Writer
    other = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items() if k != "head"}, "step": 4}
    before = _load_state_dict_from_keys(storage_reader=FileSystemReader(peer))
    expect_error(lambda: dcp.save(other, storage_writer=FileSystemWriter(peer, overwrite=False), no_dist=True))
    same_value(_load_state_dict_from_keys(storage_reader=FileSystemReader(peer)), before, f"{peer} after overwrite=False")
    before = _load_state_dict_from_keys(storage_reader=tessera_ckpt.dcp.Reader(mine))
    expect_error(lambda: dcp.save(other, storage_writer=tessera_ckpt.dcp.Writer(mine, overwrite=False), no_dist=True),
                 mine, "overwrite=False")
    same_value(_load_state_dict_from_keys(storage_reader=tessera_ckpt.dcp.Reader(mine)), before,
               f"{mine} after overwrite=False")
    if siblings(mine):
        fail(f"a refused save left {siblings(mine)} beside {mine}")
    n += 1
    # ... a new path is written (by both), and overwrite=True (the default) replaces
    for kind, writer, reader in (("fs", FileSystemWriter, FileSystemReader),
                                 ("tessera", tessera_ckpt.dcp.Writer, tessera_ckpt.dcp.Reader)):
        fresh = os.path.join(work, f"contract-fresh-{kind}")
        dcp.save(other, storage_writer=writer(fresh, overwrite=False), no_dist=True)
        dcp.save(state, storage_writer=writer(fresh, overwrite=True), no_dist=True)
        same_value(_load_state_dict_from_keys("model", storage_reader=reader(fresh)), {"model": state["model"]},
                   f"{fresh} replaced", ordered=False)
    n += 1
    return n


def main():
    args = sys.argv[1:]
    if args and args[0] == "--worker":
        worker_main(args[1:])
        return
    tessera = os.path.join(ROOT, "build", "bin", "tessera")
    keep = None
    while args:
        if args[0] == "--tessera" and len(args) > 1:
            tessera, args = args[1], args[2:]
        elif args[0] == "--keep" and len(args) > 1:
            keep, args = args[1], args[2:]
        else:
            sys.exit(__doc__)
    if not os.path.exists(tessera):
        print(f"  (no {tessera}: `tessera ckpt verify` not run)")
        tessera = None

    import torch

    try:
        import torch.distributed.checkpoint  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        sys.exit(f"dcp_backend_check needs torch 2.x with FSDP2 (fully_shard); this is torch {torch.__version__}: {e}")
    import tessera_ckpt.dcp  # noqa: F401

    t0 = time.time()
    work = keep or tempfile.mkdtemp(prefix="dcp_backend_check.")
    os.makedirs(work, exist_ok=True)
    try:
        sys.path.insert(0, HERE)
        import tessera_ckpt_v2_check

        v2 = os.path.join(work, "v2-independent")
        tessera_ckpt_v2_check.build_main(v2)
        contract = check_dcp_contract(work, v2)
        print(f"  DCP's storage contract against FileSystemWriter/Reader: {contract} checks", flush=True)
        dirs = []
        for n in WORLDS:
            d = os.path.join(work, f"saved-at-{n}")
            launch(n, ["save", d])
            dirs.append(d)
        written = sum(check_written(d, n, tessera) for d, n in zip(dirs, WORLDS))
        for m in WORLDS:
            launch(m, ["load", v2] + dirs)
        fixture = check_fixture_plain(v2)
        refusals = check_refusals(work)
        kinds = check_trainer_state(work)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"ok dcp_backend_check: torch {torch.__version__}, saved at {list(WORLDS)} rank(s) and each loaded at "
          f"{list(WORLDS)} (FSDP2 model + AdamW state, every dtype, DTensor/ShardedTensor/plain, values), "
          f"{written} keys checked in the written checkpoints{' (and tessera ckpt verify)' if tessera else ''}, "
          f"{fixture} keys of the v1 fixtures and a v2 checkpoint of every rule without a process group, {refusals} refusals, "
          f"{contract} checks of DCP's storage contract (nesting, loads by key, overwrite=False) against its "
          "FileSystemWriter/Reader, "
          f"TrainerState for {kinds - 2} optimizer kinds and 2 refusals, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
