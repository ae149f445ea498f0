"""examples/gpt/model.h for PyTorch's tensor parallelism (DTensor, parallelize_module), for
the fsdp2-tp peer of bench/peers/gpt_peer.py.

The math is gpt_model.Gpt's; the module tree is arranged for a torchtitan-style plan (its
Llama plan: embedding, column- and row-parallel linears, sequence-parallel norms, a
column-parallel head with loss parallelism):

  tok, pos, blocks.<i>.{ln1, attn, ln2, mlp}, ln_f, head
  attn: q, k, v, proj      (--qkv split, torchtitan's wq / wk / wv / wo)
        qkv, proj          (--qkv striped: the fused layer with its rows reordered)
  mlp:  fc, fc_out

Why the fused qkv cannot take a plain ColwiseParallel. gpt_model's qkv is one
Linear(d, 3d) whose rows are [q; k; v], each d rows of n_head heads. ColwiseParallel cuts
the rows contiguously: at tp 2 rank 0 would get q and the first half of k, rank 1 the
second half of k and v, and no rank could compute attention on its own heads. Tessera cuts
each of the three stripes separately (rank r: the q, k and v rows of heads r*H/tp ..).
Two ways to get that here, both the same math as the plain model:

  split    q, k, v are three Linear(d, d) (the plain qkv's three row blocks, bias
           likewise), each ColwiseParallel: rank r holds its heads' rows of each. This is
           torchtitan's layout. Three GEMMs of d/tp output features instead of one.
  striped  one Linear(d, 3d) whose rows are reordered so that the r-th contiguous chunk is
           [q_r; k_r; v_r] (stripe_rows); a plain ColwiseParallel then gives rank r exactly
           Tessera's piece, and the attention views its local output as (3, H/tp, hd).
           One GEMM, as Tessera; the global DTensor is the reordered matrix (a state dict
           of this layout is not the plain model's, which this benchmark never needs).

AdamW and weight decay are elementwise and the clipping norm sums squares, so splitting
or reordering rows changes neither the update nor the norm (the summation order only).

Names differ from gpt_model (blocks.i.attn.q, .mlp.fc, ...); the plain model's weights
load by plain_to_tp_state_dict (so --init-from / --save-init keep using gpt's names).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt_model import VOCAB, gpt2_init_

QKV_LAYOUTS = ("split", "striped")


class Attention(nn.Module):
    def __init__(self, n_head, d_model, qkv):
        super().__init__()
        self.n_head, self.d_model, self.layout = n_head, d_model, qkv
        self.hd = d_model // n_head
        if qkv == "split":
            self.q = nn.Linear(d_model, d_model)
            self.k = nn.Linear(d_model, d_model)
            self.v = nn.Linear(d_model, d_model)
        else:
            self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        # x: [B, T, d] (replicated over the tensor-parallel group); the projections
        # return this rank's heads as plain tensors: [B, T, d / tp] each, or [B, T, 3d / tp].
        if self.layout == "split":
            q, k, v = self.q(x), self.k(x), self.v(x)
            B, T = q.shape[0], q.shape[1]
            q, k, v = (t.view(B, T, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        else:
            qkv = self.qkv(x)
            B, T = qkv.shape[0], qkv.shape[1]
            q, k, v = qkv.view(B, T, 3, -1, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, -1)  # [B, T, d / tp]: own heads
        return self.proj(y)


class Mlp(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_head, d_model, qkv):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(n_head, d_model, qkv)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = Mlp(d_model)

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


class TpGpt(nn.Module):
    """gpt_model.Gpt's computation; forward returns the logits (a DTensor sharded over the
    vocabulary under loss parallelism)."""

    def __init__(self, n_layer, n_head, d_model, seq_len, qkv="split"):
        super().__init__()
        if qkv not in QKV_LAYOUTS:
            raise ValueError(f"qkv layout {qkv!r} is not one of {QKV_LAYOUTS}")
        self.n_layer, self.n_head, self.d_model, self.seq_len, self.qkv = n_layer, n_head, d_model, seq_len, qkv
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*[Block(n_head, d_model, qkv) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, tokens):
        # Under sequence parallelism tok returns this rank's [B, T / tp, d] and pos its
        # [T / tp, d] rows (see tp_plan); otherwise both are whole.
        T = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(T, dtype=torch.long, device=tokens.device))
        return self.head(self.ln_f(self.blocks(x)))


def stripe_rows(w, tp):
    """[q; k; v] (3 stripes along dim 0) -> [q_0; k_0; v_0; q_1; k_1; v_1; ...], r-th
    contiguous chunk of 3 * rows / tp rows = rank r's heads' q, k, v (torch.chunk's rule
    in each stripe, as Tessera's TpCut)."""
    stripes = w.chunk(3, dim=0)
    pieces = [s.chunk(tp, dim=0) for s in stripes]
    return torch.cat([pieces[s][r] for r in range(tp) for s in range(3)], dim=0)


def plain_to_tp_state_dict(sd, qkv, tp):
    """A gpt_model.Gpt state dict (gpt's names) -> TpGpt's."""
    out = {}
    for name, t in sd.items():
        parts = name.split(".")
        if parts[0] == "blocks":
            i, leaf, kind = parts[1], parts[2], parts[3]
            pre = f"blocks.{i}."
            if leaf == "qkv":
                if qkv == "split":
                    for tag, piece in zip("qkv", t.chunk(3, dim=0)):
                        out[f"{pre}attn.{tag}.{kind}"] = piece.clone()
                else:
                    out[f"{pre}attn.qkv.{kind}"] = stripe_rows(t, tp)
            elif leaf == "proj":
                out[f"{pre}attn.proj.{kind}"] = t
            elif leaf in ("fc", "fc_out"):
                out[f"{pre}mlp.{leaf}.{kind}"] = t
            else:
                out[name] = t
        else:
            out[name] = t
    return out


def _replicated_style(out_placement):
    """A ParallelStyle for a module whose parameters are whole on every rank of the group
    (a norm without sequence parallelism, the position embedding): its parameters become
    Replicate DTensors, its plain-tensor inputs Replicate DTensors (from_local: no
    communication), and its output is redistributed to out_placement and returned as a
    plain tensor. Replicate -> Shard(0) takes this rank's rows (no communication); its
    backward all-gathers the gradient, which gives every rank the whole parameter
    gradient."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Replicated(ParallelStyle):
        def _apply(self, module, device_mesh):
            def inputs_fn(mod, inputs, mesh):
                return tuple(DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
                             if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

            def output_fn(mod, out, mesh):
                if out.placements != (out_placement,):
                    out = out.redistribute(placements=(out_placement,))
                return out.to_local()
            return distribute_module(module, device_mesh, None, inputs_fn, output_fn)

    return _Replicated()


def tp_plan(model, sequence_parallel=True, loss_parallel=True):
    """The plan for parallelize_module on the tensor-parallel mesh (1-D), after
    torchtitan's Llama plan:

      tok       RowwiseParallel on the embedding: vocabulary rows, the partial lookups
                reduce-scattered along the sequence (SP) or all-reduced
      pos       whole on every rank; SP: each rank adds its T/tp rows
      ln1, ln2, ln_f   SequenceParallel (SP) or whole
      attn, mlp PrepareModuleInput: the sequence all-gathered once (SP) for all of
                q / k / v (fc)
      q, k, v / qkv, fc   ColwiseParallel: this rank's heads / features
      proj, fc_out        RowwiseParallel: partial sums reduce-scattered along the sequence
                (SP) or all-reduced
      head      ColwiseParallel over the vocabulary; loss parallelism keeps the logits
                sharded (vocab-parallel cross-entropy), otherwise they are all-gathered
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    seq = Shard(1)
    act = seq if sequence_parallel else Replicate()  # the residual stream's layout
    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "pos": _replicated_style(Shard(0) if sequence_parallel else Replicate()),
        "ln_f": SequenceParallel() if sequence_parallel else _replicated_style(Replicate()),
        "head": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel),
    }
    proj = ("q", "k", "v") if model.qkv == "split" else ("qkv",)
    for i in range(model.n_layer):
        b = f"blocks.{i}"
        for ln in ("ln1", "ln2"):
            plan[f"{b}.{ln}"] = SequenceParallel() if sequence_parallel else _replicated_style(Replicate())
        for sub in ("attn", "mlp"):
            plan[f"{b}.{sub}"] = PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
        for p in proj:
            plan[f"{b}.attn.{p}"] = ColwiseParallel()
        plan[f"{b}.mlp.fc"] = ColwiseParallel()
        plan[f"{b}.attn.proj"] = RowwiseParallel(output_layouts=act)
        plan[f"{b}.mlp.fc_out"] = RowwiseParallel(output_layouts=act)
    return plan


def unstripe_rows(w, tp):
    """stripe_rows's inverse."""
    chunks = w.chunk(3 * tp, dim=0)  # [q_0, k_0, v_0, q_1, ...] (equal pieces: heads divide by tp)
    return torch.cat([chunks[3 * r + s] for s in range(3) for r in range(tp)], dim=0)


def tp_to_plain_state_dict(sd, qkv, tp):
    """TpGpt's (whole) tensors -> gpt's names and layout (plain_to_tp_state_dict's inverse)."""
    out, parts_qkv = {}, {}
    for name, t in sd.items():
        p = name.split(".")
        if p[0] == "blocks" and p[2] in ("attn", "mlp"):
            pre, leaf, kind = f"blocks.{p[1]}.", p[3], p[4]
            if leaf in ("q", "k", "v"):
                parts_qkv.setdefault(f"{pre}qkv.{kind}", {})[leaf] = t
            elif leaf == "qkv":
                out[f"{pre}qkv.{kind}"] = unstripe_rows(t, tp)
            else:
                out[f"{pre}{leaf}.{kind}"] = t
        else:
            out[name] = t
    for name, d in parts_qkv.items():
        out[name] = torch.cat([d["q"], d["k"], d["v"]], dim=0)
    return out


def init_local_shards(model, seed, mesh):
    """--init meta: GPT-2 initialisation of each rank's local shard (model.h's distributions;
    the values come from seed, the parameter's name and this rank's coordinates along the
    mesh dimensions that shard the parameter, so that the ranks that hold a replica of a
    shard hold the same values)."""
    import zlib
    from torch.distributed.tensor import DTensor, Shard
    coord = mesh.get_coordinate()
    resid_std = 0.02 / math.sqrt(2.0 * model.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            key = [str(seed), name]
            if isinstance(p, DTensor):
                names = p.device_mesh.mesh_dim_names or tuple(str(i) for i in range(p.device_mesh.ndim))
                for dim_name, place in zip(names, p.placements):
                    if isinstance(place, Shard):
                        key.append(f"{dim_name}={coord[mesh.mesh_dim_names.index(dim_name)]}")
            g = torch.Generator().manual_seed(zlib.crc32("/".join(key).encode()))
            gpt2_init_(name, t, resid_std, g)
