"""Version-2 sharded checkpoints (docs/checkpoint-format.md §3) read by the tessera_ckpt package
(python/tessera_ckpt), against checkpoints this script writes itself with a small writer of its
own (safetensors data files with tessera.* metadata, block and header checksums; compact
metadata with its checksum), whose piece placement is computed independently of the package:
torch.chunk for `chunk`, FSDP's own cut of a unit (src/tessera/strategy/fsdp_param_group.cpp,
every cut moved inside whichever parameter it falls in) for `flat`.

usage: tessera_ckpt_v2_check.py [--v1 SHARDED_DIR CONSOLIDATED.safetensors]

Checks: every rule (whole, chunk, flat, list), hybrid `files` (replicas=2), uneven chunks with
empty trailing pieces, flat cuts moved inside rows and a tensor of empty rows (r == 0), a list
with two pieces in one file (FQN@k); load / get / get(rows=...) / inspect / verify and
`python -m tessera_ckpt` equal the full tensors and values; only the data files holding what is
read are opened (none for plain values); a slice of a tensor saved at 16,384 ranks opens only
its pieces' files and evaluates O(log P) cuts per piece; the rule functions against brute
force; check_tiling's overlap sweep against every pair, and lists of 100,000 pieces checked
quickly with the first overlapping pair named; then damaged copies, each refused naming the
file (and key): another save's or rank's data file, a missing or extra piece, a piece of the
wrong shape or dtype, bad rule and `files` parameters, metadata with a flipped byte or edited
and re-checksummed, flipped data and header bytes, a missing data file. --v1: a version-1
sharded checkpoint must still read, tensor for tensor and value for value, as its consolidated
file does.
Prints "ok tessera_ckpt_v2_check: N checks, M refusals" on success; exits non-zero otherwise.
"""
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

PKG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
sys.path.insert(0, PKG)

import torch  # noqa: E402

import tessera_ckpt  # noqa: E402
from tessera_ckpt import _format_metadata, _format_safetensors, _sharding_layout, _sharding_spec  # noqa: E402

crc32c = tessera_ckpt.crc32c
CHECKS = [0]
REFUSALS = [0]

ST_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    CHECKS[0] += 1


def same_tensor(a, b, what):
    check(isinstance(a, torch.Tensor), f"{what}: not a tensor: {type(a)}")
    check(a.dtype == b.dtype and list(a.shape) == list(b.shape),
          f"{what}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}")
    va, vb = a.contiguous(), b.contiguous()
    if a.dtype in INT_VIEW:
        va, vb = va.view(INT_VIEW[a.dtype]), vb.view(INT_VIEW[b.dtype])
    check(torch.equal(va, vb), f"{what}: values differ\n{a}\n{b}")


def same_value(a, b, what):
    if isinstance(b, float):
        check(isinstance(a, float) and struct.pack("<d", a) == struct.pack("<d", b), f"{what}: {a!r} vs {b!r}")
    else:
        check(type(a) is type(b) and a == b, f"{what}: {a!r} vs {b!r}")


def tensor_bytes(t):
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return bytes(_format_byte_view(t))


def _format_byte_view(t):
    from tessera_ckpt import _crc32c

    return _crc32c.byte_view(t)


# ---------------------------------------------------------------- a small writer


def write_safetensors(path, tensors, meta, block):
    """tensors: [(name, tensor)] in data order; meta: __metadata__ (tessera.crc32c,
    tessera.crc32c_block and tessera.header_crc32c are added)."""
    header = {}
    data = []
    crcs = []
    pos = 0
    for name, t in tensors:
        b = tensor_bytes(t)
        header[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(b)]}
        pos += len(b)
        data.append(b)
        crcs += [f"{crc32c(b[o:o + block]):08x}" for o in range(0, len(b), block)]
    md = dict(meta)
    md["tessera.crc32c_block"] = str(block)
    md["tessera.crc32c"] = "".join(crcs)
    md["tessera.header_crc32c"] = "00000000"
    text = json.dumps({"__metadata__": md, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    raw = struct.pack("<Q", len(text)) + text
    crc = f"{crc32c(raw):08x}".encode()
    marker = b'"tessera.header_crc32c":"00000000"'
    at = raw.index(marker) + len(marker) - 9
    raw = raw[:at] + crc + raw[at + 8:]
    with open(path, "wb") as f:
        f.write(raw)
        for b in data:
            f.write(b)


def metadata_text(obj):
    """Compact JSON, `metadata_crc32c` the last member, its checksum patched in."""
    obj = {k: v for k, v in obj.items() if k != "metadata_crc32c"}
    text = json.dumps(obj, separators=(",", ":")).encode()
    assert text.endswith(b"}")
    text = text[:-1] + b',"metadata_crc32c":"00000000"}'
    crc = f"{crc32c(text):08x}".encode()
    return text[:-10] + crc + b'"}'


def write_metadata(d, obj):
    with open(os.path.join(d, "tessera-checkpoint.json"), "wb") as f:
        f.write(metadata_text(obj))


def read_metadata(d):
    with open(os.path.join(d, "tessera-checkpoint.json"), "rb") as f:
        return json.loads(f.read())


def value_json(v):
    if isinstance(v, bool):
        return {"kind": "bool", "value": v}
    if isinstance(v, int):
        return {"kind": "int", "value": v}
    if isinstance(v, float):
        return {"kind": "float", "value": v, "bits": struct.pack(">d", v).hex()}
    if isinstance(v, str):
        return {"kind": "string", "value": v}
    if isinstance(v, bytes):
        return {"kind": "bytes", "hex": v.hex()}
    assert v == {}
    return {"kind": "dict"}


# Independent placement: the test's own rules, never the package's.


def files_of(files, pieces):
    a, s = files["first"], files["step"]
    r, g, h = files.get("replicas", 1), files.get("replica_step", 0), files.get("shift", 0)
    return [a + i * s + ((i + h) % r) * g for i in range(pieces)]


def fsdp_rows(shapes, shards):
    """Per parameter of a unit, the dim-0 rows of each shard (FsdpParamGroup::shard)."""
    params = []
    total = 0
    for shp in shapes:
        rows = 1 if len(shp) == 0 else shp[0]
        rn = 1
        for d in shp[1:]:
            rn *= d
        params.append((total, rows, rn))
        total += rows * rn
    cut = [0] * (shards + 1)
    cut[shards] = total
    moved = 0
    for k in range(1, shards):
        c = total * k // shards
        for off, rows, rn in params:
            n = rows * rn
            if n == 0 or c < off or c >= off + n:
                continue
            m = off + (c - off + rn // 2) // rn * rn
            moved += m != c
            c = m
            break
        cut[k] = max(cut[k - 1], c)
    out = []
    for off, rows, rn in params:
        n = rows * rn
        if rn == 0:
            out.append([rows] + [0] * (shards - 1))
            continue
        out.append([(min(max(cut[r + 1], off), off + n) - min(max(cut[r], off), off + n)) // rn for r in range(shards)])
    return total, [p[0] for p in params], out, moved


class Spec:
    """What the test writes for one tensor key: its full value, layout JSON and pieces
    [(file, offsets, sizes)] (empty ones included), placed by the test's own rules."""

    def __init__(self, kind, full, layout, pieces):
        self.kind, self.full, self.layout, self.pieces = kind, full, layout, pieces


def whole(full, file, kind="tensor"):
    return Spec(kind, full, {"rule": "whole", "file": file}, [(file, [0] * full.dim(), list(full.shape))])


def chunk(full, dim, pieces, files):
    parts = torch.chunk(full, pieces, dim) if full.shape[dim] else []
    fl = files_of(files, pieces)
    out = []
    begin = 0
    for i in range(pieces):
        n = parts[i].shape[dim] if i < len(parts) else 0
        offsets, sizes = [0] * full.dim(), list(full.shape)
        offsets[dim], sizes[dim] = begin, n
        out.append((fl[i], offsets, sizes))
        begin += n
    return Spec("sharded", full, {"rule": "chunk", "dim": dim, "pieces": pieces, "files": files}, out)


def flat_unit(fulls, shards, files_for):
    """FSDP's unit of ``fulls`` (laid end to end) cut into ``shards``; files_for(h) gives
    the `files` of the parameter at index h of the unit."""
    total, offs, rows, moved = fsdp_rows([list(t.shape) for t in fulls], shards)
    specs = []
    for h, (t, off, rr) in enumerate(zip(fulls, offs, rows)):
        files = files_for(h)
        fl = files_of(files, shards)
        pieces = []
        begin = 0
        if t.dim() == 0:  # a flat layout needs rows: the scalar is whole, in its shard's file
            specs.append(whole(t, fl[rr.index(1)], "sharded"))
            continue
        for i in range(shards):
            pieces.append((fl[i], [begin] + [0] * (t.dim() - 1), [rr[i]] + list(t.shape[1:])))
            begin += rr[i]
        layout = {"rule": "flat", "numel": total, "offset": off, "pieces": shards, "files": files}
        specs.append(Spec("sharded", t, layout, pieces))
    return specs, moved


def listed(full, pieces):
    return Spec("sharded", full, {"rule": "list", "pieces": [[f, o, s] for f, o, s in pieces]}, pieces)


def numel(sizes):
    n = 1
    for s in sizes or []:
        n *= s
    return n


def write_v2(d, world_size, items, block=40, save_id="5c0e2d9a11f03b77", only_files=None):
    """Writes a version-2 checkpoint: items [(fqn, Spec or plain value)] in save order.
    Returns {fqn: [(file, name, offsets, sizes)]} of the stored pieces. only_files: write only
    these data files (the others stay absent)."""
    os.makedirs(d, exist_ok=True)
    per_file = {r: [] for r in range(world_size)}
    stored = {}
    entries = {}
    for fqn, v in items:
        if not isinstance(v, Spec):
            entries[fqn] = value_json(v)
            continue
        entries[fqn] = {"kind": v.kind, "dtype": ST_DTYPE[v.full.dtype], "shape": list(v.full.shape),
                        "layout": v.layout}
        nonempty = [(f, o, s) for f, o, s in v.pieces if numel(s) and v.full.numel()]
        count = {}
        for f, _, _ in nonempty:
            count[f] = count.get(f, 0) + 1
        k = {}
        stored[fqn] = []
        for f, o, s in nonempty:
            name = fqn if count[f] == 1 else f"{fqn}@{k.get(f, 0)}"
            k[f] = k.get(f, 0) + 1
            piece = v.full[tuple(slice(a, a + b) for a, b in zip(o, s))].contiguous() if o else v.full.contiguous()
            per_file[f].append((name, piece))
            stored[fqn].append((f, name, o, s))
    for r in range(world_size):
        if only_files is not None and r not in only_files:
            continue
        meta = {"format": "pt", "tessera.format": "tessera-data", "tessera.version": "2", "tessera.rank": str(r),
                "tessera.save_id": save_id}
        write_safetensors(os.path.join(d, _format_metadata.data_file_name(r)), per_file[r], meta, block)
    write_metadata(d, {"format": "tessera-checkpoint", "version": 2, "world_size": world_size, "crc32c_block": block,
                       "save_id": save_id, "keys": [k for k, _ in items], "entries": entries})
    return stored


# ---------------------------------------------------------------- the main checkpoint


def build_main(d):
    g = torch.Generator().manual_seed(7)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    items = [
        ("model.emb", chunk(rnd(10, 6), 0, 4, {"first": 0, "step": 1})),                 # 3,3,3,1
        ("model.uneven", chunk(rnd(6, 3), 0, 4, {"first": 4, "step": 1})),              # 2,2,2,0
        ("model.col", chunk(rnd(3, 10, dtype=torch.float64), 1, 4, {"first": 0, "step": 2})),  # 3,3,3,1 along dim 1
        ("model.tiny", chunk(torch.arange(10, dtype=torch.int64).view(2, 5), 0, 8, {"first": 0, "step": 1})),  # 1,1,0..
    ]
    # An FSDP unit under HYBRID_SHARD: 8 ranks, 2 replica groups of 4; piece i of the
    # parameter at key index h in file i + ((i + h) mod 2) * 4.
    unit = [rnd(5, 3), rnd(2, 4), rnd(4, 4), rnd(()), torch.empty(3, 0), rnd(9, 3), rnd(2, 11, dtype=torch.bfloat16)]
    unit[6] = unit[6].float()  # one dtype per unit: FSDP's flat vector
    names = ["fsdp.a", "fsdp.b", "fsdp.c", "fsdp.s", "fsdp.z", "fsdp.d", "fsdp.e"]
    base = len(items)
    specs, moved = flat_unit(unit, 4, lambda h: {"first": 0, "step": 1, "replicas": 2, "replica_step": 4,
                                                   "shift": base + h})
    check(moved >= 3, f"the unit's cuts should fall inside rows (moved {moved})")
    items += list(zip(names, specs))
    # a tensor of many checksum blocks (40-byte blocks, 64-byte rows), its own unit over 8 ranks
    (big,), _ = flat_unit([rnd(64, 16)], 8, lambda h: {"first": 0, "step": 1})
    items.append(("model.big", big))
    items += [
        ("model.list", listed(rnd(4, 6, dtype=torch.bfloat16),
                              [(1, [0, 0], [2, 3]), (3, [0, 3], [2, 3]), (1, [2, 0], [2, 6])])),
        ("model.rep", whole(rnd(3, dtype=torch.float16), 0)),
        ("model.scalar", whole(rnd(()), 7)),
        ("model.empty", whole(torch.empty(0, 4), 2)),
        ("model.bool", whole(torch.tensor([True, False, True, True, False]), 6)),
        ("step", 3),
        ("lr", 0.5),
        ("neg0", -0.0),
        ("name", "gpt"),
        ("flag", True),
        ("blob", b"\x00\xff"),
        ("extra", {}),
    ]
    stored = write_v2(d, 8, items)
    return items, stored


def expect_error(fn, wanted, what, exc=tessera_ckpt.CheckpointError):
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [w for w in wanted if w not in msg]
        check(not missing, f"{what}: the message lacks {missing}: {msg}")
        REFUSALS[0] += 1
        return msg
    raise AssertionError(f"{what}: accepted")


def opened(ck):
    return sorted(int(n[len("data-rank"):-len(".safetensors")]) for n in ck._headers)


def check_main(d, items, stored):
    full = {k: v.full if isinstance(v, Spec) else v for k, v in items}
    sd = tessera_ckpt.load(d)
    check(list(sd) == [k for k, _ in items], f"key order {list(sd)}")
    for k, v in items:
        if isinstance(v, Spec):
            same_tensor(sd[k], v.full, k)
        else:
            same_value(sd[k], v, k)
    for k, t in tessera_ckpt.load(d, verify=False).items():
        (same_tensor if isinstance(t, torch.Tensor) else same_value)(t, full[k], k + " (verify=False)")
    sub = tessera_ckpt.load(d, prefix="fsdp")
    check(list(sub) == ["a", "b", "c", "s", "z", "d", "e"], f"prefix: {list(sub)}")

    # only the files that hold what is read are opened
    with tessera_ckpt.Checkpoint(d) as ck:
        check(ck.version == 2 and ck.world_size == 8 and ck.kind == "sharded" and ck.save_id == "5c0e2d9a11f03b77",
              "checkpoint properties")
        for k in ("step", "lr", "name", "flag", "blob", "extra"):
            same_value(ck[k], full[k], k)
        check(opened(ck) == [] and not ck._fds, f"plain values opened {opened(ck)}")
        same_tensor(ck["model.emb"], full["model.emb"], "model.emb")
        check(opened(ck) == [0, 1, 2, 3], f"model.emb opened {opened(ck)}")
    with tessera_ckpt.Checkpoint(d) as ck:
        same_tensor(ck["model.uneven"], full["model.uneven"], "model.uneven")
        check(opened(ck) == [4, 5, 6], f"model.uneven (empty last piece) opened {opened(ck)}")
        ck["model.empty"]
        check(opened(ck) == [4, 5, 6], "a zero-element tensor opens no file")
    for k, v in items:
        if not isinstance(v, Spec):
            continue
        want = sorted({f for f, _, _, _ in stored[k]})
        with tessera_ckpt.Checkpoint(d) as ck:
            same_tensor(ck[k], v.full, k)
            check(opened(ck) == want, f"{k}: opened {opened(ck)}, its pieces are in {want}")
        if v.full.dim() == 0:
            continue
        n = v.full.shape[0]
        rng = random.Random(k)
        ranges = [(0, n), (0, 0), (n, n)] + [tuple(sorted((rng.randint(0, n), rng.randint(0, n)))) for _ in range(12)]
        for lo, hi in ranges:
            with tessera_ckpt.Checkpoint(d) as ck:
                same_tensor(ck.get(k, rows=(lo, hi)), v.full[lo:hi], f"{k} rows [{lo}, {hi})")
                want = sorted({f for f, _, o, s in stored[k] if lo < hi and o[0] < hi and o[0] + s[0] > lo})
                check(opened(ck) == want, f"{k} rows [{lo}, {hi}): opened {opened(ck)}, want {want}")
                same_tensor(ck.get(k, rows=slice(lo, hi), verify=False), v.full[lo:hi], f"{k} rows slice")
    with tessera_ckpt.Checkpoint(d) as ck:
        expect_error(lambda: ck.get("model.emb", rows=(3, 11)), ["rows [3, 11)"], "rows past the end", IndexError)
        expect_error(lambda: ck.get("model.scalar", rows=(0, 1)), ["0-dimensional"], "rows of a scalar", ValueError)
        expect_error(lambda: ck.get("step", rows=(0, 1)), ["not a tensor"], "rows of a value", ValueError)

    # few descriptors: files closed and reopened, still the same files
    with tessera_ckpt.Checkpoint(d) as ck:
        ck._max_fds = 2
        for k, v in items:
            if isinstance(v, Spec):
                same_tensor(ck[k], v.full, k + " (2 descriptors)")
                check(len(ck._fds) <= 2, "descriptor bound")
        same_tensor(ck["model.emb"], full["model.emb"], "model.emb again")

    r = tessera_ckpt.verify(d)
    pieces = sum(len(s) for s in stored.values())
    nbytes = sum(v.full.numel() * v.full.element_size() for _, v in items if isinstance(v, Spec))
    check(r["chunks"] == pieces and r["bytes"] == nbytes and r["checksummed"], f"verify: {r}, {pieces} pieces")
    info = tessera_ckpt.inspect(d)
    check(info["version"] == 2 and info["world_size"] == 8 and len(info["files"]) == 8 and info["tensor_bytes"] == nbytes,
          f"inspect: {dict(info)}")
    for k in stored:
        check(info["keys"][k]["chunks"] == len(stored[k]), f"inspect {k}: {info['keys'][k]} vs {len(stored[k])}")
    check(info["keys"]["fsdp.a"]["layout"] == "flat" and info["keys"]["model.list"]["layout"] == "list", "inspect rules")
    str(info)
    env = dict(os.environ, PYTHONPATH=PKG)
    code = "import sys, tessera_ckpt; tessera_ckpt.verify(sys.argv[1]); assert 'torch' not in sys.modules, 'torch imported'"
    p = subprocess.run([sys.executable, "-c", code, d], env=env, capture_output=True, text=True)
    check(p.returncode == 0, f"verify without torch: {p.stderr}")
    for cmd, want in (("inspect", "format version 2"), ("verify", f"OK: {d}: {pieces} chunks, {nbytes} bytes")):
        p = subprocess.run([sys.executable, "-m", "tessera_ckpt", cmd, d], env=env, capture_output=True, text=True)
        check(p.returncode == 0 and want in p.stdout, f"python -m tessera_ckpt {cmd}: {p.returncode} {p.stdout} {p.stderr}")


# ---------------------------------------------------------------- the rule functions


def check_rules():
    rng = random.Random(1)
    for trial in range(400):
        shapes = []
        for _ in range(rng.randint(1, 5)):
            nd = rng.choice([0, 1, 2, 2, 3])
            shapes.append([rng.choice([0, 1, 2, 3, 5, 7, 16]) for _ in range(nd)])
        shards = rng.choice([1, 2, 3, 4, 5, 8, 13, 64])
        total, offs, rows, _ = fsdp_rows(shapes, shards)
        for shp, off, rr in zip(shapes, offs, rows):
            if not shp:
                continue  # a flat layout needs rows (FSDP's scalar is one row of the unit, tested through the others)
            begin = 0
            for i in range(shards):
                got = _sharding_layout.flat_rows(total, off, shp, shards, i)
                check(got == (begin, begin + rr[i]), f"flat_rows({total}, {off}, {shp}, {shards}, {i}) = {got}, "
                      f"FSDP's rows {begin}..{begin + rr[i]}")
                begin += rr[i]
            if numel(shp) == 0:
                continue
            n = shp[0]
            lo = rng.randint(0, n)
            hi = rng.randint(lo, n)
            got = _sharding_layout.flat_pieces_overlapping(total, off, shp, shards, lo, hi)
            want = []
            b = 0
            for i in range(shards):
                if rr[i] and lo < hi and b < hi and b + rr[i] > lo:
                    want.append((i, b, b + rr[i]))
                b += rr[i]
            check(got == want, f"flat_pieces_overlapping({total}, {off}, {shp}, {shards}, {lo}, {hi}) = {got}, want {want}")
    # the highest file of a `files` map, O(1), against every piece
    for trial in range(3000):
        pieces = rng.randint(1, 12)
        s = rng.randint(1, 3)
        r = rng.choice([1, 1, 2, 3, 5])
        fm = _sharding_layout.FileMap(rng.randint(0, 4), s, r, rng.randint(pieces * s, pieces * s + 3) if r > 1 else rng.randint(0, 3),
                             rng.randint(0, 9))
        files = [fm.file(i) for i in range(pieces)]
        i = fm.last_file_piece(pieces)
        check(files[i] == max(files), f"last_file_piece {fm!r} P={pieces}: {i} -> {files[i]}, max {max(files)}")
        check(len(set(files)) == pieces, f"{fm!r}: two pieces share a file")
    # a slice of a tensor cut over 2^20 pieces: a few cut evaluations per piece, not a loop over all
    calls = [0]
    real = _sharding_layout.flat_row_cut

    def counting(*a):
        calls[0] += 1
        return real(*a)

    _sharding_layout.flat_row_cut = counting
    try:
        P = 1 << 20
        shape = [3 * P + 17, 5]
        T = shape[0] * 5 + 1000
        for lo, hi in ((0, 1), (123456, 123470), (shape[0] - 4, shape[0]), (0, shape[0] // P * 3)):
            calls[0] = 0
            got = _sharding_layout.flat_pieces_overlapping(T, 1000, shape, P, lo, hi)
            check(got and got[0][1] <= lo and got[-1][2] >= hi and all(a[2] == b[1] for a, b in zip(got, got[1:])),
                  f"pieces of rows [{lo}, {hi}): {got[:3]}...")
            check(calls[0] <= 2 * 21 * (len(got) + 1), f"{calls[0]} cut evaluations for {len(got)} pieces")
    finally:
        _sharding_layout.flat_row_cut = real


def check_overlaps():
    """check_tiling's overlap check (_sharding_spec.first_overlap, a sweep) names the pair a check of
    every pair names, on random tilings of 1 to 4 dimensions (a box cut again and again, shuffled)
    with boxes moved by one; lists of 100,000 pieces (cut along one dimension, and a 250 x 400
    grid in random order) pass quickly (every pair: 5 billion comparisons), and an overlap
    among them is named by its first pair in the list, before a later piece outside the shape."""
    rng = random.Random(7)

    def box(offsets, sizes):
        return _format_metadata.Chunk(list(offsets), list(sizes), 0, None, 0, 0, [])

    def every_pair(v):
        for j, b in enumerate(v):
            for i in range(j):
                a = v[i]
                if numel(a.sizes) and numel(b.sizes) and all(
                        max(p, q) < min(p + s, q + z) for p, s, q, z in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                    return i, j
        return None

    for trial in range(1500):
        nd = rng.choice([0, 1, 2, 2, 3, 4])
        ext = rng.choice([3, 6, 20, 60])
        v = [box([0] * nd, [ext] * nd)]
        for _ in range(rng.randint(0, 60) if nd else 0):
            k, d = rng.randrange(len(v)), rng.randrange(nd)
            if v[k].sizes[d] < 2:
                continue
            cut = rng.randint(1, v[k].sizes[d] - 1)
            rest = box(v[k].offsets, v[k].sizes)
            v[k].sizes[d] = cut
            rest.offsets[d] += cut
            rest.sizes[d] -= cut
            v.append(rest)
        rng.shuffle(v)
        for _ in range(rng.randint(0, 2) if nd else 0):
            b, d = rng.choice(v), rng.randrange(nd)
            b.offsets[d] = max(0, b.offsets[d] + rng.choice([-1, 1]))
        if rng.random() < 0.3:
            extra = box([rng.randrange(ext) for _ in range(nd)], [rng.randint(0, 2) for _ in range(nd)])
            v.insert(rng.randint(0, len(v)), extra)
        got, want = _sharding_spec.first_overlap(v), every_pair(v)
        check(got == want, f"first_overlap {[(b.offsets, b.sizes) for b in v]} = {got}, every pair: {want}")

    n = 100000
    rows = [box([2 * i, 0], [2, 4]) for i in range(n)]
    grid = [box([2 * r, 3 * c], [2, 3]) for r in range(250) for c in range(400)]
    rng.shuffle(grid)
    w, g = _format_metadata.Entry("sharded", "F32", [2 * n, 4]), _format_metadata.Entry("sharded", "F32", [500, 1200])
    t0 = time.monotonic()
    _format_metadata.check_tiling("w", w, "m", rows, "piece")
    _format_metadata.check_tiling("g", g, "m", grid, "piece")
    check(time.monotonic() - t0 < 60, f"two lists of 100,000 pieces checked in {time.monotonic() - t0:.1f} s")
    # piece 70,000 moved up a row overlaps piece 69,999; the last piece, at [1:3, 0:4], overlaps
    # pieces 0 and 1 (the sweep's first meeting), later in the list; piece 80,000 lies outside
    rows[70000].offsets[0] -= 1
    rows[n - 1] = box([1, 0], [2, 4])
    rows[80000].offsets[1] = 1
    expect_error(lambda: _format_metadata.check_tiling("w", w, "m", rows, "piece"),
                 ["m: key 'w': pieces [139998:140000, 0:4] and [139999:140001, 0:4] overlap"],
                 "100,000 pieces, overlap")
    rows[70000].offsets[0] += 1
    expect_error(lambda: _format_metadata.check_tiling("w", w, "m", rows, "piece"),
                 ["m: key 'w': piece [160000:160002, 1:5] lies outside the shape [200000, 4]"],
                 "100,000 pieces, outside")
    b20, b30 = grid[20], grid[30]
    grid[60000], grid[500] = box(b20.offsets, b20.sizes), box(b30.offsets, b30.sizes)
    expect_error(lambda: _format_metadata.check_tiling("g", g, "m", grid, "piece"),
                 [f"m: key 'g': pieces {b30.box()} and {b30.box()} overlap"], "grid of 100,000 pieces, overlap")


def check_huge_world(tmp):
    """World size 16,384, one tensor cut over every rank: only the data files of the pieces
    read exist, and reading a slice (or a value) needs no other."""
    W = 16384
    g = torch.Generator().manual_seed(3)
    full = torch.randn(W * 2 + 5, 3, generator=g)
    (spec,), _ = flat_unit([full], W, lambda h: {"first": 0, "step": 1})
    lo, hi = 20000, 20013
    need = sorted({f for f, o, s in spec.pieces if s[0] and o[0] < hi and o[0] + s[0] > lo})
    d = os.path.join(tmp, "huge")
    write_v2(d, W, [("w", spec), ("step", 9)], only_files=set(need))
    with tessera_ckpt.Checkpoint(d) as ck:
        same_value(ck["step"], 9, "huge: step")
        same_tensor(ck.get("w", rows=(lo, hi)), full[lo:hi], "huge: rows")
        check(opened(ck) == need and len(need) <= 8, f"huge: opened {opened(ck)}, need {need}")
        expect_error(lambda: ck["w"], ["data file 'data-rank00000.safetensors' is missing"], "huge: whole tensor",
                     tessera_ckpt.CheckpointNotFoundError)


# ---------------------------------------------------------------- damaged copies


def copy(src, tmp, name):
    d = os.path.join(tmp, name)
    shutil.copytree(src, d)
    return d


def rewrite_file(d, rank, edit_meta=None, edit_tensors=None, block=40):
    """Rewrites data file ``rank`` from its tensors (read with the package), changing its
    metadata and/or tensors; checksums recomputed (the damage is the content)."""
    path = os.path.join(d, _format_metadata.data_file_name(rank))
    st = _format_safetensors.Safetensors(path)
    tensors = []
    for name in st.order:
        dtype, shape, b, e = st.tensors[name]
        with open(path, "rb") as f:
            f.seek(b)
            raw = f.read(e - b)
        t = torch.frombuffer(bytearray(raw), dtype=getattr(torch, _format_safetensors.DTYPES[dtype][0])) if raw else \
            torch.empty(0, dtype=getattr(torch, _format_safetensors.DTYPES[dtype][0]))
        tensors.append((name, t.reshape(shape)))
    meta = {k: v for k, v in st.metadata.items() if k not in ("tessera.crc32c", "tessera.crc32c_block", "tessera.header_crc32c")}
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        tensors = edit_tensors(tensors)
    write_safetensors(path, tensors, meta, block)


def edit_entry(d, key, fn):
    j = read_metadata(d)
    fn(j["entries"][key])
    write_metadata(d, j)


def flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def refused(d, wanted, what, also_verify=False, exc=tessera_ckpt.CheckpointError):
    expect_error(lambda: tessera_ckpt.load(d), wanted, what + " (load)", exc)
    if also_verify:
        expect_error(lambda: tessera_ckpt.verify(d), ["CORRUPT"] + wanted, what + " (verify)")


def check_damaged(src, tmp, items):
    mf = "tessera-checkpoint.json"
    f3 = _format_metadata.data_file_name(3)

    # another save's data file: refused where it is read, plain values still read
    d = copy(src, tmp, "save_id")
    rewrite_file(d, 3, lambda m: m.update({"tessera.save_id": "0123456789abcdef"}))
    refused(d, [f"/save_id/{f3}'", "tessera.save_id", "0123456789abcdef", "5c0e2d9a11f03b77"], "save_id", True)
    with tessera_ckpt.Checkpoint(d) as ck:
        same_value(ck["step"], 3, "step beside a foreign data file")
        same_tensor(ck["model.uneven"], dict(items)["model.uneven"].full, "a tensor beside a foreign data file")
        expect_error(lambda: ck["model.emb"], [f3, "tessera.save_id"], "save_id: model.emb")

    d = copy(src, tmp, "rank")  # rank 2's file in rank 3's place
    shutil.copy(os.path.join(d, _format_metadata.data_file_name(2)), os.path.join(d, f3))
    refused(d, [f3, "tessera.rank is \"2\", not 3"], "rank", True)

    d = copy(src, tmp, "version")
    rewrite_file(d, 5, lambda m: m.update({"tessera.version": "1"}))
    refused(d, [_format_metadata.data_file_name(5), "tessera.version is \"1\""], "data file version", True)

    d = copy(src, tmp, "block")  # the data file's own checksum blocks, of another size than the metadata says
    rewrite_file(d, 5, block=48)
    refused(d, [_format_metadata.data_file_name(5), "checksum blocks of 48 bytes, the metadata says 40"], "data file block size", True)

    d = copy(src, tmp, "format")
    rewrite_file(d, 5, lambda m: m.update({"tessera.format": "tessera-consolidated"}))
    refused(d, [_format_metadata.data_file_name(5), "tessera.format"], "data file format", True)

    # a missing piece: model.list's second piece in file 1
    d = copy(src, tmp, "missing_piece")
    rewrite_file(d, 1, edit_tensors=lambda ts: [t for t in ts if t[0] != "model.list@1"])
    refused(d, [_format_metadata.data_file_name(1), "key 'model.list'", "piece 2 [2:4, 0:6]", "(tensor 'model.list@1') is not in the data file"],
            "missing piece", True)
    d = copy(src, tmp, "missing_piece2")
    rewrite_file(d, 2, edit_tensors=lambda ts: [t for t in ts if t[0] != "model.emb"])
    refused(d, [_format_metadata.data_file_name(2), "key 'model.emb'", "(tensor 'model.emb') is not in the data file"], "missing piece", True)

    # extra tensors: refused by load as by verify (issue 44 item 2: what verify refuses never loads)
    for name, t in (("model.extra", torch.zeros(2)), ("model.empty", torch.zeros(0, 4)), ("model.emb@1", torch.zeros(3, 6))):
        d = copy(src, tmp, "extra_" + name)
        rewrite_file(d, 2, edit_tensors=lambda ts: ts + [(name, t)])
        expect_error(lambda: tessera_ckpt.load(d), [_format_metadata.data_file_name(2), f"tensor '{name}'",
                                                    "is no piece of any layout in the metadata"], "extra piece (load)")
        msg = expect_error(lambda: tessera_ckpt.verify(d), ["CORRUPT", _format_metadata.data_file_name(2), f"tensor '{name}'",
                                                            "is no piece of any layout in the metadata"], "extra piece " + name)
        check("1 problem(s)" in msg, msg)
        p = subprocess.run([sys.executable, "-m", "tessera_ckpt", "verify", d], env=dict(os.environ, PYTHONPATH=PKG),
                           capture_output=True, text=True)
        check(p.returncode == 1 and "CORRUPT" in p.stderr and name in p.stderr, f"python -m verify: {p.stderr}")

    # a piece of the wrong shape or dtype
    d = copy(src, tmp, "shape")
    rewrite_file(d, 0, edit_tensors=lambda ts: [(n, t[:2] if n == "model.emb" else t) for n, t in ts])
    # (the words of the C++ reader: every data file is checked whole when it is opened)
    refused(d, [_format_metadata.data_file_name(0), "key 'model.emb'",
                "tensor 'model.emb' has dtype F32 and shape [2, 6], the layout says F32 [3, 6]"], "piece shape", True)
    d = copy(src, tmp, "dtype")
    rewrite_file(d, 0, edit_tensors=lambda ts: [(n, t.double() if n == "model.emb" else t) for n, t in ts])
    refused(d, ["key 'model.emb'", "has dtype F64 and shape [3, 6], the layout says F32 [3, 6]"], "piece dtype", True)

    # bad layouts (metadata edited and re-checksummed)
    def layout_case(name, key, fn, wanted):
        d = copy(src, tmp, "layout_" + name)
        edit_entry(d, key, fn)
        refused(d, [mf, f"key '{key}'"] + wanted, "layout " + name)
        expect_error(lambda: tessera_ckpt.Checkpoint(d), [mf] + wanted, "layout " + name + " (open)")

    def set_(path, v):
        def fn(e):
            o = e
            for p in path[:-1]:
                o = o[p]
            if v is None:
                del o[path[-1]]
            else:
                o[path[-1]] = v
        return fn

    layout_case("dim", "model.emb", set_(["layout", "dim"], 2), ["layout.dim is 2, outside [0, 1]"])
    layout_case("dim_neg", "model.emb", set_(["layout", "dim"], -1), ["layout.dim is -1"])
    layout_case("pieces0", "model.emb", set_(["layout", "pieces"], 0), ["layout.pieces is 0, outside [1, 8]"])
    layout_case("pieces_big", "model.emb", set_(["layout", "pieces"], (1 << 20) + 1), ["layout.pieces is 1048577, outside [1, 8]"])
    layout_case("pieces_str", "model.emb", set_(["layout", "pieces"], "4"), ["layout.pieces: expected an integer, got \"4\""])
    layout_case("chunk_scalar", "model.scalar", lambda e: e.update(layout={"rule": "chunk", "dim": 0, "pieces": 1,
                                                                            "files": {"first": 0, "step": 1}}),
                ["a chunk layout needs a tensor of at least one dimension"])
    layout_case("flat_scalar", "fsdp.s", lambda e: e.update(layout={"rule": "flat", "numel": 89, "offset": 38, "pieces": 4,
                                                                     "files": {"first": 0, "step": 1}}),
                ["a flat layout needs a tensor of at least one dimension"])
    layout_case("rule", "model.emb", set_(["layout", "rule"], "rows"), ["unknown layout rule \"rows\" (known: whole, chunk, flat, list; tp needs format version 3)"])
    layout_case("no_layout", "model.emb", set_(["layout"], None), ["layout is not an object"])
    layout_case("flat_over", "fsdp.d", lambda e: e["layout"].update(offset=e["layout"]["numel"] - 17),
                ["layout.offset", "exceed layout.numel"])
    layout_case("flat_neg", "fsdp.d", set_(["layout", "offset"], -1), ["layout.offset is -1"])
    layout_case("whole_file", "model.rep", set_(["layout", "file"], 8), ["layout.file is 8, outside [0, 7]"])
    layout_case("list_overlap", "model.list", set_(["layout", "pieces", 2, 1], [1, 0]), ["pieces [0:2, 0:3] and [1:3, 0:6] overlap"])
    layout_case("list_gap", "model.list", set_(["layout", "pieces", 1, 2], [2, 2]), ["the pieces cover 22 of 24 elements"])
    layout_case("list_outside", "model.list", set_(["layout", "pieces", 1, 1], [0, 4]), ["layout.pieces[1] (offsets [0, 4], sizes [2, 3]) lies outside the shape [4, 6]"])
    layout_case("list_file", "model.list", set_(["layout", "pieces", 0, 0], 8), ["layout.pieces[0] file is 8, outside [0, 7]"])
    layout_case("list_form", "model.list", set_(["layout", "pieces", 0], [1, [0, 0]]), ["layout.pieces[0] is not [file, offsets, sizes]"])
    # files constraints
    layout_case("step0", "model.emb", set_(["layout", "files", "step"], 0), ["layout.files.step is 0, outside [1, 8]"])
    layout_case("first_missing", "model.emb", set_(["layout", "files", "first"], None), ["files.first: expected an integer, got null"])
    layout_case("first_out", "model.emb", set_(["layout", "files", "first"], 5), ["layout.files reach data file 8, outside [0, 7]"])
    layout_case("step_out", "model.col", set_(["layout", "files", "step"], 3), ["files reach data file 9"])
    layout_case("replica_step", "fsdp.a", set_(["layout", "files", "replica_step"], 3),
                ["layout.files.replica_step 3 is below layout.pieces * layout.files.step = 4"])
    layout_case("replicas_out", "fsdp.a", set_(["layout", "files", "replicas"], 3), ["layout.files reach data file 11, outside [0, 7]"])
    layout_case("replicas0", "fsdp.a", set_(["layout", "files", "replicas"], 0), ["files.replicas is 0"])
    layout_case("shift_missing", "fsdp.a", set_(["layout", "files", "shift"], None), ["files.shift: expected an integer, got null"])
    layout_case("shift_neg", "fsdp.a", set_(["layout", "files", "shift"], -1), ["files.shift is -1"])
    layout_case("files_form", "fsdp.a", set_(["layout", "files"], [0, 1]), ["layout.files is not an object"])

    # metadata: top-level checks (re-checksummed)
    def meta_case(name, fn, wanted):
        d = copy(src, tmp, "meta_" + name)
        j = read_metadata(d)
        fn(j)
        write_metadata(d, j)
        refused(d, [mf] + wanted, "metadata " + name)

    meta_case("version4", lambda j: j.update(version=4), ["format version 4 is not supported (this reader reads versions 1..3)"])
    meta_case("version_wrap", lambda j: j.update(version=(1 << 32) + 2), ["format version 4294967298"])
    meta_case("world0", lambda j: j.update(world_size=0), ["world_size is 0, outside [1, 1048576]"])
    meta_case("world_big", lambda j: j.update(world_size=(1 << 20) + 1), ["world_size is 1048577"])
    meta_case("save_id_upper", lambda j: j.update(save_id="5C0E2D9A11F03B77"), ["save_id", "16 lowercase hex"])
    meta_case("save_id_short", lambda j: j.update(save_id="5c0e2d9a11f03b7"), ["save_id", "16 lowercase hex"])
    meta_case("no_save_id", lambda j: j.pop("save_id"), ["save_id null"])
    meta_case("block", lambda j: j.update(crc32c_block=12), ["crc32c_block", "multiple of 8"])
    meta_case("int_value", lambda j: j["entries"]["step"].update(value=1 << 63), ["key 'step'", "outside"])
    meta_case("float_bits", lambda j: j["entries"]["lr"].update(value=0.25), ["key 'lr'", "disagrees with its bits"])
    meta_case("dtype", lambda j: j["entries"]["model.emb"].update(dtype="F8E4"), ["key 'model.emb'", "unknown dtype"])
    meta_case("entry_more", lambda j: j["entries"].update(ghost={"kind": "int", "value": 1}), ["25 entries for 24 keys"])
    meta_case("key_twice", lambda j: j["keys"].__setitem__(-1, "step"), ["key 'step' listed twice"])
    meta_case("no_entry", lambda j: j["keys"].__setitem__(-1, "ghost"), ["key 'ghost' has no entry"])
    meta_case("shape", lambda j: j["entries"]["model.emb"].update(shape=[1 << 40, 1 << 40]), ["key 'model.emb'", "2^62"])

    d = copy(src, tmp, "dup")  # a duplicate key, re-checksummed
    text = metadata_text(read_metadata(d)).replace(b'"version":2,', b'"version":2,"version":2,', 1)
    crc = f"{crc32c(text[:-10] + b'00000000' + text[-2:]):08x}".encode()
    with open(os.path.join(d, mf), "wb") as f:
        f.write(text[:-10] + crc + text[-2:])
    refused(d, [mf, "duplicate key 'version'"], "duplicate key")

    # metadata checksum: a flipped byte (a plain value's digit: still valid JSON), a trailing
    # newline, the version-1 form
    d = copy(src, tmp, "flip_meta")
    with open(os.path.join(d, mf), "rb") as f:
        at = f.read().index(b'"step":{"kind":"int","value":3}') + len('"step":{"kind":"int","value":')
    flip(os.path.join(d, mf), at)  # 3 -> 2
    refused(d, [mf, "metadata checksum mismatch"], "flipped metadata byte")
    d = copy(src, tmp, "flip_meta_crc")
    flip(os.path.join(d, mf), os.path.getsize(os.path.join(d, mf)) - 4)
    refused(d, [mf, "metadata checksum mismatch"], "flipped checksum digit")
    d = copy(src, tmp, "newline")
    with open(os.path.join(d, mf), "ab") as f:
        f.write(b"\n")
    refused(d, [mf, 'does not end with ,"metadata_crc32c":"xxxxxxxx"}'], "trailing newline")
    d = copy(src, tmp, "v1_form")  # written as version 1 writes it: no version-2 tail
    j = read_metadata(d)
    j.pop("metadata_crc32c")
    text = json.dumps(j, indent=1).encode()
    text = text[:-2] + b',\n "metadata_crc32c": "00000000"\n}'
    crc = f"{crc32c(text):08x}".encode()
    at = text.index(b'"metadata_crc32c": "') + len('"metadata_crc32c": "')
    with open(os.path.join(d, mf), "wb") as f:
        f.write(text[:at] + crc + text[at + 8:])
    refused(d, [mf, 'does not end with ,"metadata_crc32c"'], "version-1 style metadata of version 2")

    # tensor data: a flipped byte in model.big's piece in file 5
    d = copy(src, tmp, "flip_data")
    path = os.path.join(d, _format_metadata.data_file_name(5))
    st = _format_safetensors.Safetensors(path)
    b = st.tensors["model.big"][2]
    flip(path, b + 45)  # block 1 of the piece
    refused(d, [_format_metadata.data_file_name(5), "key 'model.big'", "checksum mismatch in block 1"], "flipped data byte", True)
    tessera_ckpt.load(d, verify=False)
    with tessera_ckpt.Checkpoint(d) as ck:
        big = dict(items)["model.big"]
        f, o, s = [p for p in big.pieces if p[0] == 5][0]
        # 64-byte rows, 40-byte blocks: block 1 (bytes 40..80 of the piece) holds parts of rows 0 and 1
        same_tensor(ck.get("model.big", rows=(o[0] + 2, o[0] + s[0])), big.full[o[0] + 2:o[0] + s[0]],
                    "rows past the damaged block")
        for r in (0, 1):
            expect_error(lambda: ck.get("model.big", rows=(o[0] + r, o[0] + r + 1)), ["checksum mismatch in block 1"],
                         f"damaged row {r}")

    d = copy(src, tmp, "flip_header")
    path = os.path.join(d, _format_metadata.data_file_name(6))
    with open(path, "rb") as f:
        at = f.read().index(b'"format":"pt"') + 11
    flip(path, at)  # "pt" -> "pu"
    refused(d, [_format_metadata.data_file_name(6), "header checksum mismatch"], "flipped header byte", True)

    d = copy(src, tmp, "missing_file")
    os.remove(os.path.join(d, _format_metadata.data_file_name(7)))
    refused(d, ["data file 'data-rank00007.safetensors' is missing"], "missing data file",
            exc=tessera_ckpt.CheckpointNotFoundError)
    # verify: a problem found from the directory listing, as the C++ verify reports it (never opened)
    expect_error(lambda: tessera_ckpt.verify(d), ["world_size is 8, but 1 of its data files are missing "
                                                  "('data-rank00007.safetensors')"], "missing data file (verify)")
    with tessera_ckpt.Checkpoint(d) as ck:
        same_tensor(ck["model.emb"], dict(items)["model.emb"].full, "model.emb beside a missing file")

    d = copy(src, tmp, "replaced")  # a data file replaced while it is read (reopened after its descriptor was closed)
    with tessera_ckpt.Checkpoint(d) as ck:
        ck._max_fds = 1
        ck["model.emb"]
        p0 = os.path.join(d, _format_metadata.data_file_name(0))
        shutil.copy(p0, p0 + ".new")
        os.replace(p0 + ".new", p0)
        expect_error(lambda: ck["model.emb"], [_format_metadata.data_file_name(0), "was replaced"], "replaced data file")


def check_v1(sharded, consolidated):
    a = tessera_ckpt.load(sharded)
    b = tessera_ckpt.load(consolidated)
    check(list(a) == list(b), f"v1: keys differ: {list(a)[:5]} vs {list(b)[:5]}")
    for k in a:
        (same_tensor if isinstance(b[k], torch.Tensor) else same_value)(a[k], b[k], "v1 " + k)
    with tessera_ckpt.Checkpoint(sharded) as ck:
        check(ck.version in (1, 2), "a sharded checkpoint of version 1 or 2")
        for k in ck.keys():
            t = b[k]
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] > 1:
                n = t.shape[0]
                same_tensor(ck.get(k, rows=(n // 3, n - 1)), t[n // 3:n - 1], "v1 rows " + k)
    tessera_ckpt.verify(sharded)
    tessera_ckpt.verify(consolidated)
    return len(a)


def main():
    args = sys.argv[1:]
    v1 = None
    if args[:1] == ["--v1"] and len(args) == 3:
        v1 = args[1:]
    elif args:
        print(__doc__, file=sys.stderr)
        return 2
    check_rules()
    check_overlaps()
    with tempfile.TemporaryDirectory(prefix="tessera-v2-") as tmp:
        src = os.path.join(tmp, "main")
        items, stored = build_main(src)
        check_main(src, items, stored)
        check_damaged(src, tmp, items)
        check_huge_world(tmp)
    if v1:
        print(f"v1: {check_v1(*v1)} keys read alike from {v1[0]} and {v1[1]}")
    print(f"ok tessera_ckpt_v2_check: {CHECKS[0]} checks, {REFUSALS[0]} refusals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
