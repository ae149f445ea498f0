"""Read Tessera checkpoints from Python, without Tessera.

    import tessera_ckpt
    sd = tessera_ckpt.load("runs/gpt/checkpoints/last.ckpt")            # every key, save order
    model.load_state_dict(tessera_ckpt.load(path, prefix="model."))     # one part, prefix stripped
    print(tessera_ckpt.inspect(path))                                     # what is in it, no data read
    tessera_ckpt.verify(path)                                             # every checksum, or CheckpointError

A checkpoint is a sharded directory (tessera-checkpoint.json + one safetensors data file per
rank, any world size) or a consolidated safetensors file (docs/checkpoint-format.md). Tensors
come back whole, assembled from their chunks, on the CPU; plain values as int, float, bool,
str, bytes (an empty nested dict as {}). Files are read with plain file I/O, only the byte
ranges needed; nothing is unpickled or executed. Requires torch and google-crc32c (hardware
CRC32C; without it a slow pure-Python CRC is used).
"""
import ctypes
import os

from . import _crc32c
from ._format import CheckpointError, CheckpointNotFoundError, DTYPES, Safetensors, open_file, open_layout, pread_into

__all__ = ["load", "inspect", "verify", "Checkpoint", "CheckpointError", "CheckpointNotFoundError", "crc32c"]
__version__ = "1.0"

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
            ck.kind                # "sharded", "consolidated" or "safetensors" (another writer's file)
            ck.world_size          # the world size at save (None for another writer's file)
            ck["model.w"]          # one tensor, whole, or a plain value
    """

    def __init__(self, path):
        self._layout = open_layout(path)
        self._fds = {}
        self._headers = {}

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

    def get(self, key, verify=True):
        """The whole tensor (CPU) or the plain value stored under ``key``."""
        e = self.entry(key)
        if not e.is_tensor:
            return e.value
        return self._read_tensor(key, e, verify)

    # -- files
    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

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
        if fd is None:
            fd = open_file(self._layout.file_path(name))
            self._fds[name] = fd
        return fd

    def _header(self, name):
        """The data file's own header, parsed and checked (sharded checkpoints: the metadata
        and the file must agree about every chunk)."""
        h = self._headers.get(name)
        if h is None:
            h = Safetensors(self._layout.file_path(name), self._fd(name))
            self._headers[name] = h
        return h

    def _check_chunk(self, key, e, c):
        if self._layout.kind != "sharded":
            return
        h = self._header(c.file)
        t = h.tensors.get(c.name)
        path = self._layout.file_path(c.file)
        if t is None:
            raise CheckpointError(f"'{path}' key '{key}': tensor '{c.name}' is not in the data file")
        if t[0] != e.dtype or t[1] != c.sizes or t[2] != c.begin or t[3] != c.end:
            raise CheckpointError(f"'{path}' key '{key}': the data file's entry '{c.name}' disagrees with the "
                                  "metadata (dtype, shape or byte range)")

    def _read_chunk_into(self, key, e, c, view, verify):
        """Reads chunk ``c``'s bytes into ``view`` and checks its block checksums. A large chunk
        is read in pieces, each checksummed on another thread while the next is read."""
        self._check_chunk(key, e, c)
        path = self._layout.file_path(c.file)
        fd = self._fd(c.file)
        if not (verify and c.crcs):
            pread_into(fd, view, c.begin, path)
            return
        block = self._layout.crc_block
        piece = max(1, PIPELINE_PIECE // block) * block
        n = len(view)
        pending = []
        try:
            for off in range(0, n, piece):
                part = view[off : off + piece]
                pread_into(fd, part, c.begin + off, path)
                if n <= piece:
                    pending.append((off, None, _crc32c.block_crcs(part, block)))
                else:
                    pending.append((off, _pipeline().submit(_crc32c.block_crcs, part, block), None))
        finally:
            # every checksum task is done before the caller may free the buffer
            results = [(off, f.result() if f is not None else got) for off, f, got in pending]
        for off, got in results:
            first = off // block
            for i, g in enumerate(got):
                if g != c.crcs[first + i]:
                    lo = c.begin + (first + i) * block
                    hi = min(c.end, lo + block)
                    raise CheckpointError(f"'{path}' key '{key}' chunk {c.box()}: checksum mismatch in block "
                                          f"{first + i} (bytes {lo}..{hi}) -- the checkpoint is corrupt")

    def _read_tensor(self, key, e, verify):
        torch = _torch()
        out = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        if out.numel() == 0:
            return out
        whole = _tensor_view(out)
        row_bytes = out.element_size()
        for d in e.shape[1:]:
            row_bytes *= d
        for c in e.chunks:
            if c.numel() == 0:
                continue
            if not e.shape or c.sizes[1:] == e.shape[1:]:
                # whole rows (or the whole tensor): contiguous in the result, read in place
                lo = (c.offsets[0] if e.shape else 0) * row_bytes
                self._read_chunk_into(key, e, c, whole[lo : lo + (c.end - c.begin)], verify)
                continue
            tmp = torch.empty(c.sizes, dtype=out.dtype)
            self._read_chunk_into(key, e, c, _tensor_view(tmp), verify)
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))].copy_(tmp)
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
            keys[k] = {"kind": e.kind, "dtype": e.dtype, "shape": list(e.shape), "chunks": len(e.chunks), "bytes": nb}
        else:
            keys[k] = {"kind": e.kind, "value": e.value}
    return Summary(
        path=lay.path,
        kind=lay.kind,
        version=lay.version,
        world_size=lay.world_size,
        crc32c_block=lay.crc_block,
        files=[{"name": n, "size": s} for n, s in lay.files],
        keys=keys,
        tensor_bytes=total,
    )


class Summary(dict):
    """What inspect() returns: a dict (path, kind, version, world_size, crc32c_block, files,
    keys: {fqn: {kind, dtype, shape, chunks, bytes} or {kind, value}}, tensor_bytes) that
    prints as a table."""

    def __str__(self):
        ws = self["world_size"]
        lines = [
            f"{self['path']}: {self['kind']} checkpoint, format version {self['version']}, "
            f"world size at save {ws if ws is not None else 'unknown'}, {len(self['files'])} data file(s), "
            f"{len(self['keys'])} keys, {self['tensor_bytes']} tensor bytes"
        ]
        rows = [("KEY", "KIND", "DTYPE", "SHAPE/VALUE", "CHUNKS", "BYTES")]
        for k, v in self["keys"].items():
            if "dtype" in v:
                rows.append((k, v["kind"], v["dtype"], str(v["shape"]), str(v["chunks"]), str(v["bytes"])))
            else:
                text = repr(v["value"])
                rows.append((k, v["kind"], "-", text if len(text) <= 60 else text[:57] + "...", "-", "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return "\n".join(lines)


def inspect(path):
    """A summary of the checkpoint (metadata only; no tensor data is read): see Summary."""
    with Checkpoint(path) as ck:
        return _inspect(ck)


VERIFY_PIECE = 64 << 20  # bytes read at a time by verify()


def _verify(ck):
    lay = ck._layout
    problems = []
    chunks = 0
    nbytes = 0
    checksummed = True
    piece = VERIFY_PIECE
    if lay.crc_block:
        piece = max(1, VERIFY_PIECE // lay.crc_block) * lay.crc_block
    buf = None
    for k in lay.keys:
        e = lay.entries[k]
        for c in e.chunks:
            n = c.end - c.begin
            path = lay.file_path(c.file)
            try:
                ck._check_chunk(k, e, c)
                fd = ck._fd(c.file)
                for off in range(0, n, piece):
                    length = min(piece, n - off)
                    if buf is None or len(buf) < length:
                        buf = memoryview(bytearray(length))  # no torch: `python -m tessera_ckpt verify` starts fast
                    view = buf[:length]
                    pread_into(fd, view, c.begin + off, path)
                    if not c.crcs:
                        continue
                    first = off // lay.crc_block
                    for i, got in enumerate(_crc32c.block_crcs(view, lay.crc_block)):
                        if got != c.crcs[first + i]:
                            lo = c.begin + (first + i) * lay.crc_block
                            hi = min(c.end, lo + lay.crc_block)
                            problems.append(f"'{path}' key '{k}' chunk {c.box()}: checksum mismatch in block "
                                            f"{first + i} (bytes {lo}..{hi}) -- the checkpoint is corrupt")
            except CheckpointNotFoundError:
                raise
            except CheckpointError as err:
                problems.append(str(err))
            chunks += 1
            nbytes += n
            checksummed &= bool(c.crcs)
    if problems:
        raise CheckpointError(f"CORRUPT: {lay.path}: {len(problems)} problem(s)\n" + "\n".join(problems))
    return {"path": lay.path, "chunks": chunks, "bytes": nbytes, "checksummed": checksummed}


def verify(path):
    """Reads every byte of every tensor and checks every CRC32C, and that every data file
    agrees with the metadata. Returns {"path", "chunks", "bytes", "checksummed"} (checksummed
    is False for another writer's safetensors file, which has none); raises CheckpointError
    listing every problem (file, key, block) otherwise."""
    with Checkpoint(path) as ck:
        return _verify(ck)
