"""The PyTorch side of test_dcp_backend.cpp's resume test (issue 36 item 1, both ways):
the GPT of examples/gpt (bench/peers/gpt_model.py: same architecture and parameter names),
sharded by FSDP2 and trained with torch.optim.AdamW, moving to and from `gpt train` through
tessera_ckpt.dcp.TrainerState.

usage (under tessera run -n W):
  gpt_trainer_state_peer.py save TEXT DIR N_LAYER N_HEAD D_MODEL SEQ_LEN LR WARMUP DECAY STEPS
      trains STEPS steps, saves DIR/ckpt (TrainerState.save: a Tessera checkpoint at step
      STEPS), trains two more and writes DIR/save.json: the losses of steps STEPS+1 and
      STEPS+2 (1-based, as gpt's metrics.csv counts them), and DIR/py_state.pt: the step
      and the full exp_avg / exp_avg_sq of every parameter after step STEPS+2 (rank 0).
  gpt_trainer_state_peer.py load TEXT DIR N_LAYER N_HEAD D_MODEL SEQ_LEN LR WARMUP DECAY CKPT
      builds a model with other weights, TrainerState.load(CKPT) (a checkpoint gpt train
      wrote), checks every weight and optimizer tensor against tessera_ckpt's own reader
      (bit-exact) and, where DIR/py_state.pt exists, the optimizer state against it (the
      state gpt continued from the Python run must be the one Python reached), then trains
      two steps and writes DIR/load.json: the losses of steps global_step+1 and +2.

The text repeats one SEQ_LEN-byte pattern, so every training window of gpt is the same
window and the data order does not matter; the LR follows gpt's WarmupCosineLR (min ratio
0.1), AdamW's betas (0.9, 0.95), weight decay 0.01, no gradient clipping (gpt --grad-clip 0).
"""
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "peers"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
from gpt_model import Gpt  # noqa: E402


def lr_at(base, count, warmup, decay, min_ratio=0.1):
    """trainer::WarmupCosineLR::lr_at."""
    if count < warmup:
        return base * (count + 1) / warmup
    p = min(1.0, (count - warmup) / (decay - warmup))
    return base * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


def build(n_layer, n_head, d, seq_len, lr, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Gpt(n_layer, n_head, d, seq_len)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    return model, opt


def train_step(model, opt, window, lr):
    """One gpt step on `window`: the loss before the update (what metrics.csv logs)."""
    for g in opt.param_groups:
        g["lr"] = lr
    logits = model(window[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 256).float(), window[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def optimizer_state(model, opt):
    """{fqn: (step, exp_avg, exp_avg_sq)} as full tensors."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)
    return {fqn: (int(s["step"].item()), full(s["exp_avg"]), full(s["exp_avg_sq"])) for fqn, s in osd["state"].items()}


def main(mode, text, out, n_layer, n_head, d, seq_len, lr, warmup, decay, last):
    import tessera_ckpt
    import tessera_ckpt.dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    data = open(text, "rb").read()[: seq_len + 1]
    window = torch.tensor(list(data), dtype=torch.long).unsqueeze(0)
    hparams = {"n_layer": n_layer, "n_head": n_head, "d_model": d, "seq_len": seq_len, "tie_weights": False}
    result = {}
    if mode == "save":
        steps = int(last)
        model, opt = build(n_layer, n_head, d, seq_len, lr, seed=11)
        for i in range(steps):
            train_step(model, opt, window, lr_at(lr, i, warmup, decay))
        tessera_ckpt.dcp.TrainerState(model, opt, global_step=steps, hparams=hparams).save(os.path.join(out, "ckpt"))
        for i in (steps, steps + 1):
            result[str(i + 1)] = train_step(model, opt, window, lr_at(lr, i, warmup, decay))
        state = optimizer_state(model, opt)
        if rank == 0:
            torch.save(state, os.path.join(out, "py_state.pt"))
    else:
        ckpt = last
        model, opt = build(n_layer, n_head, d, seq_len, lr, seed=99)  # other weights than the checkpoint's
        ts = tessera_ckpt.dcp.TrainerState(model, opt)
        ts.load(ckpt)
        for k in ("n_layer", "n_head", "d_model", "seq_len"):
            assert ts.hparams[k] == str(hparams[k]), (k, ts.hparams)
        ck = tessera_ckpt.Checkpoint(ckpt)
        n = 0
        for fqn, p in model.state_dict().items():
            want = ck.get("model." + fqn)
            assert torch.equal(full(p), want), f"model.{fqn} differs from tessera_ckpt's read of {ckpt}"
            n += 1
        state = optimizer_state(model, opt)
        for fqn, (step, m, v) in state.items():
            base = f"optimizer_0.state.{fqn}."
            assert step == ck.get(base + "step") == ts.global_step, (fqn, step, ck.get(base + "step"))
            assert torch.equal(m, ck.get(base + "exp_avg")), base + "exp_avg"
            assert torch.equal(v, ck.get(base + "exp_avg_sq")), base + "exp_avg_sq"
            n += 2
        ck.close()
        ref_path = os.path.join(out, "py_state.pt")
        if os.path.exists(ref_path):
            # gpt continued from the Python run's optimizer state: after the same two steps
            # its state is Python's (float32 arithmetic of two libraries: close, not equal;
            # an optimizer that restarted from zero would have half the exp_avg and step 2).
            ref = torch.load(ref_path, weights_only=True)
            assert sorted(ref) == sorted(state), (sorted(ref), sorted(state))
            for fqn, (step, m, v) in state.items():
                rstep, rm, rv = ref[fqn]
                assert step == rstep, f"{fqn}: step {step} in gpt's checkpoint, {rstep} in Python's run"
                for name, a, b in (("exp_avg", m, rm), ("exp_avg_sq", v, rv)):
                    err = (a - b).abs().max().item()
                    scale = b.abs().max().item()
                    assert err <= 1e-3 * scale + 1e-12, f"{fqn}.{name}: max difference {err} at scale {scale}"
        g = ts.global_step
        for i in (g, g + 1):
            result[str(i + 1)] = train_step(model, opt, window, lr_at(lr, i, warmup, decay))
        result["checked"] = n
    if rank == 0:
        with open(os.path.join(out, mode + ".json"), "w") as f:
            json.dump(result, f)
        print(f"gpt_trainer_state_peer {mode}: {json.dumps(result)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], *map(int, a[3:7]), float(a[7]), int(a[8]), int(a[9]), a[10])
