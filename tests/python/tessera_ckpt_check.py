"""Loads a checkpoint written by Tessera's C++ writer with the tessera_ckpt package
(python/tessera_ckpt) and compares it value for value with an independent reader.

usage: tessera_ckpt_check.py CKPT [--torch REF.pt] [--safetensors REF.safetensors]
                             [--state worker|special|none] [--world-size N] [--kind K]
                             [--prefix P --prefix-count N]

  --torch REF.pt            `tessera ckpt export --format torch` of CKPT, read by torch.load
  --safetensors REF         a consolidated file read by the safetensors library
  --state worker            the known state of tests/checkpoint/checkpoint_scenarios.cpp (ckpt_save)
  --state special           the state tests/checkpoint/test_python_package.cpp saves (dtypes, NaN/-0 bits,
                            integer extremes, multi-block tensors, a column-sharded tensor)
Every tensor is compared bit for bit (NaN payloads and -0.0 included); plain values by their
IEEE-754 bits. Prints "ok N" (keys checked).
"""
import argparse
import json
import math
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

import tessera_ckpt  # noqa: E402
from worker_state import SPECS, expected, read_safetensors_file  # noqa: E402

INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.bool: torch.uint8,
}


def bits(t):
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def same_tensor(a, b, what):
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{what}: {type(a)} vs {type(b)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert list(a.shape) == list(b.shape), f"{what}: shape {list(a.shape)} vs {list(b.shape)}"
    assert torch.equal(bits(a.contiguous()), bits(b.contiguous())), f"{what}: values differ\n{a}\n{b}"


def fbits(x):
    return struct.pack("<d", x)


def same_value(a, b, what):
    if isinstance(b, float):
        assert isinstance(a, float) and fbits(a) == fbits(b), f"{what}: {a!r} vs {b!r} (bits differ)"
    else:
        assert type(a) is type(b) and a == b, f"{what}: {a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})"


def f64(bits_list):
    return torch.tensor(bits_list, dtype=torch.int64).view(torch.float64)


def f32(bits_list):
    return torch.tensor(bits_list, dtype=torch.int32).view(torch.float32)


# ---------------------------------------------------------------- the known states


def worker_state():
    out = {fqn: expected(fqn, shape, dtype) for fqn, shape, dtype in SPECS}
    out.update({"opt.step": 7, "opt.lr": 0.125, "name": "tessera", "blob": b"a\x00b"})
    order = [f for f, _, _ in SPECS if f.startswith("model.")] + ["opt.m", "opt.big", "opt.step", "opt.lr", "name", "blob"]
    return {k: out[k] for k in order}


NAN_PAYLOAD = 0x7FF8000000000123


def special_state():
    """Mirrors special_state() in tests/checkpoint/test_python_package.cpp."""
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    s = {
        "model.f16": (torch.arange(12, dtype=torch.float32) * 0.5 - 2).reshape(3, 4).to(torch.float16),
        "model.bf16": (torch.arange(5, dtype=torch.float32) - 2.5).to(torch.bfloat16),
        "model.f64": f64([NAN_PAYLOAD, -(1 << 63), 0x7FF0000000000000, -(1 << 52), 1, 0x3FD5555555555555]),
        "model.f32": f32([0x7FC00001, -(1 << 31), 0x7F800000, 1, 0x40600000, -0x40800000]).reshape(2, 3),
        "model.i8": (torch.arange(256) - 128).to(torch.int8),
        "model.u8": torch.arange(256).to(torch.uint8),
        "model.i16": torch.tensor([-32768, -1, 0, 1, 32767], dtype=torch.int16),
        "model.i32": torch.tensor([-(1 << 31), -7, 0, (1 << 31) - 1], dtype=torch.int32),
        "model.i64": i64([-(1 << 63), -1, 0, (1 << 63) - 1]),
        "model.mask": torch.tensor([True, False, False, True, True]),
        "model.big": (torch.arange(3000 * 1100, dtype=torch.float32) + 0.25).reshape(3000, 1100),
        "model.whole": torch.arange(2 * 3000000, dtype=torch.float32).reshape(2, 3000000),
        "model.cols": (torch.arange(28, dtype=torch.float64) * 1.5).reshape(4, 7),
        "model.empty": torch.zeros(0, 5),
        "model.scalar": torch.tensor(2.5, dtype=torch.float64),
        "step": 42,
        "int_min": -(1 << 63),
        "int_max": (1 << 63) - 1,
        "nan": struct.unpack("<d", struct.pack("<Q", NAN_PAYLOAD))[0],
        "negzero": -0.0,
        "inf": math.inf,
        "neginf": -math.inf,
        "tiny": 5e-324,
        "third": 1.0 / 3.0,
        "flag": True,
        "off": False,
        "text": 'h\u00e9llo "q"\n\t\u2713',
        "blob": b"\x00\xff\x01tessera",
        "empty_dict": {},
    }
    return s


# ---------------------------------------------------------------- independent readers


def read_torch(path):
    try:
        return torch.load(path, weights_only=True)
    except TypeError:  # a torch without weights_only
        return torch.load(path)


def read_safetensors(path):
    out, meta = read_safetensors_file(path)
    values = {}
    for k, v in json.loads(meta.get("tessera.values", "{}")).items():  # the raw JSON, decoded here
        kind = v["kind"]
        if kind == "float":
            values[k] = struct.unpack(">d", bytes.fromhex(v["bits"]))[0]
        elif kind == "bytes":
            values[k] = bytes.fromhex(v["hex"])
        elif kind == "dict":
            values[k] = {}
        else:
            values[k] = v["value"]
    return out, values, json.loads(meta["tessera.keys"]) if "tessera.keys" in meta else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--torch")
    ap.add_argument("--safetensors")
    ap.add_argument("--state", default="none", choices=["worker", "special", "none"])
    ap.add_argument("--world-size", type=int)
    ap.add_argument("--kind")
    ap.add_argument("--prefix")
    ap.add_argument("--prefix-count", type=int)
    a = ap.parse_args()

    sd = tessera_ckpt.load(a.ckpt)
    assert type(sd) is dict and sd, f"load returned {type(sd)} with {len(sd)} keys"
    with tessera_ckpt.Checkpoint(a.ckpt) as ck:
        assert list(sd) == ck.keys(), "load's keys are not in save order"
        if a.world_size is not None:
            assert ck.world_size == a.world_size, f"world size {ck.world_size}, expected {a.world_size}"
        if a.kind is not None:
            assert ck.kind == a.kind, f"kind {ck.kind}, expected {a.kind}"
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert v.device.type == "cpu" and v.is_contiguous(), k
    checked = 0

    if a.state != "none":
        want = worker_state() if a.state == "worker" else special_state()
        assert list(sd) == list(want), f"keys {list(sd)}\nexpected {list(want)}"
        for k, w in want.items():
            (same_tensor if isinstance(w, torch.Tensor) else same_value)(sd[k], w, f"{a.ckpt} key {k}")
            checked += 1

    if a.torch:
        ref = read_torch(a.torch)
        assert type(ref) is dict, type(ref)
        tensors = [k for k, v in sd.items() if isinstance(v, torch.Tensor)]
        assert sorted(tensors) == sorted(ref), f"tensor keys {sorted(tensors)} vs export {sorted(ref)}"
        for k in tensors:
            same_tensor(sd[k], ref[k], f"key {k} vs torch.load of the export")
            checked += 1

    if a.safetensors:
        tensors, values, keys = read_safetensors(a.safetensors)
        cons = tessera_ckpt.load(a.safetensors)
        assert list(cons) == list(sd), f"consolidated keys {list(cons)} vs {list(sd)}"
        if keys is not None:
            assert keys == list(sd), "tessera.keys differ from the save order"
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                same_tensor(tensors[k], v, f"key {k}: safetensors library vs tessera_ckpt")
                same_tensor(cons[k], v, f"key {k}: consolidated vs sharded")
            else:
                same_value(values[k], v, f"value {k}: consolidated file's JSON vs tessera_ckpt")
                same_value(cons[k], v, f"value {k}: consolidated vs sharded")
            checked += 1
        assert sorted(tensors) == sorted(k for k, v in sd.items() if isinstance(v, torch.Tensor))
        # a file another writer made (the safetensors library): no checksums, no plain values
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as tmp:
            foreign = os.path.join(tmp, "foreign.safetensors")
            save_file({k: v for k, v in tensors.items()}, foreign, metadata={"format": "pt"})
            other = tessera_ckpt.load(foreign)
            assert sorted(other) == sorted(tensors), f"foreign file keys {sorted(other)}"
            for k, v in tensors.items():
                same_tensor(other[k], v, f"key {k}: a file the safetensors library wrote")
            with tessera_ckpt.Checkpoint(foreign) as ck:
                assert ck.kind == "safetensors" and ck.world_size is None, (ck.kind, ck.world_size)
            r = tessera_ckpt.verify(foreign)
            assert not r["checksummed"] and r["chunks"] == sum(1 for v in tensors.values() if v.numel()), r

    # prefix: the keys under it, stripped, same objects' values
    if a.prefix:
        part = tessera_ckpt.load(a.ckpt, prefix=a.prefix)
        p = a.prefix if a.prefix.endswith(".") else a.prefix + "."
        want = {k[len(p) :]: v for k, v in sd.items() if k.startswith(p)}
        assert list(part) == list(want), f"prefix {a.prefix}: {list(part)} vs {list(want)}"
        for k in want:
            (same_tensor if isinstance(want[k], torch.Tensor) else same_value)(part[k], want[k], f"prefix key {k}")
        if a.prefix_count is not None:
            assert len(part) == a.prefix_count, f"prefix {a.prefix}: {len(part)} keys"
        try:
            tessera_ckpt.load(a.ckpt, prefix="no_such_prefix.")
            raise AssertionError("an unknown prefix loaded")
        except tessera_ckpt.CheckpointError as e:
            assert "no_such_prefix." in str(e) and a.ckpt.rstrip("/") in str(e), str(e)

    # a forked child (a DataLoader worker, say) loads too: the checksum threads the parent
    # started (the 24 MB tensor of the special state uses them) are not the child's
    if a.state == "special" and hasattr(os, "fork"):
        pid = os.fork()
        if pid == 0:
            try:
                torch.set_num_threads(1)  # as DataLoader workers do: OpenMP's threads do not survive fork
                again = tessera_ckpt.load(a.ckpt)
                os._exit(0 if list(again) == list(sd) and torch.equal(again["model.whole"], sd["model.whole"]) else 3)
            except BaseException:
                os._exit(4)
        import signal
        import time

        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("load in a forked child hung for 60 s")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0, f"load in a forked child: status {status}"

    # inspect (metadata only) and verify (every byte)
    info = tessera_ckpt.inspect(a.ckpt)
    assert list(info["keys"]) == list(sd), "inspect keys"
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert info["keys"][k]["shape"] == list(v.shape), k
            assert info["keys"][k]["bytes"] == v.numel() * v.element_size(), k
    assert all(k in str(info) for k in sd), "inspect's table lacks a key"
    r = tessera_ckpt.verify(a.ckpt)
    assert r["checksummed"] and r["bytes"] == sum(
        v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor)
    ), r
    print("ok", checked, "crc", tessera_ckpt._crc32c.implementation())


if __name__ == "__main__":
    main()
