"""_format_json.py: strict JSON as the C++ reader parses it, and the bound on what a text holds
(too_many_json_items, counted without parsing) against a count over the parsed value."""
import json
import random

import pytest

from tessera_ckpt._error import CheckpointError
from tessera_ckpt._format_json import (INT64_MAX, INT64_MIN, UINT64_MAX, int_in, is_json_int, jdump, json_dims,
                                       json_u64, parse_json_strict, too_many_json_items)


def refused(fn, *words):
    with pytest.raises(CheckpointError) as e:
        fn()
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


def test_parses_json_in_bytes_and_str():
    assert parse_json_strict(b'{"a": [1, 2.5, "x", null, true]}', "m") == {"a": [1, 2.5, "x", None, True]}
    assert parse_json_strict('{"a": {"b": {}}}', "m") == {"a": {"b": {}}}
    assert parse_json_strict(bytearray(b"[]"), "m") == []


def test_refuses_a_key_twice_at_any_depth():
    msg = refused(lambda: parse_json_strict(b'{"a": 1, "b": 2, "a": 3}', "'F'"), "duplicate key 'a'")
    assert msg == "'F': duplicate key 'a' (edited or corrupt; a key may appear once)"
    refused(lambda: parse_json_strict(b'{"x": [{"k": 1, "k": 1}]}', "'F'"), "'F': duplicate key 'k'")
    # the same key in two objects is no duplicate
    assert parse_json_strict(b'{"x": {"k": 1}, "y": {"k": 2}}', "m") == {"x": {"k": 1}, "y": {"k": 2}}


@pytest.mark.parametrize("text,name", [(b'{"a": NaN}', "NaN"), (b"[Infinity]", "Infinity"),
                                       (b"[-Infinity]", "-Infinity")])
def test_refuses_non_json_constants(text, name):
    refused(lambda: parse_json_strict(text, "'F'"), "'F' is not valid JSON: ", f"{name} is not JSON")


def test_refuses_malformed_text():
    refused(lambda: parse_json_strict(b'{"a": 1', "'F'"), "'F' is not valid JSON: ")
    refused(lambda: parse_json_strict(b'{"a": "\xff"}', "'F'"), "'F' is not valid JSON: ")  # not UTF-8


def count_items(v):
    """Values and member names, as the C++ reader counts them while parsing."""
    if isinstance(v, dict):
        return 1 + sum(1 + count_items(x) for x in v.values())
    if isinstance(v, list):
        return 1 + sum(count_items(x) for x in v)
    return 1


def random_json(rng, depth=0):
    k = rng.randrange(7 if depth < 4 else 4)
    if k == 0:
        return rng.randint(-5, 10 ** 6)
    if k == 1:  # strings holding what the quick count must not take for structure
        return rng.choice(["", "a,b", "x:y", "[]", "{}", 'q"uote', "back\\slash", "}]:,", "\\\""])
    if k == 2:
        return rng.choice([None, True, 1.5])
    if k == 3:
        return []
    if k in (4, 5):
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "b,c", "d:e", "f]", ""]) + str(i): random_json(rng, depth + 1)
            for i in range(rng.randint(0, 4))}


def test_item_count_bound_against_parsing():
    rng = random.Random(9)
    for i in range(1500):
        v = random_json(rng)
        text = json.dumps(v, indent=rng.choice([None, 1, 2]), separators=None if i % 2 else (",", ":")).encode()
        n = count_items(v)
        for bound in (n - 1, n, n + 1, 0, n // 2):
            assert too_many_json_items(text, bound) == (n > bound), (text, n, bound)


def test_item_count_hand_checked():
    # the object, "a", the array, 1 and 2: five
    assert too_many_json_items(b'{"a":[1,2]}', 4)
    assert not too_many_json_items(b'{"a":[1,2]}', 5)
    assert not too_many_json_items(b'{ "a" : [ 1 ,\n 2 ] }', 5)  # whitespace is no item
    # the array, [], {} and "": four (an empty container is one value)
    assert too_many_json_items(b'[[], {}, ""]', 3)
    assert not too_many_json_items(b'[[], {}, ""]', 4)
    # the array and one string: separators inside strings do not count
    assert not too_many_json_items(b'["a,b,c:d]}"]', 2)
    assert too_many_json_items(b'["a,b,c:d]}"]', 1)


def test_json_integers_as_nlohmann_sees_them():
    assert is_json_int(0) and is_json_int(INT64_MIN) and is_json_int(UINT64_MAX)
    assert not is_json_int(UINT64_MAX + 1) and not is_json_int(INT64_MIN - 1)
    assert not is_json_int(True) and not is_json_int(1.0)
    assert jdump(1 << 64) == "1.8446744073709552e+19"  # a longer run of digits is a double there
    assert jdump(10 ** 400) == "null"  # beyond a double: infinity, printed as null
    assert jdump("é") == '"é"' and jdump([1, None]) == "[1,null]"


def test_integer_fields_refused_with_their_bounds():
    assert int_in(3, 1, 4, "w") == 3
    refused(lambda: int_in(5, 1, 4, "'M' world_size"), "'M' world_size is 5, outside [1, 4]")
    refused(lambda: int_in("5", 1, 4, "x"), 'x: expected an integer, got "5"')
    refused(lambda: int_in(1 << 64, 0, INT64_MAX, "x"), "x: expected an integer, got 1.8446744073709552e+19")
    assert json_u64(0, "s") == 0
    refused(lambda: json_u64(-1, "s"), "s: expected a non-negative integer, got -1")
    assert json_dims([0, 3, INT64_MAX], "shape") == [0, 3, INT64_MAX]
    refused(lambda: json_dims([2, -1], "shape"), "shape: bad dimension -1")
    refused(lambda: json_dims([INT64_MAX + 1], "shape"), "shape: bad dimension 9223372036854775808")
    refused(lambda: json_dims({"0": 1}, "shape"), "shape: expected an array of dimensions")
