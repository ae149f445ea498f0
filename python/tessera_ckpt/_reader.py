"""Reading a checkpoint of any kind (C++: src/tessera/checkpoint/reader.cpp): open_layout
recognises a sharded directory (format version 1 or 2, any world size at save), a safetensors
file (Tessera's consolidated format or another writer's) and a Hugging Face model directory
(_interop_hf_dir.py), and checks what it holds before any tensor byte is read;
CheckpointReader reads the tensors and values a caller asks for with pread, only the byte
ranges (and, of a version-2 checkpoint, only the data files) needed, verifying the checksum
blocks it reads; load reads them all. Tensors come back whole (or some dim-0 rows of one) on
the CPU; torch is imported only when a tensor is read."""
import collections
import ctypes
import json
import os
import stat
import struct

from . import _crc32c
from ._error import CheckpointError, CheckpointNotFoundError, fail
from ._format_json import is_json_int, parse_json_strict
from ._format_metadata import (MAX_METADATA_BYTES, MAX_WORLD_SIZE, METADATA_FILE, PIECE_OFFSETS_KEY, Chunk, Entry,
                               Layout, check_metadata_checksum, data_file_name, decode_value, parse_metadata)
from ._format_safetensors import DTYPES, Safetensors
from ._interop_hf_dir import is_hf_directory, open_hf_directory
from ._sharding_chunk import shape_string
from ._storage_commit import aside_sibling
from ._storage_file import open_file, pread, pread_into

# ---------------------------------------------------------------- what a checkpoint holds


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


def open_layout(path):
    """Parses and checks a checkpoint: a sharded directory, a safetensors file or a Hugging
    Face model directory (_interop_hf_dir.py)."""
    path = os.fspath(path)
    p = path
    if not os.path.exists(p):
        aside = aside_sibling(p)
        if aside is None:
            raise CheckpointNotFoundError(f"checkpoint '{path}' does not exist")
        p = aside
    if os.path.isdir(p):
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


# ---------------------------------------------------------------- version-2 data files


def check_data_file(st, m, rank):
    """A version-2 (or -3) data file must be this save's file of ``rank``: tessera.format
    tessera-data, tessera.version 2 (in both), tessera.rank and tessera.save_id, and block checksums."""
    md, path = st.metadata, st.path
    if md.get("tessera.format") != "tessera-data":
        fail("'", path, "': tessera.format is ", json.dumps(md.get("tessera.format")),
             ", not \"tessera-data\" (not a data file of a sharded checkpoint)")
    if md.get("tessera.version") != "2":  # version 3 changed the metadata only: its data files say 2 too
        fail("'", path, "': tessera.version is ", json.dumps(md.get("tessera.version")), ", not \"2\", in a version-",
             m.version, " checkpoint (a data file of another save)")
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
            if not isinstance(v, list) or not all(is_json_int(x) for x in v):
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


# ---------------------------------------------------------------- reading tensors


def _torch():
    import torch

    return torch


def torch_dtype(name):
    """The torch dtype of a safetensors dtype name ("F32", "BF16", ...)."""
    return getattr(_torch(), DTYPES[name][0])


PIPELINE_PIECE = 16 << 20  # bytes read before their checksums are handed to another thread
_pipe = {}


def _pipeline():
    """One thread that checksums the pieces already read (separate from the CRC module's
    pool, which its tasks may use), per process: a forked child has none of its parent's."""
    p = _pipe.get(os.getpid())
    if p is None:
        from concurrent.futures import ThreadPoolExecutor

        p = _pipe[os.getpid()] = ThreadPoolExecutor(1, thread_name_prefix="tessera-ckpt-verify")
    return p


def _max_open_files():
    """Data files kept open at once: an eighth of the descriptor limit, as the C++ reader
    (a checkpoint of more ranks than that is read closing and reopening the oldest)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft <= 0:
            soft = 1 << 16
    except (ImportError, OSError, ValueError):
        soft = 1024
    return max(8, soft // 8)


def tensor_view(t):
    """A writable byte memoryview of a contiguous CPU tensor (bf16 included: no numpy)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class CheckpointReader:
    """An open checkpoint: its metadata parsed and checked, data files opened on demand
    (tessera_ckpt.Checkpoint is this class with inspect() and verify()).

        with tessera_ckpt.Checkpoint(path) as ck:
            ck.keys()              # every FQN, save order
            ck.kind                # "sharded", "consolidated", "safetensors" (another writer's file) or "hf"
            ck.world_size          # the world size at save (None for another writer's file)
            ck["model.w"]          # one tensor, whole, or a plain value
            ck.get("model.w", rows=(2, 5))   # dim-0 rows [2, 5) of it: only the pieces holding them are read

    Data files are opened when something in them is read (a version-2 checkpoint's are not
    even looked at before), their headers parsed and checked once and kept.
    """

    def __init__(self, path):
        self._layout = open_layout(path)
        self._fds = collections.OrderedDict()  # name -> fd, least recently used first
        self._ids = {}  # name -> (st_dev, st_ino) of the file first opened under it
        self._headers = {}
        self._max_fds = _max_open_files()

    # -- what is there
    @property
    def path(self):
        return self._layout.path

    @property
    def location(self):
        """The directory or file actually read (differs from ``path`` only when ``path`` was
        missing and the previous checkpoint was found at its `.NAME.tessera-old-*` sibling)."""
        return self._layout.location

    @property
    def kind(self):
        return self._layout.kind

    @property
    def world_size(self):
        return self._layout.world_size

    @property
    def version(self):
        return self._layout.version

    def keys(self):
        return list(self._layout.keys)

    def __contains__(self, key):
        return key in self._layout.entries

    def __len__(self):
        return len(self._layout.keys)

    def entry(self, key):
        e = self._layout.entries.get(key)
        if e is None:
            raise KeyError(f"'{self.path}' has no key '{key}'")
        return e

    def __getitem__(self, key):
        return self.get(key)

    @property
    def save_id(self):
        """Version 2: the save's id (16 hex digits) that every data file carries; else None."""
        return self._layout.save_id

    def get(self, key, verify=True, rows=None):
        """The whole tensor (CPU) or the plain value stored under ``key``. ``rows=(begin, end)``
        (or a slice without step): only dim-0 rows [begin, end) of a tensor, reading only the
        pieces (and checksum blocks) that hold them."""
        e = self.entry(key)
        if not e.is_tensor:
            if rows is not None:
                raise ValueError(f"'{self.path}' key '{key}' is a {e.kind} value, not a tensor: rows= needs a tensor")
            return e.value
        return self._read_tensor(key, e, verify, rows)

    # -- files
    def close(self):
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _fd(self, name):
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        lay = self._layout
        path = lay.file_path(name)
        try:
            fd = open_file(path)
        except CheckpointNotFoundError:
            if lay.kind == "sharded":  # version 2: data files are first looked at here
                raise CheckpointNotFoundError(f"checkpoint '{lay.path}': data file '{name}' is missing") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                fail("checkpoint '", lay.path, "': data file '", name, "' is not a regular file: '", path, "'")
            ident = (st.st_dev, st.st_ino)
            if self._ids.setdefault(name, ident) != ident:
                fail("'", path, "' was replaced while the checkpoint was read (reopened, it is another file)")
        except BaseException:
            os.close(fd)
            raise
        while len(self._fds) >= self._max_fds:
            os.close(self._fds.popitem(last=False)[1])
        self._fds[name] = fd
        return fd

    def _drop(self, name):
        """Closes data file ``name`` and forgets its header."""
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)
        self._headers.pop(name, None)

    def _header(self, name, rank=None):
        """The data file's own header, parsed and checked, once (a version-2 data file
        (``rank`` given): this save's file of that rank)."""
        h = self._headers.get(name)
        if h is None:
            h = Safetensors(self._layout.file_path(name), self._fd(name))
            if rank is not None:
                check_data_file(h, self._layout, rank)
            self._headers[name] = h
        return h

    def check_structure(self):
        """What verify checks of the structure, before a tensor byte is read (a version-2
        sharded checkpoint: every data file present, this save's file of its rank, holding
        exactly the pieces the layouts place there, each at its recorded offsets). load() calls
        it, so that a checkpoint verify refuses never loads. The C++ readers do the same."""
        lay = self._layout
        if lay.kind != "sharded" or lay.version < 2:
            return  # version 1: every listed file was checked (present, its size) when it was opened
        for rank in range(lay.world_size):
            name = data_file_name(rank)
            self._header(name, rank)
            self._drop(name)  # the header is checked; a read opens what it needs again

    def _piece(self, key, e, i):
        """Piece i of version-2 entry ``e``, located in its data file's header."""
        rank = e.layout.file_of(i)
        return piece_chunk(self._layout, self._header(data_file_name(rank), rank), key, e, i)

    def _check_chunk(self, key, e, c):
        """Version 1 (and a Hugging Face directory's shards): the data file's header must agree
        with the metadata about the chunk."""
        if self._layout.kind not in ("sharded", "hf") or c.index is not None:
            return
        h = self._header(c.file)
        t = h.tensors.get(c.name)
        path = self._layout.file_path(c.file)
        if t is None:
            raise CheckpointError(f"'{path}' key '{key}': tensor '{c.name}' is not in the data file")
        if t[0] != e.dtype or t[1] != c.sizes or t[2] != c.begin or t[3] != c.end:
            raise CheckpointError(f"'{path}' key '{key}': the data file's entry '{c.name}' disagrees with the "
                                  "metadata (dtype, shape or byte range)")

    def _chunks(self, key, e, begin=None, end=None):
        """The non-empty stored pieces holding dim-0 rows [begin, end) of ``e`` (None: all),
        checked against their data files."""
        if e.layout is not None:
            return [self._piece(key, e, i) for i in e.layout.overlapping(begin, end)]
        out = []
        for c in e.chunks:
            if c.numel() == 0:
                continue
            if begin is not None and e.shape and (c.offsets[0] >= end or c.offsets[0] + c.sizes[0] <= begin):
                continue
            self._check_chunk(key, e, c)
            out.append(c)
        return out

    def _mismatch(self, key, c, k, block):
        lo = c.begin + k * block
        hi = min(c.end, lo + block)
        return CheckpointError(f"'{self._layout.file_path(c.file)}' key '{key}' {c.label()}: checksum mismatch in "
                               f"block {k} (bytes {lo}..{hi}) -- the checkpoint is corrupt")

    def _read_range(self, key, c, lo, hi, view, verify):
        """Reads bytes [lo, hi) of chunk ``c`` (relative to its first byte) into ``view`` and
        checks the block checksums of every block they touch: blocks wholly inside the range
        are read in place (large runs in pieces, each checksummed on another thread while the
        next is read), a partial block at either end is read whole into a buffer first."""
        path = self._layout.file_path(c.file)
        fd = self._fd(c.file)
        if not (verify and c.crcs):
            pread_into(fd, view, c.begin + lo, path)
            return
        block = self._layout.crc_block  # version 2: every data file's too (check_data_file)
        n = c.end - c.begin
        a = -(-lo // block) * block  # the first block boundary at or after lo
        z = hi if hi == n else hi // block * block  # the end of the last whole block inside
        head_end = min(a, hi)
        if lo < head_end:
            self._read_partial_block(key, c, lo // block, lo, head_end, view, lo, fd, path, block)
        if a < z:
            self._read_blocks(key, c, a, z, view[a - lo : z - lo], fd, path, block)
        tail = max(z, head_end)
        if tail < hi:
            self._read_partial_block(key, c, tail // block, tail, hi, view, lo, fd, path, block)

    def _read_partial_block(self, key, c, k, lo, hi, view, view_lo, fd, path, block):
        b = k * block
        buf = bytearray(min(c.end - c.begin, b + block) - b)
        pread_into(fd, memoryview(buf), c.begin + b, path)
        if _crc32c.block_crcs(buf, block)[0] != c.crcs[k]:
            raise self._mismatch(key, c, k, block)
        view[lo - view_lo : hi - view_lo] = buf[lo - b : hi - b]

    def _read_blocks(self, key, c, lo, hi, view, fd, path, block):
        """Whole blocks [lo, hi) of chunk ``c`` into ``view``, checked."""
        piece = max(1, PIPELINE_PIECE // block) * block
        n = hi - lo
        pending = []
        try:
            for off in range(0, n, piece):
                part = view[off : off + piece]
                pread_into(fd, part, c.begin + lo + off, path)
                if n <= piece:
                    pending.append((off, None, _crc32c.block_crcs(part, block)))
                else:
                    pending.append((off, _pipeline().submit(_crc32c.block_crcs, part, block), None))
        finally:
            # every checksum task is done before the caller may free the buffer
            results = [(off, f.result() if f is not None else got) for off, f, got in pending]
        for off, got in results:
            first = (lo + off) // block
            for i, g in enumerate(got):
                if g != c.crcs[first + i]:
                    raise self._mismatch(key, c, first + i, block)

    def _read_tensor(self, key, e, verify, rows=None):
        torch = _torch()
        shape = list(e.shape)
        begin = end = None
        if rows is not None:
            if not shape:
                raise ValueError(f"'{self.path}' key '{key}' is 0-dimensional: it has no rows to select")
            if isinstance(rows, slice):
                if rows.step not in (None, 1):
                    raise ValueError(f"rows={rows!r}: a step is not supported")
                begin, end, _ = rows.indices(shape[0])
            else:
                begin, end = rows
                if not (0 <= begin <= end <= shape[0]):
                    raise IndexError(f"'{self.path}' key '{key}': rows [{begin}, {end}) are not inside its "
                                     f"{shape[0]} rows")
            end = max(begin, end)
            shape = [end - begin] + shape[1:]
        out = torch.empty(shape, dtype=torch_dtype(e.dtype))
        if out.numel() == 0:
            return out
        whole = tensor_view(out)
        item = out.element_size()
        row_bytes = item
        for d in shape[1:]:
            row_bytes *= d
        row0 = begin or 0
        for c in self._chunks(key, e, begin, end):
            if not shape:  # a 0-dimensional tensor: one element
                self._read_range(key, c, 0, c.end - c.begin, whole, verify)
                continue
            a = max(row0, c.offsets[0])
            b = min(row0 + shape[0], c.offsets[0] + c.sizes[0])
            if a >= b:
                continue
            prow = item
            for d in c.sizes[1:]:
                prow *= d
            lo, hi = (a - c.offsets[0]) * prow, (b - c.offsets[0]) * prow
            if c.sizes[1:] == shape[1:]:
                # whole rows: contiguous in the result, read in place
                self._read_range(key, c, lo, hi, whole[(a - row0) * row_bytes : (b - row0) * row_bytes], verify)
                continue
            tmp = torch.empty([b - a] + c.sizes[1:], dtype=out.dtype)
            self._read_range(key, c, lo, hi, tensor_view(tmp), verify)
            inner = tuple(slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:]))
            out[(slice(a - row0, b - row0),) + inner].copy_(tmp)
        return out

    # -- the whole checkpoint
    def load(self, prefix=None, verify=True):
        return _load(self, prefix, verify)


def _strip(ck, prefix):
    if prefix is None or prefix == "":
        return [(k, k) for k in ck.keys()]
    p = prefix if prefix.endswith(".") else prefix + "."
    picked = [(k, k[len(p) :]) for k in ck.keys() if k.startswith(p)]
    if not picked:
        tops = []
        for k in ck.keys():
            t = k.split(".", 1)[0]
            if t not in tops:
                tops.append(t)
        raise CheckpointError(f"'{ck.path}': no key starts with '{p}' (top-level names: {', '.join(tops) or 'none'})")
    return picked


def _load(ck, prefix, verify):
    ck.check_structure()
    return {short: ck.get(k, verify) for k, short in _strip(ck, prefix)}


def load(path, *, verify=True, prefix=None):
    """Loads a Tessera checkpoint (sharded directory written at any world size, or a
    consolidated / other safetensors file) into a dict FQN -> torch.Tensor (whole, CPU) or
    plain value, keys in save order.

    ``prefix="model."``: only the keys under it, with the prefix stripped, e.g.
    ``module.load_state_dict(load(path, prefix="model."))`` (a prefix without the trailing dot
    gets one). ``verify``: check the CRC32C of every block read (the metadata and header
    checksums are always checked). Raises CheckpointError (CheckpointNotFoundError for a
    missing path or data file) naming the file and the key."""
    with CheckpointReader(path) as ck:
        return _load(ck, prefix, verify)
