"""Writes the checkpoints test_gpt_init_from.cpp gives to `gpt train --init-from`, from the
weights of a consolidated gpt checkpoint (keys model.<fqn>), with the real libraries:

  bare.pt                 torch.save of the bare state dict (keys <fqn>)
  bare.safetensors        the same through safetensors.torch.save_file (another writer)
  missing.safetensors     without head.weight
  extra.safetensors       with a tensor that is no weight of the model (blocks.9.fc.weight)
  bf16.safetensors        ln_f.weight stored as bfloat16
  hf/                     a Hugging Face model directory of the bare state dict, several shards and
                          model.safetensors.index.json (huggingface_hub's save_torch_state_dict)
  hf-missing/             the same with head.weight in the index but not in its shard

usage: gpt_init_from_files.py CONSOLIDATED.safetensors OUTDIR
"""
import json
import os
import sys

import torch
from huggingface_hub import save_torch_state_dict
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
hf = os.path.join(out, "hf")
os.makedirs(hf)
save_torch_state_dict(w, hf, max_shard_size=20000)
with open(os.path.join(hf, "model.safetensors.index.json")) as f:
    index = json.load(f)
assert len(set(index["weight_map"].values())) > 2, index

# head.weight dropped from its shard (rewritten by the safetensors library), still in the index.
missing_dir = os.path.join(out, "hf-missing")
os.makedirs(missing_dir)
save_torch_state_dict(w, missing_dir, max_shard_size=20000)
shard = os.path.join(missing_dir, index["weight_map"]["head.weight"])
rest = {k: v for k, v in load_file(shard).items() if k != "head.weight"}
save_file(rest, shard, metadata={"format": "pt"})
print("wrote", len(w), "weights; hf shard of head.weight:", index["weight_map"]["head.weight"])
