"""Peer for strategy_bench: the same block stack, batch and optimizer under PyTorch's
own DDP (gloo, CPU). Run with torchrun, or `tessera run -n 2 /usr/bin/python3 py_ddp.py`.
Prints {"mode": "py_ddp", "world", "params", "step_ms"} on rank 0."""
import json, os, sys, time
import torch, torch.nn as nn, torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from py_blocks import Block  # the pre-norm block, shared with bench/gpt/py_gpt.py


def main():
    dim = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    blocks = [Block(dim, 4, mask_value=-1e9) for _ in range(layers)]  # as strategy_bench.cpp's Block
    model = nn.Sequential(nn.Linear(dim, dim), *blocks, nn.Linear(dim, dim))
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
