"""Writes the torch_xla FSDP fixtures of `tessera ckpt import-xla` (tests/checkpoint/test_xla_import.cpp).

Run by scripts/make-xla-fixtures.sh in its own environment (.venv-xla: torch 2.9 and torch_xla 2.9
from PyPI), on the PJRT CPU device:

    PJRT_DEVICE=CPU .venv-xla/bin/python scripts/xla_fixtures.py tests/checkpoint/fixtures/xla

What it does (the README it writes into the output says the same, with the versions):
 1. Tries multi-device XLA on the CPU (CPU_NUM_DEVICES=2 and 4, xmp.spawn, one all_reduce) and
    records what happens in probe-cpu-<n>.txt.
 2. Trains a small nested model (an inner FSDP unit inside the root one) for two AdamW steps
    with torch_xla's XlaFullyShardedDataParallel at world size 1 on the CPU device, and saves the
    rank file the way torch_xla's examples do: {"model": model.state_dict(), "shard_metadata":
    model.get_shard_metadata(), "optimizer": optimizer.state_dict()} with xm.save.
 3. Makes the world-size-2 and -4 files from that trained state with torch_xla's own sharding
    code, which runs without a second device: for each rank r it wraps the same module, holding
    the trained weights, in XlaFullyShardedDataParallel(sharding_groups=[[0..W-1]],
    sharding_rank=r, sharding_world_size=W), so the shards, their padding, the state dict keys
    and get_shard_metadata() are torch_xla's; the optimizer moments are cut with the same FSDP
    object's _get_shard (flatten, pad to a multiple of W * 128, take rank r's stretch), loaded into a
    torch.optim.AdamW over that rank's parameters and saved from its state_dict().
 4. Stores the oracles: torch_xla's consolidate_sharded_model_checkpoints over each set's files
    (oracle/<set>.model.pth, written by torch_xla), and the optimizer moments put together by
    torch_xla's consolidate_sharded_state_dicts from per-rank dicts {sharded parameter key:
    moment} (oracle/<set>.optim.pth, a flat dict "optimizer.state.<fqn>.<name>" plus
    "optimizer.param_groups.0.params.<i>").
 5. Writes the damaged inputs of the error tests under bad/.

    PJRT_DEVICE=CPU .venv-xla/bin/python scripts/xla_fixtures.py --big OUTDIR LAYERS WORLD

writes the input of the memory measurement in docs/cli.md (import-xla) instead: LAYERS Linear(2048,
2048) layers with AdamW state, as WORLD rank files, flattened and not (no fixture).
"""
import copy
import glob
import json
import os
import platform
import shutil
import subprocess
import sys

PROBE = "--probe"


def _probe_fn(_):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    t = torch.ones(3, device=torch_xla.device()) * (xr.global_ordinal() + 1)
    s = xm.all_reduce(xm.REDUCE_SUM, t)
    torch_xla.sync()
    print("rank", xr.global_ordinal(), "of", xr.world_size(), "all_reduce", s.cpu().tolist(), flush=True)


# (xmp.spawn's processes import this file as __mp_main__: only the parent probes)
if __name__ == "__main__" and sys.argv[1:2] == [PROBE]:
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_probe_fn, args=())
    sys.exit(0)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP  # noqa: E402
from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts  # noqa: E402


class Block(nn.Module):
    """The inner FSDP unit: a linear layer (65 + 5 elements), a layer norm and an fp16 buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(13, 5)
        self.norm = nn.LayerNorm(5)
        self.register_buffer("shift", (torch.arange(5) * 0.37 - 0.6).to(torch.float16))

    def forward(self, x):
        return self.norm(self.fc(x)) + self.shift.float()


class Net(nn.Module):
    """Root unit: an embedding (37 x 13: 481 elements, whose shards at 2 and 4 ranks end inside rows), the
    block, a head (3 x 5 + 3), a bf16 and an int64 buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(37, 13)
        self.block = Block()
        self.head = nn.Linear(5, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5).to(torch.bfloat16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.steps.add_(1)
        # the buffers change in training (in fp32 on the device, so not exactly bf16 / fp16 values)
        self.scale.mul_(1.0001)
        self.block.shift.add_(0.0003)
        return self.head(self.block(self.embed(x)) * self.scale)


def wrap(net, flat, dim0, device_first, rank=None, world=None):
    """The nested FSDP model; with rank/world: torch_xla's sharding for that rank of that world."""
    kw = dict(flatten_parameters=flat, shard_param_on_dim_0=dim0)
    if world is not None:
        kw.update(sharding_groups=[list(range(world))], sharding_rank=rank, sharding_world_size=world)
    if device_first:  # buffer_info is recorded only for buffers already on the device (see README)
        net = net.to(torch_xla.device())
    net.block = FSDP(net.block, **kw)
    return FSDP(net, **kw)


def norm_name(n):
    return ".".join(p for p in n.split(".") if p not in ("_fsdp_wrapped_module", "_fpw_module"))


def sharded_keys(model):
    """The state dict keys of the sharded parameters, in parameters() order (= optimizer ids)."""
    sd_keys = [k for k in model.state_dict() if any(p.startswith("_fsdp_shard") for p in k.split("."))]
    named = [n.replace("_fpw_module.", "") for n, _ in model.named_parameters()]
    assert named == sd_keys, (named, sd_keys)  # the fact the importer relies on, checked here
    return sd_keys


def cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return type(obj)((k, cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu(v) for v in obj)
    return obj


def save_rank(path, model, opt, lightning):
    if lightning:  # Lightning Fabric's XLAFSDPStrategy: the user's state keys + shard_metadata
        ckpt = {"shard_metadata": model.get_shard_metadata(), "model": model.state_dict(),
                "optimizer": opt.state_dict(), "step": 2}
    else:  # torch_xla's examples (test_train_mp_mnist_fsdp_with_ckpt.py)
        ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
                "optimizer": opt.state_dict()}
    xm.save(ckpt, path, master_only=False)


def opt_params(model, named):
    """What the optimizer is built over: model.parameters(), as torch_xla's examples and Lightning do;
    or (named) its named_parameters() in reverse order, so that the ids follow another order than the
    state dict's and only the param_names torch records tell them apart."""
    return list(reversed(list(model.named_parameters()))) if named else model.parameters()


def train(flat, dim0, device_first, named):
    torch.manual_seed(1234)
    net = Net()
    model = wrap(net, flat, dim0, device_first)
    opt = torch.optim.AdamW(opt_params(model, named), lr=0.01, weight_decay=0.1)
    dev = torch_xla.device()
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randint(0, 37, (4, 3), generator=g).to(dev)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        torch_xla.sync()
    return model, opt


def file_name(prefix, rank, world):
    return f"{prefix}_rank-{rank:08d}-of-{world:08d}.pth"


def make_set(out, name, flat, dim0, device_first, lightning, worlds, named=False):
    prefix = "checkpoint" if lightning else "final_ckpt"
    model1, opt1 = train(flat, dim0, device_first, named)
    keys1 = sharded_keys(model1)
    md1 = model1.get_shard_metadata()
    # the trained weights as a plain module state (torch_xla's own consolidation)
    full = consolidate_sharded_state_dicts([cpu(model1.state_dict())], md1)
    osd1 = cpu(opt1.state_dict())
    made = []
    for world in worlds:
        d = os.path.join(out, f"{name}-w{world}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for rank in range(world):
            if world == 1:
                model, opt = model1, opt1
            else:
                net = Net()
                net.load_state_dict(full)
                model = wrap(net, flat, dim0, device_first, rank, world)
                assert sharded_keys(model) == keys1
                opt = torch.optim.AdamW(opt_params(model, named), lr=0.01, weight_decay=0.1)
                state = {}
                infos = {}
                for mod_name, m in model.named_modules():
                    if isinstance(m, FSDP):
                        for p in m.sharded_params:
                            infos[id(p)] = (m, p._orig_size)
                for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
                    m, orig = infos[id(p)]
                    numel = 1
                    for s in orig:
                        numel *= s
                    st = {}
                    for k, v in osd1["state"][i].items():
                        if v.dim() == 0:
                            st[k] = v.clone()
                        else:  # unpad the world-size-1 moment, then torch_xla's own cut for this rank
                            whole = v[:orig[0]] if dim0 else v.reshape(-1)[:numel]
                            st[k] = m._get_shard(whole.to(torch_xla.device())).cpu()
                            assert st[k].shape == p.shape, (k, st[k].shape, p.shape)
                    state[i] = st
                opt.load_state_dict({"state": state, "param_groups": copy.deepcopy(osd1["param_groups"])})
            save_rank(os.path.join(d, file_name(prefix, rank, world)), model, opt, lightning)
        made.append((f"{name}-w{world}", d, prefix, world))
    return made


def oracles(out, set_name, d, prefix, world):
    od = os.path.join(out, "oracle")
    os.makedirs(od, exist_ok=True)
    # torch_xla's consolidation of the model, as torch_xla writes it
    tmp = os.path.join(od, f"{set_name}.model.pth")
    consolidate_sharded_model_checkpoints(os.path.join(d, prefix), "_rank-*-of-*.pth", tmp, True)
    # the optimizer moments through the same consolidation of per-rank {sharded key: moment}
    files = sorted(glob.glob(os.path.join(d, prefix + "_rank-*-of-*.pth")))
    ckpts = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    md = ckpts[0]["shard_metadata"]
    keys = [k for k in ckpts[0]["model"] if any(p.startswith("_fsdp_shard") for p in k.split("."))]
    # optimizer id -> sharded key: the i-th shard of the state dict (an optimizer over parameters()),
    # or what torch's param_names say (checked against the live model's order by sharded_keys)
    groups = ckpts[0]["optimizer"]["param_groups"]
    ids = [i for g in groups for i in g["params"]]
    if "param_names" in groups[0]:
        key_of = {i: n.replace("_fpw_module.", "") for g in groups for i, n in zip(g["params"], g["param_names"])}
    else:
        key_of = dict(enumerate(keys))
    res = {}
    names = sorted({n for c in ckpts for s in c["optimizer"]["state"].values() for n, v in s.items() if v.dim() > 0})
    for n in names:
        per_rank = [{key_of[i]: c["optimizer"]["state"][i][n] for i in ids} for c in ckpts]
        for fqn, t in consolidate_sharded_state_dicts(per_rank, md).items():
            res[f"optimizer.state.{fqn}.{n}"] = t.clone()
    # which original FQNs each optimizer id stands for, found by torch_xla's consolidation itself: a
    # marker (ones in parameter i's shards, zeros elsewhere) comes out in exactly those FQNs
    j = 0
    for i in ids:
        k = key_of[i]
        per = [{kk: torch.full((ckpts[0]["model"][kk].numel(),), float(kk == k)) for kk in keys}] * world
        for fqn, t in consolidate_sharded_state_dicts(per, md).items():
            if t.numel() and bool((t == 1).all()):
                res[f"optimizer.param_groups.0.params.{j}"] = fqn
                j += 1
                for n, v in ckpts[0]["optimizer"]["state"][i].items():
                    if v.dim() == 0:  # scalar states (step): rank 0's, under each FQN
                        res[f"optimizer.state.{fqn}.{n}"] = v.clone()
    torch.save(res, os.path.join(od, f"{set_name}.optim.pth"))


class Evil:
    """Pickles as a call of os.system: an importer that ran code would create the marker file."""

    def __reduce__(self):
        return (os.system, ("touch tessera-xla-pwned",))


def bad_inputs(out, src_w2, src_w1):
    bad = os.path.join(out, "bad")
    shutil.rmtree(bad, ignore_errors=True)
    # rank 1 of a world-size-2 set with one shard an element short (model and shard_metadata only)
    d = os.path.join(bad, "shard-size")
    os.makedirs(d)
    for r in range(2):
        c = torch.load(os.path.join(src_w2, file_name("final_ckpt", r, 2)), weights_only=False)
        c = {"model": c["model"], "shard_metadata": c["shard_metadata"]}
        if r == 1:
            k = next(k for k in c["model"] if "fc_FSDP_SHARD_SEPARATOR_weight" in k)
            c["model"][k] = c["model"][k][:-1].clone()
        torch.save(c, os.path.join(d, file_name("final_ckpt", r, 2)))
    # a world-size-1 file holding an object that pickles as os.system(...)
    d = os.path.join(bad, "global")
    os.makedirs(d)
    c = torch.load(os.path.join(src_w1, file_name("final_ckpt", 0, 1)), weights_only=False)
    c = {"model": c["model"], "shard_metadata": c["shard_metadata"], "extra": Evil()}
    torch.save(c, os.path.join(d, file_name("final_ckpt", 0, 1)))


def probe(n):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n))
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), PROBE], env=env, capture_output=True,
                           text=True, timeout=180)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = ((e.stdout or b"").decode() + (e.stderr or b"").decode()), "timeout after 180 s"
    lines = [l for l in text.splitlines() if " F " in l or "rendezvous" in l or "Error" in l or "rank" in l]
    return rc, lines


def main():
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    probes = {}
    for n in (2, 4):
        rc, lines = probe(n)
        probes[n] = (rc, lines)
        with open(os.path.join(out, f"probe-cpu-{n}.txt"), "w") as f:
            f.write(f"CPU_NUM_DEVICES={n} xmp.spawn + xm.all_reduce: exit status {rc}\n")
            f.write("\n".join(lines) + "\n")
    shutil.rmtree(os.path.join(out, "oracle"), ignore_errors=True)
    sets = []
    # flatten_parameters=False, model on the device before wrapping (buffer_info filled), examples' names
    sets += make_set(out, "params", flat=False, dim0=False, device_first=True, lightning=False, worlds=(1, 2, 4))
    # flatten_parameters=True, model on the CPU when wrapped (buffer_info empty), Lightning's names
    sets += make_set(out, "flat", flat=True, dim0=False, device_first=False, lightning=True, worlds=(1, 2, 4))
    # shard_param_on_dim_0=True (dim-0 shards, padded rows), examples' names
    # ... and an optimizer over named_parameters() in reverse order (param_names decide the ids)
    sets += make_set(out, "dim0", flat=False, dim0=True, device_first=True, lightning=False, worlds=(2,), named=True)
    for s in sets:
        oracles(out, *s)
    bad_inputs(out, os.path.join(out, "params-w2"), os.path.join(out, "params-w1"))
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_xla": torch_xla.__version__,
            "probes": {str(n): {"status": str(rc), "lines": lines} for n, (rc, lines) in probes.items()},
            "sets": [s[0] for s in sets]}
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(info, f, indent=1)
    readme(out, info)
    print(json.dumps(info, indent=1))


def readme(out, info):
    probe_text = ""
    for n, p in info["probes"].items():
        probe_text += f"- `CPU_NUM_DEVICES={n}`: exit status {p['status']}\n"
        probe_text += "".join(f"  ```\n  {l}\n  ```\n" for l in p["lines"] if " F " in l or "rank" in l[:5])
    sizes = []
    for root, _, names in sorted(os.walk(out)):
        for n in sorted(names):
            if n.endswith(".pth"):
                path = os.path.join(root, n)
                sizes.append(f"| `{os.path.relpath(path, out)}` | {os.path.getsize(path)} |")
    text = f"""# torch_xla FSDP fixtures (`tessera ckpt import-xla`)

Written by `bash scripts/make-xla-fixtures.sh` (scripts/xla_fixtures.py, which says step by step
what it does) with Python {info['python']}, torch {info['torch']} and torch_xla {info['torch_xla']} from
PyPI, on the PJRT CPU device (`PJRT_DEVICE=CPU`). Read by tests/checkpoint/test_xla_import.cpp
(`make test`); regenerating them here gave the same bytes (the seeds are fixed).

## Multi-device XLA on the CPU does not run here

`xmp.spawn` with `CPU_NUM_DEVICES` starts one process with a thread per CPU device; one
`xm.all_reduce` across them never meets (pytorch/xla#9089 reports the same hang). What the probe
(probe-cpu-N.txt) printed:

{probe_text}
So the world-size-1 files are written by real XLA FSDP training (two AdamW steps of a nested model:
an inner FSDP unit inside the root one) and the world-size-2 and -4 files by torch_xla's own
sharding code, which needs no second device: the trained module wrapped again, per rank, in
`XlaFullyShardedDataParallel(sharding_groups=[[0..W-1]], sharding_rank=r, sharding_world_size=W)`
(its shards, padding, state dict keys and `get_shard_metadata()` are torch_xla's), the optimizer
moments cut by the same object's `_get_shard` and saved from a `torch.optim.AdamW` over that rank's
parameters.

## Sets

| set | options | names | contents |
|---|---|---|---|
| `params-w1`, `-w2`, `-w4` | `flatten_parameters=False`; the model moved to the device before wrapping, so `buffer_info` records the bf16 and fp16 buffers | torch_xla's examples: `final_ckpt_rank-XXXXXXXX-of-YYYYYYYY.pth` | `model`, `shard_metadata`, `optimizer` |
| `flat-w1`, `-w2`, `-w4` | `flatten_parameters=True` (`flat_param_0` per unit); the model on the CPU when wrapped, so `buffer_info` is empty | Lightning's XLAFSDPStrategy: `checkpoint_rank-XXXXXXXX-of-YYYYYYYY.pth` | Fabric's layout: `shard_metadata`, `model`, `optimizer`, `step` |
| `dim0-w2` | `shard_param_on_dim_0=True`; the optimizer built over `named_parameters()` in reverse order, so its ids follow another order than the state dict and only `param_names` tell which is which | examples' | as `params` |
| `bad/shard-size` | `params-w2` with rank 1's `block.fc.weight` shard one element short | examples' | `model`, `shard_metadata` |
| `bad/global` | `params-w1` plus an object that pickles as `os.system('touch tessera-xla-pwned')` | examples' | |

The model: `embed` (Embedding 37 x 13: 481 elements, so at 2 and 4 ranks the shards end inside its
rows), `block.fc` (Linear 13 -> 5), `block.norm` (LayerNorm 5), `head` (Linear 5 -> 3), the buffers
`scale` (bf16), `block.shift` (fp16), both changed in training in fp32 on the device, and `steps`
(int64). Every parameter is padded (flattened, to a multiple of 128 x world size elements; with
`shard_param_on_dim_0`, dim 0 to a multiple of the world size).

## Oracles (`oracle/`)

- `<set>.model.pth`: torch_xla's `consolidate_sharded_model_checkpoints` over the set's files, as
  torch_xla writes it (`{{"model": state dict}}`). It leaves the buffers in fp32 even where
  `buffer_info` records their dtype (it looks them up by the state dict's names, which lack the
  `_fpw_module` level that `buffer_info`'s names have).
- `<set>.optim.pth`: the optimizer state put together by torch_xla's `consolidate_sharded_state_dicts`
  from per-rank dicts {{sharded parameter key: moment}} (`optimizer.state.<fqn>.exp_avg` ...), the
  scalar `step` of each parameter, and `optimizer.param_groups.0.params.<i>`: which FQNs each
  optimizer id holds, found by the same consolidation of a marker (torch_xla's consolidation itself
  drops the optimizer state).

## Files (bytes)

| file | bytes |
|---|---|
""" + "\n".join(sizes) + "\n"
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)


def big(out, layers, world):
    """The memory measurement of docs/checkpoint-format.md §7 (not a fixture): `layers` Linear(2048,
    2048) layers (16 MiB each) with an AdamW state, cut for `world` ranks like the fixtures."""
    for flat in (False, True):
        d = os.path.join(out, "flat" if flat else "params")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for rank in range(world):
            torch.manual_seed(0)
            net = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(layers)])
            model = FSDP(net, flatten_parameters=flat, sharding_groups=[list(range(world))], sharding_rank=rank,
                         sharding_world_size=world)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            torch_xla.sync()
            save_rank(os.path.join(d, file_name("final_ckpt", rank, world)), model, opt, False)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--big"]:  # --big OUTDIR LAYERS WORLD
        big(os.path.abspath(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
