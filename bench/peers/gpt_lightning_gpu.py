"""Lightning Fabric peer of the GPU benchmark (scripts/gpu-check.sh): the architecture of
examples/gpt (bench/gpt/py_gpt.py's Gpt), AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1),
gradient clipping at 1.0, bf16-mixed, on one GPU with the strategy Lightning picks for one
device ("auto": single device). Prints one JSON line:
{"impl": "lightning-fabric", "params", "tokens_per_s", "mfu", "peak_mem_mib", "lightning", "torch"}.

  gpt_lightning_gpu.py N_LAYER N_HEAD D_MODEL SEQ_LEN BATCH STEPS
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "gpt"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
from py_gpt import Gpt  # noqa: E402

try:
    import lightning
    from lightning.fabric import Fabric
except ImportError as e:  # the device machine's image carries lightning; say so if not
    print(json.dumps({"impl": "lightning-fabric", "error": f"lightning is not installed: {e}"}))
    sys.exit(0)


def main():
    n_layer, n_head, d, seq_len, batch, steps = (int(a) for a in sys.argv[1:7])
    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    model = Gpt(n_layer, n_head, d, seq_len)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(1)

    def step():
        data = torch.randint(0, 256, (batch, seq_len + 1), generator=g).to(fabric.device)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), data[:, 1:].reshape(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    tokens = steps * batch * seq_len
    flops = tokens * (6 * params + 12 * n_layer * d * seq_len)
    peak_tflops = float(os.environ.get("GPU_PEAK_TFLOPS", "989"))  # H100/H200 dense bf16
    print(json.dumps({"impl": "lightning-fabric", "params": params, "tokens_per_s": round(tokens / secs, 1),
                      "mfu": round(flops / secs / (peak_tflops * 1e12), 4),
                      "peak_mem_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                      "lightning": lightning.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
