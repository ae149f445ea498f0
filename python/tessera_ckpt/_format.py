"""Parsing of Tessera checkpoints (docs/checkpoint-format.md): the sharded directory's
tessera-checkpoint.json and the safetensors files (data files and consolidated files).

Everything here is plain data (JSON and byte offsets): nothing is unpickled or executed.
The checks follow the C++ reader (src/tessera/checkpoint/{metadata,safetensors,reader}.cpp),
so a file Tessera refuses is refused here too, with the file and key named.
"""
import json
import math
import os
import re
import struct

from . import _crc32c

METADATA_FILE = "tessera-checkpoint.json"
FORMAT_VERSION = 1
MAX_METADATA_BYTES = 256 << 20
MAX_HEADER_BYTES = 100 << 20
MAX_WORLD_SIZE = 1 << 20
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# safetensors dtype -> (torch dtype name, item size)
DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}

_METADATA_CRC_MARKER = b'\n "metadata_crc32c": "'
_HEADER_CRC_MARKER = b'"tessera.header_crc32c":"'
_HEX8 = re.compile(r"[0-9a-fA-F]{8}\Z")
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*\Z")


class CheckpointError(Exception):
    """A checkpoint that cannot be read: missing, incomplete, corrupt or not Tessera's.
    The message names the file and, where one is at fault, the key."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path (or a data file it lists) does not exist."""


def fail(*parts):
    raise CheckpointError("".join(str(p) for p in parts))


# ---------------------------------------------------------------- strict JSON


class _Duplicate(Exception):
    pass


def _pairs(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Duplicate(k)
        d[k] = v
    return d


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def parse_json_strict(text, what):
    """JSON with every key at most once per object (json.loads keeps the last one silently)
    and without NaN/Infinity literals; ``text`` is bytes (UTF-8) or str."""
    try:
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8")
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant)
    except _Duplicate as e:
        fail(what, ": duplicate key '", e.args[0], "' (edited or corrupt; a key may appear once)")
    except (ValueError, UnicodeDecodeError) as e:
        fail(what, " is not valid JSON: ", e)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def int_in(v, lo, hi, what):
    if not _is_int(v):
        fail(what, ": expected an integer, got ", json.dumps(v))
    if not lo <= v <= hi:
        fail(what, " is ", v, ", outside [", lo, ", ", hi, "]")
    return v


def _u64(v, what):
    if not _is_int(v) or v < 0 or v >= 1 << 64:
        fail(what, ": expected a non-negative integer, got ", json.dumps(v))
    return v


def _dims(v, what):
    # As the C++ reader: a dimension (or offset) is an int64, never above 2^63 - 1.
    if not isinstance(v, list):
        fail(what, ": expected an array of dimensions")
    for d in v:
        if not _is_int(d) or d < 0 or d > INT64_MAX:
            fail(what, ": bad dimension ", json.dumps(d))
    return list(v)


def _crc_hex(s, what):
    if not isinstance(s, str) or not _HEX8.match(s):
        fail(what, ": checksum ", json.dumps(s), " is not 8 hex digits")
    return int(s, 16)


def num_blocks(nbytes, block):
    return (nbytes + block - 1) // block


# Checksum block sizes a reader accepts (C++: checksum.h check_crc_block): a multiple of 8, so
# that every block starts on a whole element of every dtype, and at most 1 GiB.
MIN_CRC_BLOCK, MAX_CRC_BLOCK = 8, 1 << 30


def check_crc_block(block, what):
    if not MIN_CRC_BLOCK <= block <= MAX_CRC_BLOCK or block % 8:
        fail(what, ": checksum block size ", block, " is not a multiple of 8 bytes between ", MIN_CRC_BLOCK, " and ",
             MAX_CRC_BLOCK, " (corrupt or tampered)")
    return block


def byte_size(shape, dtype, what):
    """prod(shape) * itemsize; refused above 2^62 bytes (so the element count fits in int64)."""
    for d in shape:
        if d == 0:
            return 0
    n = DTYPES[dtype][1]
    for d in shape:
        n *= d
        if n > 1 << 62:
            fail(what, ": shape too large (more than 2^62 bytes)")
    return n


def shape_string(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


def dtype_of(name, what):
    if not isinstance(name, str) or name not in DTYPES:
        fail(what, ": unknown dtype ", json.dumps(name), " (known: ", " ".join(DTYPES), ")")
    return name


def check_plain_name(name, what):
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or len(name.encode("utf-8")) >= 256
    ):
        fail(what, ": file name ", json.dumps(name), " is not a plain name inside the checkpoint directory")
    return name


# ---------------------------------------------------------------- plain values


def decode_value(j, what):
    """A plain value's JSON ({"kind": ...}) as a Python value."""
    if not isinstance(j, dict) or not isinstance(j.get("kind"), str):
        fail(what, ": value has no kind")
    k = j["kind"]

    def need(field, ok):
        if field not in j or not ok:
            fail(what, ": ", k, " value has a missing or bad '", field, "'")

    if k == "int":
        need("value", _is_int(j.get("value")))
        return int_in(j["value"], INT64_MIN, INT64_MAX, what + " value")
    if k == "float":
        bits = j.get("bits")
        need("bits", isinstance(bits, str) and len(bits) == 16)
        if not _HEX.match(bits):
            fail(what, ": bad hex digit in float bits ", json.dumps(bits))
        (d,) = struct.unpack(">d", bytes.fromhex(bits))
        if "value" in j:
            v = j["value"]
            if math.isfinite(d):
                agrees = (
                    isinstance(v, (int, float))
                    and not isinstance(v, bool)
                    and float(v) == d
                    and math.copysign(1.0, float(v)) == math.copysign(1.0, d)
                )
            else:
                agrees = v is None
            if not agrees:
                fail(what, ": float value ", json.dumps(v), " disagrees with its bits ", json.dumps(bits))
        return d
    if k == "bool":
        need("value", isinstance(j.get("value"), bool))
        return j["value"]
    if k == "string":
        need("value", isinstance(j.get("value"), str))
        return j["value"]
    if k == "bytes":
        need("hex", isinstance(j.get("hex"), str))
        if not _HEX.match(j["hex"]):
            fail(what, ": bad hex in bytes value")
        return bytes.fromhex(j["hex"])
    if k == "dict":
        return {}
    fail(what, ": unknown value kind '", k, "'")


# ---------------------------------------------------------------- model


class Chunk:
    """One stored piece of a tensor: its box in the whole tensor and where its bytes are."""

    __slots__ = ("offsets", "sizes", "file", "name", "begin", "end", "crcs")

    def __init__(self, offsets, sizes, file, name, begin, end, crcs):
        self.offsets, self.sizes, self.file, self.name = offsets, sizes, file, name
        self.begin, self.end, self.crcs = begin, end, crcs

    def box(self):
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"

    def numel(self):
        n = 1
        for s in self.sizes:
            n *= s
        return n


class Entry:
    """A key of the checkpoint: a tensor (kind "tensor" or "sharded": dtype, shape, chunks)
    or a plain value (kind "int", "float", "bool", "string", "bytes", "dict": value)."""

    __slots__ = ("kind", "dtype", "shape", "chunks", "value")

    def __init__(self, kind, dtype=None, shape=None, chunks=None, value=None):
        self.kind, self.dtype, self.shape, self.chunks, self.value = kind, dtype, shape, chunks or [], value

    @property
    def is_tensor(self):
        return self.kind in ("tensor", "sharded")

    def nbytes(self):
        return sum(c.end - c.begin for c in self.chunks)


def _overlap(a, b):
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        if max(ao, bo) >= min(ao + asz, bo + bsz):
            return False
    return True


def check_tiling(fqn, e, where):
    # The whole tensor's byte size (and element count) is bounded first, as in C++.
    byte_size(e.shape, e.dtype, f"{where}: key '{fqn}': shape {shape_string(e.shape)}")
    volume = 0
    nonempty = []
    whole = 1
    for d in e.shape:
        whole *= d
    for c in e.chunks:
        if len(c.offsets) != len(e.shape) or len(c.sizes) != len(e.shape):
            fail(where, ": key '", fqn, "': chunk ", c.box(), " has the wrong number of dimensions for shape ", e.shape)
        for o, s, d in zip(c.offsets, c.sizes, e.shape):
            if o + s > d:
                fail(where, ": key '", fqn, "': chunk ", c.box(), " lies outside the shape ", e.shape)
        if c.numel() == 0:
            continue
        for o in nonempty:
            if _overlap(o, c):
                fail(where, ": key '", fqn, "': chunks ", o.box(), " and ", c.box(), " overlap")
        nonempty.append(c)
        volume += c.numel()
    if volume != whole:
        fail(where, ": key '", fqn, "': the chunks cover ", volume, " of ", whole, " elements (incomplete checkpoint)")


class Layout:
    """What a checkpoint holds, parsed and checked, before any tensor data is read."""

    def __init__(self):
        self.path = ""  # what the user named
        self.location = ""  # the directory or file actually read (an aside sibling after a torn publish)
        self.kind = ""  # "sharded" | "consolidated" | "safetensors"
        self.version = FORMAT_VERSION
        self.world_size = None
        self.crc_block = 0
        self.files = []  # [(name, size)]
        self.keys = []  # save order
        self.entries = {}

    def file_path(self, name):
        return os.path.join(self.location, name) if self.kind == "sharded" else self.location


# ---------------------------------------------------------------- sharded metadata


def check_metadata_checksum(text, where):
    at = text.find(_METADATA_CRC_MARKER)
    start = at + len(_METADATA_CRC_MARKER)
    if at < 0 or text.find(_METADATA_CRC_MARKER, at + 1) >= 0 or start + 8 > len(text):
        fail(where, ": no metadata_crc32c where the writer puts it -- the metadata is corrupt (or hand-edited)")
    want = _crc_hex(text[start : start + 8].decode("latin-1"), where + " metadata_crc32c")
    got = _crc32c.crc32c(text[:start] + b"00000000" + text[start + 8 :])
    if got != want:
        fail(where, f": metadata checksum mismatch (metadata_crc32c {want:08x}, computed {got:08x}) -- the metadata is corrupt")


def parse_metadata(text, directory):
    where = f"'{os.path.join(directory, METADATA_FILE)}'"
    j = parse_json_strict(text, where + ": metadata")
    if not isinstance(j, dict) or j.get("format") != "tessera-checkpoint":
        fail(where, ': not Tessera checkpoint metadata (no "format": "tessera-checkpoint")')
    m = Layout()
    m.kind = "sharded"
    m.location = directory
    if "version" not in j or not _is_int(j["version"]):
        fail(where, ": no integer version")
    if not 1 <= j["version"] <= FORMAT_VERSION:
        fail(where, ": format version ", j["version"], " is not supported (this reader reads versions 1..", FORMAT_VERSION, ")")
    m.version = j["version"]
    if "world_size" not in j:
        fail(where, ": no world_size")
    m.world_size = int_in(j["world_size"], 1, MAX_WORLD_SIZE, where + " world_size")
    m.crc_block = check_crc_block(_u64(j.get("crc32c_block"), where + " crc32c_block"), where + " crc32c_block")
    if not isinstance(j.get("files"), list):
        fail(where, ": files is not an array")
    for f in j["files"]:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            fail(where, ": bad files entry")
        check_plain_name(f["name"], where)
        m.files.append((f["name"], _u64(f.get("size"), where + " file size")))
    if len(m.files) != m.world_size:
        fail(where, ": world_size is ", m.world_size, " but ", len(m.files), " data files are listed (one per rank)")
    if not isinstance(j.get("keys"), list) or not isinstance(j.get("entries"), dict):
        fail(where, ": keys/entries missing")
    listed = {n for n, _ in m.files}
    for fqn in j["keys"]:
        if not isinstance(fqn, str):
            fail(where, ": a key is not a string")
        if fqn not in j["entries"]:
            fail(where, ": key '", fqn, "' has no entry")
        if fqn in m.entries:
            fail(where, ": key '", fqn, "' listed twice")
        je = j["entries"][fqn]
        what = f"{where} key '{fqn}'"
        if not isinstance(je, dict) or not isinstance(je.get("kind"), str):
            fail(what, ": no kind")
        kind = je["kind"]
        if kind not in ("tensor", "sharded"):
            e = Entry(kind, value=decode_value(je, what))
        else:
            e = Entry(kind, dtype_of(je.get("dtype"), what), _dims(je.get("shape"), what + " shape"))
            if not isinstance(je.get("chunks"), list):
                fail(what, ": chunks is not an array")
            for jc in je["chunks"]:
                if not isinstance(jc, dict):
                    fail(what, ": a chunk is not an object")
                offsets = _dims(jc.get("offsets"), what + " chunk offsets")
                sizes = _dims(jc.get("sizes"), what + " chunk sizes")
                if not isinstance(jc.get("file"), str) or not isinstance(jc.get("name"), str):
                    fail(what, ": chunk without file/name")
                check_plain_name(jc["file"], what)
                br = jc.get("byte_range")
                if not isinstance(br, list) or len(br) != 2:
                    fail(what, ": bad byte_range")
                b, en = _u64(br[0], what + " byte_range"), _u64(br[1], what + " byte_range")
                c = Chunk(offsets, sizes, jc["file"], jc["name"], b, en, [])
                if b > en or en - b != byte_size(sizes, e.dtype, what):
                    fail(what, ": byte_range [", b, ", ", en, "] does not match chunk ", c.box())
                crcs = jc.get("crc32c")
                need = num_blocks(en - b, m.crc_block)
                if not isinstance(crcs, list) or len(crcs) != need:
                    fail(what, ": chunk ", c.box(), " needs ", need, " checksums")
                c.crcs = [_crc_hex(x, what) for x in crcs]
                if c.file not in listed:
                    fail(what, ": chunk file '", c.file, "' is not listed in files")
                e.chunks.append(c)
            check_tiling(fqn, e, where)
        m.keys.append(fqn)
        m.entries[fqn] = e
    return m


# ---------------------------------------------------------------- safetensors


class Safetensors:
    """A parsed safetensors header: tensors (name -> (dtype, shape, begin, end), absolute
    byte offsets), __metadata__, Tessera block checksums, all checked."""

    def __init__(self, path, fd=None):
        self.path = path
        own = fd is None
        if own:
            fd = open_file(path)
        try:
            self._parse(fd)
        finally:
            if own:
                os.close(fd)

    def _parse(self, fd):
        path = self.path
        size = os.fstat(fd).st_size
        self.size = size
        if size < 8:
            fail("'", path, "' is not a safetensors file: ", size, " bytes, shorter than the 8-byte header length")
        lenbuf = pread(fd, 0, 8, path)
        (n,) = struct.unpack("<Q", lenbuf)
        if n > MAX_HEADER_BYTES:
            fail("'", path, "': safetensors header length ", n, " exceeds the limit of ", MAX_HEADER_BYTES, " bytes")
        if n < 2 or 8 + n > size:
            fail("'", path, "': safetensors header length ", n, " does not fit in the file of ", size, " bytes (truncated?)")
        text = pread(fd, 8, n, path)
        h = parse_json_strict(text, f"'{path}': safetensors header")
        if not isinstance(h, dict):
            fail("'", path, "': safetensors header is not a JSON object")
        data_start = 8 + n
        data_len = size - data_start
        self.metadata = {}
        self.tensors = {}
        for name, v in h.items():
            if name == "__metadata__":
                if v is not None and not isinstance(v, dict):
                    fail("'", path, "': __metadata__ is not an object")
                for mk, mv in (v or {}).items():
                    if not isinstance(mv, str):
                        fail("'", path, "': __metadata__ value '", mk, "' is not a string")
                    self.metadata[mk] = mv
                continue
            what = f"'{path}' tensor '{name}'"
            if not isinstance(v, dict) or not all(k in v for k in ("dtype", "shape", "data_offsets")):
                fail(what, ": entry needs dtype, shape and data_offsets")
            dtype = dtype_of(v["dtype"], what)
            if not isinstance(v["shape"], list):
                fail(what, ": shape is not an array")
            shape = _dims(v["shape"], what + " shape")
            off = v["data_offsets"]
            if not isinstance(off, list) or len(off) != 2 or not all(_is_int(x) and x >= 0 for x in off):
                fail(what, ": data_offsets must be two non-negative integers")
            b, en = off
            if b > en or en > data_len:
                fail(what, ": data_offsets [", b, ", ", en, "] outside the data section of ", data_len, " bytes (truncated file?)")
            need = byte_size(shape, dtype, what)
            if en - b != need:
                fail(what, ": data_offsets cover ", en - b, " bytes but the shape and dtype need ", need)
            self.tensors[name] = (dtype, shape, data_start + b, data_start + en)
        order = sorted(self.tensors, key=lambda k: (self.tensors[k][2], self.tensors[k][3]))
        self.order = order  # data-offset order
        pos = data_start
        for name in order:
            b, en = self.tensors[name][2:]
            if b != pos:
                fail("'", path, "' tensor '", name, "': data starts at byte ", b,
                     " and overlaps the previous tensor" if b < pos else " leaving a gap", " (expected ", pos, ")")
            pos = en
        if pos != size:
            fail("'", path, "': ", size - pos, " bytes after the last tensor are not covered by the header")
        self.crc_block = 0
        self.crcs = {}
        crc = self.metadata.get("tessera.crc32c")
        if crc is not None:
            bs = self.metadata.get("tessera.crc32c_block", "")
            if not bs or not bs.isdigit() or not bs.isascii() or len(bs) >= 12:
                fail("'", path, "': bad tessera.crc32c_block '", bs, "'")
            self.crc_block = check_crc_block(int(bs), f"'{path}': tessera.crc32c_block")
            total = sum(num_blocks(self.tensors[k][3] - self.tensors[k][2], self.crc_block) for k in order)
            if len(crc) != 8 * total:
                fail("'", path, "': tessera.crc32c holds ", len(crc) // 8, " checksums for ", total, " blocks")
            k = 0
            for name in order:
                nb = num_blocks(self.tensors[name][3] - self.tensors[name][2], self.crc_block)
                self.crcs[name] = [_crc_hex(crc[8 * i : 8 * i + 8], f"'{path}' tensor '{name}'") for i in range(k, k + nb)]
                k += nb
        # Header checksum, required once any tessera.* key is there; checked last so that
        # structural errors keep their own messages.
        if any(k.startswith("tessera.") for k in self.metadata):
            hc = self.metadata.get("tessera.header_crc32c")
            if hc is None:
                fail("'", path, "': Tessera header without tessera.header_crc32c -- the header is corrupt "
                     "(or the file predates header checksums)")
            at = text.find(_HEADER_CRC_MARKER)
            start = at + len(_HEADER_CRC_MARKER)
            if (at < 0 or text.find(_HEADER_CRC_MARKER, at + 1) >= 0 or start + 8 > len(text)
                    or text[start : start + 8] != hc.encode("utf-8")):
                fail("'", path, "': tessera.header_crc32c is not where the writer puts it -- the header is corrupt")
            want = _crc_hex(hc, f"'{path}' tessera.header_crc32c")
            got = _crc32c.crc32c(lenbuf + text[:start] + b"00000000" + text[start + 8 :])
            if got != want:
                fail("'", path, f"': header checksum mismatch (tessera.header_crc32c {hc}, computed {got:08x}) "
                     "-- the header is corrupt")


def parse_world_size(s, path):
    if not s or len(s) > 8 or not s.isascii() or not s.isdigit() or not 1 <= int(s) <= MAX_WORLD_SIZE:
        fail("'", path, "': __metadata__ tessera.world_size '", s, "' is not a world size in [1, ", MAX_WORLD_SIZE, "]")
    return int(s)


def from_safetensors(path, st):
    m = Layout()
    m.kind = "consolidated" if st.metadata.get("tessera.format") == "tessera-consolidated" else "safetensors"
    m.location = path
    m.crc_block = st.crc_block
    m.files = [(os.path.basename(path), st.size)]
    what = f"'{path}': __metadata__ "
    md = st.metadata
    kinds = parse_json_strict(md["tessera.kinds"], what + "tessera.kinds") if md.get("tessera.kinds") else {}
    values = parse_json_strict(md["tessera.values"], what + "tessera.values") if md.get("tessera.values") else {}
    keys = parse_json_strict(md["tessera.keys"], what + "tessera.keys") if md.get("tessera.keys") else []
    if md.get("tessera.world_size"):
        m.world_size = parse_world_size(md["tessera.world_size"], path)
    if not isinstance(kinds, dict) or not isinstance(values, dict) or not isinstance(keys, list):
        fail("'", path, "': malformed Tessera __metadata__ (kinds/values/keys)")
    for name in st.order:
        dtype, shape, b, en = st.tensors[name]
        kind = kinds.get(name) if isinstance(kinds.get(name), str) else "tensor"
        if kind not in ("tensor", "sharded"):
            fail("'", path, "' key '", name, "': bad kind '", kind, "'")
        e = Entry(kind, dtype, shape)
        if en > b:
            e.chunks.append(Chunk([0] * len(shape), list(shape), os.path.basename(path), name, b, en, st.crcs.get(name, [])))
        m.entries[name] = e
    for k, v in values.items():
        if k in m.entries:
            fail("'", path, "': key '", k, "' is both a tensor and a value")
        m.entries[k] = Entry(v.get("kind") if isinstance(v, dict) else None, value=decode_value(v, f"'{path}' key '{k}'"))
    ordered = [k for k in keys if isinstance(k, str) and k in m.entries]
    if len(ordered) == len(m.entries) and len(set(ordered)) == len(ordered):
        m.keys = ordered
    else:  # another writer, or an incomplete list: data-offset order, then the values
        m.keys = list(st.order) + list(values)
    return m


# ---------------------------------------------------------------- files


def open_file(path):
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"'{path}' does not exist") from None
    except OSError as e:
        fail("cannot open '", path, "': ", e.strerror or e)


def pread_into(fd, view, offset, path):
    """Fills the writable byte memoryview ``view`` from ``offset`` of the file."""
    done = 0
    total = len(view)
    while done < total:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            fail("'", path, "': read of bytes ", offset, "..", offset + total, " failed: ", e.strerror or e)
        if n == 0:
            fail("'", path, "': unexpected end of file at byte ", offset + done, " (truncated?)")
        done += n


def pread(fd, offset, n, path):
    buf = bytearray(n)
    pread_into(fd, memoryview(buf), offset, path)
    return bytes(buf)


def aside_sibling(path):
    """A `.NAME.tessera-old-*` sibling holding a whole checkpoint: where the previous one is
    during the one window of a publish without RENAME_EXCHANGE (docs/checkpoint-format.md 4)."""
    parent = os.path.dirname(os.path.abspath(path))
    prefix = "." + os.path.basename(os.path.normpath(path)) + ".tessera-old-"
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return None
    for n in names:
        p = os.path.join(parent, n)
        if n.startswith(prefix) and os.path.exists(os.path.join(p, METADATA_FILE)):
            return p
    return None


def open_layout(path):
    """Parses and checks a checkpoint: a sharded directory or a safetensors file."""
    path = os.fspath(path)
    p = path
    if not os.path.exists(p):
        aside = aside_sibling(p)
        if aside is None:
            raise CheckpointNotFoundError(f"checkpoint '{path}' does not exist")
        p = aside
    if os.path.isdir(p):
        mf = os.path.join(p, METADATA_FILE)
        if not os.path.isfile(mf):
            why = "is missing" if not os.path.exists(mf) else "is not a regular file"
            fail("'", path, "' is not a Tessera checkpoint: '", METADATA_FILE, "' ", why, " (incomplete or foreign directory)")
        fd = open_file(mf)
        try:
            size = os.fstat(fd).st_size
            if size > MAX_METADATA_BYTES:
                fail("'", mf, "' is ", size, " bytes, over the limit of ", MAX_METADATA_BYTES)
            text = pread(fd, 0, size, mf)
        finally:
            os.close(fd)
        m = parse_metadata(text, p)
        check_metadata_checksum(text, f"'{mf}'")  # after parsing: structural errors keep their messages
        for name, size in m.files:
            fp = os.path.join(p, name)
            if not os.path.exists(fp):
                raise CheckpointNotFoundError(f"checkpoint '{path}': data file '{name}' is missing")
            if not os.path.isfile(fp):
                fail("checkpoint '", path, "': data file '", name, "' is not a regular file: '", fp, "'")
            actual = os.path.getsize(fp)
            if actual != size:
                fail("checkpoint '", path, "': data file '", name, "' is ", actual, " bytes, the metadata says ", size,
                     " (truncated or replaced)")
        m.path = path
        return m
    if not os.path.isfile(p):
        fail("'", path, "' is neither a checkpoint directory nor a file")
    fd = open_file(p)
    try:
        if os.fstat(fd).st_size >= 4 and pread(fd, 0, 4, p) == b"PK\x03\x04":
            fail("'", path, "' is a torch.save (zip) file, not a Tessera checkpoint: read it with torch.load "
                 "(weights_only=True), or import it with `tessera ckpt`")
        head = pread(fd, 0, 8, p) if os.fstat(fd).st_size >= 8 else b""
        if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and \
                struct.unpack("<Q", head)[0] > os.fstat(fd).st_size - 8:
            # a pickle's PROTO opcode, read as a safetensors header length, is far beyond the file
            fail("'", path, "' is a Python pickle, not a zip archive or a safetensors file: the legacy (non-zip) "
                 "torch.save format is not supported; re-save it with torch.save(obj, path, "
                 "_use_new_zipfile_serialization=True) (the default since torch 1.6)")
        st = Safetensors(p, fd)
    finally:
        os.close(fd)
    m = from_safetensors(p, st)
    m.path = path
    return m
