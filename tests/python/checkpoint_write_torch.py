"""Writes checkpoints the way Python users do, for Tessera to import.

usage: checkpoint_write_torch.py OUT_DIR
  model.pt           torch.save(nn.Sequential(Linear(4, 3), BatchNorm1d(3)).state_dict())
  nested.pt          {"model": <that state_dict>, "extra": {...}, "step": 5, "lr": 0.5, "name": "x"}
  model.safetensors  the same state_dict written by safetensors.torch.save_file
  evil.pt            a pickle whose loading would run os.system (must be refused)
Values: Linear weight = arange(12).reshape(3, 4) / 2, bias = [1, 2, 3],
BatchNorm weight = [0.5, 1.5, 2.5], bias = -weight, running_mean = [0.25, 0.5, 0.75],
running_var = [2, 3, 4], num_batches_tracked = 9.
"""
import os
import sys

import torch
from safetensors.torch import save_file

out = sys.argv[1]
m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
with torch.no_grad():
    m[0].weight.copy_(torch.arange(12.0).reshape(3, 4) / 2)
    m[0].bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
    m[1].weight.copy_(torch.tensor([0.5, 1.5, 2.5]))
    m[1].bias.copy_(-m[1].weight)
    m[1].running_mean.copy_(torch.tensor([0.25, 0.5, 0.75]))
    m[1].running_var.copy_(torch.tensor([2.0, 3.0, 4.0]))
    m[1].num_batches_tracked.fill_(9)
sd = m.state_dict()
torch.save(sd, os.path.join(out, "model.pt"))
base = torch.arange(10, dtype=torch.float32)
torch.save(
    {
        "model": sd,
        "extra": {"bf": torch.arange(6, dtype=torch.float32).to(torch.bfloat16), "view": base[2:8:2]},
        "step": 5,
        "lr": 0.5,
        "name": "x",
    },
    os.path.join(out, "nested.pt"),
)

# Written by the real safetensors library, as Hugging Face tooling writes it.
save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"),
          metadata={"format": "pt"})


class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + os.path.join(out, "PWNED"),))


torch.save({"w": torch.ones(2), "evil": Evil()}, os.path.join(out, "evil.pt"))
print("wrote", out)
