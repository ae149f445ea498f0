"""Checks a `tessera ckpt export --format hf` directory with the real Python readers.

usage: hf_export_check.py HF_DIR REFERENCE.pt --prefix P --max-shard-size BYTES
                          [--dtype bf16|fp16|fp32] [--files N] [--dcp]

REFERENCE.pt is an independent copy of the same checkpoint (`tessera ckpt export
--format torch`, read by torch.load). The export must hold exactly the tensors of the
reference whose key starts with P, named without it, each bit for bit equal to the
reference tensor (or, with --dtype, to torch's `.to(dtype)` of it for floating tensors).
The layout is checked against transformers / huggingface_hub conventions, recomputed here:
the split into files (huggingface_hub's split_state_dict_into_shards rule, keys in the
reference's order), the file names, and the index text (json.dumps(indent=2,
sort_keys=True)). Every file is read by `safetensors.torch.load_file`; with --dcp also
through torch.distributed.checkpoint's HuggingFaceStorageReader (dcp.load into a
preallocated state dict, no process group).
Prints "ok N FILES" (tensors, files) when everything holds.
"""
import argparse
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file

p = argparse.ArgumentParser()
p.add_argument("hf_dir")
p.add_argument("reference")
p.add_argument("--prefix", required=True)
p.add_argument("--max-shard-size", type=int, required=True)
p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
p.add_argument("--files", type=int)
p.add_argument("--dcp", action="store_true")
a = p.parse_args()

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def same_bits(x, y):
    """dtype, shape and every byte equal (NaN payloads and -0 included)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    bx = x.contiguous().reshape(-1).view(torch.uint8)
    by = y.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(bx, by)


ref = torch.load(a.reference)
assert type(ref) is dict, type(ref)
prefix = a.prefix
expected = {}
for k, v in ref.items():  # the reference keeps the checkpoint's key order
    if not k.startswith(prefix):
        continue
    if a.dtype and v.is_floating_point():
        v = v.to(DTYPES[a.dtype])
    expected[k[len(prefix):]] = v
assert expected, f"nothing in {a.reference} starts with {prefix!r}: {list(ref)}"

# The split into files, by huggingface_hub's rule, with transformers' names.
sizes = {n: t.numel() * t.element_size() for n, t in expected.items()}
shards, current, current_size = [], [], 0
for n, s in sizes.items():
    if s > a.max_shard_size:
        shards.append([n])
        continue
    if current_size + s > a.max_shard_size:
        shards.append(current)
        current, current_size = [], 0
    current.append(n)
    current_size += s
if current:
    shards.append(current)
if len(shards) == 1:
    want_map = {n: "model.safetensors" for n in shards[0]}
else:
    want_map = {n: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, ns in enumerate(shards) for n in ns}
if a.files is not None:
    assert len(shards) == a.files, f"{len(shards)} files, test wanted {a.files}"

listing = sorted(os.listdir(a.hf_dir))
want_files = sorted(set(want_map.values()))
index_path = os.path.join(a.hf_dir, "model.safetensors.index.json")
if len(shards) > 1:
    want_files = sorted(want_files + ["model.safetensors.index.json"])
    text = open(index_path).read()
    index = json.loads(text)
    want_index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": want_map}
    assert index == want_index, f"index {index}\nwanted {want_index}"
    assert text == json.dumps(want_index, indent=2, sort_keys=True) + "\n", "index text differs from transformers'"
assert listing == want_files, f"files {listing}, wanted {want_files}"

# Every file through the safetensors library.
got = {}
for f in sorted(set(want_map.values())):
    path = os.path.join(a.hf_dir, f)
    with safe_open(path, framework="pt") as sf:
        assert (sf.metadata() or {}).get("format") == "pt", f"{f}: metadata {sf.metadata()}"
    part = load_file(path)
    assert sorted(part) == sorted(n for n, g in want_map.items() if g == f), f"{f}: {sorted(part)}"
    for n, t in part.items():
        assert n not in got, f"{n} in two files"
        got[n] = t
assert sorted(got) == sorted(expected), f"names {sorted(got)}\nwanted {sorted(expected)}"
for n, want in expected.items():
    assert same_bits(got[n], want), f"{n}: {got[n].dtype} {list(got[n].shape)} differs from {want.dtype} {list(want.shape)}"

if a.dcp:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    sd = {}
    for n, t in expected.items():
        d = torch.empty_like(t)
        if d.is_floating_point():
            d.fill_(float("nan"))
        elif d.dtype == torch.bool:
            d.fill_(not bool(t.reshape(-1)[0])) if t.numel() else None
        else:
            d.fill_(-7)
        sd[n] = d
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(a.hf_dir))
    for n, want in expected.items():
        assert same_bits(sd[n], want), f"dcp {n}: {sd[n]} differs from {want}"
    print("dcp ok", len(sd))

print("ok", len(got), len(want_files))
