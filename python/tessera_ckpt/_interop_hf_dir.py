"""Hugging Face model directories as input: what transformers' save_pretrained,
huggingface_hub's save_torch_state_dict and torch DCP's HuggingFaceStorageWriter write,

    DIR/model.safetensors                                     (one file, no index)
    DIR/model-00001-of-0000N.safetensors ... + DIR/model.safetensors.index.json

the index being {"metadata": {"total_size": B}, "weight_map": {tensor: file}}. Read as a
checkpoint of kind "hf": every tensor is one whole chunk of its shard file. The checks and
their words are the C++ reader's (src/tessera/checkpoint/interop/hf_dir.cpp): a file name
that is not a plain name inside DIR, a missing shard (or a symbolic link leading out of DIR,
or no regular file), a mapped tensor its shard does not hold, a tensor in two shards
("duplicated") and a shard's tensor the map does not name ("unmapped") are errors naming the
tensor and the file. total_size is informational, as for Hugging Face's own readers: a value
other than the tensors' bytes is a note (Layout.notes), not an error. Files the map does not
name are read only when they belong to the series of its shards (model-<i>-of-<n>.safetensors):
config.json, tokenizer files or a consolidated.safetensors beside the shards are not.
"""
import json
import os
import re
import stat

from ._error import CheckpointError, fail
from ._format_json import parse_json_strict
from ._format_metadata import METADATA_FILE, Chunk, Entry, Layout
from ._format_safetensors import Safetensors
from ._storage_file import escape_path, join_path, not_regular_file_reason, open_file, pread

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_INDEX_BYTES = 100 << 20  # the bound of a safetensors header, as the C++ reader
MAX_PROBLEMS_SHOWN = 20
# What verify checks in a directory whose files carry no checksums (the C++ tool prints the same).
VERIFY_CHECKED = ("a Hugging Face directory carries no checksums: checked the weight map against the shards (every "
                  "tensor in the one shard the map names), every shard's header and size, and read every byte")


class HfDirectoryError(CheckpointError):
    """A directory whose weight map and shards disagree: the message joins the problems with
    "; " (at most 20 spelled out), ``problems`` lists each (verify reports them one by one)."""

    def __init__(self, msg, problems):
        super().__init__(msg)
        self.problems = problems


def is_hf_directory(d):
    """A directory without Tessera's metadata file that holds model.safetensors.index.json or
    model.safetensors (whatever they turn out to be)."""
    return (os.path.isdir(d) and not os.path.lexists(join_path(d, METADATA_FILE))
            and (os.path.lexists(join_path(d, INDEX_FILE)) or os.path.lexists(join_path(d, SINGLE_FILE))))


def _file_problem(d, name):
    """Why file ``name`` of ``d`` may not be read ("" when it may): a symbolic link is followed
    only to a target inside the directory; a FIFO, a device or a directory is refused."""
    path = join_path(d, name)
    try:
        st = os.lstat(path)
    except OSError:
        return f"'{path}' does not exist"
    if stat.S_ISLNK(st.st_mode):
        try:
            to = os.readlink(path)
        except OSError:
            to = "?"
        if not os.path.exists(path):
            return f"'{path}' is a symbolic link to '{to}', which does not exist"
        real, real_dir = os.path.realpath(path), os.path.realpath(d)
        inside = real_dir if real_dir == "/" else real_dir + "/"
        if len(real) <= len(inside) or not real.startswith(inside):
            return (f"'{path}' is a symbolic link to '{to}' ({real}), outside the directory: refusing to follow it "
                    "(copy the file into the directory)")
    why = not_regular_file_reason(path)
    return f"'{path}' {why}" if why else ""


def _plain_name(n):
    try:
        size = len(n.encode("utf-8"))
    except UnicodeEncodeError:
        return False
    if not n or n in (".", "..") or size >= 256:
        return False
    return not any(ch in "/\\" or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in n)


_SERIES = re.compile(r"(.*)-([0-9]+)-of-([0-9]+)\.safetensors\Z", re.S)


def _series(name):
    """The series of a shard name "<prefix>-<i>-of-<n>.safetensors": (prefix, n), or None."""
    m = _SERIES.match(name)
    return (m.group(1), m.group(3)) if m else None


def _quoted_list(v):
    s = ""
    for i, x in enumerate(v):
        s += ("" if i == 0 else " and " if i + 1 == len(v) else ", ") + f"'{x}'"
    return s


def _data_order(st):
    """A shard's tensors by data offset, ties (empty tensors) by name: the C++ reader's order."""
    return sorted(st.tensors, key=lambda t: (st.tensors[t][2], st.tensors[t][3], t))


def _read_index(d):
    path = join_path(d, INDEX_FILE)
    where = f"'{path}'"
    bad = _file_problem(d, INDEX_FILE)
    if bad:
        fail(bad)
    fd = open_file(path)
    try:
        n = os.fstat(fd).st_size
        if n > MAX_INDEX_BYTES:
            fail(where, " is ", n, " bytes, more than the limit of ", MAX_INDEX_BYTES)
        text = pread(fd, 0, n, path)
    finally:
        os.close(fd)
    j = parse_json_strict(text, where)
    if not isinstance(j, dict):
        fail(where, " is not a JSON object")
    total_size = bad_total = None
    md = j.get("metadata")
    if md is not None:
        if not isinstance(md, dict):
            fail(where, ": metadata is not an object")
        ts = md.get("total_size")
        if isinstance(ts, float) and ts.is_integer() and 0 <= ts < 2.0**64:
            ts = int(ts)  # some writers store the byte count as a JSON float (1234.0)
        if ts is not None:
            if not isinstance(ts, int) or isinstance(ts, bool) or not 0 <= ts < 1 << 64:
                bad_total = json.dumps(ts)  # informational only: a note, as a count that is off
            else:
                total_size = ts
    wm = j.get("weight_map")
    if not isinstance(wm, dict):
        fail(where, ": no weight_map object")
    for t, f in wm.items():
        if not isinstance(f, str):
            fail(where, ": the weight_map value of '", t, "' is not a string")
    if not wm:
        fail(where, ": the weight map names no tensor")
    return dict(sorted(wm.items())), total_size, bad_total


def open_hf_directory(d):
    """The Layout of Hugging Face directory ``d`` (kind "hf"), its index and every shard header
    it names checked; CheckpointError listing every problem otherwise."""
    index_path = join_path(d, INDEX_FILE)
    iq = f"'{index_path}'"
    has_index = os.path.lexists(index_path)
    weight_map, total_size, bad_total = {}, None, None
    by_file = {}  # file -> the tensors mapped there, sorted
    problems = []
    if has_index:
        weight_map, total_size, bad_total = _read_index(d)
        for t, f in weight_map.items():
            if _plain_name(f):
                by_file.setdefault(f, []).append(t)
            else:
                problems.append(f"{iq}: tensor '{t}' is mapped to '{escape_path(f)}', which is not a plain file name "
                                "inside the directory")
        if SINGLE_FILE not in by_file and os.path.lexists(join_path(d, SINGLE_FILE)):
            fail("'", d, "' holds both ", SINGLE_FILE, " and ", INDEX_FILE, ", whose weight map does not name it: ",
                 "which of them is the model is ambiguous (transformers would read ", SINGLE_FILE,
                 "); remove the stale one")
        # A shard of the same series that the map does not name is read too: its tensors are unmapped.
        series = {_series(f) for f in by_file} - {None}
        if series:
            for n in sorted(os.listdir(d)):
                if n not in by_file and _series(n) in series:
                    by_file[n] = []
    else:
        by_file[SINGLE_FILE] = []
    shards = {}
    for f in sorted(by_file):
        tensors = by_file[f]
        path = join_path(d, f)
        if not os.path.lexists(path):
            problems.append(f"'{path}' does not exist" if not tensors else
                            f"{iq}: shard '{f}' is missing (the weight map puts {len(tensors)} tensor(s) there, "
                            f"e.g. '{tensors[0]}')")
            continue
        bad = _file_problem(d, f)
        if bad:
            problems.append(bad)
            continue
        try:
            shards[f] = Safetensors(path)
        except FileNotFoundError:
            raise
        except Exception as e:  # a CheckpointError naming the file (and the tensor)
            problems.append(str(e))
    holders = {}
    for f, st in shards.items():
        for t in st.tensors:
            holders.setdefault(t, []).append(join_path(d, f))
    for t in sorted(holders):
        if len(holders[t]) > 1:
            problems.append(f"tensor '{t}' is in {len(holders[t])} shards, {_quoted_list(holders[t])} (duplicated)")
    if has_index:
        for t, f in weight_map.items():
            st = shards.get(f)
            if st is None or t in st.tensors:
                continue
            where = f" (it is in {_quoted_list(holders[t])})" if t in holders else ""
            problems.append(f"{iq}: tensor '{t}' is mapped to '{f}', but '{join_path(d, f)}' does not hold it{where}")
        for f, st in shards.items():
            for t in _data_order(st):
                if t not in weight_map:
                    problems.append(f"'{join_path(d, f)}': tensor '{t}' is not in the weight map of {iq} (unmapped)")
    m = Layout()
    crc_file = None
    for f, st in shards.items():
        if not st.crc_block:
            continue
        if not m.crc_block:
            m.crc_block, crc_file = st.crc_block, f
        elif st.crc_block != m.crc_block:
            problems.append(f"'{join_path(d, f)}' has checksum blocks of {st.crc_block} bytes, "
                            f"'{join_path(d, crc_file)}' of {m.crc_block} (shards of different writers)")
    if problems:
        msg = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
        if len(problems) > MAX_PROBLEMS_SHOWN:
            msg += f"; and {len(problems) - MAX_PROBLEMS_SHOWN} more problem(s)"
        raise HfDirectoryError(msg, problems)
    m.kind = "hf"
    m.location = d
    m.version = None
    m.hf_index = INDEX_FILE if has_index else None
    m.total_size = total_size
    tensor_bytes = 0
    for f, st in shards.items():
        m.files.append((f, st.size))
        for t in _data_order(st):
            dtype, shape, b, en = st.tensors[t]
            e = Entry("tensor", dtype, shape)
            if en > b:
                e.chunks.append(Chunk([0] * len(shape), list(shape), f, t, b, en, st.crcs.get(t, [])))
            m.file_of[t] = f
            tensor_bytes += en - b
            m.keys.append(t)
            m.entries[t] = e
    if total_size is not None and total_size != tensor_bytes:
        m.notes.append(f"{iq}: metadata.total_size is {total_size} but the tensors hold {tensor_bytes} bytes "
                       "(not an error: Hugging Face's readers do not check it either)")
    if bad_total is not None:
        m.notes.append(f"{iq}: metadata.total_size is {bad_total}, not a byte count: ignored "
                       "(not an error: Hugging Face's readers do not use it)")
    return m
