"""What `tessera ckpt inspect` shows that the package has (C++:
src/tessera/checkpoint/offline/offline.cpp): what a checkpoint holds, from its metadata alone
(no tensor data read). It does not import torch: `python -m tessera_ckpt inspect` starts fast."""
from ._reader import CheckpointReader


def hf_summary_head(s):
    """The first line of an "hf" inspect() summary, before its key and byte counts."""
    what = (f"{s['index']} and {len(s['files'])} shard file(s)" if s["index"] else
            s["files"][0]["name"] if s["files"] else "no shard")
    head = f"{s['path']}: hf checkpoint (a Hugging Face model directory: {what})"
    return head if s["total_size"] is None else f"{head}, index total_size {s['total_size']}"


def inspect_checkpoint(ck):
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
                keys[k]["layout_words"] = e.layout.describe()  # "tp dim 0, 3 stripes, tp 2, inner flat over 2"
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
    keys: {fqn: {kind, dtype, shape, chunks, bytes} (versions 2 and 3: and layout, the rule, and
    layout_words, the rule in words as `tessera ckpt inspect` prints it: "chunk dim 0, 4 pieces",
    "tp dim 0, 3 stripes, tp 2, inner flat over 2"; a Hugging
    Face directory: and file, its shard) or {kind, value}}, tensor_bytes, save_id (version 2,
    else None), notes (remarks that are no error); a Hugging Face directory (kind "hf") also
    index (the index file's name, None for a single model.safetensors) and total_size (the
    index's)) that prints as a table; chunks counts the stored (version 2: non-empty) pieces."""

    def __str__(self):
        ws = self["world_size"]
        hf = self["kind"] == "hf"
        head = hf_summary_head(self) if hf else (
            f"{self['path']}: {self['kind']} checkpoint, format version {self['version']}, "
            f"world size at save {ws if ws is not None else 'unknown'}, {len(self['files'])} data file(s)")
        lines = [f"{head}, {len(self['keys'])} keys, {self['tensor_bytes']} tensor bytes"]
        lines += [f"note: {n}" for n in self.get("notes", [])]
        layouts = any("layout" in v for v in self["keys"].values())  # a sharded checkpoint of format 2 or 3
        rows = [("KEY", "KIND", "DTYPE", "SHAPE/VALUE", "CHUNKS", "BYTES") + (("FILE",) if hf else ())
                + (("LAYOUT",) if layouts else ())]
        for k, v in self["keys"].items():
            if "dtype" in v:
                rows.append((k, v["kind"], v["dtype"], str(v["shape"]), str(v["chunks"]), str(v["bytes"]))
                            + ((v.get("file") or "-",) if hf else ()) + ((v.get("layout_words", "-"),) if layouts else ()))
            else:
                text = repr(v["value"])
                rows.append((k, v["kind"], "-", text if len(text) <= 60 else text[:57] + "...", "-", "-")
                            + (("-",) if hf else ()) + (("-",) if layouts else ()))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return "\n".join(lines)


def inspect(path):
    """A summary of the checkpoint (metadata only; no tensor data is read): see Summary."""
    with CheckpointReader(path) as ck:
        return inspect_checkpoint(ck)
