#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (run once; the seeds are committed).

Uses Debian's /usr/bin/python3 with torch for the torch.save seeds; `make_seeds.py hostile`
writes only the hostile pickles (hostile_seeds.py, standard library only)."""
import json
import pathlib
import struct
import sys

from hostile_seeds import write_hostile

ROOT = pathlib.Path(__file__).resolve().parent / "corpus"
write_hostile(ROOT)
if sys.argv[1:] == ["hostile"]:
    sys.exit(0)

import torch  # noqa: E402


def safetensors(tensors, meta=None):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": {torch.float32: "F32", torch.int64: "I64", torch.uint8: "U8"}[t.dtype],
                        "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


(ROOT / "safetensors").mkdir(parents=True, exist_ok=True)
(ROOT / "safetensors" / "two_tensors").write_bytes(
    safetensors({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([7], dtype=torch.int64)},
                {"format": "pt"}))
(ROOT / "safetensors" / "empty_tensor").write_bytes(safetensors({"z": torch.zeros(0, 4)}))
(ROOT / "safetensors" / "no_tensors").write_bytes(safetensors({}, {"format": "pt"}))

(ROOT / "torch").mkdir(parents=True, exist_ok=True)
torch.save({"w": torch.ones(2, 2), "b": torch.arange(3)}, ROOT / "torch" / "dict_of_tensors.pt")
torch.save(torch.nn.Linear(3, 2).state_dict(), ROOT / "torch" / "linear_state_dict.pt")
torch.save({"nested": {"x": torch.zeros(1)}, "list": [torch.ones(1)]}, ROOT / "torch" / "nested.pt")
print("seeds written under", ROOT)
