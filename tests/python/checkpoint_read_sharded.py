"""Reads every data file of a Tessera sharded checkpoint with the safetensors library and
rebuilds each tensor from its chunks, the way a Python user without Tessera would.

usage: checkpoint_read_sharded.py CKPT_DIR
Checks: every data file opens with safetensors.safe_open; each chunk named by
tessera-checkpoint.json is a tensor of that file with the chunk's dtype and box, stored at
the chunk's byte_range; the chunks rebuild every tensor of the known worker state
(tests/checkpoint/checkpoint_scenarios.cpp) exactly. Prints "ok N" (tensors checked).
"""
import json
import os
import struct
import sys

import torch
from safetensors import safe_open

from worker_state import SPECS, expected

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F64": torch.float64, "I64": torch.int64}

ckpt = sys.argv[1]
with open(os.path.join(ckpt, "tessera-checkpoint.json")) as f:
    meta = json.load(f)

files = {}
for entry in meta["files"]:
    path = os.path.join(ckpt, entry["name"])
    with open(path, "rb") as raw:
        (n,) = struct.unpack("<Q", raw.read(8))
    handle = safe_open(path, framework="pt")
    files[entry["name"]] = (handle, 8 + n, json.loads(open(path, "rb").read()[8 : 8 + n]))

checked = 0
for fqn, shape, dtype in SPECS:
    e = meta["entries"][fqn]
    assert DTYPES[e["dtype"]] == dtype and e["shape"] == shape, f"{fqn}: {e['dtype']} {e['shape']}"
    full = torch.zeros(shape, dtype=dtype)
    covered = 0
    for c in e.get("chunks", []):
        handle, data_start, header = files[c["file"]]
        assert c["name"] in handle.keys(), f"{fqn}: {c['name']} not in {c['file']}"
        t = handle.get_tensor(c["name"])
        assert t.dtype == dtype and list(t.shape) == c["sizes"], f"{fqn}: chunk {list(t.shape)} {t.dtype}"
        b, en = header[c["name"]]["data_offsets"]
        assert [data_start + b, data_start + en] == c["byte_range"], f"{fqn}: byte range {c['byte_range']}"
        box = tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"]))
        full[box] = t
        covered += t.numel()
    assert covered == full.numel(), f"{fqn}: chunks cover {covered} of {full.numel()} elements"
    assert torch.equal(full, expected(fqn, shape, dtype)), f"{fqn}: values differ"
    checked += 1
print("ok", checked)
