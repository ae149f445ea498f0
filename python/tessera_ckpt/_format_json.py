"""Strict JSON, as the C++ reader parses it (src/tessera/checkpoint/format/json.cpp
parse_json_strict / parse_json_bounded: a key at most once per object, no NaN or Infinity,
the count of values bounded before parsing), and JSON integers as it sees them (nlohmann).
Used by the metadata (_format_metadata.py), the safetensors headers (_format_safetensors.py)
and the Hugging Face index (_interop_hf_dir.py), as its C++ twin is."""
import json
import re

from ._error import fail

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1


class _Duplicate(Exception):
    pass


def _pairs(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return d


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def too_many_json_items(text, bound):
    """Whether JSON text ``text`` (bytes) holds more than ``bound`` values and member names
    together (as the C++ reader counts them while parsing), found without parsing it: every
    value but the outermost is followed by ``,``, ``]`` or ``}``, except that an empty array
    or object ends with no value; every member name is followed by ``:``. Counted outside
    strings, and the strings themselves counted only when the quick bounds do not decide."""
    text = bytes(text)
    upper = 1 + text.count(b",") + text.count(b"]") + text.count(b"}") + text.count(b":")
    if upper <= bound:
        return False
    if (text.count(b'"') - text.count(b'\\"')) // 2 > bound:  # at least that many strings, each an item
        return True
    s = _JSON_STRING.sub(b'""', text)  # compact text: one copy of it (with whitespace: two)
    if any(c in s for c in (b" ", b"\t", b"\r", b"\n")):
        s = s.translate(None, b" \t\r\n")
    n = 1 + s.count(b",") + s.count(b"]") + s.count(b"}") + s.count(b":") - s.count(b"[]") - s.count(b"{}")
    return n > bound


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def parse_json_strict(text, what):
    """JSON with every key at most once per object (json.loads keeps the last one silently)
    and without NaN/Infinity literals; ``text`` is bytes (UTF-8) or str."""
    try:
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8")
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant)
    except _Duplicate as e:
        fail(what, ": duplicate key '", e.args[0], "' (edited or corrupt; a key may appear once)")
    except (ValueError, UnicodeDecodeError) as e:
        fail(what, " is not valid JSON: ", e)


def is_json_int(v):
    """A JSON integer as the C++ reader (nlohmann) sees one: in [-2^63, 2^64 - 1]; a longer
    run of digits is a floating-point number there."""
    return isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= UINT64_MAX


def jdump(v):
    """``v`` as the C++ reader prints a JSON value in its messages (nlohmann's dump)."""
    if isinstance(v, int) and not isinstance(v, bool) and not is_json_int(v):
        try:
            v = float(v)
        except OverflowError:
            return "null"  # nlohmann: infinity prints as null
    try:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return "null"


def int_in(v, lo, hi, what):
    if not is_json_int(v):
        fail(what, ": expected an integer, got ", jdump(v))
    if not lo <= v <= hi:
        fail(what, " is ", v, ", outside [", lo, ", ", hi, "]")
    return v


def json_u64(v, what):
    if not is_json_int(v) or v < 0:
        fail(what, ": expected a non-negative integer, got ", jdump(v))
    return v


def json_dims(v, what):
    # As the C++ reader: a dimension (or offset) is an int64, never above 2^63 - 1.
    if not isinstance(v, list):
        fail(what, ": expected an array of dimensions")
    for d in v:
        if not is_json_int(d) or d < 0 or d > INT64_MAX:
            fail(what, ": bad dimension ", jdump(d))
    return list(v)
