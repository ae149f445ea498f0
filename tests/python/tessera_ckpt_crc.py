"""The CRC32C implementations of tessera_ckpt agree with the standard's test vectors and with
each other, on every length class (empty, short, lane multiples and not, several blocks with a
short last one).

usage: tessera_ckpt_crc.py [--bench MIB]
--bench: also prints each implementation's throughput on MIB MiB (4 MiB blocks, as checkpoints;
the torch one on 16 MiB, the Python loop on 1 MiB). Prints "ok IMPLS" (torch first, python last).
"""
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

from tessera_ckpt import _crc32c as c  # noqa: E402

# RFC 3720 (iSCSI) B.4 and the check value of the CRC catalogue.
VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"", 0),
]

kinds = ["torch"]
for opt in ("numpy", "ext2fs", "package"):
    try:
        c._make(opt)
        kinds.append(opt)
    except ImportError:
        pass
kinds.append("python")

rng = random.Random(7)
cases = []
for n, block in [(0, 64), (1, 64), (63, 64), (64, 64), (65, 64), (4096, 4096), (16384, 16384), (16385, 16384),
                 (16448, 100000), (70000, 100000), (65536 * 3 + 17, 65536), (65536 * 4, 65536),
                 (131072 + 20000, 131072), (300001, 150000), (200000, 64 * 1000 + 32)]:
    cases.append((bytes(rng.getrandbits(8) for _ in range(n)), block))

big = random.Random(3).randbytes(9 << 20)
want_all = {}
for kind in kinds:
    c._impl = c._make(kind)
    assert c.implementation() != "" and (kind == "python") == (c._impl is None)
    for data, want in VECTORS:
        got = c.crc32c(data)
        assert got == want, f"{kind}: crc32c({data[:12]!r}...) = {got:08x}, expected {want:08x}"
    for data, block in cases:
        want = [c.crc32c_python(data[o : o + block]) for o in range(0, len(data), block)]
        got = c.block_crcs(data, block)
        assert got == want, f"{kind}: {len(data)} bytes in blocks of {block}: {got[:3]} vs {want[:3]}"
        got_ba = c.block_crcs(bytearray(data), block)
        assert got_ba == want, f"{kind}: bytearray input"
    if kind != "python":  # 9 MiB: split over the thread pool; each 1 MiB block alone is not (under 8 MiB)
        want = [c.crc32c(big[o : o + (1 << 20)]) for o in range(0, len(big), 1 << 20)]
        assert c.block_crcs(big, 1 << 20) == want, f"{kind}: 9 MiB in 1 MiB blocks (threads)"
        want_all.setdefault("big", want)
        assert want == want_all["big"], f"{kind}: 1 MiB blocks differ from {kinds[0]}'s"
    # a torch tensor of another dtype: its bytes
    import torch

    t = torch.arange(40000, dtype=torch.float32).to(torch.bfloat16)
    raw = bytes(c.byte_view(t))
    assert c.crc32c(t) == c.crc32c_python(raw), f"{kind}: bf16 tensor"

print("ok", " ".join(kinds))

if "--bench" in sys.argv:
    mib = int(sys.argv[sys.argv.index("--bench") + 1])
    import torch

    data = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8)
    for kind in kinds:
        c._impl = c._make(kind)
        n = min(len(data), {"python": 1 << 20, "torch": 16 << 20}.get(kind, len(data)))
        part = data[:n]
        c.block_crcs(part[: 4 << 20], 4 << 20)  # tables built
        dt = 1e9
        for _ in range(3):  # best of 3 (a shared machine)
            t0 = time.perf_counter()
            c.block_crcs(part, 4 << 20)
            dt = min(dt, time.perf_counter() - t0)
        print(f"{kind}: {n / dt / 1e6:.1f} MB/s ({n >> 20} MiB in {dt:.3f} s)")
