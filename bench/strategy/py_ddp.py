"""Peer for strategy_bench: the same block stack, batch and optimizer under PyTorch's
own DDP (gloo, CPU). Run with torchrun, or `tessera run -n 2 /usr/bin/python3 py_ddp.py`.
Prints {"mode": "py_ddp", "world", "params", "step_ms"} on rank 0."""
import json, math, os, sys, time
import torch, torch.nn as nn, torch.distributed as dist

class Block(nn.Module):
    def __init__(self, d, heads=4):
        super().__init__()
        self.d, self.heads = d, heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, x):
        B, T, _ = x.shape
        hd = self.d // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-2, -1) / math.sqrt(hd)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -1e9).softmax(-1)
        h = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, self.d))
        return h + self.fc2(nn.functional.gelu(self.fc1(self.ln2(h))))

def main():
    dim = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim), *[Block(dim) for _ in range(layers)], nn.Linear(dim, dim))
    params = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x, y = torch.randn(8, 64, dim, generator=g), torch.randn(8, 64, dim, generator=g)
    def step():
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
    for _ in range(3): step()
    dist.barrier(); t0 = time.perf_counter()
    for _ in range(steps): step()
    dist.barrier()
    ms = (time.perf_counter() - t0) * 1000 / steps
    if dist.get_rank() == 0:
        print(json.dumps({"mode": "py_ddp", "world": dist.get_world_size(), "params": params, "step_ms": round(ms, 3)}))

if __name__ == "__main__":
    main()
