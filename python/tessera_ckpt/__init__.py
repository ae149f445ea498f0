"""Read Tessera checkpoints from Python, without Tessera.

    import tessera_ckpt
    sd = tessera_ckpt.load("runs/gpt/checkpoints/last.ckpt")            # every key, save order
    model.load_state_dict(tessera_ckpt.load(path, prefix="model."))     # one part, prefix stripped
    print(tessera_ckpt.inspect(path))                                     # what is in it, no data read
    tessera_ckpt.verify(path)                                             # every checksum, or CheckpointError

A checkpoint is a sharded directory (tessera-checkpoint.json + one safetensors data file per
rank, any world size; format version 1 or 2) or a consolidated safetensors file
(docs/checkpoint-format.md), or a Hugging Face model directory (_hf.py). Tensors come back
whole (or some dim-0 rows of one: ``Checkpoint.get(key, rows=(begin, end))``), assembled from
their pieces, on the CPU; plain
values as int, float, bool, str, bytes (an empty nested dict as {}). Files are read with plain
file I/O, only the byte ranges needed, and of a version-2 checkpoint only the data files that
hold what is read are opened; nothing is unpickled or executed. Requires torch and google-crc32c (hardware
CRC32C; without it a slow pure-Python CRC is used).
"""
import collections
import ctypes
import os
import stat

from . import _crc32c, _hf
from ._format import (CheckpointError, CheckpointNotFoundError, DTYPES, MAX_REPORTED_PROBLEMS, Safetensors,
                      check_data_file, data_file_name, fail, open_file, open_layout, piece_chunk, pread_into)

__all__ = ["load", "inspect", "verify", "Checkpoint", "CheckpointError", "CheckpointNotFoundError", "crc32c"]
__version__ = "2.0"

crc32c = _crc32c.crc32c


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


def _tensor_view(t):
    """A writable byte memoryview of a contiguous CPU tensor (bf16 included: no numpy)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class Checkpoint:
    """An open checkpoint: its metadata parsed and checked, data files opened on demand.

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
        whole = _tensor_view(out)
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
            self._read_range(key, c, lo, hi, _tensor_view(tmp), verify)
            inner = tuple(slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:]))
            out[(slice(a - row0, b - row0),) + inner].copy_(tmp)
        return out

    # -- whole-checkpoint operations
    def load(self, prefix=None, verify=True):
        return _load(self, prefix, verify)

    def inspect(self):
        return _inspect(self)

    def verify(self):
        return _verify(self)


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
    with Checkpoint(path) as ck:
        return _load(ck, prefix, verify)


def _inspect(ck):
    lay = ck._layout
    keys = {}
    total = 0
    for k in lay.keys:
        e = lay.entries[k]
        if e.is_tensor:
            nb = e.nbytes()
            total += nb
            n = len(e.chunks) if e.layout is None else e.pieces()
            keys[k] = {"kind": e.kind, "dtype": e.dtype, "shape": list(e.shape), "chunks": n, "bytes": nb}
            if e.layout is not None:
                keys[k]["layout"] = e.layout.rule
            if lay.kind == "hf":
                keys[k]["file"] = lay.file_of.get(k)
        else:
            keys[k] = {"kind": e.kind, "value": e.value}
    extra = {"index": lay.hf_index, "total_size": lay.total_size} if lay.kind == "hf" else {}
    return Summary(
        path=lay.path,
        kind=lay.kind,
        version=lay.version,
        world_size=lay.world_size,
        crc32c_block=lay.crc_block,
        files=[{"name": n, "size": s} for n, s in lay.files] if lay.files else
        [{"name": n, "size": None} for n in lay.data_files()],  # version 2: sizes are not in the metadata
        keys=keys,
        tensor_bytes=total,
        save_id=lay.save_id,
        notes=list(lay.notes),
        **extra,
    )


class Summary(dict):
    """What inspect() returns: a dict (path, kind, version, world_size, crc32c_block, files,
    keys: {fqn: {kind, dtype, shape, chunks, bytes} (version 2: and layout, the rule; a Hugging
    Face directory: and file, its shard) or {kind, value}}, tensor_bytes, save_id (version 2,
    else None), notes (remarks that are no error); a Hugging Face directory (kind "hf") also
    index (the index file's name, None for a single model.safetensors) and total_size (the
    index's)) that prints as a table; chunks counts the stored (version 2: non-empty) pieces."""

    def __str__(self):
        ws = self["world_size"]
        hf = self["kind"] == "hf"
        head = _hf.summary_head(self) if hf else (
            f"{self['path']}: {self['kind']} checkpoint, format version {self['version']}, "
            f"world size at save {ws if ws is not None else 'unknown'}, {len(self['files'])} data file(s)")
        lines = [f"{head}, {len(self['keys'])} keys, {self['tensor_bytes']} tensor bytes"]
        lines += [f"note: {n}" for n in self.get("notes", [])]
        rows = [("KEY", "KIND", "DTYPE", "SHAPE/VALUE", "CHUNKS", "BYTES") + (("FILE",) if hf else ())]
        for k, v in self["keys"].items():
            if "dtype" in v:
                rows.append((k, v["kind"], v["dtype"], str(v["shape"]), str(v["chunks"]), str(v["bytes"]))
                            + ((v.get("file") or "-",) if hf else ()))
            else:
                text = repr(v["value"])
                rows.append((k, v["kind"], "-", text if len(text) <= 60 else text[:57] + "...", "-", "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return "\n".join(lines)


def inspect(path):
    """A summary of the checkpoint (metadata only; no tensor data is read): see Summary."""
    with Checkpoint(path) as ck:
        return _inspect(ck)


VERIFY_PIECE = 64 << 20  # bytes read at a time by verify()


class _Problems:
    """What verify found: the first MAX_REPORTED_PROBLEMS kept, the others counted (as the C++
    verify: issue 44 item 4, a million bad pieces printed a million lines)."""

    def __init__(self):
        self.kept, self.more = [], 0

    def append(self, p):
        if len(self.kept) < MAX_REPORTED_PROBLEMS:
            self.kept.append(p)
        else:
            self.more += 1

    def __bool__(self):
        return bool(self.kept)

    def error(self, path):
        """CheckpointError "CORRUPT: PATH: N problem(s)", one line each, then "and K more problem(s)"."""
        lines = self.kept + ([f"and {self.more} more problem(s)"] if self.more else [])
        return CheckpointError(f"CORRUPT: {path}: {len(self.kept) + self.more} problem(s)\n" + "\n".join(lines))


def _some_names(names):
    """"'a', 'b', 'c', ..." of at most three names (``names``: up to four)."""
    return ", ".join(f"'{n}'" for n in names[:3]) + (", ..." if len(names) > 3 else "")


def _check_data_files_present(lay, problems):
    """Version 2: the data files the directory holds against world_size, from one listing,
    before any is opened (the C++ verify's check_data_files_present, the same words). Returns
    the set of ranks whose file is there."""
    present = {n for n in os.listdir(lay.location)
               if n.startswith("data-rank") and n.endswith(".safetensors") and len(n) > 21}
    there, missing, n_missing = set(), [], 0
    for r in range(lay.world_size):
        name = data_file_name(r)
        if name in present:
            there.add(r)
            present.discard(name)
        else:
            if len(missing) < 4:
                missing.append(name)
            n_missing += 1
    if n_missing:
        problems.append(f"'{lay.location}': world_size is {lay.world_size}, but {n_missing} of its data files are "
                        f"missing ({_some_names(missing)})")
    if present:
        extra = sorted(present)
        problems.append(f"'{lay.location}': {len(extra)} data file(s) of no rank below world_size {lay.world_size} "
                        f"({_some_names(extra[:4])}): the world size was edited or files were added")
    return there


def _verify_chunk(ck, k, c, block, state, problems):
    """Reads chunk ``c`` of key ``k`` whole and checks every block checksum; problems found
    are appended. ``state``: {"buf": the reused read buffer}."""
    n = c.end - c.begin
    path = ck._layout.file_path(c.file)
    piece = max(1, VERIFY_PIECE // block) * block if block else VERIFY_PIECE
    fd = ck._fd(c.file)
    for off in range(0, n, piece):
        length = min(piece, n - off)
        buf = state.get("buf")
        if buf is None or len(buf) < length:
            buf = state["buf"] = memoryview(bytearray(length))  # no torch: `python -m tessera_ckpt verify` starts fast
        view = buf[:length]
        pread_into(fd, view, c.begin + off, path)
        if not c.crcs:
            continue
        first = off // block
        for i, got in enumerate(_crc32c.block_crcs(view, block)):
            if got != c.crcs[first + i]:
                problems.append(str(ck._mismatch(k, c, first + i, block)))


def _verify(ck):
    lay = ck._layout
    if lay.kind == "sharded" and lay.version >= 2:
        return _verify_v2(ck)
    problems = _Problems()
    chunks = 0
    nbytes = 0
    checksummed = True
    state = {}
    for k in lay.keys:
        e = lay.entries[k]
        for c in e.chunks:
            try:
                ck._check_chunk(k, e, c)
                _verify_chunk(ck, k, c, lay.crc_block, state, problems)
            except CheckpointNotFoundError:
                raise
            except CheckpointError as err:
                problems.append(str(err))
            chunks += 1
            nbytes += c.end - c.begin
            checksummed &= bool(c.crcs)
    if problems:
        raise problems.error(lay.path)
    out = {"path": lay.path, "chunks": chunks, "bytes": nbytes, "checksummed": checksummed, "kind": lay.kind,
           "notes": list(lay.notes)}
    if lay.kind == "hf" and not checksummed:
        out["checked"] = _hf.VERIFY_CHECKED  # what was checked instead of checksums
    return out


def _verify_v2(ck):
    """Version 2: every data file is this save's file of its rank and holds exactly the pieces
    the layouts place there (none missing, no other tensor); every piece is read and checked."""
    lay = ck._layout
    problems = _Problems()
    on_disk = _check_data_files_present(lay, problems)  # a missing file is that one problem, never opened
    expected = {}  # rank -> {tensor name: (key, piece)}
    for k in lay.keys:
        e = lay.entries[k]
        if not e.is_tensor:
            continue
        for i in e.layout.overlapping():
            rank = e.layout.file_of(i)
            if rank not in on_disk:
                continue
            name = e.layout.name(k, i)
            there = expected.setdefault(rank, {})
            if name in there:
                problems.append(f"'{lay.file_path(data_file_name(rank))}': key '{k}' piece {i} and key "
                                f"'{there[name][0]}' piece {there[name][1]} are both named '{name}'")
                continue
            there[name] = (k, i)
    chunks = nbytes = 0
    state = {}
    for rank in sorted(on_disk):
        name = data_file_name(rank)
        path = lay.file_path(name)
        try:
            h = ck._header(name, rank)
        except CheckpointNotFoundError:
            raise
        except CheckpointError as err:
            problems.append(str(err))
            continue
        want = expected.pop(rank, {})  # _header checked the file holds exactly these (check_data_file_contents)
        for t, (k, i) in sorted(want.items(), key=lambda kv: h.tensors[kv[0]][2] if kv[0] in h.tensors else -1):
            try:
                c = piece_chunk(lay, h, k, lay.entries[k], i)
                _verify_chunk(ck, k, c, lay.crc_block, state, problems)
            except CheckpointNotFoundError:
                raise
            except CheckpointError as err:
                problems.append(str(err))
                continue
            chunks += 1
            nbytes += c.end - c.begin
        ck._drop(name)  # verify reads every file once: keep no descriptor or header
    if problems:
        raise problems.error(lay.path)
    return {"path": lay.path, "chunks": chunks, "bytes": nbytes, "checksummed": True, "kind": lay.kind, "notes": []}


def verify(path):
    """Reads every byte of every tensor and checks every CRC32C, and that every data file
    agrees with the metadata (version 2: is this save's file of its rank and holds exactly
    the pieces the layouts place there). Returns {"path", "chunks", "bytes", "checksummed", "kind",
    "notes"} (checksummed is False for another writer's safetensors file, which has none; a Hugging
    Face directory without checksums adds "checked": what was checked instead, its weight map
    against the shards); raises CheckpointError listing every problem (file, key, block) otherwise."""
    try:
        ck = Checkpoint(path)
    except _hf.HfDirectoryError as e:  # every disagreement of the weight map and the shards, one by one
        problems = _Problems()
        for p in e.problems:
            problems.append(p)
        raise problems.error(path) from None
    with ck:
        return _verify(ck)
