"""A sharded checkpoint's metadata, tessera-checkpoint.json (C++:
src/tessera/checkpoint/format/metadata.cpp, docs/checkpoint-format.md §3): version 1 lists
every chunk with its byte range and checksums, version 2 holds a layout rule per tensor (byte
ranges and checksums in each data file's own header). Parsed and checked as the C++ reader
does, field by field in the same order and words, so a file Tessera refuses is refused here
too, with the file and key named; then the Layout (what a checkpoint holds) every reader of
the package works from. Everything here is plain data: nothing is unpickled or executed."""
import json
import math
import os
import re
import struct

from . import _crc32c
from ._error import CheckpointError, fail
from ._format_checksum import check_crc_block, num_blocks, parse_crc_hex
from ._format_json import (INT64_MAX, INT64_MIN, int_in, is_json_int, jdump, json_dims, json_u64, parse_json_strict,
                           too_many_json_items)
from ._format_safetensors import byte_size, dtype_of
from ._sharding_chunk import Box, box_text, shape_string
from ._sharding_layout import INNER_RULES, MAX_STRIPES, RULES, RULES_V3, FileMap, PieceLayout
from ._sharding_spec import first_overlap

METADATA_FILE = "tessera-checkpoint.json"
FORMAT_VERSION = 3  # the newest version read; every version from 1 is read
MAX_METADATA_BYTES = 256 << 20
MAX_WORLD_SIZE = 1 << 20
MAX_LIST_PIECES_PER_FILE = 64  # a list layout names at most 64 pieces per data file (64 * world_size in all)
# JSON values and member names a metadata file may hold (C++ kMaxMetadataItems, metadata.h):
# bounds what parsing it costs, whatever is in it (issue 44 item 3).
MAX_METADATA_ITEMS = 1 << 22
# Version 2 data files: the __metadata__ key recording each stored piece's offsets in its tensor.
PIECE_OFFSETS_KEY = "tessera.offsets"

_METADATA_CRC_MARKER = b'\n "metadata_crc32c": "'  # version 1 (json.dump(indent=1) style)
_METADATA_CRC_TAIL = b',"metadata_crc32c":"'  # version 2: the text ends with it, 8 hex digits and "}
_SAVE_ID = re.compile(r"[0-9a-f]{16}\Z")
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*\Z")


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
        need("value", is_json_int(j.get("value")))
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


class Chunk(Box):
    """One stored piece of a tensor: its box in the whole tensor and where its bytes are
    (version 1: from the metadata; version 2: from the data file's own header)."""

    __slots__ = ("file", "name", "begin", "end", "crcs", "index")

    def __init__(self, offsets, sizes, file, name, begin, end, crcs, index=None):
        self.offsets, self.sizes, self.file, self.name = offsets, sizes, file, name
        self.begin, self.end, self.crcs = begin, end, crcs
        self.index = index  # the piece's index in its version-2 layout; None for a version-1 chunk

    def label(self):
        """How messages name it: "chunk [0:3, 0:4]" (version 1) or "piece 2 [0:3, 0:4]"."""
        return f"chunk {self.box()}" if self.index is None else f"piece {self.index} {self.box()}"


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


class Layout:
    """What a checkpoint holds, parsed and checked, before any tensor data is read."""

    def __init__(self):
        self.path = ""  # what the user named
        self.location = ""  # the directory or file actually read (an aside sibling after a torn publish)
        self.kind = ""  # "sharded" | "consolidated" | "safetensors" | "hf" (a Hugging Face directory)
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


def _parse_files(j, pieces, world_size, what, version=2, holders_are="layout.pieces"):
    # The C++ reader's files_from_json (metadata.cpp): the same bounds, order and words.
    # ``pieces``: the map's pieces (a tp layout's holders, named ``holders_are`` in messages).
    if not isinstance(j, dict):
        fail(what, ": layout.files is not an object")
    fm = FileMap(int_in(j.get("first"), 0, world_size - 1, what + " layout.files.first"),
                 int_in(j.get("step"), 1, world_size, what + " layout.files.step"))
    if "replicas" in j:  # replicas, replica_step and shift come together
        fm.replicas = int_in(j["replicas"], 1, world_size, what + " layout.files.replicas")
        fm.replica_step = int_in(j.get("replica_step"), 0, world_size - 1, what + " layout.files.replica_step")
        fm.shift = int_in(j.get("shift"), 0, INT64_MAX, what + " layout.files.shift")  # any: taken mod replicas
    # Replica groups follow each other or (version 3) interleave inside each step.
    if fm.replicas > 1 and fm.replica_step < pieces * fm.step and not (fm.interleaved() and version >= 3):
        fail(what, ": layout.files.replica_step ", fm.replica_step, " is below ", holders_are,
             " * layout.files.step = ", pieces * fm.step, " (two pieces would share a file)",
             "; interleaved replica groups need format version 3" if fm.interleaved() else "")
    # Every replica group's files lie in the world, whether or not a piece reaches the last group.
    f = fm.first + (pieces - 1) * fm.step + (fm.replicas - 1) * fm.replica_step
    if f >= world_size:
        fail(what, ": layout.files reach data file ", f, ", outside [0, ", world_size - 1, "]")
    return fm


def _parse_tp_layout(j, lay, world_size, what):
    """Version 3's tp rule, as the C++ reader's tp_layout_from_json then Layout::validate_tp
    check it (metadata.cpp, sharding/layout.cpp): the same fields, order, bounds and words."""
    shape = lay.shape
    rank = len(shape)
    if rank == 0:
        fail(what, ": a tp layout needs a tensor of at least one dimension")
    lay.dim = int_in(j.get("dim"), 0, rank - 1, what + " layout.dim")
    lay.stripes = int_in(j.get("stripes"), 1, MAX_STRIPES, what + " layout.stripes")
    lay.tp = tp = int_in(j.get("tp"), 1, world_size, what + " layout.tp")
    jin = j.get("inner")
    if not isinstance(jin, dict):
        fail(what, ": layout.inner is not an object")
    rule = jin.get("rule")
    if not isinstance(rule, str) or rule not in INNER_RULES:
        fail(what, ": unknown layout.inner.rule ", jdump(rule), " (known: whole, chunk, flat)")
    lay.inner = rule
    lay.pieces = 1
    if rule == "chunk":
        lay.inner_dim = int_in(jin.get("dim"), 0, rank - 1, what + " layout.inner.dim")
        lay.pieces = int_in(jin.get("pieces"), 1, world_size, what + " layout.inner.pieces")
    elif rule == "flat":
        def ints(name):  # one integer, or one per TP piece (tp of them)
            v, at = jin.get(name), f"{what} layout.inner.{name}"
            if not isinstance(v, list):
                return [int_in(v, 0, INT64_MAX, at)]
            if len(v) != tp:
                fail(at, " holds ", len(v), " values (1, or layout.tp = ", tp, ")")
            return [int_in(x, 0, INT64_MAX, f"{at}[{t}]") for t, x in enumerate(v)]

        lay.inner_numel = ints("numel")
        lay.inner_offset = ints("offset")
        lay.pieces = int_in(jin.get("pieces"), 1, world_size, what + " layout.inner.pieces")
    if lay.pieces * tp > world_size:
        fail(what, ": layout.inner.pieces ", lay.pieces, " x layout.tp ", tp, " holders exceed world_size ", world_size)
    lay.files = _parse_files(j.get("files"), lay.pieces * tp, world_size, what, 3, "layout.inner.pieces * layout.tp")
    # What Layout::validate_tp checks beyond the fields' own bounds.
    n = shape[lay.dim]
    if n % lay.stripes:
        fail(what, ": layout.stripes ", lay.stripes, " does not divide dimension ", lay.dim, " of shape ",
             shape_string(shape), " (", n, ")")
    if rule == "flat":
        for t in range(tp):
            local = 1
            for d in lay.tp_local_shape(t):
                local *= d
            numel = lay.inner_numel[0 if len(lay.inner_numel) == 1 else t]
            offset = lay.inner_offset[0 if len(lay.inner_offset) == 1 else t]
            if offset + local > numel:
                fail(what, ": layout.inner.offset ", offset, " + the ", local, " elements of tensor-parallel piece ", t,
                     " exceed layout.inner.numel ", numel)


def parse_layout(j, e, fqn, world_size, where, version=2):
    """The `layout` of tensor entry ``e`` (dtype, shape set), checked as the C++ reader checks
    it (metadata.cpp layout_from_json, sharding::Layout::validate), field by field in the same
    order and words: parameters in range, files in [0, world_size), a list's pieces (at most
    64 per data file, each non-empty and inside the shape) tiling the shape."""
    what = f"{where} key '{fqn}'"
    if not isinstance(j, dict):
        fail(what, ": layout is not an object")
    rule = j.get("rule")
    if not isinstance(rule, str) or rule not in (RULES_V3 if version >= 3 else RULES):
        fail(what, ": unknown layout rule ", jdump(rule), " (known: whole, chunk, flat, list, tp)" if version >= 3
             else " (known: whole, chunk, flat, list; tp needs format version 3)")
    shape = e.shape
    lay = PieceLayout(rule, shape)
    if rule == "tp":
        _parse_tp_layout(j, lay, world_size, what)
    elif rule == "whole":
        lay.file = int_in(j.get("file"), 0, world_size - 1, what + " layout.file")
    elif rule in ("chunk", "flat") and not shape:
        fail(what, ": a ", rule, " layout needs a tensor of at least one dimension (a 0-dimensional one is whole)")
    elif rule == "chunk":
        lay.dim = int_in(j.get("dim"), 0, len(shape) - 1, what + " layout.dim")
        lay.pieces = int_in(j.get("pieces"), 1, world_size, what + " layout.pieces")
        lay.files = _parse_files(j.get("files"), lay.pieces, world_size, what, version)
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
        lay.files = _parse_files(j.get("files"), lay.pieces, world_size, what, version)
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
            boxes.append((f, json_dims(p[1], at + " offsets"), json_dims(p[2], at + " sizes")))
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
                fail(what, ": layout.pieces[", i, "] ", box_text(offsets, sizes),
                     " is empty (a list layout names only the pieces its data files store)")
            n = 1
            for s_ in sizes:
                n *= s_
            volume += n
        chunks = [Box(o, z) for f, o, z in boxes]
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
    want = parse_crc_hex(text[start : start + 8].decode("latin-1"), where + " metadata_crc32c")
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
    if "version" not in j or not is_json_int(j["version"]):
        fail(where, ": no integer version")
    if not 1 <= j["version"] <= FORMAT_VERSION:
        fail(where, ": format version ", j["version"], " is not supported (this reader reads versions 1..",
             FORMAT_VERSION, ")")
    m.version = j["version"]
    if "world_size" not in j:
        fail(where, ": no world_size")
    m.world_size = int_in(j["world_size"], 1, MAX_WORLD_SIZE, where + " world_size")
    m.crc_block = check_crc_block(json_u64(j.get("crc32c_block"), where + " crc32c_block"), where + " crc32c_block")
    if m.version >= 2:
        return _parse_metadata_v2(j, m, where)
    if not isinstance(j.get("files"), list):
        fail(where, ": files is not an array")
    for f in j["files"]:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            fail(where, ": bad files entry")
        check_plain_name(f["name"], where)
        m.files.append((f["name"], json_u64(f.get("size"), where + " file size")))
    if len(m.files) != m.world_size:
        fail(where, ": world_size is ", m.world_size, " but ", len(m.files), " data files are listed (one per rank)")
    if not isinstance(j.get("keys"), list) or not isinstance(j.get("entries"), dict):
        fail(where, ": keys/entries missing")
    listed = {n for n, _ in m.files}

    def chunks(fqn, e, je, what):
        if not isinstance(je.get("chunks"), list):
            fail(what, ": chunks is not an array")
        for jc in je["chunks"]:
            if not isinstance(jc, dict):
                fail(what, ": a chunk is not an object")
            offsets = json_dims(jc.get("offsets"), what + " chunk offsets")
            sizes = json_dims(jc.get("sizes"), what + " chunk sizes")
            if not isinstance(jc.get("file"), str) or not isinstance(jc.get("name"), str):
                fail(what, ": chunk without file/name")
            check_plain_name(jc["file"], what)
            br = jc.get("byte_range")
            if not isinstance(br, list) or len(br) != 2:
                fail(what, ": bad byte_range")
            b, en = json_u64(br[0], what + " byte_range"), json_u64(br[1], what + " byte_range")
            c = Chunk(offsets, sizes, jc["file"], jc["name"], b, en, [])
            if b > en or en - b != byte_size(sizes, e.dtype, what):
                fail(what, ": byte_range [", b, ", ", en, "] does not match chunk ", c.box())
            crcs = jc.get("crc32c")
            need = num_blocks(en - b, m.crc_block)
            if not isinstance(crcs, list) or len(crcs) != need:
                fail(what, ": chunk ", c.box(), " needs ", need, " checksums")
            c.crcs = [parse_crc_hex(x, what) for x in crcs]
            if c.file not in listed:
                fail(what, ": chunk file '", c.file, "' is not listed in files")
            e.chunks.append(c)
        check_tiling(fqn, e, where)

    return _parse_entries(j, m, where, chunks)


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

    def layout(fqn, e, je, what):
        byte_size(e.shape, e.dtype, f"{what}: shape {shape_string(e.shape)}")
        e.layout = parse_layout(je.get("layout"), e, fqn, m.world_size, where, m.version)

    return _parse_entries(j, m, where, layout)


def _parse_entries(j, m, where, tensor):
    """The keys and their entries, of either version: each key a string, listed once, with an
    entry that has a kind; a plain value decoded, a tensor's dtype and shape read, then
    ``tensor(fqn, entry, its JSON, what)`` reads where it is stored (version 1: its chunks;
    version 2: its layout)."""
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
            e = Entry(kind, dtype_of(je.get("dtype"), what), json_dims(je.get("shape"), what + " shape"))
            tensor(fqn, e, je, what)
        m.keys.append(fqn)
        m.entries[fqn] = e
    return m
