"""Reads what `tessera ckpt export` wrote and checks every value.

usage: checkpoint_read_export.py OUT.pt OUT.safetensors
       checkpoint_read_export.py --safetensors-only OUT.safetensors
Expected values follow tests/checkpoint/checkpoint_scenarios.cpp (full_value, iteration 0).
Reads the .pt file with torch.load and the safetensors file with the safetensors library.
"""
import json
import sys

import torch

from worker_state import SPECS, expected, read_safetensors_file


def check(d, what):
    assert isinstance(d, dict), f"{what}: {type(d)} is not a dict"
    assert sorted(d) == sorted(k for k, _, _ in SPECS), f"{what}: keys {sorted(d)}"
    for fqn, shape, dtype in SPECS:
        t = d[fqn]
        want = expected(fqn, shape, dtype)
        assert t.dtype == dtype and list(t.shape) == shape, f"{what} {fqn}: {t.dtype} {list(t.shape)}"
        assert torch.equal(t, want), f"{what} {fqn}: values differ\n{t}\n{want}"


if sys.argv[1] == "--safetensors-only":
    pt, st = None, sys.argv[2]
else:
    pt, st = sys.argv[1], sys.argv[2]
if pt is not None:
    d = torch.load(pt)
    assert type(d) is dict, type(d)
    check(d, "torch.load")
    try:
        check(torch.load(pt, weights_only=True), "torch.load(weights_only=True)")
    except TypeError:  # a torch without weights_only
        pass
tensors, meta = read_safetensors_file(st)
check(tensors, "safetensors")
assert meta.get("tessera.format") == "tessera-consolidated", meta
values = json.loads(meta["tessera.values"])
assert values["opt.step"] == {"kind": "int", "value": 7}, values
print("ok", len(tensors))
