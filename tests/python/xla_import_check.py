"""Checks a `tessera ckpt import-xla` output with the Python reader (tessera_ckpt, every checksum
verified) against torch_xla's oracles (tests/checkpoint/fixtures/xla/oracle, read by torch.load).

    xla_import_check.py OUT ORACLE.model.pth ORACLE.optim.pth

Every model tensor must equal torch_xla's consolidation bit for bit (a buffer that Tessera gives
back in its original dtype: equal to the oracle's fp32 value cast to it, as torch's .to() casts),
and every optimizer tensor and parameter name the oracle lists must be there, bit for bit.
Prints "ok N" (tensors compared) and exits 0, else names the first key that differs and exits 1.
"""
import sys

import torch

import tessera_ckpt


def same(a, b):
    """Same dtype, shape and bytes (NaN payloads and -0 included)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8))


def main():
    out, model_oracle, optim_oracle = sys.argv[1:4]
    sd = tessera_ckpt.load(out)
    model = torch.load(model_oracle)["model"]
    optim = torch.load(optim_oracle)
    n = 0
    for k, v in model.items():
        mine = sd.get("model." + k)
        if mine is None:
            sys.exit(f"model.{k}: missing in {out}")
        if mine.dtype != v.dtype:
            v = v.to(mine.dtype)
        if not same(mine, v):
            sys.exit(f"model.{k}: differs from torch_xla's consolidation")
        n += 1
    extra = sorted(k for k in sd if k.startswith("model.") and k[6:] not in model)
    if extra:
        sys.exit(f"keys torch_xla's consolidation does not have: {extra}")
    for k, v in optim.items():
        if k not in sd:
            sys.exit(f"{k}: missing in {out}")
        if isinstance(v, str):
            if sd[k] != v:
                sys.exit(f"{k}: {sd[k]!r}, expected {v!r}")
        elif not same(sd[k], v):
            sys.exit(f"{k}: differs from the oracle")
        n += 1
    print("ok", n)


if __name__ == "__main__":
    main()
