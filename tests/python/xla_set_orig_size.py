"""Copies a torch_xla FSDP rank-file set with one parameter's recorded size changed, for
import-xla's refusal of an _orig_size that does not match the shards
(XlaImport.OrigSizeSmallerThanTheShardsIsRefused in tests/checkpoint/test_xla_import.cpp).

    xla_set_orig_size.py TEMPLATE_DIR OUT_DIR ORIG_NAME DIM [DIM ...]

Every rank file of TEMPLATE_DIR (rank files written by real torch_xla, e.g.
tests/checkpoint/fixtures/xla/params-w2) is loaded and saved under the same name in OUT_DIR
with shard_metadata.shard_info[..][..]["_orig_size"] of the parameter whose "_orig_name" is
ORIG_NAME set to [DIM, ...] (in the type torch_xla stored it as) on every rank, so that the
ranks still agree. The shards and everything else are left as they are. torch_xla is not needed.
"""
import glob
import os
import sys

import torch


def main():
    template, out, name, dims = sys.argv[1], sys.argv[2], sys.argv[3], [int(d) for d in sys.argv[4:]]
    files = sorted(glob.glob(os.path.join(template, "*_rank-*-of-*.pth")))
    if not files:
        sys.exit(f"no rank files in {template}")
    os.makedirs(out, exist_ok=True)
    for f in files:
        ck = torch.load(f, weights_only=False)
        found = [info for keys in ck["shard_metadata"]["shard_info"].values() for info in keys.values()
                 if info["_orig_name"] == name]
        if len(found) != 1:
            sys.exit(f"{f}: {len(found)} parameters named {name!r}")
        found[0]["_orig_size"] = type(found[0]["_orig_size"])(dims)
        torch.save(ck, os.path.join(out, os.path.basename(f)))


if __name__ == "__main__":
    main()
