"""safetensors files (C++: src/tessera/checkpoint/format/safetensors.cpp,
docs/checkpoint-format.md §1): the dtypes and their sizes, and the strictly checked header of
a data file, a consolidated file or another writer's file: every tensor's dtype, shape and
byte range (tiling the data section), __metadata__, Tessera's block checksums and header
checksum. Only the header is read here; nothing is unpickled or executed."""
import os
import struct

from . import _crc32c
from ._error import fail
from ._format_checksum import check_crc_block, num_blocks, parse_crc_hex
from ._format_json import is_json_int, jdump, json_dims, parse_json_strict
from ._storage_file import open_file, pread

MAX_HEADER_BYTES = 100 << 20

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


_HEADER_CRC_MARKER = b'"tessera.header_crc32c":"'


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


def dtype_of(name, what):
    if not isinstance(name, str) or name not in DTYPES:
        fail(what, ": unknown dtype ", jdump(name), " (known: ", " ".join(DTYPES), ")")
    return name


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
            shape = json_dims(v["shape"], what + " shape")
            off = v["data_offsets"]
            if not isinstance(off, list) or len(off) != 2 or not all(is_json_int(x) and x >= 0 for x in off):
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
                self.crcs[name] = [parse_crc_hex(crc[8 * i : 8 * i + 8], f"'{path}' tensor '{name}'") for i in range(k, k + nb)]
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
            want = parse_crc_hex(hc, f"'{path}' tessera.header_crc32c")
            got = _crc32c.crc32c(lenbuf + text[:start] + b"00000000" + text[start + 8 :])
            if got != want:
                fail("'", path, f"': header checksum mismatch (tessera.header_crc32c {hc}, computed {got:08x}) "
                     "-- the header is corrupt")
