"""Reads what `tessera ckpt export` wrote and checks every value.

usage: checkpoint_read_export.py OUT.pt OUT.safetensors
Expected values follow tests/worker/checkpoint_scenarios.cpp (full_value, iteration 0).
Reads the safetensors file with a small parser of its own (the format is 8 bytes of
little-endian header length, a JSON header, then the data), so it needs only torch.
"""
import json
import struct
import sys

import torch

SPECS = [
    ("model.w", [7, 5], torch.float32),
    ("model.v", [3, 10], torch.bfloat16),
    ("model.e", [0, 4], torch.float32),
    ("model.b", [5], torch.float32),
    ("model.s", [], torch.float64),
    ("model.z", [0], torch.int64),
    ("opt.m", [9], torch.bfloat16),
    ("opt.big", [6, 3, 2], torch.float32),
]
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F64": torch.float64, "I64": torch.int64}


def expected(fqn, shape, dtype):
    h = 0
    for c in fqn:
        h = (h * 31 + ord(c)) % 23
    n = 1
    for d in shape:
        n *= d
    t = torch.remainder(torch.arange(n, dtype=torch.float64) * 7 + h, 23) - 11
    return (t * 0.25).reshape(shape).to(dtype)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, en = e["data_offsets"]
        dt = ST_DTYPES[e["dtype"]]
        raw = bytearray(data[b:en])
        flat = torch.frombuffer(raw, dtype=dt) if len(raw) else torch.empty(0, dtype=dt)
        out[name] = flat.reshape(e["shape"])
    return out, header.get("__metadata__", {})


def check(d, what):
    assert isinstance(d, dict), f"{what}: {type(d)} is not a dict"
    assert sorted(d) == sorted(k for k, _, _ in SPECS), f"{what}: keys {sorted(d)}"
    for fqn, shape, dtype in SPECS:
        t = d[fqn]
        want = expected(fqn, shape, dtype)
        assert t.dtype == dtype and list(t.shape) == shape, f"{what} {fqn}: {t.dtype} {list(t.shape)}"
        assert torch.equal(t, want), f"{what} {fqn}: values differ\n{t}\n{want}"


pt, st = sys.argv[1], sys.argv[2]
d = torch.load(pt)
assert type(d) is dict, type(d)
check(d, "torch.load")
try:
    check(torch.load(pt, weights_only=True), "torch.load(weights_only=True)")
except TypeError:  # a torch without weights_only
    pass
tensors, meta = read_safetensors(st)
check(tensors, "safetensors")
assert meta.get("tessera.format") == "tessera-consolidated", meta
values = json.loads(meta["tessera.values"])
assert values["opt.step"] == {"kind": "int", "value": 7}, values
print("ok", len(d))
