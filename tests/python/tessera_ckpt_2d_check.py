"""A 2-D (FSDP x tensor parallel) sharded checkpoint read by the tessera_ckpt package: format
version 3, `tp` layouts (stripes of qkv, cuts along dim 0 and dim 1) and interleaved replica
groups (docs/checkpoint-format.md §3), against the full checkpoint of the same run.

usage: tessera_ckpt_2d_check.py SHARDED_DIR FULL_FILE

verify() passes; load() gives every tensor equal to the full checkpoint's and the same plain
values (strings naming the run's own directory aside); get(rows=...) of every tensor equals
those rows; inspect() names each tp rule. Prints "ok tessera_ckpt_2d_check: N tensors" on success.
"""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

import tessera_ckpt  # noqa: E402

sharded, full = sys.argv[1], sys.argv[2]
info = tessera_ckpt.inspect(sharded)
assert info["version"] == 3, info["version"]
layouts = {k: v["layout_words"] for k, v in info["keys"].items() if v.get("layout") == "tp"}
assert any(v.startswith("tp dim 0, 3 stripes") for v in layouts.values()), layouts  # qkv
assert any(v.startswith("tp dim 1,") for v in layouts.values()), layouts  # row-parallel weights
report = tessera_ckpt.verify(sharded)  # raises CheckpointError naming every problem
assert report["chunks"] > 0 and report["checksummed"], report
with tessera_ckpt.Checkpoint(sharded) as ck:
    lay = ck._layout
    assert any(e.layout is not None and e.layout.files is not None and e.layout.files.interleaved()
               for e in lay.entries.values()), "no interleaved replica groups"
a, b = tessera_ckpt.load(sharded), tessera_ckpt.load(full)
assert list(a) == list(b), (set(a) ^ set(b))
tensors = 0
for k in a:
    if torch.is_tensor(b[k]):
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        tensors += 1
    elif not (isinstance(b[k], str) and os.sep in b[k]):  # the checkpoint callback's paths differ
        assert a[k] == b[k], (k, a[k], b[k])
rng = random.Random(3)
with tessera_ckpt.Checkpoint(sharded) as ck:
    for k in a:
        if torch.is_tensor(b[k]) and b[k].dim() > 0:
            lo = rng.randint(0, b[k].shape[0])
            hi = rng.randint(lo, b[k].shape[0])
            assert torch.equal(ck.get(k, rows=(lo, hi)), b[k][lo:hi]), (k, lo, hi)
print(f"ok tessera_ckpt_2d_check: {tensors} tensors")
