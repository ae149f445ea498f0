"""The DCP storage writer (``tessera_ckpt.dcp.Writer``; the module doc of dcp.py says how it
is used): ``torch.distributed.checkpoint.save`` into a Tessera format-2 sharded checkpoint.
Each rank writes ``data-rank%05d.safetensors`` of its WriteItems (block and header checksums,
each piece's offsets); the coordinator chooses the save id and the temporary directory, writes
``tessera-checkpoint.json`` (``whole`` / ``chunk`` layouts where the pieces follow those rules,
else ``list``; non-tensor values flattened into plain values, _dcp_members.py) and publishes
the directory atomically (_storage_commit.py). Imported through dcp.py, which checks first
that this torch has DCP."""
import io
import json
import os
import secrets
import shutil
import struct
import sys

import torch
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _crc32c
from ._dcp_members import DCP_NESTING, DCP_VALUES, flatten_value, nesting_of
from ._error import CheckpointError
from ._format_json import too_many_json_items
from ._format_metadata import (MAX_METADATA_BYTES, MAX_METADATA_ITEMS, METADATA_FILE, Entry, check_tiling,
                               data_file_name)
from ._format_safetensors import DTYPES, MAX_HEADER_BYTES
from ._sharding_chunk import Box, chunk_range
from ._storage_commit import (check_destination, forget_temp, make_temp_dir, publish, refuse_existing,
                              remove_stale_temps)
from ._storage_file import check_path_chars, fsync_dir

CRC_BLOCK = 4194304  # tessera.crc32c_block of every file the Writer writes
FORMAT_VERSION = 2

_TORCH_TO_ST = {getattr(torch, name): st for st, (name, _) in DTYPES.items()}


def _st_dtype(dtype, key):
    st = _TORCH_TO_ST.get(dtype)
    if st is None:
        raise CheckpointError(f"key '{key}': dtype {dtype} has no safetensors counterpart in a Tessera checkpoint "
                              f"(supported: {', '.join(DTYPES)})")
    return st


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
        check_path_chars(dest)
        check_destination(dest)
        if not self.overwrite:
            refuse_existing(dest)
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        remove_stale_temps(dest)
        tmp = make_temp_dir(dest)
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
            fsync_dir(tmp)
            publish(tmp, self.path, self.overwrite)
            forget_temp(self.path, tmp)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                forget_temp(self.path, tmp)
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
                leaves, shape = flatten_value(item.index.fqn, obj)
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
            check_tiling(fqn, e, where, [Box(o, z) for f, o, z, _ in ps], "piece")
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
        nesting = nesting_of(getattr(metadata, "planner_data", None), set(order))
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
