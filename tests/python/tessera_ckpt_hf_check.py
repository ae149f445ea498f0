"""Checks the tessera_ckpt package (python/tessera_ckpt) on the Hugging Face directories that
tests/python/hf_dir_write.py wrote with the real libraries.

usage: tessera_ckpt_hf_check.py FIXTURES [--consolidated FILE]

For every directory the manifest lists as good (huggingface_hub's shards and single file, a
shard linked inside the directory, an index whose total_size is off, DCP's
HuggingFaceStorageWriter output where written): load(), Checkpoint(...)[key], get(rows=...),
inspect() and verify() against the reference file read by safetensors.torch.load_file, every
tensor bit for bit; the keys are the union of what the shards hold (each read by the safetensors
library too). For every broken one: load, inspect, verify and Checkpoint each raise
CheckpointError holding every substring the manifest gives (the tensor and the file at fault),
and `python -m tessera_ckpt verify` exits 1 saying CORRUPT. With torch 2.x, each good directory
is also loaded by DCP's own `dcp.load` through tessera_ckpt.dcp.Reader. --consolidated FILE: `tessera ckpt
consolidate` of ok/hub, which must hold the reference's tensors and be Tessera's consolidated
format. Prints "ok tessera_ckpt_hf_check: N directories, M refusals".
"""
import json
import os
import subprocess
import sys

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
sys.path.insert(0, PYTHON_DIR)

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import tessera_ckpt  # noqa: E402
from tessera_ckpt import _interop_hf_dir  # noqa: E402

INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def same(a, b, what):
    assert a.dtype == b.dtype and list(a.shape) == list(b.shape), f"{what}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
    va = a.contiguous().view(INT_VIEW[a.dtype]) if a.dtype in INT_VIEW else a.contiguous()
    vb = b.contiguous().view(INT_VIEW[b.dtype]) if b.dtype in INT_VIEW else b.contiguous()
    assert torch.equal(va, vb), f"{what}: values differ"


def refused(fn, want, what):
    try:
        fn()
    except tessera_ckpt.CheckpointError as e:
        msg = str(e)
        for w in want:
            assert w in msg, f"{what}: the error does not hold {w!r}:\n{msg}"
        return
    raise AssertionError(f"{what}: no error")


try:  # torch 2.x: the DCP storage backend reads the same directories
    import torch.distributed.checkpoint  # noqa: E402
    from tessera_ckpt.dcp import Reader as dcp_reader  # noqa: E402
except ImportError:
    dcp_reader = None

fixtures = sys.argv[1]
with open(os.path.join(fixtures, "manifest.json")) as f:
    manifest = json.load(f)
ref = load_file(manifest["reference"])
dirs = refusals = dcp_loads = 0
for d in manifest["ok"]:
    # What the shards hold, through the safetensors library.
    shards = {}
    names = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
    for n in names:
        for k, t in load_file(os.path.join(d, n)).items():
            assert k not in shards, f"{d}: {k} in two files"
            shards[k] = t
    sd = tessera_ckpt.load(d)
    assert sorted(sd) == sorted(ref) == sorted(shards), f"{d}: keys {sorted(sd)}"
    for k, t in sd.items():
        same(t, ref[k], f"{d} {k}")
        same(t, shards[k], f"{d} {k} (shard)")
    model = tessera_ckpt.load(d, prefix="model.")
    assert sorted(model) == sorted(k[6:] for k in ref if k.startswith("model.")), sorted(model)
    with tessera_ckpt.Checkpoint(d) as ck:
        assert ck.kind == "hf" and ck.world_size is None, (ck.kind, ck.world_size)
        k = "model.embed_tokens.weight"
        same(ck[k], ref[k], f"{d} [{k}]")
        same(ck.get(k, rows=(5, 9)), ref[k][5:9], f"{d} {k} rows 5:9")
        same(ck.get(k, rows=slice(60, None)), ref[k][60:], f"{d} {k} rows 60:")
    s = tessera_ckpt.inspect(d)
    assert s["kind"] == "hf" and s["tensor_bytes"] == sum(t.numel() * t.element_size() for t in ref.values()), s
    assert {x["name"] for x in s["files"]} <= set(names), s["files"]
    for k, v in s["keys"].items():
        assert v["file"] in names and k in load_file(os.path.join(d, v["file"])), (k, v)
    text = str(s)
    assert text.startswith(f"{d}: hf checkpoint (a Hugging Face model directory: "), text
    r = tessera_ckpt.verify(d)
    assert r["kind"] == "hf" and not r["checksummed"] and r["checked"] == _interop_hf_dir.VERIFY_CHECKED, r
    assert r["bytes"] == s["tensor_bytes"], r
    want_notes = manifest["notes"].get(d, [])
    assert len(r["notes"]) == len(want_notes) and all(w in n for w, n in zip(want_notes, r["notes"])), r["notes"]
    if want_notes:
        assert any(want_notes[0] in line for line in text.splitlines() if line.startswith("note: ")), text
    out = subprocess.run([sys.executable, "-m", "tessera_ckpt", "verify", d], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=PYTHON_DIR))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"OK: {d}: " in out.stdout and f"bytes read ({_interop_hf_dir.VERIFY_CHECKED})" in out.stdout, out.stdout
    if dcp_reader is not None:
        # DCP's own load through tessera_ckpt.dcp.Reader, into a state dict of the reference's
        # shapes filled with another value (no process group: one process).
        into = {k: torch.full_like(t, 7) for k, t in ref.items()}
        torch.distributed.checkpoint.load(into, storage_reader=dcp_reader(d), no_dist=True)
        for k, t in into.items():
            same(t, ref[k], f"{d} {k} (dcp.load)")
        dcp_loads += 1
    dirs += 1

rows = manifest["rows"]
big = load_file(rows["reference"])[rows["key"]]
with tessera_ckpt.Checkpoint(rows["dir"]) as ck:
    for w in (2, 3):
        split = -(-big.shape[0] // w)
        for r in range(w):
            got = ck.get(rows["key"], rows=(r * split, min(big.shape[0], (r + 1) * split)))
            same(got, big[r * split : (r + 1) * split], f"rows of rank {r}/{w}")
dirs += 1

for d, want in manifest["bad"].items():
    for name, fn in (("load", lambda: tessera_ckpt.load(d)), ("inspect", lambda: tessera_ckpt.inspect(d)),
                     ("verify", lambda: tessera_ckpt.verify(d)), ("Checkpoint", lambda: tessera_ckpt.Checkpoint(d))):
        refused(fn, want, f"{d} {name}")
    out = subprocess.run([sys.executable, "-m", "tessera_ckpt", "verify", d], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=PYTHON_DIR))
    assert out.returncode == 1 and out.stderr.startswith(f"CORRUPT: {d}: "), out.stdout + out.stderr
    for w in want:
        assert w in out.stderr, f"{d}: python -m tessera_ckpt verify does not say {w!r}:\n{out.stderr}"
    refusals += 1

if "--consolidated" in sys.argv:
    path = sys.argv[sys.argv.index("--consolidated") + 1]
    with safe_open(path, framework="pt") as f:
        assert (f.metadata() or {}).get("tessera.format") == "tessera-consolidated", f.metadata()
    full = load_file(path)
    assert sorted(full) == sorted(ref), sorted(full)
    for k, t in full.items():
        same(t, ref[k], f"{path} {k}")
    r = tessera_ckpt.verify(path)
    assert r["checksummed"] and r["kind"] == "consolidated", r

print(f"ok tessera_ckpt_hf_check: {dirs} directories, {refusals} refusals"
      + (f", {dcp_loads} through dcp.load" if dcp_reader is not None else ""))
