"""Hostile seeds for the unpickler targets (issue 35 items 3, 12, 13), written with the
standard library only: raw pickle opcodes and torch.save-style zips.

corpus/pickle/  raw pickles (fuzz_pickle: every persistent id is a storage of 4 floats)
corpus/torch/   torch.save archives (fuzz_torch_import)
corpus/dcp/     u32 length + .metadata + __0_0.distcp (fuzz_dcp)
The deep lists are 5,000 levels (over the 1,000 limit, under the fuzzers' 64 KiB inputs);
the C++ tests (tests/checkpoint/test_pickle_hardening.cpp) cover 200,000 and 1,000,000."""
import io
import struct
import zipfile


def le32(v):
    return struct.pack("<I", v)


def s(x):  # BINUNICODE
    x = x.encode() if isinstance(x, str) else x
    return b"X" + le32(len(x)) + x


def i64(v):  # LONG1, 8 bytes
    return b"\x8a\x08" + struct.pack("<q", v)


def put(k):
    return b"r" + le32(k)


def get(k):
    return b"j" + le32(k)


def glob(mod, name):
    return b"c" + mod.encode() + b"\n" + name.encode() + b"\n"


def tup(v):
    return b"(" + b"".join(i64(x) for x in v) + b"t"


def tensor(offset, size, stride, cls="FloatStorage", numel=4):
    """torch.save's pickle of a tensor over storage record data/0."""
    return (glob("torch._utils", "_rebuild_tensor_v2") + b"((" + s("storage") + glob("torch", cls) + s("0") +
            s("cpu") + i64(numel) + b"tQ" + i64(offset) + tup(size) + tup(stride) + b"\x89" +
            glob("collections", "OrderedDict") + b")RtR")


def deep_list(levels):
    return b"\x80\x02" + b"]" * levels + b"a" * (levels - 1) + b"."


def doubling_dicts(n):
    p = b"\x80\x02}" + s("x") + b"K\x01" + put(0) + b"0"
    for k in range(1, n + 1):
        p += b"}(" + s("a") + get(k - 1) + s("b") + get(k - 1) + b"u" + put(k) + b"0"
    return p + get(n) + b"s."


def doubling_lists(n):
    p = b"\x80\x02}" + s("x") + b"]" + put(0) + b"0"
    for k in range(1, n + 1):
        p += b"](" + get(k - 1) + get(k - 1) + b"e" + put(k) + b"0"
    return p + get(n) + b"s."


HEAP = 2**63 - 99999
FOUR_FLOATS = b"\0" * 16


def state_dict(*items):
    return b"\x80\x02}(" + b"".join(s(k) + v for k, v in items) + b"u."


def archive(pkl, records=()):
    """A torch.save zip (stored, like torch writes them)."""
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        for name, data in records:
            z.writestr("archive/" + name, data)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")
    return b.getvalue()


M = "torch.distributed.checkpoint.metadata"


def obj(mod, name, state):
    return glob(mod, name) + b")\x81" + state + b"b"


def dcp_metadata(tensors=(), values=()):
    """DCP's Metadata: tensors [(fqn, n, offset, length)] of one float chunk [n]; values
    [(fqn, offset, length)] (BytesStorageMetadata); all in __0_0.distcp."""
    sdm, sd = b"", b""
    for fqn, n, off, length in tensors:
        props = obj(M, "TensorProperties", b"(" + glob("torch", "float32") + glob("torch", "strided") + b"\x89N\x89t")
        chunk = obj(M, "ChunkStorageMetadata", b"}(" + s("offsets") + tup([0]) + s("sizes") + tup([n]) + b"u")
        sdm += s(fqn) + obj(M, "TensorStorageMetadata", b"}(" + s("properties") + props + s("size") + tup([n]) +
                            s("chunks") + b"]" + chunk + b"au")
        sd += obj(M, "MetadataIndex", b"}(" + s("fqn") + s(fqn) + s("offset") + tup([0]) + s("index") + i64(0) + b"u")
        sd += info(off, length)
    for fqn, off, length in values:
        sdm += s(fqn) + obj(M, "BytesStorageMetadata", b"}")
        sd += obj(M, "MetadataIndex", b"}(" + s("fqn") + s(fqn) + s("offset") + b"N" + s("index") + i64(0) + b"u")
        sd += info(off, length)
    return (b"\x80\x02" + obj(M, "Metadata", b"}(" + s("state_dict_metadata") + b"}(" + sdm + b"u" +
                              s("storage_data") + b"}(" + sd + b"u" + b"u") + b".")


def info(off, length):
    return obj("torch.distributed.checkpoint.filesystem", "_StorageInfo",
               b"}(" + s("relative_path") + s("__0_0.distcp") + s("offset") + i64(off) + s("length") + i64(length) +
               b"u")


def dcp_input(metadata, distcp):
    return le32(len(metadata)) + metadata + distcp


def dcp_dir(tensors=(), values=()):
    """tensors [(fqn, n, item)], values [(fqn, item)]: items laid out one after another."""
    blob, ts, vs = b"", [], []
    for fqn, n, item in tensors:
        ts.append((fqn, n, len(blob), len(item)))
        blob += item
    for fqn, item in values:
        vs.append((fqn, len(blob), len(item)))
        blob += item
    return dcp_input(dcp_metadata(ts, vs), blob)


def write_hostile(root):
    pk, tc, dc = root / "pickle", root / "torch", root / "dcp"
    for d in (pk, tc, dc):
        d.mkdir(parents=True, exist_ok=True)
    seeds = {
        pk / "deep_list": deep_list(5000),
        pk / "doubling_dicts": doubling_dicts(60),
        pk / "doubling_lists": doubling_lists(60),
        pk / "self_reference": b"\x80\x02]q\x00h\x00a.",
        pk / "heap_offset": state_dict(("w", tensor(HEAP, [200000], [1]))),
        pk / "stride_overflow": state_dict(("w", tensor(0, [3], [2**62]))),
        pk / "storage_numel_overflow": state_dict(("w", tensor(1000, [1], [1], "DoubleStorage", 2**61))),
        pk / "good_tensor": state_dict(("w", tensor(1, [2], [1])), ("n", b"K\x05")),
        pk / "nones": b"\x80\x02" + b"N" * 20000 + b".",
        pk / "dcp_metadata": dcp_metadata([("w", 4, 0, 100)], [("v", 100, 50)]),
        tc / "deep_list.pt": archive(deep_list(5000)),
        tc / "doubling_dicts.pt": archive(doubling_dicts(60)),
        tc / "heap_offset.pt": archive(state_dict(("w", tensor(HEAP, [200000], [1]))), [("data/0", FOUR_FLOATS)]),
        tc / "storage_numel_overflow.pt": archive(state_dict(("w", tensor(1000, [1], [1], "DoubleStorage", 2**61))),
                                                  [("data/0", FOUR_FLOATS)]),
        dc / "tensor_and_value": dcp_dir([("w", 4, archive(b"\x80\x02" + tensor(0, [4], [1]) + b".",
                                                           [("data/0", FOUR_FLOATS)]))],
                                         [("v", archive(state_dict(("lr", i64(3)))))]),
        dc / "heap_offset_item": dcp_dir([("w", 200000, archive(b"\x80\x02" + tensor(HEAP, [200000], [1]) + b".",
                                                                [("data/0", FOUR_FLOATS)]))]),
        dc / "doubling_value": dcp_dir(values=[("v", archive(doubling_lists(60)))]),
        dc / "deep_metadata": dcp_input(deep_list(5000), b""),
        dc / "nones_metadata": dcp_input(b"\x80\x02" + b"N" * 20000 + b".", b""),
    }
    for path, data in seeds.items():
        path.write_bytes(data)
    print("hostile seeds written under", root)


if __name__ == "__main__":
    import pathlib
    write_hostile(pathlib.Path(__file__).resolve().parent / "corpus")
