"""What the DCP Writer stores beside Tessera's own entries, and the Reader reads back
(docs/checkpoint-format.md §8): the metadata members ``dcp_values`` (how non-tensor values
DCP saves -- tuples, lists, dicts, None, io.BytesIO -- were flattened into Tessera plain values,
``KEY.0``, ``KEY.name``, as ``tessera ckpt import-dcp`` flattens them) and ``dcp_nesting``
(DCP's flatten mapping: each key's path of dict keys and list indices). No C++ twin: Tessera's
own readers ignore both members."""
import io
import json
import struct

import torch

from ._error import CheckpointError
from ._format_json import INT64_MAX, INT64_MIN

DCP_VALUES = "dcp_values"  # metadata member: the shape of non-scalar DCP values (see the module doc)
DCP_NESTING = "dcp_nesting"  # metadata member: DCP's flatten mapping, where a key is not top-level

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


def flatten_value(key, obj):
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


def leaf_keys(key, shape, out, where):
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
            leaf_keys(f"{key}.{i}", s, out, where)
    elif t == "dict" and isinstance(items, dict):
        if not items:
            out.add(key)
        for name, s in items.items():
            leaf_keys(f"{key}.{name}", s, out, where)
    elif t != "none":
        raise CheckpointError(f"{where}: {DCP_VALUES} key '{key}': malformed shape {json.dumps(shape)}")


def rebuild_value(values, key, shape, where):
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
        out = [rebuild_value(values, f"{key}.{i}", s, where) for i, s in enumerate(items)]
        return tuple(out) if t == "tuple" else out
    if t == "dict" and isinstance(items, dict):
        return {name: rebuild_value(values, f"{key}.{name}", s, where) for name, s in items.items()}
    raise CheckpointError(f"{where}: {DCP_VALUES} key '{key}': malformed shape {json.dumps(shape)}")


# ---------------------------------------------------------------- DCP's nesting of the keys


def _is_path_part(p):
    return isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and p >= 0)


def nesting_of(planner_data, keys):
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


def check_nesting(nesting, keys, where):
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
