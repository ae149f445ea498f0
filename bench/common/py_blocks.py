"""Modules shared by the Python peers of the benchmarks (bench/gpt/py_gpt.py,
bench/strategy/py_ddp.py). The scripts run as `/usr/bin/python3 path/to/script.py`, so
each puts this folder on sys.path from its own __file__ before importing it."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(ln1(x)), then h + MLP(ln2(h)), with causal
    multi-head self-attention and a 4x GELU MLP. `mask_value` fills the future positions
    before the softmax: each peer uses the value of the C++ model it is measured against
    (examples/gpt/model.h: -inf; bench/strategy/strategy_bench.cpp: -1e9); in float32
    both give exactly zero weight."""

    def __init__(self, d, heads, mask_value=float("-inf")):
        super().__init__()
        self.d, self.heads, self.mask_value = d, heads, mask_value
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def attention(self, x):
        B, T, _ = x.shape
        hd = self.d // self.heads
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        att = q @ k.transpose(-2, -1) / math.sqrt(hd)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(future, self.mask_value).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, self.d))

    def forward(self, x):
        h = x + self.attention(self.ln1(x))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
