"""Parsing of Tessera checkpoints (docs/checkpoint-format.md): the sharded directory's
tessera-checkpoint.json (version 1: every chunk listed with its byte range and checksums;
version 2: a layout rule per tensor, byte ranges and checksums in each data file's header)
and the safetensors files (data files and consolidated files).

Everything here is plain data (JSON and byte offsets): nothing is unpickled or executed.
The checks follow the C++ reader (src/tessera/checkpoint/{metadata,safetensors,reader}.cpp),
so a file Tessera refuses is refused here too, with the file and key named.
"""
import bisect
import heapq
import json
import math
import os
import re
import struct

from . import _crc32c

METADATA_FILE = "tessera-checkpoint.json"
FORMAT_VERSION = 2  # the newest version read; every version from 1 is read
MAX_METADATA_BYTES = 256 << 20
MAX_HEADER_BYTES = 100 << 20
MAX_WORLD_SIZE = 1 << 20
MAX_PIECES = 1 << 20  # a chunk or flat layout's piece count (the launcher's limit on ranks)
MAX_LIST_PIECES_PER_FILE = 64  # a list layout names at most 64 pieces per data file (64 * world_size in all)
# JSON values and member names a metadata file may hold (C++ kMaxMetadataItems, metadata.h):
# bounds what parsing it costs, whatever is in it (issue 44 item 3).
MAX_METADATA_ITEMS = 1 << 22
MAX_REPORTED_PROBLEMS = 100  # verify reports this many problems one by one, then "and K more problem(s)"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1

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

_METADATA_CRC_MARKER = b'\n "metadata_crc32c": "'  # version 1 (json.dump(indent=1) style)
_METADATA_CRC_TAIL = b',"metadata_crc32c":"'  # version 2: the text ends with it, 8 hex digits and "}
_SAVE_ID = re.compile(r"[0-9a-f]{16}\Z")
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
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return d


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def too_many_json_items(text, bound):
    """Whether JSON text ``text`` (bytes) holds more than ``bound`` values and member names
    together (as the C++ reader counts them while parsing), found without parsing it: every
    value but the outermost is followed by ``,``, ``]`` or ``}``, except that an empty array
    or object ends with no value; every member name is followed by ``:``. Counted outside
    strings, and the strings themselves counted only when the quick bounds do not decide."""
    text = bytes(text)
    upper = 1 + text.count(b",") + text.count(b"]") + text.count(b"}") + text.count(b":")
    if upper <= bound:
        return False
    if (text.count(b'"') - text.count(b'\\"')) // 2 > bound:  # at least that many strings, each an item
        return True
    s = _JSON_STRING.sub(b'""', text)  # compact text: one copy of it (with whitespace: two)
    if any(c in s for c in (b" ", b"\t", b"\r", b"\n")):
        s = s.translate(None, b" \t\r\n")
    n = 1 + s.count(b",") + s.count(b"]") + s.count(b"}") + s.count(b":") - s.count(b"[]") - s.count(b"{}")
    return n > bound


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
    """A JSON integer as the C++ reader (nlohmann) sees one: in [-2^63, 2^64 - 1]; a longer
    run of digits is a floating-point number there."""
    return isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= UINT64_MAX


def jdump(v):
    """``v`` as the C++ reader prints a JSON value in its messages (nlohmann's dump)."""
    if isinstance(v, int) and not isinstance(v, bool) and not _is_int(v):
        try:
            v = float(v)
        except OverflowError:
            return "null"  # nlohmann: infinity prints as null
    try:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return "null"


def int_in(v, lo, hi, what):
    if not _is_int(v):
        fail(what, ": expected an integer, got ", jdump(v))
    if not lo <= v <= hi:
        fail(what, " is ", v, ", outside [", lo, ", ", hi, "]")
    return v


def _u64(v, what):
    if not _is_int(v) or v < 0:
        fail(what, ": expected a non-negative integer, got ", jdump(v))
    return v


def _dims(v, what):
    # As the C++ reader: a dimension (or offset) is an int64, never above 2^63 - 1.
    if not isinstance(v, list):
        fail(what, ": expected an array of dimensions")
    for d in v:
        if not _is_int(d) or d < 0 or d > INT64_MAX:
            fail(what, ": bad dimension ", jdump(d))
    return list(v)


def _crc_hex(s, what):
    if not isinstance(s, str) or not _HEX8.match(s):
        fail(what, ": checksum ", json.dumps(s), " is not 8 hex digits")
    return int(s, 16)


def num_blocks(nbytes, block):
    return (nbytes + block - 1) // block


# Checksum block sizes a reader accepts (C++: checkpoint/format/checksum.h check_crc_block): a multiple of 8, so
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
        fail(what, ": unknown dtype ", jdump(name), " (known: ", " ".join(DTYPES), ")")
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
    """One stored piece of a tensor: its box in the whole tensor and where its bytes are
    (version 1: from the metadata; version 2: from the data file's own header)."""

    __slots__ = ("offsets", "sizes", "file", "name", "begin", "end", "crcs", "index")

    def __init__(self, offsets, sizes, file, name, begin, end, crcs, index=None):
        self.offsets, self.sizes, self.file, self.name = offsets, sizes, file, name
        self.begin, self.end, self.crcs = begin, end, crcs
        self.index = index  # the piece's index in its version-2 layout; None for a version-1 chunk

    def box(self):
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"

    def label(self):
        """How messages name it: "chunk [0:3, 0:4]" (version 1) or "piece 2 [0:3, 0:4]"."""
        return f"chunk {self.box()}" if self.index is None else f"piece {self.index} {self.box()}"

    def numel(self):
        n = 1
        for s in self.sizes:
            n *= s
        return n


class Entry:
    """A key of the checkpoint: a tensor (kind "tensor" or "sharded": dtype, shape, and its
    chunks (version 1, consolidated) or its layout (version 2)) or a plain value (kind "int",
    "float", "bool", "string", "bytes", "dict": value)."""

    __slots__ = ("kind", "dtype", "shape", "chunks", "value", "layout")

    def __init__(self, kind, dtype=None, shape=None, chunks=None, value=None, layout=None):
        self.kind, self.dtype, self.shape, self.chunks, self.value = kind, dtype, shape, chunks or [], value
        self.layout = layout

    @property
    def is_tensor(self):
        return self.kind in ("tensor", "sharded")

    def nbytes(self):
        if self.layout is not None:  # the layout tiles the shape
            return byte_size(self.shape, self.dtype, "")
        return sum(c.end - c.begin for c in self.chunks)

    def pieces(self):
        """How many non-empty pieces (chunks) it is stored in."""
        if self.layout is not None:
            return self.layout.stored_count()
        return sum(1 for c in self.chunks if c.numel())


def _overlap(a, b):
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        if max(ao, bo) >= min(ao + asz, bo + bsz):
            return False
    return True


def first_overlap(boxes):
    """The first two non-empty boxes of ``boxes`` (objects with ``offsets`` and ``sizes``, of
    one rank) that overlap, as (i, j) with i < j, in the order a box-by-box check meets them
    (the smallest j that overlaps an earlier box, then the smallest such i); None when no two
    overlap. The C++ sharding::first_overlap's sweep: along the dimension whose offsets differ
    most, each box compared only with the boxes still open at its start there, kept ordered
    along a second dimension, so boxes of one or two dimensions cost O(P log P), not every
    pair (134 million at 16,384 pieces); naming the first pair takes O(log P) more sweeps."""
    nonempty = [i for i, b in enumerate(boxes) if all(s > 0 for s in b.sizes)]
    if len(nonempty) < 2:
        return None
    nd = len(boxes[nonempty[0]].sizes)
    if nd == 0:
        return nonempty[0], nonempty[1]  # two non-empty pieces of a scalar
    distinct = [len({boxes[i].offsets[d] for i in nonempty}) for d in range(nd)]
    dim = max(range(nd), key=lambda d: (distinct[d], -d))
    others = [d for d in range(nd) if d != dim]
    dim2 = max(others, key=lambda d: (distinct[d], -d)) if others else dim
    longest2 = max(boxes[i].sizes[dim2] for i in nonempty)
    order = sorted(nonempty, key=lambda i: boxes[i].offsets[dim])  # stable: ties by index

    def sweep(limit):
        # The open boxes (started at or before the current start along dim, not yet ended)
        # all contain that start, so no two of them overlap elsewhere. Kept by their offset
        # along dim2, a box is compared with those starting before its end there, the last
        # first, down to the ones that must end before its start (starting longest2 or more
        # before it). Of two dimensions they are disjoint along dim2, so only the last can
        # overlap it; of one, dim2 == dim and at most one box is open.
        closing = []  # heap of (end along dim, index)
        open_ = []  # sorted (offset along dim2, index)
        for i in order:
            if i >= limit:
                continue
            b = boxes[i]
            while closing and closing[0][0] <= b.offsets[dim]:
                k = heapq.heappop(closing)[1]
                del open_[bisect.bisect_left(open_, (boxes[k].offsets[dim2], k))]
            at = bisect.bisect_left(open_, (b.offsets[dim2] + b.sizes[dim2],))
            while at > 0:
                at -= 1
                start2, k = open_[at]
                if start2 + longest2 <= b.offsets[dim2]:
                    break
                if _overlap(boxes[k], b):
                    return min(k, i), max(k, i)
                if nd <= 2:
                    break
            bisect.insort(open_, (b.offsets[dim2], i))
            heapq.heappush(closing, (b.offsets[dim] + b.sizes[dim], i))
        return None

    found = sweep(len(boxes))
    if found is None:
        return None
    # The smallest ``bad`` such that boxes below it overlap (none below ``good`` do): sweeps
    # over growing prefixes, then bisection; a pair found lowers ``bad`` past its later box.
    good, bad = 1, found[1] + 1
    while good * 2 < bad:
        p = sweep(good * 2)
        if p:
            bad = p[1] + 1
            break
        good *= 2
    while good + 1 < bad:
        mid = good + (bad - good) // 2
        p = sweep(mid)
        if p:
            bad = p[1] + 1
        else:
            good = mid
    j = bad - 1
    for i in range(j):
        if all(s > 0 for s in boxes[i].sizes) and _overlap(boxes[i], boxes[j]):
            return i, j
    raise AssertionError(f"first_overlap: box {j} overlaps no earlier box")


def check_tiling(fqn, e, where, chunks=None, word="chunk"):
    """The boxes (``e.chunks``, or ``chunks``) lie inside the shape and tile it exactly; the
    messages call them ``word`` ("chunk", or "piece" for a version-2 list layout)."""
    # The whole tensor's byte size (and element count) is bounded first, as in C++.
    byte_size(e.shape, e.dtype, f"{where}: key '{fqn}': shape {shape_string(e.shape)}")
    boxes = list(e.chunks if chunks is None else chunks)
    whole = 1
    for d in e.shape:
        whole *= d

    def check_overlap(limit):
        """No two of the boxes below ``limit`` overlap (first_overlap's sweep, not every pair)."""
        p = first_overlap(boxes[:limit])
        if p:
            fail(where, ": key '", fqn, "': ", word, "s ", boxes[p[0]].box(), " and ", boxes[p[1]].box(), " overlap")

    for n, c in enumerate(boxes):
        try:
            if len(c.offsets) != len(e.shape) or len(c.sizes) != len(e.shape):
                fail(where, ": key '", fqn, "': ", word, " ", c.box(), " has the wrong number of dimensions for shape ",
                     e.shape)
            for o, s, d in zip(c.offsets, c.sizes, e.shape):
                if o + s > d:
                    fail(where, ": key '", fqn, "': ", word, " ", c.box(), " lies outside the shape ", e.shape)
        except CheckpointError:
            check_overlap(n)  # an overlap before the bad box is named first, as a box-by-box check does
            raise
    check_overlap(len(boxes))
    volume = sum(c.numel() for c in boxes)
    if volume != whole:
        fail(where, ": key '", fqn, "': the ", word, "s cover ", volume, " of ", whole,
             " elements (incomplete checkpoint)")


# ---------------------------------------------------------------- version-2 layouts


def data_file_name(rank):
    """The data file of ``rank`` in a version-2 checkpoint."""
    return f"data-rank{rank:05d}.safetensors"


def chunk_range(n, pieces, i):
    """torch.chunk's rule: [begin, end) of piece i of a dimension of n split into ``pieces``
    (c = ceil(n / pieces) each; trailing pieces may be empty, their begin clamped to n)."""
    c = -(-n // pieces)
    return min(i * c, n), min((i + 1) * c, n)


def flat_row_cut(numel, offset, rows, row_numel, pieces, k):
    """Dim-0 row of cut k (0 <= k <= pieces) of a tensor of ``rows`` rows of ``row_numel``
    elements that is elements [offset, offset + rows * row_numel) of a flat vector of ``numel``
    elements cut into ``pieces`` stretches at floor(numel * k / pieces), a cut inside the
    tensor moved to its nearest row boundary, every cut clamped to the tensor
    (docs/checkpoint-format.md §3). O(1). Piece i is rows [cut(i), cut(i + 1)). Rows of no
    elements (row_numel == 0) are all in piece 0."""
    if k <= 0:
        return 0
    if row_numel == 0:
        return rows
    c = numel if k >= pieces else numel * k // pieces
    moved = offset + (c - offset + row_numel // 2) // row_numel * row_numel  # floor division
    return (min(max(moved, offset), offset + rows * row_numel) - offset) // row_numel


def flat_rows(numel, offset, shape, pieces, i):
    """(begin, end): the dim-0 rows of piece i of a ``flat`` layout of a tensor of ``shape``
    (at least one dimension; parse_layout refuses a flat 0-dimensional tensor). O(1)."""
    rows, r = _rows_of(shape)
    return (flat_row_cut(numel, offset, rows, r, pieces, i), flat_row_cut(numel, offset, rows, r, pieces, i + 1))


def _rows_of(shape):
    if not shape:
        return 1, 1  # one row of one element, as FSDP sees it (a flat layout of one is refused)
    r = 1
    for d in shape[1:]:
        r *= d
    return shape[0], r


def _first_above(cut, lo, hi, value):
    """The smallest k in [lo, hi] with cut(k) > value (cut non-decreasing, cut(hi) > value)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) > value:
            hi = mid
        else:
            lo = mid + 1
    return lo


def flat_pieces_overlapping(numel, offset, shape, pieces, begin, end):
    """The non-empty pieces of a ``flat`` layout that hold some of dim-0 rows [begin, end),
    ascending, with their rows: [(i, row_begin, row_end)]. Binary search over the cuts: O(log P)
    per piece returned, never a loop over every piece."""
    rows, r = _rows_of(shape)
    begin, end = max(begin, 0), min(end, rows)
    out = []
    if begin >= end:
        return out

    def cut(k):
        return flat_row_cut(numel, offset, rows, r, pieces, k)

    # piece i = k - 1 for the first cut k above `begin`: cut(i) <= begin < cut(i + 1)
    k = _first_above(cut, 1, pieces, begin)
    while True:
        lo, hi = cut(k - 1), cut(k)
        out.append((k - 1, lo, hi))
        if hi >= end or k == pieces:
            return out
        # the next non-empty piece starts at `hi`: the last of the pieces whose cut is `hi`
        k = _first_above(cut, k + 1, pieces, hi)


class FileMap:
    """A chunk or flat layout's `files`: piece i is in data file
    first + i*step + ((i + shift) mod replicas) * replica_step."""

    __slots__ = ("first", "step", "replicas", "replica_step", "shift")

    def __init__(self, first=0, step=1, replicas=1, replica_step=0, shift=0):
        self.first, self.step, self.replicas, self.replica_step, self.shift = first, step, replicas, replica_step, shift

    def file(self, i):
        return self.first + i * self.step + ((i + self.shift) % self.replicas) * self.replica_step

    def last_file_piece(self, pieces):
        """The piece whose file is the highest-numbered: O(1). With replicas > 1 and
        replica_step >= pieces*step the replica term dominates, so it is the last piece of the
        highest replica group (i + shift) mod replicas that some piece reaches."""
        if self.replicas == 1:
            return pieces - 1
        i0 = (self.replicas - 1 - self.shift) % self.replicas  # first piece in the last group
        if i0 > pieces - 1:
            return pieces - 1  # the groups the pieces reach do not wrap: the last piece's is highest
        return i0 + (pieces - 1 - i0) // self.replicas * self.replicas

    def __repr__(self):
        return (f"FileMap(first={self.first}, step={self.step}, replicas={self.replicas}, "
                f"replica_step={self.replica_step}, shift={self.shift})")


class PieceLayout:
    """A version-2 tensor's `layout`: how the tensor of ``shape`` is cut into pieces and which
    data file (rank) holds each. Built by parse_layout, which checks it."""

    __slots__ = ("rule", "shape", "pieces", "file", "dim", "numel", "offset", "files", "boxes", "names")

    def __init__(self, rule, shape):
        self.rule, self.shape = rule, list(shape)
        self.pieces = 1  # P, empty pieces included
        self.file = 0  # whole
        self.dim = 0  # chunk
        self.numel = self.offset = 0  # flat: T, o
        self.files = None  # chunk, flat: FileMap
        self.boxes = None  # list: [(file, offsets, sizes)]
        self.names = None  # list: each piece's tensor name in its file (None for an empty piece)

    def count(self):
        """Pieces, empty ones included."""
        return self.pieces

    def file_of(self, i):
        if self.rule == "whole":
            return self.file
        if self.rule == "list":
            return self.boxes[i][0]
        return self.files.file(i)

    def box(self, i):
        """(offsets, sizes) of piece i."""
        shape = self.shape
        if self.rule == "whole":
            return [0] * len(shape), list(shape)
        if self.rule == "list":
            return list(self.boxes[i][1]), list(self.boxes[i][2])
        if self.rule == "chunk":
            b, e = chunk_range(shape[self.dim], self.pieces, i)
            offsets, sizes = [0] * len(shape), list(shape)
            offsets[self.dim], sizes[self.dim] = b, max(0, e - b)
            return offsets, sizes
        b, e = flat_rows(self.numel, self.offset, shape, self.pieces, i)
        return [b] + [0] * (len(shape) - 1), [e - b] + list(shape[1:])

    def pieces_in_file(self, f):
        """The pieces (empty ones included) that data file ``f`` stores, ascending: the inverse
        of file_of, O(1) for the rules (a valid layout: with replicas > 1, replica_step >=
        pieces*step, so the replica groups' files do not interleave), one pass for a list."""
        if self.rule == "whole":
            return [0] if self.file == f else []
        if self.rule == "list":
            return [i for i, b in enumerate(self.boxes) if b[0] == f]
        fm = self.files
        rel, group = f - fm.first, 0
        if rel < 0 or fm.step < 1:
            return []
        if fm.replicas > 1:
            if fm.replica_step < 1:
                return [i for i in range(self.pieces) if fm.file(i) == f]
            group = rel // fm.replica_step
            if group >= fm.replicas:
                return []
            rel -= group * fm.replica_step
        if rel % fm.step:
            return []
        i = rel // fm.step
        return [i] if i < self.pieces and fm.file(i) == f else []

    def name(self, fqn, i):
        """The tensor name of (non-empty) piece i in its data file: FQN when it is the entry's
        only piece there (always, for the rules), else FQN@k."""
        if self.rule == "list":
            return self.names[i]
        return fqn

    def overlapping(self, begin=None, end=None):
        """The non-empty pieces holding some of dim-0 rows [begin, end) (None: the whole
        tensor), ascending. Chunk and flat need no loop over every piece."""
        shape = self.shape
        if any(d == 0 for d in shape):
            return []  # a zero-element tensor has no stored piece
        whole = begin is None
        rows = shape[0] if shape else 1
        if whole:
            begin, end = 0, rows
        begin, end = max(begin, 0), min(end, rows)
        if begin >= end:
            return []
        if self.rule == "whole":
            return [0]
        if self.rule == "chunk":
            n = shape[self.dim]
            c = -(-n // self.pieces)
            last = -(-n // c) - 1  # the last non-empty piece
            if self.dim != 0:
                return list(range(last + 1))  # every piece holds part of every row
            return list(range(begin // c, min(last, (end - 1) // c) + 1))
        if self.rule == "flat":
            return [i for i, _, _ in flat_pieces_overlapping(self.numel, self.offset, shape, self.pieces, begin, end)]
        out = []
        for i, (_, offsets, sizes) in enumerate(self.boxes):
            if all(sizes) and (not shape or (offsets[0] < end and offsets[0] + sizes[0] > begin)):
                out.append(i)
        return out

    def stored_count(self):
        """How many non-empty (stored) pieces."""
        if any(d == 0 for d in self.shape):
            return 0
        if self.rule == "whole":
            return 1
        if self.rule == "chunk":
            n = self.shape[self.dim]
            return -(-n // -(-n // self.pieces))
        return len(self.overlapping())


RULES = ("whole", "chunk", "flat", "list")


def _parse_files(j, pieces, world_size, what):
    # The C++ reader's files_from_json (metadata.cpp): the same bounds, order and words.
    if not isinstance(j, dict):
        fail(what, ": layout.files is not an object")
    fm = FileMap(int_in(j.get("first"), 0, world_size - 1, what + " layout.files.first"),
                 int_in(j.get("step"), 1, world_size, what + " layout.files.step"))
    if "replicas" in j:  # replicas, replica_step and shift come together
        fm.replicas = int_in(j["replicas"], 1, world_size, what + " layout.files.replicas")
        fm.replica_step = int_in(j.get("replica_step"), 0, world_size - 1, what + " layout.files.replica_step")
        fm.shift = int_in(j.get("shift"), 0, INT64_MAX, what + " layout.files.shift")  # any: taken mod replicas
    if fm.replicas > 1 and fm.replica_step < pieces * fm.step:
        fail(what, ": layout.files.replica_step ", fm.replica_step, " is below layout.pieces * layout.files.step = ",
             pieces * fm.step, " (two pieces would share a file)")
    # Every replica group's files lie in the world, whether or not a piece reaches the last group.
    f = fm.first + (pieces - 1) * fm.step + (fm.replicas - 1) * fm.replica_step
    if f >= world_size:
        fail(what, ": layout.files reach data file ", f, ", outside [0, ", world_size - 1, "]")
    return fm


def _box_text(offsets, sizes):
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def parse_layout(j, e, fqn, world_size, where):
    """The `layout` of tensor entry ``e`` (dtype, shape set), checked as the C++ reader checks
    it (metadata.cpp layout_from_json, sharding::Layout::validate), field by field in the same
    order and words: parameters in range, files in [0, world_size), a list's pieces (at most
    64 per data file, each non-empty and inside the shape) tiling the shape."""
    what = f"{where} key '{fqn}'"
    if not isinstance(j, dict):
        fail(what, ": layout is not an object")
    rule = j.get("rule")
    if rule not in RULES:
        fail(what, ": unknown layout rule ", jdump(rule), " (known: ", ", ".join(RULES), ")")
    shape = e.shape
    lay = PieceLayout(rule, shape)
    if rule == "whole":
        lay.file = int_in(j.get("file"), 0, world_size - 1, what + " layout.file")
    elif rule in ("chunk", "flat") and not shape:
        fail(what, ": a ", rule, " layout needs a tensor of at least one dimension (a 0-dimensional one is whole)")
    elif rule == "chunk":
        lay.dim = int_in(j.get("dim"), 0, len(shape) - 1, what + " layout.dim")
        lay.pieces = int_in(j.get("pieces"), 1, world_size, what + " layout.pieces")
        lay.files = _parse_files(j.get("files"), lay.pieces, world_size, what)
    elif rule == "flat":
        lay.numel = int_in(j.get("numel"), 0, INT64_MAX, what + " layout.numel")
        lay.offset = int_in(j.get("offset"), 0, INT64_MAX, what + " layout.offset")
        lay.pieces = int_in(j.get("pieces"), 1, world_size, what + " layout.pieces")
        n = 1
        for d in shape:
            n *= d
        if lay.offset + n > lay.numel:
            fail(what, ": layout.offset ", lay.offset, " + the tensor's ", n, " elements exceed layout.numel ",
                 lay.numel)
        lay.files = _parse_files(j.get("files"), lay.pieces, world_size, what)
    else:
        jp = j.get("pieces")
        if not isinstance(jp, list):
            fail(what, ": layout.pieces is not an array")
        most = MAX_LIST_PIECES_PER_FILE * world_size
        if len(jp) > most:
            fail(what, ": layout.pieces lists ", len(jp), " pieces, more than ", MAX_LIST_PIECES_PER_FILE,
                 " per data file (", most, " for world_size ", world_size, ")")
        boxes = []
        for i, p in enumerate(jp):
            at = f"{what} layout.pieces[{i}]"
            if not isinstance(p, list) or len(p) != 3:
                fail(at, " is not [file, offsets, sizes]")
            f = int_in(p[0], 0, world_size - 1, at + " file")
            boxes.append((f, _dims(p[1], at + " offsets"), _dims(p[2], at + " sizes")))
        # Piece by piece: its rank, inside the shape, not empty; then no overlap, then coverage.
        volume = 0
        for i, (f, offsets, sizes) in enumerate(boxes):
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                fail(what, ": layout.pieces[", i, "] has ", len(offsets), " offsets and ", len(sizes),
                     " sizes for a shape of rank ", len(shape))
            if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
                fail(what, ": layout.pieces[", i, "] (offsets ", shape_string(offsets), ", sizes ",
                     shape_string(sizes), ") lies outside the shape ", shape_string(shape))
            if not all(sizes):
                fail(what, ": layout.pieces[", i, "] ", _box_text(offsets, sizes),
                     " is empty (a list layout names only the pieces its data files store)")
            n = 1
            for s_ in sizes:
                n *= s_
            volume += n
        chunks = [Chunk(o, z, f, None, 0, 0, []) for f, o, z in boxes]
        ov = first_overlap(chunks)
        if ov:
            fail(what, ": pieces ", chunks[ov[0]].box(), " and ", chunks[ov[1]].box(), " overlap")
        whole = 1
        for d in shape:
            whole *= d
        if volume != whole:
            fail(what, ": the pieces cover ", volume, " of ", whole, " elements (incomplete checkpoint)")
        lay.boxes = boxes
        lay.pieces = len(boxes)
        stored = {}
        for i, (f, _, sizes) in enumerate(boxes):
            stored.setdefault(f, []).append(i)
        lay.names = [None] * len(boxes)
        for idx in stored.values():
            for k, i in enumerate(idx):
                lay.names[i] = fqn if len(idx) == 1 else f"{fqn}@{k}"
    return lay


class Layout:
    """What a checkpoint holds, parsed and checked, before any tensor data is read."""

    def __init__(self):
        self.path = ""  # what the user named
        self.location = ""  # the directory or file actually read (an aside sibling after a torn publish)
        self.kind = ""  # "sharded" | "consolidated" | "safetensors" | "hf" (a Hugging Face directory: _hf.py)
        self.version = 1  # a consolidated or another writer's file: 1
        self.world_size = None
        self.save_id = None  # version 2: the save's id, which every data file carries
        self.crc_block = 0
        self.files = []  # [(name, size)]
        self.keys = []  # save order
        self.entries = {}
        self.notes = []  # remarks that are no error (an "hf" index's total_size)
        self.hf_index = None  # "hf": the index file's name, None for a single model.safetensors
        self.total_size = None  # "hf": the index's metadata.total_size
        self.file_of = {}  # "hf": tensor -> its shard file (empty tensors too)

    def file_path(self, name):
        return os.path.join(self.location, name) if self.kind in ("sharded", "hf") else self.location

    def data_files(self):
        """The names of the data files (version 2: one per rank, in rank order)."""
        if self.version >= 2 and self.kind == "sharded":
            return [data_file_name(r) for r in range(self.world_size)]
        return [n for n, _ in self.files]


# ---------------------------------------------------------------- sharded metadata


def check_metadata_checksum(text, where, version=1):
    """The metadata_crc32c of the metadata text: version 1 on its own line (indent=1 style),
    version 2 the last member of compact JSON, ``,"metadata_crc32c":"xxxxxxxx"}`` ending the text."""
    if version >= 2:
        start = len(text) - 10
        if start < len(_METADATA_CRC_TAIL) or text[start - len(_METADATA_CRC_TAIL) : start] != _METADATA_CRC_TAIL \
                or text[-2:] != b'"}':
            fail(where, ': the text does not end with ,"metadata_crc32c":"xxxxxxxx"} where the writer puts it '
                 "-- the metadata is corrupt (or hand-edited)")
    else:
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
    if too_many_json_items(text, MAX_METADATA_ITEMS):  # before building it: what parsing costs is bounded
        fail(where, ": metadata holds more than ", MAX_METADATA_ITEMS,
             " JSON values and keys, the bound every reader enforces (corrupt or hostile)")
    j = parse_json_strict(text, where + ": metadata")
    if not isinstance(j, dict) or j.get("format") != "tessera-checkpoint":
        fail(where, ': not Tessera checkpoint metadata (no "format": "tessera-checkpoint")')
    m = Layout()
    m.kind = "sharded"
    m.location = directory
    if "version" not in j or not _is_int(j["version"]):
        fail(where, ": no integer version")
    if not 1 <= j["version"] <= FORMAT_VERSION:
        fail(where, ": format version ", j["version"], " is not supported (this reader reads versions 1..",
             FORMAT_VERSION, ")")
    m.version = j["version"]
    if "world_size" not in j:
        fail(where, ": no world_size")
    m.world_size = int_in(j["world_size"], 1, MAX_WORLD_SIZE, where + " world_size")
    m.crc_block = check_crc_block(_u64(j.get("crc32c_block"), where + " crc32c_block"), where + " crc32c_block")
    if m.version >= 2:
        return _parse_metadata_v2(j, m, where)
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


def _parse_metadata_v2(j, m, where):
    """Version 2: a layout per tensor; no files list (data-rank%05d.safetensors for every
    rank) and no byte ranges or checksums (each data file's own header has them)."""
    sid = j.get("save_id")
    if not isinstance(sid, str) or not _SAVE_ID.match(sid):
        fail(where, ": save_id ", jdump(sid), " is not 16 lowercase hex digits")
    m.save_id = sid
    if not isinstance(j.get("keys"), list) or not isinstance(j.get("entries"), dict):
        fail(where, ": keys/entries missing")
    if len(j["entries"]) != len(j["keys"]):
        fail(where, ": ", len(j["entries"]), " entries for ", len(j["keys"]), " keys")
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
            byte_size(e.shape, e.dtype, f"{what}: shape {shape_string(e.shape)}")
            e.layout = parse_layout(je.get("layout"), e, fqn, m.world_size, where)
        m.keys.append(fqn)
        m.entries[fqn] = e
    return m


def check_data_file(st, m, rank):
    """A version-2 data file must be this save's file of ``rank``: tessera.format
    tessera-data, tessera.version 2, tessera.rank and tessera.save_id, and block checksums."""
    md, path = st.metadata, st.path
    if md.get("tessera.format") != "tessera-data":
        fail("'", path, "': tessera.format is ", json.dumps(md.get("tessera.format")),
             ", not \"tessera-data\" (not a data file of a sharded checkpoint)")
    if md.get("tessera.version") != str(m.version):
        fail("'", path, "': tessera.version is ", json.dumps(md.get("tessera.version")), " in a version-", m.version,
             " checkpoint (a data file of another save)")
    if md.get("tessera.rank") != str(rank):
        fail("'", path, "': tessera.rank is ", json.dumps(md.get("tessera.rank")), ", not ", rank,
             " (a data file of another rank)")
    if md.get("tessera.save_id") != m.save_id:
        fail("'", path, "': tessera.save_id is ", json.dumps(md.get("tessera.save_id")), ", not the metadata's \"",
             m.save_id, "\" (a data file of another save)")
    if "tessera.crc32c" not in md:
        fail("'", path, "': no tessera.crc32c block checksums")
    if st.crc_block != m.crc_block:
        fail("'", path, "': checksum blocks of ", st.crc_block, " bytes, the metadata says ", m.crc_block)
    check_data_file_contents(st, m, rank)


PIECE_OFFSETS_KEY = "tessera.offsets"


def check_data_file_contents(st, m, rank):
    """A version-2 data file holds exactly the pieces the layouts place in it: each with the
    entry's dtype and the piece's shape, at the offsets the file records for it
    (tessera.offsets, written since 2026-12-06; an older file has none), and no other tensor.
    The C++ reader's ChunkReader::data_file makes the same checks with the same words."""
    path = st.path
    offsets = None
    if PIECE_OFFSETS_KEY in st.metadata:
        offsets = parse_json_strict(st.metadata[PIECE_OFFSETS_KEY], f"'{path}': {PIECE_OFFSETS_KEY}")
        if not isinstance(offsets, dict):
            fail("'", path, "': ", PIECE_OFFSETS_KEY, " is not a JSON object")
        for name, v in offsets.items():
            if not isinstance(v, list) or not all(_is_int(x) for x in v):
                fail("'", path, "': ", PIECE_OFFSETS_KEY, " of tensor '", name, "' is not an array of integers")
    want = set()
    for k in m.keys:
        e = m.entries[k]
        if not e.is_tensor or e.layout is None:
            continue
        for i in e.layout.pieces_in_file(rank):
            box_offsets, sizes = e.layout.box(i)
            if any(s == 0 for s in sizes):
                continue
            name = e.layout.name(k, i)
            want.add(name)
            t = st.tensors.get(name)
            if t is None:
                label = Chunk(box_offsets, sizes, None, name, 0, 0, [], i).label()
                fail("'", path, "' key '", k, "': ", label, " (tensor '", name,
                     "') is not in the data file (incomplete or mixed-up checkpoint)")
            if t[0] != e.dtype or t[1] != sizes:
                fail("'", path, "' key '", k, "': tensor '", name, "' has dtype ", t[0], " and shape ",
                     shape_string(t[1]), ", the layout says ", e.dtype, " ", shape_string(sizes))
            if offsets is None:
                continue
            if name not in offsets:
                fail("'", path, "' key '", k, "': tensor '", name, "' has no entry in ", PIECE_OFFSETS_KEY)
            if offsets[name] != box_offsets:
                fail("'", path, "' key '", k, "': tensor '", name, "' holds the piece at offsets ",
                     shape_string(offsets[name]), ", the layout places the piece at ", shape_string(box_offsets),
                     " in this file (pieces swapped or mixed up)")
    for name in st.order:
        if name not in want:
            fail("'", path, "': tensor '", name, "' is no piece of any layout in the metadata (a foreign or mixed-up "
                 "data file)")
    for name in offsets or {}:
        if name not in want:
            fail("'", path, "': ", PIECE_OFFSETS_KEY, " names tensor '", name,
                 "', which is no piece of any layout in the metadata")


def piece_chunk(m, st, fqn, e, i):
    """Piece i of version-2 entry ``e`` as found in data file ``st`` (its rank's header,
    already checked by check_data_file): the tensor there must have the piece's dtype and
    box sizes. A Chunk with the byte range and block checksums of that file."""
    offsets, sizes = e.layout.box(i)
    name = e.layout.name(fqn, i)
    c = Chunk(offsets, sizes, os.path.basename(st.path), name, 0, 0, [], i)
    t = st.tensors.get(name)
    if t is None:
        fail("'", st.path, "' key '", fqn, "' ", c.label(), ": tensor '", name, "' is not in the data file")
    if t[0] != e.dtype or t[1] != sizes:
        fail("'", st.path, "' key '", fqn, "' ", c.label(), ": the data file's tensor '", name, "' is ", t[0], " ",
             shape_string(t[1]), ", the layout needs ", e.dtype, " ", shape_string(sizes))
    c.begin, c.end, c.crcs = t[2], t[3], st.crcs.get(name, [])
    return c


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
    """Parses and checks a checkpoint: a sharded directory, a safetensors file or a Hugging
    Face model directory (_hf.py)."""
    path = os.fspath(path)
    p = path
    if not os.path.exists(p):
        aside = aside_sibling(p)
        if aside is None:
            raise CheckpointNotFoundError(f"checkpoint '{path}' does not exist")
        p = aside
    if os.path.isdir(p):
        from ._hf import is_hf_directory, open_hf_directory

        if is_hf_directory(p):  # no Tessera metadata; model.safetensors.index.json or model.safetensors
            m = open_hf_directory(p)
            m.path = path
            return m
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
        check_metadata_checksum(text, f"'{mf}'", m.version)  # after parsing: structural errors keep their messages
        # Version 1 lists every data file with its size, checked here; version 2's are opened
        # (and their presence checked) only when something in them is read.
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
