"""The two CRC32C implementations of tessera_ckpt -- google-crc32c's C extension ("package") and
the pure-Python loop ("python") -- agree with the standard's test vectors, with each other on
every length class (empty, short, blocks with a short last one, blocks over several copy
pieces), and with the block checksums Tessera's C++ writer put in a checkpoint. Also: a
google_crc32c without its C extension is not used, and the Python loop then warns once.

usage: tessera_ckpt_crc.py [--checkpoint DIR] [--file FILE.safetensors] [--bench MIB]
--checkpoint: tessera_ckpt.verify(DIR) with each implementation (and, in a fresh process, without
importing torch); --file: each one's block_crcs of
every tensor of a consolidated file against its tessera.crc32c list; --bench: each one's
throughput (4 MiB blocks; the Python loop on 1 MiB). Prints "ok package python".
"""
import json
import os
import random
import subprocess
import sys
import time
import types
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import tessera_ckpt  # noqa: E402
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
KINDS = ["package", "python"]


def arg(name):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def use(kind):
    c._impl = c._make(kind)  # "package" raises ImportError when google-crc32c's C extension is missing
    assert c.implementation() == ("python" if kind == "python" else "google_crc32c"), kind


rng = random.Random(7)
cases = []
for n, block in [(0, 64), (1, 64), (63, 64), (64, 64), (65, 64), (4096, 4096), (16385, 16384),
                 (70000, 100000), (65536 * 3 + 17, 65536), (300001, 150000), (200000, 64 * 1000 + 32)]:
    data = rng.randbytes(n)
    cases.append((data, block, [c.crc32c_python(data[o : o + block]) for o in range(0, n, block)]))

import torch  # noqa: E402

bf16 = torch.arange(40000, dtype=torch.float32).to(torch.bfloat16)
bf16_crc = c.crc32c_python(bytes(c.byte_view(bf16)))
for kind in KINDS:
    use(kind)
    for data, want in VECTORS:
        got = c.crc32c(data)
        assert got == want, f"{kind}: crc32c({data[:12]!r}...) = {got:08x}, expected {want:08x}"
    for piece in ((1 << 20, 1000) if kind == "package" else (1 << 20,)):  # 1000: blocks over many pieces
        c.PIECE = piece
        for data, block, want in cases:
            for form in (data, bytearray(data), memoryview(data)):
                got = c.block_crcs(form, block)
                assert got == want, f"{kind}: {len(data)} bytes ({type(form).__name__}) in blocks of {block}: {got[:3]} vs {want[:3]}"
        c.PIECE = 1 << 20
    assert c.crc32c(bf16) == bf16_crc, f"{kind}: bf16 tensor"

# google_crc32c whose C extension did not load (its Python code only): not used; the Python
# loop warns once when it checksums a large input (and not when it was asked for).
real = sys.modules.get("google_crc32c")
sys.modules["google_crc32c"] = types.SimpleNamespace(implementation="python", value=lambda b: 0xE3069283)
try:
    c._make("package")
    raise AssertionError("a google_crc32c without its C extension was accepted")
except ImportError:
    pass
os.environ.pop("TESSERA_CKPT_CRC", None)
c._impl, c._warned, c.WARN_BYTES = False, False, 1000
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    assert c.implementation() == "python"
    assert c.block_crcs(b"x" * 1000, 64) == [c.crc32c_python(b"x" * 64)] * 15 + [c.crc32c_python(b"x" * 40)]
    c.block_crcs(b"y" * 2000, 64)
assert len(w) == 1 and "google-crc32c" in str(w[0].message), [str(m.message) for m in w]
sys.modules["google_crc32c"] = real
c.WARN_BYTES = 1 << 20

ckpt, file = arg("--checkpoint"), arg("--file")
if ckpt:  # verify needs no torch (`python -m tessera_ckpt verify` starts in a fraction of a second)
    code = "import sys, tessera_ckpt; tessera_ckpt.verify(sys.argv[1]); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code, ckpt], check=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(tessera_ckpt.__file__))))
for kind in KINDS:
    use(kind)
    if ckpt:
        r = tessera_ckpt.verify(ckpt)
        assert r["checksummed"] and r["bytes"] > (4 << 20), f"{kind}: {r}"
    if file:  # the writer's block checksums: tensors in data-offset order, 4 MiB blocks
        with open(file, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        head = json.loads(raw[8 : 8 + n])
        meta = head.pop("__metadata__")
        block, want = int(meta["tessera.crc32c_block"]), meta["tessera.crc32c"]
        got = ""
        for name, t in sorted(head.items(), key=lambda kv: kv[1]["data_offsets"]):
            b, e = t["data_offsets"]
            got += "".join(f"{x:08x}" for x in c.block_crcs(memoryview(raw)[8 + n + b : 8 + n + e], block))
        assert got == want and len(got) > 8, f"{kind}: {file}: block checksums {got[:32]}... vs the writer's {want[:32]}..."

print("ok", " ".join(KINDS))

if arg("--bench"):
    data = torch.randint(0, 256, (int(arg("--bench")) << 20,), dtype=torch.uint8)
    for kind in KINDS:
        use(kind)
        part = data[: 1 << 20] if kind == "python" else data
        best = 1e9
        for _ in range(3):  # best of 3 (a shared machine)
            t0 = time.perf_counter()
            c.block_crcs(part, 4 << 20)
            best = min(best, time.perf_counter() - t0)
        print(f"{kind}: {len(part) / best / 1e6:.1f} MB/s ({len(part) >> 20} MiB in {best:.3f} s)")
