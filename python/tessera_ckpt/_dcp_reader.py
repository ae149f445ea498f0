"""The DCP storage reader (``tessera_ckpt.dcp.Reader``; the module doc of dcp.py says how it
is used): ``torch.distributed.checkpoint.load`` of a Tessera checkpoint of any kind the
package reads (_reader.py), each rank reading only the byte ranges of the pieces its
ReadItems need, rounded out to the checksum blocks it verifies; plain values served as the
torch.save'd buffer DCP's planner expects, rebuilt from the Writer's ``dcp_values`` and
nested as its ``dcp_nesting`` says (_dcp_members.py). Imported through dcp.py, which checks
first that this torch has DCP."""
import io
import os

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ._dcp_members import DCP_NESTING, DCP_VALUES, check_nesting, leaf_keys, rebuild_value
from ._error import CheckpointError
from ._format_json import parse_json_strict
from ._format_metadata import MAX_METADATA_BYTES, METADATA_FILE, Chunk, check_metadata_checksum
from ._format_safetensors import DTYPES
from ._reader import CheckpointReader, tensor_view


class Reader(StorageReader):
    """``torch.distributed.checkpoint.load(state_dict, storage_reader=Reader(path))`` of a
    Tessera checkpoint: a sharded directory (format 1, 2 or 3, any world size at save) or a
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
        ck = CheckpointReader(self.path)
        self._ck = ck
        # What verify checks of the structure (every data file present, holding exactly its
        # pieces), before DCP plans a read: a checkpoint verify refuses never loads.
        ck.check_structure()
        lay = ck._layout
        shapes, nesting = self._read_dcp_members(ck) if lay.kind == "sharded" and lay.version >= 2 else ({}, {})
        self._shapes = shapes
        claimed = set()  # the plain values the dcp_values shapes are rebuilt from: not offered on their own
        for root, shape in shapes.items():
            leaf_keys(root, shape, claimed, f"'{lay.path}'")

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
        nesting = check_nesting(nesting, md, f"'{os.path.join(lay.location, METADATA_FILE)}'")
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
        self._check_targets(plan, planner)
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
    def _check_targets(self, plan, planner):
        """Refuses, before anything is read, a DTensor target whose local tensor DCP's plan
        places wrongly (``_one_box_problem``): DCP would fill it with other rows of the
        checkpoint, whatever the storage reader. The targets are the planner's flattened state
        dict (DefaultLoadPlanner's ``state_dict``); a planner without one is not checked."""
        sd = getattr(planner, "state_dict", None)
        if not isinstance(sd, dict):
            return
        seen = set()
        for req in plan.items:
            fqn = req.dest_index.fqn
            if req.type == LoadItemType.BYTE_IO or fqn in seen:
                continue
            seen.add(fqn)
            why = _one_box_problem(sd.get(fqn))
            if why:
                raise CheckpointError(f"'{self.path}' key '{req.storage_index.fqn}': {why}")

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
            return rebuild_value(self._values, fqn, self._shapes[fqn], f"'{self._ck.path}'")
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
            self._ck._read_range(fqn, c, lo, hi, tensor_view(target), self.verify)
            return
        buf = torch.empty((hi - lo) // item, dtype=dtype)
        self._ck._read_range(fqn, c, lo, hi, tensor_view(buf), self.verify)
        region = buf.as_strided(lens, strides, 0) if lens else buf.view([])
        target.copy_(region)


def _one_box_problem(t):
    """Why DCP's description of DTensor ``t``'s local tensor is not where that tensor's
    elements lie in the global tensor, or None. torch 2.x's DCP describes each rank's local
    tensor as one box (``DTensor.__create_chunk_list__``: its first global offset and its
    shape). A ``_StridedShard(d, split_factor=s)`` is one box only as FSDP2 makes it over a
    tensor-parallel cut: s equal to the product of the mesh sizes of the later placements
    cutting dim d (``(_StridedShard(0, sf=tp), Shard(0))``), or on a mesh dimension of size 1.
    Otherwise its local tensor is s stripes of dim d (Tessera's layout of a fused qkv at
    s = 3: one piece of each of q, k and v), which DCP would read from the wrong rows."""
    placements, mesh = getattr(t, "placements", None), getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return None
    for i, p in enumerate(placements):
        if type(p).__name__ != "_StridedShard" or p.split_factor == 1 or mesh.size(i) == 1:
            continue
        later = 1
        for j in range(i + 1, len(placements)):
            q = placements[j]
            if type(q).__name__ in ("Shard", "_StridedShard") and q.dim == p.dim:
                later *= mesh.size(j)
        if later != p.split_factor:
            return (f"the target DTensor's placements {tuple(placements)} on a mesh of shape {tuple(mesh.shape)}: "
                    f"its local tensor is {p.split_factor} stripes of dim {p.dim}, which torch's DCP describes as one "
                    f"box (DTensor.__create_chunk_list__), so it would be filled from the wrong rows (with any "
                    f"storage reader); load a Shard({p.dim}) DTensor (ColwiseParallel's cut) or a plain tensor and "
                    f"reorder the stripes after")
    return None
