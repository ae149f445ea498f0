"""Grows a torch_xla FSDP fixture set into a large input for import-xla's memory test
(XlaImport.PeakMemoryFollowsTheLargestTensorNotTheModel in tests/checkpoint/test_xla_import.cpp).

    xla_grow.py TEMPLATE_DIR OUT_DIR ELEMENTS

TEMPLATE_DIR holds rank files written by real torch_xla (tests/checkpoint/fixtures/xla/params-w2,
flatten_parameters=False): their key layout, shard_metadata and optimizer layout are kept, and
every sharded parameter is given ELEMENTS elements (a 2-D parameter [ELEMENTS/side, side] with
side = 2048, a 1-D one [ELEMENTS]). Its shards are cut the way torch_xla cuts them (flatten, pad
with zeros to a multiple of world size * 128, rank r takes the r-th stretch), and so are the AdamW
moments. torch_xla itself is not needed: only the sizes change, not the format.

Values, exact in float32 (the test checks them after the import): parameter i (in the order of
the template's shard_info) is (arange(ELEMENTS) % 65521) + 0.25 * i; its exp_avg adds 100000, its
exp_avg_sq 200000.
"""
import glob
import os
import sys

import torch

SIDE = 2048


def full(i, n, extra):
    return (torch.arange(n, dtype=torch.int64) % 65521).to(torch.float32) + (0.25 * i + extra)


def shard(t, world, rank):
    flat = t.reshape(-1)
    unit = world * 128
    padded = (flat.numel() + unit - 1) // unit * unit
    flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    step = padded // world
    return flat[rank * step:(rank + 1) * step].clone()


def main():
    template, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if n % SIDE:
        sys.exit(f"ELEMENTS must be a multiple of {SIDE}")
    files = sorted(glob.glob(os.path.join(template, "*_rank-*-of-*.pth")))
    if not files:
        sys.exit(f"no rank files in {template}")
    os.makedirs(out, exist_ok=True)
    ckpts = [torch.load(f, weights_only=False) for f in files]
    world = ckpts[0]["shard_metadata"]["world_size"]
    # (unit prefix, shard key) in shard_info order; the optimizer's ids follow the same order.
    params = [(p, k) for p, keys in ckpts[0]["shard_metadata"]["shard_info"].items() for k in keys]
    for rank, ck in enumerate(ckpts):
        assert ck["shard_metadata"]["rank"] == rank, files[rank]
        state = ck["optimizer"]["state"]
        assert sorted(state) == list(range(len(params))), files[rank]
        for i, (prefix, key) in enumerate(params):
            info = ck["shard_metadata"]["shard_info"][prefix][key]
            shape = [n // SIDE, SIDE] if len(info["_orig_size"]) == 2 else [n]
            info["_orig_size"] = type(info["_orig_size"])(shape)  # as torch_xla stored it
            sd_key = (prefix + "." if prefix else "") + key
            assert ck["model"][sd_key].numel() == state[i]["exp_avg"].numel(), (files[rank], sd_key)
            ck["model"][sd_key] = shard(full(i, n, 0), world, rank)
            state[i]["exp_avg"] = shard(full(i, n, 100000), world, rank)
            state[i]["exp_avg_sq"] = shard(full(i, n, 200000), world, rank)
        torch.save(ck, os.path.join(out, os.path.basename(files[rank])))
    print("wrote", len(files), "rank files of", len(params), "parameters of", n, "elements")


if __name__ == "__main__":
    main()
