"""examples/gpt/model.h in PyTorch, for the torch 2.x peers (bench/peers/gpt_peer.py).

The same architecture (token + position embeddings, pre-norm blocks with causal
self-attention and a GELU MLP, final LayerNorm, untied bias-free head over the 256 byte
values) under the SAME parameter names as Tessera's module, so that a state dict moves
between the two sides by name (`tessera ckpt inspect` shows them as model.<fqn>):

    tok.weight, pos.weight,
    blocks.<i>.{ln1,qkv,proj,ln2,fc,fc_out}.{weight,bias},
    ln_f.{weight,bias}, head.weight

GPT-2 initialisation as in model.h: N(0, 0.02) for the embeddings, qkv, fc and the head,
N(0, 0.02 / sqrt(2 n_layer)) for the residual projections (proj, fc_out), zero biases,
LayerNorms (1, 0). The random stream is consumed in model.h's construction order (each
module's own reset first, exactly as torch::nn's constructors do, then the GPT-2 values),
so torch.manual_seed(s) here and at::manual_seed(s) in gpt give the same weights when both
run the same libtorch (bench/peers checks this against build-torch2's gpt; the parity test
loads one set of weights on both sides anyway).

(bench/common/py_blocks.py's Block names its MLP fc1/fc2 for the older peers; this module
is separate so that those keep their names.)
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # bytes


class Block(nn.Module):
    """Pre-norm block: h = x + attn(ln1(x)); out = h + fc_out(gelu(fc(ln2(h))))."""

    def __init__(self, n_layer, n_head, d_model):
        super().__init__()
        self.n_head, self.d_model = n_head, d_model
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        resid_std = 0.02 / math.sqrt(2.0 * n_layer)
        with torch.no_grad():
            for lin in (self.qkv, self.proj, self.fc, self.fc_out):
                lin.weight.normal_(0.0, resid_std if lin is self.proj or lin is self.fc_out else 0.02)
                lin.bias.zero_()

    def attention(self, x):
        B, T, _ = x.shape
        hd = self.d_model // self.n_head
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, hd).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, self.d_model)
        return self.proj(y)

    def forward(self, x):
        h = x + self.attention(self.ln1(x))
        return h + self.fc_out(F.gelu(self.fc(self.ln2(h))))


class Gpt(nn.Module):
    def __init__(self, n_layer=4, n_head=4, d_model=128, seq_len=64):
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"--d-model {d_model} must be a multiple of --n-head {n_head}")
        self.n_layer, self.n_head, self.d_model, self.seq_len = n_layer, n_head, d_model, seq_len
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        with torch.no_grad():
            self.tok.weight.normal_(0.0, 0.02)
            self.pos.weight.normal_(0.0, 0.02)
        self.blocks = nn.Sequential(*[Block(n_layer, n_head, d_model) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        with torch.no_grad():
            self.head.weight.normal_(0.0, 0.02)

    def forward(self, tokens):
        T = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(T, dtype=torch.long, device=tokens.device))
        return self.head(self.ln_f(self.blocks(x)))


def count_parameters(n_layer, d_model, seq_len):
    """model.h's count_parameters (untied)."""
    d = d_model
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return VOCAB * d + seq_len * d + n_layer * block + 2 * d + d * VOCAB


def lm_loss(logits, targets):
    """gpt's lm_loss: cross-entropy of the float logits over the 256 bytes."""
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def gpt2_init_(name, t, resid_std, generator):
    """GPT-2's initial value of the parameter `name` (or its local piece `t`), in place, as
    examples/gpt/model.h gives it: zero biases, LayerNorm weights 1, N(0, resid_std) for the
    residual projections (proj, fc_out), N(0, 0.02) for every other weight."""
    leaf = name.rsplit(".", 2)
    if name.endswith(".bias"):
        t.zero_()
    elif ".ln" in name or name.startswith("ln_f"):
        t.fill_(1.0)
    elif len(leaf) >= 2 and leaf[-2] in ("proj", "fc_out"):
        t.normal_(0.0, resid_std, generator=generator)
    else:
        t.normal_(0.0, 0.02, generator=generator)
