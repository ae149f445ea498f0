"""Time tessera_ckpt.load on a checkpoint, cold (its files dropped from the page cache with
posix_fadvise(DONTNEED) first) and warm, with verify=True and verify=False; for reference also
the same bytes read by torch.load (a `tessera ckpt export --format torch` file) and by
safetensors.torch.load_file (a consolidated file), when given. Every result has one element
of each 4 KiB page read before the clock stops (safetensors maps the file).

usage: tessera_ckpt_load_bench.py CKPT [--pt FILE.pt] [--safetensors FILE] [--rounds N]
Prints one line per measurement: what, seconds (best of N), MB/s.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

import tessera_ckpt  # noqa: E402


def files_of(path):
    if os.path.isdir(path):
        return [os.path.join(path, n) for n in os.listdir(path)]
    return [path]


def drop(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def touch(d):
    """Reads one element of every 4 KiB page of every tensor: a reader that maps the file
    (safetensors) has then read it too."""
    s = 0
    for v in d.values():
        if isinstance(v, torch.Tensor) and v.numel():
            flat = v.reshape(-1)
            s += int(flat[:: max(1, 4096 // v.element_size())].to(torch.float64).sum() != 0)
    return s


def bench(what, paths, nbytes, fn, rounds, cold):
    best = 1e9
    for _ in range(rounds):
        if cold:
            drop(paths)
        t0 = time.perf_counter()
        r = fn()
        touch(r)
        best = min(best, time.perf_counter() - t0)
        del r
    print(f"{what:<44} {'cold' if cold else 'warm'} {best:7.3f} s {nbytes / best / 1e6:8.0f} MB/s", flush=True)


ap = argparse.ArgumentParser()
ap.add_argument("ckpt")
ap.add_argument("--pt")
ap.add_argument("--safetensors")
ap.add_argument("--rounds", type=int, default=3)
a = ap.parse_args()
info = tessera_ckpt.inspect(a.ckpt)
nbytes = info["tensor_bytes"]
print(f"{a.ckpt}: {info['kind']}, world size {info['world_size']}, {nbytes / 2**20:.0f} MiB of tensors; "
      f"CRC32C by {tessera_ckpt._crc32c.implementation()}; torch {torch.__version__}", flush=True)
for cold in (True, False):
    bench("tessera_ckpt.load(verify=True)", files_of(a.ckpt), nbytes, lambda: tessera_ckpt.load(a.ckpt), a.rounds, cold)
    bench("tessera_ckpt.load(verify=False)", files_of(a.ckpt), nbytes,
          lambda: tessera_ckpt.load(a.ckpt, verify=False), a.rounds, cold)
    if a.pt:
        def tl():
            try:
                return torch.load(a.pt, weights_only=True)
            except TypeError:
                return torch.load(a.pt)
        bench("torch.load(export .pt)", [a.pt], nbytes, tl, a.rounds, cold)
    if a.safetensors:
        from safetensors.torch import load_file

        bench("safetensors load_file(consolidated)", [a.safetensors], nbytes, lambda: load_file(a.safetensors),
              a.rounds, cold)
        bench("tessera_ckpt.load(consolidated, verify=True)", [a.safetensors], nbytes,
              lambda: tessera_ckpt.load(a.safetensors), a.rounds, cold)
