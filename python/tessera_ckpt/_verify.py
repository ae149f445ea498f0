"""Verifying a checkpoint (C++: src/tessera/checkpoint/verify.cpp): every byte read and every
CRC32C checked, every data file checked against the metadata; the first 100 problems reported
one by one, in the C++ verify's words. It does not import torch: `python -m tessera_ckpt
verify` starts fast."""
import os

from . import _crc32c
from ._error import CheckpointError, CheckpointNotFoundError
from ._format_metadata import data_file_name
from ._interop_hf_dir import VERIFY_CHECKED, HfDirectoryError
from ._reader import CheckpointReader, piece_chunk
from ._storage_file import pread_into

MAX_REPORTED_PROBLEMS = 100  # verify reports this many problems one by one, then "and K more problem(s)"
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


def verify_checkpoint(ck):
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
        out["checked"] = VERIFY_CHECKED  # what was checked instead of checksums
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
        ck = CheckpointReader(path)
    except HfDirectoryError as e:  # every disagreement of the weight map and the shards, one by one
        problems = _Problems()
        for p in e.problems:
            problems.append(p)
        raise problems.error(path) from None
    with ck:
        return verify_checkpoint(ck)
