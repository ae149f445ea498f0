"""Python peer of the GPT benchmark: the architecture of examples/gpt/model.h (token +
position embeddings, pre-norm blocks with causal self-attention and a GELU MLP, final
LayerNorm, untied linear head over 256 bytes), AdamW, the same global batch split over the
ranks, under PyTorch's own DDP (gloo, CPU).

Started once per rank with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in the environment
(bench/gpt/run.sh spawns them). Prints one JSON line on rank 0:
{"impl": "python-ddp", "world", "params", "tokens_per_s", "peak_rss_mib"}.

  py_gpt.py N_LAYER N_HEAD D_MODEL SEQ_LEN GLOBAL_BATCH STEPS
"""
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from py_blocks import Block  # noqa: E402  (the pre-norm block, shared with bench/strategy/py_ddp.py)


class Gpt(nn.Module):
    def __init__(self, n_layer, n_head, d, seq_len):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(seq_len, d)
        self.blocks = nn.Sequential(*[Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(T, device=tokens.device))
        return self.head(self.ln_f(self.blocks(x)))


def main():
    n_layer, n_head, d, seq_len, batch, steps = (int(a) for a in sys.argv[1:7])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Gpt(n_layer, n_head, d, seq_len)
    params = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    per_rank = batch // world

    def step():
        data = torch.randint(0, 256, (per_rank, seq_len + 1), generator=g)
        logits = ddp(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), data[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    secs = time.perf_counter() - t0
    # The largest rank's peak resident set, MiB (ru_maxrss is in KiB on Linux).
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"impl": "python-ddp", "world": world, "params": params,
                          "tokens_per_s": round(steps * batch * seq_len / secs, 1),
                          "peak_rss_mib": round(rss.item(), 1)}))


if __name__ == "__main__":
    main()
