"""A PyTorch Distributed Checkpoint (DCP) storage backend for Tessera checkpoints.

    import torch.distributed.checkpoint as dcp
    import tessera_ckpt.dcp

    # load a Tessera checkpoint (sharded at any world size, format 1 or 2, or a consolidated
    # safetensors file) into a plain or FSDP2 / DTensor state dict, at any world size
    dcp.load({"model": model.state_dict()}, storage_reader=tessera_ckpt.dcp.Reader(path))

    # write a Tessera format-2 sharded checkpoint from any state dict DCP can save
    dcp.save({"model": model.state_dict(), "optimizer": optim_sd}, storage_writer=tessera_ckpt.dcp.Writer(path))

Keys: DCP flattens nested dicts with "." exactly as Tessera does, so ``{"model": {...}}``
meets the checkpoint's ``model.<name>`` keys. The Writer also stores DCP's flatten mapping
(each key's path of dict keys and list indices) in the metadata's ``dcp_nesting`` member, so
that a load into an empty state dict (``format_utils.dcp_to_torch_save``,
``_load_state_dict_from_keys``) gets the nested dict back and can pick keys like ``"model"``;
a checkpoint without it (Tessera's own saves, other writers) comes back with flat keys, as
``tessera_ckpt.load`` gives them. ``Writer(path, overwrite=False)`` refuses a checkpoint
already at ``path``, as DCP's FileSystemWriter does.

Reader: each rank reads only the byte ranges of the pieces its ReadItems need (rounded out
to the 4 MiB checksum blocks that cover them) and verifies those blocks' CRC32C; plain values
are served to DCP as the torch.save'd buffer its planner expects.

Writer: each rank writes ``data-rank%05d.safetensors`` of its WriteItems, the coordinator
writes ``tessera-checkpoint.json`` (format 2: ``whole`` / ``chunk`` layouts where the pieces
follow those rules, else ``list``), everything into a temporary sibling directory that is
renamed into place at the end (docs/checkpoint-format.md §4): a failed save leaves the previous
checkpoint at the path. Non-tensor values become Tessera plain values (int, float, bool, str,
bytes); tuples, lists and dicts of them are flattened to ``KEY.0``, ``KEY.name`` (as
``tessera ckpt import-dcp`` does) and ``None`` is left out, with their shape recorded in the
metadata's ``dcp_values`` member so that the Reader hands DCP back the same objects. Any other
value is refused, naming its key.

Needs torch 2.2 or later (``torch.distributed.checkpoint.load`` / ``save``); ``import
tessera_ckpt`` itself does not import this module.
"""
import ctypes
import errno
import io
import json
import os
import secrets
import shutil
import stat
import struct
import sys

import torch

try:
    import torch.distributed.checkpoint as _dcp
    from torch.distributed.checkpoint import StorageReader, StorageWriter
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    if not (hasattr(_dcp, "load") and hasattr(_dcp, "save")):
        raise ImportError("torch.distributed.checkpoint has no load/save")
except ImportError as _e:  # torch 1.x: DCP missing or a prototype with another interface
    raise ImportError(f"tessera_ckpt.dcp needs torch 2.2 or later with torch.distributed.checkpoint "
                      f"(load/save); this is torch {torch.__version__} ({_e}). The rest of tessera_ckpt "
                      "works without it.") from None

from . import Checkpoint, _crc32c, _tensor_view
from ._format import (DTYPES, INT64_MAX, INT64_MIN, MAX_HEADER_BYTES, MAX_METADATA_BYTES, MAX_METADATA_ITEMS,
                      METADATA_FILE, CheckpointError, Chunk, Entry, check_metadata_checksum, check_tiling, chunk_range,
                      data_file_name, parse_json_strict, too_many_json_items)

__all__ = ["Reader", "TrainerState", "Writer"]

CRC_BLOCK = 4194304  # tessera.crc32c_block of every file the Writer writes
FORMAT_VERSION = 2
DCP_VALUES = "dcp_values"  # metadata member: the shape of non-scalar DCP values (see module doc)
DCP_NESTING = "dcp_nesting"  # metadata member: DCP's flatten mapping, where a key is not top-level

_TORCH_TO_ST = {getattr(torch, name): st for st, (name, _) in DTYPES.items()}


def _st_dtype(dtype, key):
    st = _TORCH_TO_ST.get(dtype)
    if st is None:
        raise CheckpointError(f"key '{key}': dtype {dtype} has no safetensors counterpart in a Tessera checkpoint "
                              f"(supported: {', '.join(DTYPES)})")
    return st


# ---------------------------------------------------------------- plain values <-> DCP objects


def _scalar_json(v):
    """The Tessera plain-value JSON of a scalar, or None when ``v`` is not one."""
    if isinstance(v, bool):
        return {"kind": "bool", "value": v}
    if isinstance(v, int):
        if not INT64_MIN <= v <= INT64_MAX:
            return None
        return {"kind": "int", "value": v}
    if isinstance(v, float):
        bits = struct.pack(">d", v).hex()
        return {"kind": "float", "value": v if v == v and v not in (float("inf"), float("-inf")) else None,
                "bits": bits}
    if isinstance(v, str):
        return {"kind": "string", "value": v}
    if isinstance(v, (bytes, bytearray)):
        return {"kind": "bytes", "hex": bytes(v).hex()}
    return None


def _encode_value(key, obj):
    """A DCP non-tensor value as Tessera plain values: ([(tessera key, value json)], shape),
    shape None for a bare scalar, else the container / None description the Reader rebuilds
    the object from. Refuses what Tessera cannot hold, naming the key."""
    leaves = []

    def walk(k, v):
        if isinstance(v, io.BytesIO):
            leaves.append((k, {"kind": "bytes", "hex": v.getvalue().hex()}))
            return {"t": "bytesio"}
        j = _scalar_json(v)
        if j is not None:
            leaves.append((k, j))
            return {"t": "value"}
        if v is None:
            return {"t": "none"}
        if isinstance(v, (list, tuple)):
            if not v:
                leaves.append((k, {"kind": "dict"}))
            return {"t": "tuple" if isinstance(v, tuple) else "list",
                    "items": [walk(f"{k}.{i}", x) for i, x in enumerate(v)]}
        if isinstance(v, dict):
            if not v:
                leaves.append((k, {"kind": "dict"}))
            items = {}
            for name, x in v.items():
                if not isinstance(name, str):
                    raise CheckpointError(f"key '{key}': a dict key {name!r} ({type(name).__name__}) is not a string; "
                                          "a Tessera checkpoint names every value by a string path")
                items[name] = walk(f"{k}.{name}", x)
            return {"t": "dict", "items": items}
        what = type(v).__module__ + "." + type(v).__qualname__
        if isinstance(v, int):
            what = f"int {v}, outside int64"
        elif isinstance(v, torch.Tensor):
            what = "tensor inside a non-tensor value"
        raise CheckpointError(f"key '{key}': cannot store a {what} in a Tessera checkpoint (plain values are int, "
                              "float, bool, str, bytes, io.BytesIO, None and lists/tuples/dicts of them)")

    shape = walk(key, obj)
    return leaves, (None if shape == {"t": "value"} else shape)


def _leaf_keys(key, shape, out, where):
    """Adds to ``out`` the Tessera keys of the plain values a dcp_values ``shape`` is rebuilt
    from (its scalars, and its empty containers' {"kind": "dict"} entries)."""
    t = shape.get("t") if isinstance(shape, dict) else None
    items = shape.get("items") if isinstance(shape, dict) else None
    if t in ("value", "bytesio"):
        out.add(key)
    elif t in ("list", "tuple") and isinstance(items, list):
        if not items:
            out.add(key)
        for i, s in enumerate(items):
            _leaf_keys(f"{key}.{i}", s, out, where)
    elif t == "dict" and isinstance(items, dict):
        if not items:
            out.add(key)
        for name, s in items.items():
            _leaf_keys(f"{key}.{name}", s, out, where)
    elif t != "none":
        raise CheckpointError(f"{where}: {DCP_VALUES} key '{key}': malformed shape {json.dumps(shape)}")


def _decode_value(values, key, shape, where):
    """Rebuilds a DCP value from the plain values ``values`` (tessera key -> Python value)."""
    t = shape.get("t") if isinstance(shape, dict) else None
    if t == "none":
        return None
    if t == "value":
        if key not in values:
            raise CheckpointError(f"{where}: {DCP_VALUES} key '{key}': the plain value is missing")
        return values[key]
    if t == "bytesio":
        if key not in values or not isinstance(values[key], (bytes, bytearray)):
            raise CheckpointError(f"{where}: {DCP_VALUES} key '{key}': the bytes value is missing")
        return io.BytesIO(bytes(values[key]))
    items = shape.get("items") if isinstance(shape, dict) else None
    if t in ("list", "tuple") and isinstance(items, list):
        out = [_decode_value(values, f"{key}.{i}", s, where) for i, s in enumerate(items)]
        return tuple(out) if t == "tuple" else out
    if t == "dict" and isinstance(items, dict):
        return {name: _decode_value(values, f"{key}.{name}", s, where) for name, s in items.items()}
    raise CheckpointError(f"{where}: {DCP_VALUES} key '{key}': malformed shape {json.dumps(shape)}")


# ---------------------------------------------------------------- DCP's nesting of the keys


def _is_path_part(p):
    return isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and p >= 0)


def _nesting_of(planner_data, keys):
    """What the Writer stores of DCP's flatten mapping (``Metadata.planner_data``: flat key ->
    path of dict keys and list indices): {key: [path]} for the ``keys`` that are not
    top-level. None when ``planner_data`` is not such a mapping (a custom planner's own data),
    so that nothing is stored and the Reader answers every key as top-level."""
    if not hasattr(planner_data, "items"):
        return None
    out = {}
    for k, path in planner_data.items():
        if k not in keys:
            continue
        if not (isinstance(path, (tuple, list)) and path and all(_is_path_part(p) for p in path)
                and ".".join(map(str, path)) == k):
            return None
        if len(path) > 1:
            out[k] = list(path)
    return out


def _check_nesting(nesting, keys, where):
    """The stored ``dcp_nesting`` as DCP's planner_data entries ({key: path tuple}), checked:
    every key one the Reader offers, each path its dict keys (strings) and list indices
    (integers) joined by "." to the key, and the paths one tree (no path is another's
    prefix, no container both a dict and a list)."""
    out, kinds = {}, {}
    for k, path in nesting.items():
        if k not in keys:
            raise CheckpointError(f"{where}: {DCP_NESTING} names '{k}', which is no key of the checkpoint")
        if not (isinstance(path, list) and path and all(_is_path_part(p) for p in path)
                and ".".join(map(str, path)) == k):
            raise CheckpointError(f"{where}: {DCP_NESTING} key '{k}': {json.dumps(path)} is not a path of dict keys "
                                  f"and list indices that joins to the key")
        out[k] = tuple(path)
    for k in keys:
        path = out.get(k, (k,))
        for i in range(len(path)):
            kind = "leaf" if i == len(path) - 1 else ("list" if isinstance(path[i + 1], int) else "dict")
            prev = kinds.setdefault(path[:i + 1], kind)
            if prev != kind:
                raise CheckpointError(f"{where}: {DCP_NESTING}: {json.dumps(list(path[:i + 1]))} is both a {prev} and a "
                                      f"{kind} (key '{k}')")
    return out


# ---------------------------------------------------------------- Reader


class Reader(StorageReader):
    """``torch.distributed.checkpoint.load(state_dict, storage_reader=Reader(path))`` of a
    Tessera checkpoint: a sharded directory (format 1 or 2, any world size at save) or a
    consolidated / other safetensors file. ``verify=False`` skips the block checksums (the
    metadata and header checksums are always checked)."""

    def __init__(self, path, *, verify=True):
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self._ck = None
        self._pieces = {}  # fqn -> [piece ref, in the order of the DCP chunks]
        self._by_offset = {}  # fqn -> {offsets tuple: position in _pieces[fqn]}
        self._values = {}  # tessera key -> plain value
        self._shapes = {}  # DCP key -> dcp_values shape (containers and None)

    # -- DCP interface
    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self._close()

    def read_metadata(self, *args):
        self._close()
        ck = Checkpoint(self.path)
        self._ck = ck
        # What verify checks of the structure (every data file present, holding exactly its
        # pieces), before DCP plans a read: a checkpoint verify refuses never loads.
        ck.check_structure()
        lay = ck._layout
        shapes, nesting = self._read_dcp_members(ck) if lay.kind == "sharded" and lay.version >= 2 else ({}, {})
        self._shapes = shapes
        claimed = set()  # the plain values the dcp_values shapes are rebuilt from: not offered on their own
        for root, shape in shapes.items():
            _leaf_keys(root, shape, claimed, f"'{lay.path}'")

        md = {}
        for key in lay.keys:
            e = lay.entries[key]
            if not e.is_tensor:
                self._values[key] = e.value
                if key not in claimed:
                    md[key] = BytesStorageMetadata()
                continue
            refs, chunks = [], []
            if e.layout is not None:
                for i in e.layout.overlapping():
                    offsets, sizes = e.layout.box(i)
                    refs.append(i)
                    chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            else:
                for c in e.chunks:
                    if c.numel():
                        refs.append(c)
                        chunks.append(ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)))
            self._pieces[key] = refs
            md[key] = TensorStorageMetadata(properties=TensorProperties(dtype=getattr(torch, DTYPES[e.dtype][0])),
                                            size=torch.Size(e.shape), chunks=chunks)
        for key in shapes:
            if key in md:
                raise CheckpointError(f"'{lay.path}': {DCP_VALUES} key '{key}' is also a tensor or plain value")
            md[key] = BytesStorageMetadata()
        nesting = _check_nesting(nesting, md, f"'{os.path.join(lay.location, METADATA_FILE)}'")
        meta = Metadata(state_dict_metadata=md)
        # DCP's flatten mapping (key -> path in the nested state dict), which loading into an
        # empty state dict (_EmptyStateDictLoadPlanner: dcp_to_torch_save,
        # _load_state_dict_from_keys) rebuilds the nesting from: the Writer's, stored in the
        # metadata; a key it does not list (every key of a checkpoint other writers made) is
        # top-level, as tessera_ckpt.load returns it.
        meta.planner_data = {k: nesting.get(k, (k,)) for k in md}
        return meta

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        if self._ck is None:
            self.read_metadata()

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        ck = self._ck
        if ck is None:
            self.read_metadata()
            ck = self._ck
        try:
            for req in plan.items:
                fqn = req.storage_index.fqn
                if req.type == LoadItemType.BYTE_IO:
                    buf = io.BytesIO()
                    torch.save(self._value(fqn), buf)
                    buf.seek(0)
                    planner.load_bytes(req, buf)
                    continue
                e = ck.entry(fqn)
                c = self._piece(fqn, e, req.storage_index)
                target = planner.resolve_tensor(req).detach()
                lengths = list(req.lengths)
                if list(target.shape) != lengths:
                    raise CheckpointError(f"'{ck.path}' key '{fqn}': DCP's target is {list(target.shape)}, its read "
                                          f"item {lengths}")
                self._read_region(fqn, e, c, list(req.storage_offsets), lengths, target)
                planner.commit_tensor(req, target)
        finally:
            ck.close()  # the data files' descriptors (a later read reopens them, checked to be the same files)
        fut = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        p = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, bytes, os.PathLike)) else None
        if not isinstance(p, str):
            return False
        if os.path.isdir(p):
            return os.path.isfile(os.path.join(p, METADATA_FILE))
        return os.path.isfile(p) and p.endswith(".safetensors")

    # -- internals
    def _close(self):
        if self._ck is not None:
            self._ck.close()
        self._ck = None
        self._pieces, self._by_offset, self._values, self._shapes = {}, {}, {}, {}

    def _read_dcp_members(self, ck):
        """The Writer's ``dcp_values`` and ``dcp_nesting`` members (absent in checkpoints other
        writers made), from the same metadata text the layout was parsed from (same checksum
        and save id)."""
        lay = ck._layout
        mf = os.path.join(lay.location, METADATA_FILE)
        with open(mf, "rb") as f:
            text = f.read(MAX_METADATA_BYTES + 1)
        check_metadata_checksum(text, f"'{mf}'", lay.version)
        j = parse_json_strict(text, f"'{mf}': metadata")
        if j.get("save_id") != lay.save_id:
            raise CheckpointError(f"'{mf}' was replaced while it was read (another save id)")
        shapes = j.get(DCP_VALUES, {})
        if not isinstance(shapes, dict):
            raise CheckpointError(f"'{mf}': {DCP_VALUES} is not an object")
        nesting = j.get(DCP_NESTING, {})
        if not isinstance(nesting, dict):
            raise CheckpointError(f"'{mf}': {DCP_NESTING} is not an object")
        return shapes, nesting

    def _value(self, fqn):
        if fqn in self._shapes:
            return _decode_value(self._values, fqn, self._shapes[fqn], f"'{self._ck.path}'")
        if fqn not in self._values:
            raise CheckpointError(f"'{self._ck.path}' has no plain value '{fqn}'")
        return self._values[fqn]

    def _piece(self, fqn, e, index):
        """The stored piece (a Chunk with its byte range and block checksums) DCP's
        storage_index names: its chunk offsets, the index as a hint."""
        refs = self._pieces.get(fqn)
        if refs is None:
            raise CheckpointError(f"'{self._ck.path}' has no tensor '{fqn}'")
        want = tuple(index.offset) if index.offset is not None else tuple([0] * len(e.shape))
        pos = index.index
        if pos is None or not 0 <= pos < len(refs) or tuple(self._offsets(e, refs[pos])) != want:
            table = self._by_offset.get(fqn)
            if table is None:
                table = self._by_offset[fqn] = {tuple(self._offsets(e, r)): p for p, r in enumerate(refs)}
            pos = table.get(want)
            if pos is None:
                raise CheckpointError(f"'{self._ck.path}' key '{fqn}': no stored piece at offsets {list(want)}")
        ref = refs[pos]
        if isinstance(ref, Chunk):
            self._ck._check_chunk(fqn, e, ref)
            return ref
        return self._ck._piece(fqn, e, ref)

    @staticmethod
    def _offsets(e, ref):
        return ref.offsets if isinstance(ref, Chunk) else e.layout.box(ref)[0]

    def _read_region(self, fqn, e, c, offs, lens, target):
        """Copies box [offs, offs + lens) of piece ``c`` into ``target``, reading only the
        bytes from the box's first element to its last (the package's reader rounds them
        out to the checksum blocks it verifies)."""
        for o, n, s in zip(offs, lens, c.sizes):
            if o < 0 or o + n > s:
                raise CheckpointError(f"'{self._ck.path}' key '{fqn}': read of [{offs}, +{lens}] outside the "
                                      f"{c.label()}")
        numel = 1
        for n in lens:
            numel *= n
        if numel == 0:
            return
        dtype = getattr(torch, DTYPES[e.dtype][0])
        item = DTYPES[e.dtype][1]
        strides = [1] * len(c.sizes)
        for d in range(len(c.sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * c.sizes[d + 1]
        first = sum(o * s for o, s in zip(offs, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offs, lens, strides))
        lo, hi = first * item, (last + 1) * item
        contiguous = (hi - lo) == numel * item
        if (contiguous and target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous()):
            self._ck._read_range(fqn, c, lo, hi, _tensor_view(target), self.verify)
            return
        buf = torch.empty((hi - lo) // item, dtype=dtype)
        self._ck._read_range(fqn, c, lo, hi, _tensor_view(buf), self.verify)
        region = buf.as_strided(lens, strides, 0) if lens else buf.view([])
        target.copy_(region)


# ---------------------------------------------------------------- Writer

_tmp_counter = [0]
_own_temps = {}  # destination -> temporaries this process created for it (left by a failed save)


def _check_path(path):
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        raise CheckpointError(f"checkpoint path {path!r} holds a control character: refused")


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _check_destination(dest):
    """Case 3 of docs/checkpoint-format.md §4: only a missing path, an empty directory or a
    Tessera checkpoint directory may be replaced."""
    if os.path.islink(dest):
        raise CheckpointError(f"'{dest}' is a symbolic link (to '{os.readlink(dest)}'): refusing to replace it; "
                              "give the target's path")
    if not os.path.lexists(dest):
        return
    st = os.stat(dest)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"'{dest}' exists and is not a directory: refusing to replace it with a sharded "
                              "checkpoint (remove it, or choose another path)")
    if os.listdir(dest) and not os.path.isfile(os.path.join(dest, METADATA_FILE)):
        raise CheckpointError(f"'{dest}' is a non-empty directory without {METADATA_FILE}, not a Tessera "
                              "checkpoint: refusing to replace it")


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a, b):
    """renameat2(RENAME_EXCHANGE): True when the two paths were swapped atomically."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of '{a}' and '{b}' failed: {os.strerror(err)}")


def _refuse_existing(dest):
    """``overwrite=False`` (DCP's FileSystemWriter's meaning): a checkpoint at ``dest`` stays."""
    if os.path.isfile(os.path.join(dest, METADATA_FILE)):
        raise CheckpointError(f"'{dest}' already holds a Tessera checkpoint and the Writer has overwrite=False: "
                              "refusing to replace it (nothing was written)")


def _publish(tmp, dest, overwrite=True):
    """Puts the finished temporary directory at ``dest`` (§4): rename when nothing (or an
    empty directory) is there, else swap with the Tessera checkpoint there and remove it
    (unless ``overwrite`` is False)."""
    _check_destination(dest)
    if not overwrite:
        _refuse_existing(dest)
    parent = os.path.dirname(dest) or "."
    if not os.path.lexists(dest) or not os.listdir(dest):
        os.rename(tmp, dest)  # rename(2) replaces an empty directory
    elif _exchange(tmp, dest):
        shutil.rmtree(tmp)  # the old checkpoint, now at the temporary name
    else:
        base = os.path.basename(dest)
        _tmp_counter[0] += 1
        old = os.path.join(parent, f".{base}.tessera-old-{os.getpid()}-{_tmp_counter[0]}")
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old)
    _fsync_dir(parent)


def _remove_stale_temps(dest):
    """Temporaries of earlier saves to ``dest`` that will never be published: those of
    processes no longer running here, and those this process left after a failed save."""
    parent = os.path.dirname(dest) or "."
    prefix = "." + os.path.basename(dest) + ".tessera-tmp-"
    try:
        names = os.listdir(parent)
    except OSError:
        return
    mine = _own_temps.pop(dest, set())
    for n in names:
        if not n.startswith(prefix):
            continue
        p = os.path.join(parent, n)
        pid = n[len(prefix):].split("-", 1)[0]
        if p in mine or (pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)


def _chunk_layout(shape, pieces, world):
    """The `whole` or `chunk` layout that places exactly ``pieces`` ([(file, offsets,
    sizes)], non-empty, tiling ``shape``), or None."""
    if not pieces:
        return {"rule": "whole", "file": 0}
    if len(pieces) == 1 and list(pieces[0][2]) == list(shape):
        return {"rule": "whole", "file": pieces[0][0]}
    for d in range(len(shape)):
        if any(o[i] != 0 or s[i] != shape[i] for _, o, s in pieces for i in range(len(shape)) if i != d):
            continue
        ps = sorted(pieces, key=lambda p: p[1][d])
        k = len(ps)
        if any(chunk_range(shape[d], k, i) != (p[1][d], p[1][d] + p[2][d]) for i, p in enumerate(ps)):
            continue
        first, step = ps[0][0], ps[1][0] - ps[0][0]
        if step < 1 or any(p[0] != first + i * step for i, p in enumerate(ps)):
            continue
        if first + (k - 1) * step >= world:
            continue
        return {"rule": "chunk", "dim": d, "pieces": k, "files": {"first": first, "step": step}}
    return None


def _unpickling_reason(err):
    """The line of a weights_only torch.load error that names the refused global."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for ln in lines:
        if "Unsupported global" in ln:
            return ln[ln.index("Unsupported global"):].split(". Please")[0]
    return lines[-1] if lines else type(err).__name__


def _compact(obj):
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


class Writer(StorageWriter):
    """``torch.distributed.checkpoint.save(state_dict, storage_writer=Writer(path))``: writes a
    Tessera format-2 sharded checkpoint directory at ``path`` (one data file per rank of the
    process group, the metadata by the coordinator), published atomically at the end.
    A checkpoint already at ``path`` is replaced, or with ``overwrite=False`` (as for DCP's
    FileSystemWriter) refused before anything is written."""

    def __init__(self, path, *, overwrite=True):
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.overwrite = bool(overwrite)
        self.is_coordinator = False
        self.rank = None
        self._order = []
        self._plan = None  # coordinator: {"tmp", "save_id", "world_size"}

    # -- DCP interface
    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self._plan = None

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        if kwargs.get("use_collectives") is False:
            raise CheckpointError("tessera_ckpt.dcp.Writer needs dcp.save's collectives (use_collectives=True): "
                                  "the ranks agree on one save id and the coordinator writes the metadata")
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan):
        for item in plan.items:
            if item.tensor_data is not None:
                _st_dtype(item.tensor_data.properties.dtype, item.index.fqn)
        return plan

    def prepare_global_plan(self, plans):
        import dataclasses

        if any(getattr(p, "usable", True) is False for p in plans):
            raise CheckpointError("tessera_ckpt.dcp.Writer does not support DCP's save plan caching "
                                  "(enable_plan_caching): every save needs a fresh save id")
        dest = self.path
        _check_path(dest)
        _check_destination(dest)
        if not self.overwrite:
            _refuse_existing(dest)
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        _remove_stale_temps(dest)
        while True:
            _tmp_counter[0] += 1
            tmp = os.path.join(parent, f".{os.path.basename(dest)}.tessera-tmp-{os.getpid()}-{_tmp_counter[0]}")
            try:
                os.mkdir(tmp)
                break
            except FileExistsError:
                continue
        _own_temps.setdefault(dest, set()).add(tmp)
        world = len(plans)
        save_id = secrets.token_hex(8)
        self._plan = {"tmp": tmp, "save_id": save_id, "world_size": world}
        order, seen = [], set()
        for p in plans:  # the flattened state dict's order (DCP's planner_data), every rank's keys
            keys = p.planner_data.keys() if isinstance(p.planner_data, dict) else [it.index.fqn for it in p.items]
            for k in keys:
                if k not in seen:
                    seen.add(k)
                    order.append(k)
        self._order = order
        return [dataclasses.replace(p, storage_data={"tmp": tmp, "save_id": save_id, "rank": i, "world_size": world})
                for i, p in enumerate(plans)]

    def write_data(self, plan, planner):
        sd = plan.storage_data
        if not (isinstance(sd, dict) and "save_id" in sd):
            raise CheckpointError("tessera_ckpt.dcp.Writer: the plan carries no save id (prepare_global_plan "
                                  "did not run on the coordinator)")
        path = os.path.join(sd["tmp"], data_file_name(sd["rank"]))
        try:
            results = self._write_file(path, sd, plan, planner)
        except Exception as err:  # noqa: BLE001 - handed to the coordinator, which fails the save on every rank
            try:
                os.unlink(path)
            except OSError:
                pass
            msg = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
            results = [WriteResult(index=MetadataIndex("__tessera_error__"), size_in_bytes=0,
                                   storage_data={"error": f"rank {sd['rank']}: {msg}"})]
        fut = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):
        tmp = self._plan["tmp"] if self._plan else None
        try:
            errors = [r.storage_data["error"] for rs in results for r in rs
                      if isinstance(r.storage_data, dict) and "error" in r.storage_data]
            if errors:
                raise CheckpointError(f"save to '{self.path}' failed, nothing was published:\n" + "\n".join(errors))
            text = self._metadata_text(metadata, results)
            with open(os.path.join(tmp, METADATA_FILE), "wb") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _publish(tmp, self.path, self.overwrite)
            _own_temps.get(self.path, set()).discard(tmp)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                _own_temps.get(self.path, set()).discard(tmp)
            raise
        finally:
            self._plan = None

    def storage_meta(self):
        return None

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- a rank's data file
    def _write_file(self, path, sd, plan, planner):
        if sys.byteorder != "little":
            raise CheckpointError("tessera_ckpt.dcp.Writer writes little-endian safetensors: a big-endian host "
                                  "is not supported")
        rank = sd["rank"]
        tensors, results = [], []
        by_fqn = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                # An io.BytesIO value (DCP saves its bytes) is looked up as it is: the planner's
                # resolved form is a pickle of the stream, which the restricted unpickler refuses.
                obj = planner.lookup_object(item.index) if hasattr(planner, "lookup_object") else None
                if not isinstance(obj, io.BytesIO):
                    buf = planner.resolve_data(item)
                    if hasattr(buf, "seek"):
                        buf.seek(0)
                    try:
                        obj = torch.load(buf, weights_only=True)
                    except Exception as err:  # noqa: BLE001
                        raise CheckpointError(f"key '{item.index.fqn}': cannot store this value in a Tessera "
                                              f"checkpoint (plain values are int, float, bool, str, bytes, io.BytesIO, "
                                              f"None and lists/tuples/dicts of them): {_unpickling_reason(err)}") from None
                leaves, shape = _encode_value(item.index.fqn, obj)
                results.append(WriteResult(index=item.index, size_in_bytes=0,
                                           storage_data={"value": leaves, "shape": shape}))
                continue
            td = item.tensor_data
            fqn = item.index.fqn
            dtype = _st_dtype(td.properties.dtype, fqn)
            offsets, sizes = list(td.chunk.offsets), list(td.chunk.sizes)
            info = {"kind": "sharded" if item.type == WriteItemType.SHARD else "tensor", "dtype": dtype,
                    "shape": list(td.size), "rank": rank, "offsets": offsets, "sizes": sizes, "name": None}
            results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=info))
            if all(sizes):
                by_fqn.setdefault(fqn, []).append((item, info))
        names = {}
        for fqn, its in by_fqn.items():
            its.sort(key=lambda p: p[1]["offsets"])  # the order of the layout's pieces (the coordinator sorts alike)
            for k, (item, info) in enumerate(its):
                name = fqn if len(its) == 1 else f"{fqn}@{k}"
                if name in names:
                    raise CheckpointError(f"'{path}': keys '{fqn}' and '{names[name]}' would both store a piece "
                                          f"named '{name}'")
                names[name] = fqn
                info["name"] = name
                n = DTYPES[info["dtype"]][1]
                for s in info["sizes"]:
                    n *= s
                info["nbytes"] = n
                tensors.append((item, info))
        _write_safetensors(path, tensors, planner, sd)
        return results

    # -- the coordinator's metadata
    def _metadata_text(self, metadata, results):
        world = self._plan["world_size"]
        where = f"'{os.path.join(self.path, METADATA_FILE)}'"
        pieces, values, info = {}, {}, {}
        for rs in results:
            for r in rs:
                s = r.storage_data
                fqn = r.index.fqn
                if "value" in s:
                    values[fqn] = s
                    continue
                info.setdefault(fqn, s)
                if all(s["sizes"]):
                    pieces.setdefault(fqn, []).append((s["rank"], s["offsets"], s["sizes"], s["name"]))
        order = [k for k in self._order if k in metadata.state_dict_metadata]
        listed = set(order)
        order += [k for k in metadata.state_dict_metadata if k not in listed]
        keys, entries, shapes, origin = [], {}, {}, {}

        def add(k, entry, src):
            if k in origin:
                raise CheckpointError(f"{where}: DCP keys '{src}' and '{origin[k]}' both become the Tessera key '{k}'")
            origin[k] = src
            keys.append(k)
            entries[k] = entry

        for fqn in order:
            md = metadata.state_dict_metadata[fqn]
            if isinstance(md, BytesStorageMetadata):
                v = values.get(fqn)
                if v is None:
                    raise CheckpointError(f"{where}: no rank wrote the value '{fqn}'")
                for k, j in v["value"]:
                    add(k, j, fqn)
                if v["shape"] is not None:
                    shapes[fqn] = v["shape"]
                continue
            s = info.get(fqn)
            dtype = s["dtype"] if s else _st_dtype(md.properties.dtype, fqn)
            shape = list(md.size)
            ps = sorted(pieces.get(fqn, []), key=lambda p: p[1])
            e = Entry(s["kind"] if s else "sharded", dtype, shape)
            check_tiling(fqn, e, where, [Chunk(o, z, f, None, 0, 0, []) for f, o, z, _ in ps], "piece")
            layout = _chunk_layout(shape, [(f, o, z) for f, o, z, _ in ps], world)
            if layout is None:
                layout = {"rule": "list", "pieces": [[f, o, z] for f, o, z, _ in ps]}
            add(fqn, {"kind": e.kind, "dtype": dtype, "shape": shape, "layout": layout}, fqn)
        for k in shapes:
            if k in origin and origin[k] != k:
                raise CheckpointError(f"{where}: the value '{k}' collides with the Tessera key of '{origin[k]}'")
        j = {"format": "tessera-checkpoint", "version": FORMAT_VERSION, "world_size": world,
             "crc32c_block": CRC_BLOCK, "save_id": self._plan["save_id"], "keys": keys, "entries": entries}
        if shapes:
            j[DCP_VALUES] = shapes
        nesting = _nesting_of(getattr(metadata, "planner_data", None), set(order))
        if nesting:
            j[DCP_NESTING] = {k: nesting[k] for k in order if k in nesting}
        body = _compact(j).encode("utf-8")
        text = body[:-1] + b',"metadata_crc32c":"00000000"}'
        crc = _crc32c.crc32c(text)
        text = text[:-10] + f"{crc:08x}".encode() + b'"}'
        if len(text) > MAX_METADATA_BYTES:
            raise CheckpointError(f"{where}: the metadata would be {len(text)} bytes, over the readers' bound of "
                                  f"{MAX_METADATA_BYTES} (kMaxMetadataBytes); nothing was published")
        if too_many_json_items(text, MAX_METADATA_ITEMS):
            raise CheckpointError(f"{where}: the metadata would hold more than {MAX_METADATA_ITEMS} JSON values and "
                                  "keys, over the readers' bound (kMaxMetadataItems); nothing was published")
        return text


def _header_text(tensors, md):
    h = {"__metadata__": md}
    pos = 0
    for _, info in tensors:
        h[info["name"]] = {"dtype": info["dtype"], "shape": info["sizes"], "data_offsets": [pos, pos + info["nbytes"]]}
        pos += info["nbytes"]
    t = _compact(h).encode("utf-8")
    return t + b" " * (-len(t) % 8)


def _write_safetensors(path, tensors, planner, sd):
    """One data file (§1, §3): header with placeholder checksums, the tensors streamed one
    at a time (each resolved from the planner only when it is written), then the block
    checksums and the header checksum patched in place, fsync."""
    nblocks = sum(-(-info["nbytes"] // CRC_BLOCK) for _, info in tensors)
    md = {"format": "pt", "tessera.format": "tessera-data", "tessera.version": str(FORMAT_VERSION),
          "tessera.rank": str(sd["rank"]), "tessera.save_id": sd["save_id"], "tessera.crc32c_block": str(CRC_BLOCK),
          "tessera.crc32c": "0" * (8 * nblocks), "tessera.header_crc32c": "00000000",
          # each piece's place in its tensor, which every reader checks (docs/checkpoint-format.md §3)
          "tessera.offsets": _compact({info["name"]: info["offsets"] for _, info in tensors})}
    header = _header_text(tensors, md)
    if len(header) > MAX_HEADER_BYTES:
        raise CheckpointError(f"'{path}': the safetensors header would be {len(header)} bytes, over the readers' "
                              f"bound of {MAX_HEADER_BYTES}; nothing was published")
    crcs = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        pos = 8 + len(header)
        for item, info in tensors:
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"key '{item.index.fqn}': the planner resolved a {type(t).__name__}, not a tensor")
            t = t.detach()
            if list(t.shape) != info["sizes"]:
                raise CheckpointError(f"key '{item.index.fqn}': the planner's tensor is {list(t.shape)}, the write item "
                                      f"{info['sizes']}")
            if _TORCH_TO_ST.get(t.dtype) != info["dtype"]:
                raise CheckpointError(f"key '{item.index.fqn}': the planner's tensor is {t.dtype}, the metadata says "
                                      f"{info['dtype']}")
            t = t.to("cpu").contiguous()
            view = _crc32c.byte_view(t)
            if len(view) != info["nbytes"]:
                raise CheckpointError(f"key '{item.index.fqn}': {len(view)} bytes, expected {info['nbytes']}")
            crcs.extend(_crc32c.block_crcs(view, CRC_BLOCK))
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done : done + (16 << 20)], pos + done)
            pos += len(view)
            del view, t
        md["tessera.crc32c"] = "".join(f"{c:08x}" for c in crcs)
        final = _header_text(tensors, md)
        if len(final) != len(header):
            raise CheckpointError(f"'{path}': internal error: the header changed length when patched")
        lenbuf = struct.pack("<Q", len(final))
        hcrc = _crc32c.crc32c(lenbuf + final)
        marker = b'"tessera.header_crc32c":"'
        at = final.index(marker) + len(marker)
        final = final[:at] + f"{hcrc:08x}".encode() + final[at + 8 :]
        os.pwrite(fd, lenbuf + final, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- Trainer checkpoints

# Tessera's optimizer layout (optimizer_state.cpp) next to torch.optim's state_dict: the
# kind, each group's hyperparameters (Adam's betas as beta1 / beta2), the per-parameter
# state by FQN with an integer step.
_OPTIMIZER_KINDS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "Adagrad": "adagrad", "RMSprop": "rmsprop"}
_HYPER = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"),
    "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
    "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"),
}
_BOOL_HYPER = ("nesterov", "amsgrad", "centered")
_STATE = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adagrad": ("sum",),
    "rmsprop": ("square_avg", "momentum_buffer", "grad_avg"),
}


def _optimizer_kind(optimizer):
    name, module = type(optimizer).__name__, type(optimizer).__module__
    torch_optim = module.split(".")[:2] == ["torch", "optim"]
    if not torch_optim or name not in _OPTIMIZER_KINDS:
        what = f"torch.optim.{name}" if torch_optim else f"{module}.{name}"
        raise CheckpointError(f"TrainerState: a {what} has no Tessera counterpart "
                              f"(supported: torch.optim.{', torch.optim.'.join(_OPTIMIZER_KINDS)})")
    kind = _OPTIMIZER_KINDS[name]
    for i, g in enumerate(optimizer.param_groups):
        if kind == "adam" and g.get("decoupled_weight_decay"):
            kind = "adamw"  # Adam(decoupled_weight_decay=True) is AdamW
        if g.get("maximize"):
            raise CheckpointError(f"TrainerState: param group {i} has maximize=True, which libtorch's optimizers "
                                  "do not have")
    return kind


def _number(v, where):
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise CheckpointError(f"TrainerState: {where} is a tensor of {v.numel()} elements, not a number")
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CheckpointError(f"TrainerState: {where} is a {type(v).__name__}, not a number")
    return float(v)


def _to_tessera_optimizer(kind, osd):
    """torch.optim state dict keyed by FQN (get_state_dict's form) -> Tessera's layout."""
    groups = {}
    for gi, g in enumerate(osd["param_groups"]):
        hp = dict(g)
        if "betas" in hp:
            hp["beta1"], hp["beta2"] = hp["betas"]
        out = {}
        for k in _HYPER[kind]:
            if k not in hp:
                raise CheckpointError(f"TrainerState: param group {gi} has no '{k}' (a {kind} optimizer needs it)")
            out[k] = bool(hp[k]) if k in _BOOL_HYPER else _number(hp[k], f"param group {gi} '{k}'")
        out["params"] = {str(i): str(fqn) for i, fqn in enumerate(g["params"])}
        groups[str(gi)] = out
    state = {}
    for fqn, s in osd["state"].items():
        fields = {}
        for k, v in s.items():
            if k == "step":
                fields["step"] = int(_number(v, f"state of '{fqn}' 'step'"))
            elif k in _STATE[kind]:
                if v is not None and not (isinstance(v, torch.Tensor) and v.numel() == 0):
                    fields[k] = v
            else:
                raise CheckpointError(f"TrainerState: the state of '{fqn}' has '{k}', which a Tessera {kind} "
                                      "optimizer does not hold")
        if kind != "sgd" and "step" not in fields:
            raise CheckpointError(f"TrainerState: the state of '{fqn}' has no 'step'")
        state[str(fqn)] = fields
    return {"optimizer": kind, "state": state, "param_groups": groups}


def _from_tessera_optimizer(kind, tsd, osd, where):
    """Tessera's layout (as dcp.load filled it) -> a torch.optim state dict like ``osd``
    (the optimizer's own, giving the fields Tessera does not keep, e.g. foreach)."""
    if tsd.get("optimizer") != kind:
        raise CheckpointError(f"{where}: optimizer_0 is a {tsd.get('optimizer')!r} optimizer's state, this one is {kind}")
    groups = []
    for gi, g in enumerate(osd["param_groups"]):
        t = tsd["param_groups"][str(gi)]
        mine = [str(p) for p in g["params"]]
        saved = [t["params"][str(i)] for i in range(len(mine))]
        if saved != mine:
            bad = next(i for i in range(len(mine)) if saved[i] != mine[i])
            raise CheckpointError(f"{where}: param group {gi} parameter {bad} is '{saved[bad]}' in the checkpoint but "
                                  f"'{mine[bad]}' in the optimizer")
        ng = dict(g)
        for k in _HYPER[kind]:
            ng[k] = bool(t[k]) if k in _BOOL_HYPER else float(t[k])
        if "beta1" in ng:
            ng["betas"] = (ng.pop("beta1"), ng.pop("beta2"))
        for k, old in g.items():  # the optimizer's own types: an int default stays an int, a tensor lr a tensor
            new = ng[k]
            if isinstance(old, torch.Tensor) and isinstance(new, float):
                ng[k] = torch.tensor(new, dtype=old.dtype, device=old.device)
            elif isinstance(old, int) and not isinstance(old, bool) and isinstance(new, float) and new.is_integer():
                ng[k] = int(new)
        groups.append(ng)
    state = {}
    for fqn, s in osd["state"].items():
        t = tsd["state"].get(fqn)
        if t is None:
            continue
        ns = dict(s)
        for k, v in t.items():
            if k == "step":
                old = s.get("step")
                ns["step"] = (torch.tensor(float(v), dtype=old.dtype, device=old.device)
                              if isinstance(old, torch.Tensor) else v)
            else:
                ns[k] = v
        state[fqn] = ns
    return {"state": state, "param_groups": groups}


def _hparam_text(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:f}"
    return str(v)


class TrainerState:
    """A Tessera Trainer checkpoint (what ``gpt train --resume`` and ``Trainer::fit(...,
    ckpt_path)`` continue from) of a PyTorch model and optimizer, plain or FSDP2 / DTensor::

        state = tessera_ckpt.dcp.TrainerState(model, optimizer, global_step=step,
                                              hparams={"n_layer": 4, "n_head": 4, ...})
        state.save(path)   # dcp.save through Writer: model.*, optimizer_0.*, global_step, hparams.*
        state.load(path)   # dcp.load through Reader, e.g. a checkpoint gpt train wrote;
                           # then state.global_step, state.hparams

    The model's weights go under ``model.<fqn>``; the optimizer's state (torch.optim SGD, Adam,
    AdamW, Adagrad or RMSprop, through ``get_state_dict`` so FSDP2 state stays sharded) under
    ``optimizer_0`` in Tessera's layout: the per-parameter state by FQN with an integer
    ``step``, each group's hyperparameters (Adam's betas as ``beta1`` / ``beta2``) and its
    parameters' FQNs in order. There is no loop state: the Trainer resumes such a checkpoint
    at ``global_step`` with its own data order and LR schedule at that step (and says so).
    ``hparams`` values are stored as text, as the Trainer writes them. Collective, like
    dcp.save / dcp.load."""

    def __init__(self, model, optimizer, *, global_step=0, hparams=None):
        self.model, self.optimizer = model, optimizer
        self.kind = _optimizer_kind(optimizer)
        self.global_step = int(global_step)
        self.hparams = dict(hparams or {})

    def _torch_state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.optimizer)

    def state_dict(self):
        msd, osd = self._torch_state()
        sd = {"model": msd, "optimizer_0": _to_tessera_optimizer(self.kind, osd), "global_step": self.global_step}
        if self.hparams:
            sd["hparams"] = {str(k): _hparam_text(v) for k, v in self.hparams.items()}
        return sd

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        _, osd = self._torch_state()
        where = "TrainerState.load_state_dict"
        optim = _from_tessera_optimizer(self.kind, sd["optimizer_0"], osd, where)
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=optim)
        self.global_step = int(sd["global_step"])
        if "hparams" in sd:
            self.hparams = dict(sd["hparams"])

    def save(self, path):
        _dcp.save(self.state_dict(), storage_writer=Writer(path))

    def load(self, path, *, verify=True):
        sd = self.state_dict()
        sd.pop("hparams", None)
        _dcp.load(sd, storage_reader=Reader(path, verify=verify))
        with Checkpoint(path) as ck:
            sd["hparams"] = {k[len("hparams."):]: ck.get(k) for k in ck.keys() if k.startswith("hparams.")}
        self.load_state_dict(sd)
