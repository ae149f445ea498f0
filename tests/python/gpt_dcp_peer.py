"""A minimal PyTorch 2.x version of examples/gpt (same architecture and parameter names),
for test_dcp_import.cpp: random weights, the loss of a batch under them, and those weights
saved with dcp.save from a model sharded by FSDP2 (fully_shard per block and at the root).

usage (2 ranks: tessera run -n 2 -- python gpt_dcp_peer.py TEXT OUTDIR N_LAYER N_HEAD D_MODEL SEQ_LEN [tessera])
  OUTDIR/dcp/        dcp.save({"model": get_model_state_dict(model)})
  OUTDIR/tessera/    with "tessera": the same state dict saved through Tessera's DCP storage
                     writer, dcp.save(..., storage_writer=tessera_ckpt.dcp.Writer(...)): a
                     Tessera checkpoint that gpt reads as it is (test_dcp_backend.cpp)
  OUTDIR/loss.txt    rank 0: the loss (repr of a float) of gpt's first training window, which
                     for a TEXT repeating one SEQ_LEN-byte pattern is every window
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The model of examples/gpt in PyTorch, shared with the benchmark peers.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "peers"))
from gpt_model import Gpt  # noqa: E402


def main(text_path, out, n_layer, n_head, d, seq_len, writer=""):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(11)  # the same weights on every rank, none of them gpt's own init
    model = Gpt(n_layer, n_head, d, seq_len)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")) else 0))
    # gpt's first training window: bytes [0, seq_len] of the text.
    data = open(text_path, "rb").read()[: seq_len + 1]
    window = torch.tensor(list(data), dtype=torch.long).unsqueeze(0)
    with torch.no_grad():
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256).float(), window[:, 1:].reshape(-1)).item()

    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=os.path.join(out, "dcp"))
    if writer == "tessera":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
        import tessera_ckpt.dcp

        dcp.save(state, storage_writer=tessera_ckpt.dcp.Writer(os.path.join(out, "tessera")))
    if rank == 0:
        with open(os.path.join(out, "loss.txt"), "w") as f:
            f.write(repr(loss) + "\n")
        print(f"gpt_dcp_peer: loss {loss!r}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7]), *sys.argv[7:8])
