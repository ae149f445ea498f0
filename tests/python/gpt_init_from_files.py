"""Writes the checkpoints test_gpt_init_from.cpp gives to `gpt train --init-from`, from the
weights of a consolidated gpt checkpoint (keys model.<fqn>), with the real libraries:

  bare.pt                 torch.save of the bare state dict (keys <fqn>)
  bare.safetensors        the same through safetensors.torch.save_file (another writer)
  missing.safetensors     without head.weight
  extra.safetensors       with a tensor that is no weight of the model (blocks.9.fc.weight)
  bf16.safetensors        ln_f.weight stored as bfloat16

usage: gpt_init_from_files.py CONSOLIDATED.safetensors OUTDIR
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file

src, out = sys.argv[1], sys.argv[2]
full = load_file(src)
w = {k[len("model."):]: v.clone() for k, v in full.items() if k.startswith("model.")}
assert "tok.weight" in w and "head.weight" in w, f"{src}: no gpt weights under model.: {sorted(full)[:8]}"

torch.save(w, os.path.join(out, "bare.pt"))
save_file(w, os.path.join(out, "bare.safetensors"))

missing = {k: v for k, v in w.items() if k != "head.weight"}
save_file(missing, os.path.join(out, "missing.safetensors"))

extra = dict(w)
extra["blocks.9.fc.weight"] = torch.zeros(4, 4)
save_file(extra, os.path.join(out, "extra.safetensors"))

bf16 = dict(w)
bf16["ln_f.weight"] = w["ln_f.weight"].to(torch.bfloat16)
save_file(bf16, os.path.join(out, "bf16.safetensors"))
print("wrote", len(w), "weights")
