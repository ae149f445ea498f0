"""_format_metadata.py: tessera-checkpoint.json parsed and checked as the C++ reader checks it
(docs/checkpoint-format.md §3): layouts, plain values, the checksum, the item bound, and each
refusal in its words. The metadata texts are made here, their checksums computed by a bitwise
CRC32C of this file's own."""
import json
import struct

import pytest

from tessera_ckpt._error import CheckpointError
from tessera_ckpt._format_metadata import (MAX_METADATA_ITEMS, METADATA_FILE, Entry, check_metadata_checksum,
                                           check_plain_name, check_tiling, data_file_name, decode_value,
                                           parse_metadata)
from tessera_ckpt._sharding_chunk import Box, chunk_range

WHERE = "'DIR/tessera-checkpoint.json'"


def crc32c_bitwise(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def v2_text(obj):
    """Compact JSON ending with ,"metadata_crc32c":"xxxxxxxx"}, as the writers write version 2."""
    text = json.dumps(obj, separators=(",", ":")).encode()[:-1] + b',"metadata_crc32c":"00000000"}'
    return text[:-10] + b"%08x" % crc32c_bitwise(text) + b'"}'


def v1_text(obj):
    """json.dump(indent=1) with "metadata_crc32c" on its own line, as version 1 was written."""
    text = json.dumps(dict(obj, metadata_crc32c="00000000"), indent=1).encode()
    at = text.index(b'"metadata_crc32c": "') + len(b'"metadata_crc32c": "')
    return text[:at] + b"%08x" % crc32c_bitwise(text) + text[at + 8:]


def float_json(x, value=None):
    return {"kind": "float", "bits": struct.pack(">d", x).hex(), "value": x if value is None else value}


def entries():
    return {
        "model.w": {"kind": "sharded", "dtype": "F32", "shape": [10, 3],
                    "layout": {"rule": "chunk", "dim": 0, "pieces": 4, "files": {"first": 0, "step": 1}}},
        "model.f": {"kind": "sharded", "dtype": "BF16", "shape": [7, 5],
                    "layout": {"rule": "flat", "numel": 100, "offset": 30, "pieces": 4, "files": {"first": 0, "step": 1}}},
        "model.l": {"kind": "sharded", "dtype": "I64", "shape": [4, 2],
                    "layout": {"rule": "list", "pieces": [[0, [0, 0], [2, 2]], [1, [2, 0], [1, 2]], [0, [3, 0], [1, 2]]]}},
        "b": {"kind": "tensor", "dtype": "F16", "shape": [], "layout": {"rule": "whole", "file": 3}},
        "step": {"kind": "int", "value": 7},
        "lr": float_json(0.1),
        "name": {"kind": "string", "value": "x"},
    }


def v2(ents=None, **top):
    ents = entries() if ents is None else ents
    j = {"format": "tessera-checkpoint", "version": 2, "world_size": 4, "crc32c_block": 4194304,
         "save_id": "0123456789abcdef", "keys": list(ents), "entries": ents}
    j.update(top)
    return j


def refused(text, *words):
    with pytest.raises(CheckpointError) as e:
        parse_metadata(text, "DIR")
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


def with_layout(fqn, layout, shape=None, world_size=4):
    ents = entries()
    ents[fqn]["layout"] = layout
    if shape is not None:
        ents[fqn]["shape"] = shape
    return v2_text(v2(ents, world_size=world_size))


def test_a_version_2_metadata_file():
    m = parse_metadata(v2_text(v2()), "DIR")
    assert (m.kind, m.version, m.world_size, m.crc_block, m.save_id) == ("sharded", 2, 4, 4194304, "0123456789abcdef")
    assert m.keys == ["model.w", "model.f", "model.l", "b", "step", "lr", "name"]
    assert [m.entries[k].value for k in ("step", "lr", "name")] == [7, 0.1, "x"]
    w = m.entries["model.w"]
    assert (w.kind, w.dtype, w.shape, w.layout.rule) == ("sharded", "F32", [10, 3], "chunk")
    assert [w.layout.box(i) for i in range(4)] == [([b, 0], [e - b, 3]) for b, e in (chunk_range(10, 4, i)
                                                                                     for i in range(4))]
    assert w.nbytes() == 10 * 3 * 4 and w.pieces() == 4
    f = m.entries["model.f"].layout
    assert (f.numel, f.offset, f.pieces) == (100, 30, 4)
    # elements 30..65 of 100 cut at 25, 50, 75: rows of 5 from 30, cuts at rows 0 (-1 clamped), 4, 7 (clamped)
    assert [f.box(i) for i in range(4)] == [([0, 0], [0, 5]), ([0, 0], [4, 5]), ([4, 0], [3, 5]), ([7, 0], [0, 5])]
    assert m.entries["model.f"].pieces() == 2
    lay = m.entries["model.l"].layout
    assert [lay.name("model.l", i) for i in range(3)] == ["model.l@0", "model.l", "model.l@1"]
    assert [lay.pieces_in_file(f) for f in range(4)] == [[0, 2], [1], [], []]
    b = m.entries["b"]
    assert (b.layout.rule, b.layout.file_of(0), b.nbytes()) == ("whole", 3, 2)


def test_the_layout_maps_every_data_file():
    m = parse_metadata(v2_text(v2()), "DIR")
    assert m.data_files() == [f"data-rank0000{r}.safetensors" for r in range(4)]
    assert m.file_path("data-rank00002.safetensors") == "DIR/data-rank00002.safetensors"
    assert data_file_name(7) == "data-rank00007.safetensors"
    assert data_file_name(123456) == "data-rank123456.safetensors"


def test_version_and_header_fields_refused_in_the_readers_words():
    refused(v2_text(v2(version=4)), "format version 4 is not supported (this reader reads versions 1..3)")
    refused(v2_text(v2(version=0)), "format version 0 is not supported (this reader reads versions 1..3)")
    assert parse_metadata(v2_text(v2(version=3)), "DIR").version == 3  # version 2 plus tp and interleaved groups
    refused(v2_text(v2(version="2")), WHERE + ": no integer version")
    refused(v2_text(v2(world_size=0)), WHERE + " world_size is 0, outside [1, 1048576]")
    refused(v2_text(v2(crc32c_block=12)), WHERE + " crc32c_block: checksum block size 12 is not a multiple of 8 bytes "
            "between 8 and 1073741824 (corrupt or tampered)")
    refused(v2_text(v2(save_id="0123456789ABCDEF")), 'save_id "0123456789ABCDEF" is not 16 lowercase hex digits')
    refused(v2_text(v2(format="other")), 'not Tessera checkpoint metadata (no "format": "tessera-checkpoint")')
    refused(v2_text(v2(keys=["model.w"])), WHERE + ": 7 entries for 1 keys")
    ents = entries()
    refused(v2_text(v2(ents, keys=list(ents)[:-1] + ["model.w"])), WHERE + ": key 'model.w' listed twice")
    refused(v2_text(v2(ents, keys=list(ents)[:-1] + ["model.z"])), WHERE + ": key 'model.z' has no entry")
    ents["model.w"]["dtype"] = "C64"
    refused(v2_text(v2(ents)), "key 'model.w': unknown dtype \"C64\" (known: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)")


def test_duplicate_keys_and_constants_refused():
    text = v2_text(v2())
    dup = text.replace(b'"world_size":4,', b'"world_size":4,"world_size":1,')
    refused(dup, WHERE + ": metadata: duplicate key 'world_size' (edited or corrupt; a key may appear once)")
    nan = text.replace(b'"value":7', b'"value":NaN')
    refused(nan, WHERE + ": metadata is not valid JSON: NaN is not JSON")


def test_the_item_bound_comes_before_parsing():
    pad = b'{"format":"tessera-checkpoint","x":1,"x":2,"pad":[' + b"0," * MAX_METADATA_ITEMS + b"0]}"
    # a duplicate key too, but what parsing would cost is refused first
    refused(pad, WHERE + ": metadata holds more than 4194304 JSON values and keys, the bound every reader enforces "
            "(corrupt or hostile)")
    # at the bound: the object, 5 member names, their 4 scalars and the array with its N numbers
    n = MAX_METADATA_ITEMS - 11
    at_bound = b'{"format":"tessera-checkpoint","version":9,"world_size":1,"crc32c_block":8,"pad":[' + \
        b"0," * (n - 1) + b"0]}"
    refused(at_bound, "format version 9 is not supported")  # parsed: the bound was not hit


@pytest.mark.parametrize("fqn,layout,shape,world,words", [
    ("model.w", {"rule": "ring"}, None, 4,
     'unknown layout rule "ring" (known: whole, chunk, flat, list; tp needs format version 3)'),
    ("model.w", {"rule": "tp", "dim": 0, "stripes": 1, "tp": 2, "inner": {"rule": "whole"},
                 "files": {"first": 0, "step": 1}}, None, 4,
     WHERE + ' key \'model.w\': unknown layout rule "tp" (known: whole, chunk, flat, list; tp needs format version 3)'),
    ("model.w", {"rule": "chunk", "dim": 0, "pieces": 2,
                 "files": {"first": 0, "step": 2, "replicas": 2, "replica_step": 1, "shift": 0}}, None, 4,
     WHERE + " key 'model.w': layout.files.replica_step 1 is below layout.pieces * layout.files.step = 4 (two pieces "
     "would share a file); interleaved replica groups need format version 3"),
    ("model.w", {"rule": "chunk", "dim": 0, "pieces": 0, "files": {"first": 0, "step": 1}}, None, 4,
     WHERE + " key 'model.w' layout.pieces is 0, outside [1, 4]"),
    ("model.w", {"rule": "chunk", "dim": 2, "pieces": 2, "files": {"first": 0, "step": 1}}, None, 4,
     WHERE + " key 'model.w' layout.dim is 2, outside [0, 1]"),
    ("model.w", {"rule": "chunk", "dim": 0, "pieces": 2, "files": {"first": 0, "step": 0}}, None, 4,
     WHERE + " key 'model.w' layout.files.step is 0, outside [1, 4]"),
    ("model.w", {"rule": "chunk", "dim": 0, "pieces": 4, "files": {"first": 2, "step": 1}}, None, 4,
     WHERE + " key 'model.w': layout.files reach data file 5, outside [0, 3]"),
    ("model.w", {"rule": "chunk", "dim": 0, "pieces": 4,
                 "files": {"first": 0, "step": 1, "replicas": 2, "replica_step": 3, "shift": 0}}, None, 8,
     "layout.files.replica_step 3 is below layout.pieces * layout.files.step = 4 (two pieces would share a file)"),
    ("b", {"rule": "chunk", "dim": 0, "pieces": 1, "files": {"first": 0, "step": 1}}, None, 4,
     "key 'b': a chunk layout needs a tensor of at least one dimension (a 0-dimensional one is whole)"),
    ("b", {"rule": "whole", "file": 4}, None, 4, WHERE + " key 'b' layout.file is 4, outside [0, 3]"),
    ("model.f", {"rule": "flat", "numel": 60, "offset": 30, "pieces": 2, "files": {"first": 0, "step": 1}}, None, 4,
     "key 'model.f': layout.offset 30 + the tensor's 35 elements exceed layout.numel 60"),
    ("model.l", {"rule": "list", "pieces": [[0, [0, 0], [2, 2]], [1, [1, 0], [3, 2]]]}, None, 4,
     WHERE + " key 'model.l': pieces [0:2, 0:2] and [1:4, 0:2] overlap"),
    ("model.l", {"rule": "list", "pieces": [[0, [0, 0], [2, 2]]]}, None, 4,
     "key 'model.l': the pieces cover 4 of 8 elements (incomplete checkpoint)"),
    ("model.l", {"rule": "list", "pieces": [[0, [0, 0], [2, 2]], [1, [2, 0], [0, 2]], [2, [2, 0], [2, 2]]]}, None, 4,
     "key 'model.l': layout.pieces[1] [2:2, 0:2] is empty (a list layout names only the pieces its data files store)"),
    ("model.l", {"rule": "list", "pieces": [[0, [3, 0], [2, 2]]]}, None, 4,
     "key 'model.l': layout.pieces[0] (offsets [3, 0], sizes [2, 2]) lies outside the shape [4, 2]"),
    ("model.l", {"rule": "list", "pieces": [[4, [0, 0], [4, 2]]]}, None, 4,
     WHERE + " key 'model.l' layout.pieces[0] file is 4, outside [0, 3]"),
    ("model.l", {"rule": "list", "pieces": [[0, [i, 0], [1, 1]] for i in range(65)]}, [65, 1], 1,
     "key 'model.l': layout.pieces lists 65 pieces, more than 64 per data file (64 for world_size 1)"),
])
def test_layouts_refused_field_by_field(fqn, layout, shape, world, words):
    ents = entries()
    ents[fqn]["layout"] = layout
    if shape is not None:
        ents[fqn]["shape"] = shape
    if world < 4:  # the other entries' files must stay inside the world
        ents = {fqn: ents[fqn]}
    refused(v2_text(v2(ents, world_size=world)), words)


def test_the_metadata_checksum():
    text = v2_text(v2())
    check_metadata_checksum(text, WHERE, 2)
    bad = text.replace(b'"value":7', b'"value":8')
    want = text[-10:-2].decode()
    got = crc32c_bitwise(bad[:-10] + b"00000000" + bad[-2:])
    with pytest.raises(CheckpointError) as e:
        check_metadata_checksum(bad, WHERE, 2)
    assert str(e.value) == (f"{WHERE}: metadata checksum mismatch (metadata_crc32c {want}, computed {got:08x}) "
                            "-- the metadata is corrupt")
    with pytest.raises(CheckpointError, match="does not end with ,\"metadata_crc32c\":\"xxxxxxxx\"}"):
        check_metadata_checksum(text[:-2] + b'" }', WHERE, 2)
    with pytest.raises(CheckpointError, match="checksum \"0000000g\" is not 8 hex digits"):
        check_metadata_checksum(text[:-10] + b'0000000g"}', WHERE, 2)


def v1():
    return {"format": "tessera-checkpoint", "version": 1, "world_size": 2, "crc32c_block": 8,
            "files": [{"name": "rank0.safetensors", "size": 100}, {"name": "rank1.safetensors", "size": 100}],
            "keys": ["w", "n"],
            "entries": {"w": {"kind": "sharded", "dtype": "F32", "shape": [3, 2], "chunks": [
                {"offsets": [0, 0], "sizes": [2, 2], "file": "rank0.safetensors", "name": "w", "byte_range": [80, 96],
                 "crc32c": ["00000001", "00000002"]},
                {"offsets": [2, 0], "sizes": [1, 2], "file": "rank1.safetensors", "name": "w", "byte_range": [88, 96],
                 "crc32c": ["0000000a"]}]},
                "n": {"kind": "bool", "value": True}}}


def test_a_version_1_metadata_file():
    text = v1_text(v1())
    check_metadata_checksum(text, WHERE, 1)
    m = parse_metadata(text, "DIR")
    assert (m.version, m.world_size, m.files) == (1, 2, [("rank0.safetensors", 100), ("rank1.safetensors", 100)])
    w = m.entries["w"]
    assert [(c.box(), c.file, c.begin, c.end, c.crcs) for c in w.chunks] == [
        ("[0:2, 0:2]", "rank0.safetensors", 80, 96, [1, 2]), ("[2:3, 0:2]", "rank1.safetensors", 88, 96, [10])]
    assert m.entries["n"].value is True and m.data_files() == ["rank0.safetensors", "rank1.safetensors"]
    with pytest.raises(CheckpointError, match="metadata checksum mismatch"):
        check_metadata_checksum(text.replace(b"true", b"false"), WHERE, 1)


def test_version_1_chunks_refused():
    def edit(fn):
        j = v1()
        fn(j)
        return v1_text(j)

    def chunk(i):
        return lambda j: j["entries"]["w"]["chunks"][i]

    refused(edit(lambda j: chunk(0)(j).update(byte_range=[80, 90])),
            WHERE + " key 'w': byte_range [80, 90] does not match chunk [0:2, 0:2]")
    refused(edit(lambda j: chunk(0)(j).update(crc32c=["00000001"])), "key 'w': chunk [0:2, 0:2] needs 2 checksums")
    refused(edit(lambda j: chunk(1)(j).update(file="rank9.safetensors")),
            "key 'w': chunk file 'rank9.safetensors' is not listed in files")
    refused(edit(lambda j: j["files"][1].update(name="../x")),
            'file name "../x" is not a plain name inside the checkpoint directory')
    refused(edit(lambda j: chunk(1)(j).update(offsets=[1, 0])), "key 'w': chunks [0:2, 0:2] and [1:2, 0:2] overlap")
    refused(edit(lambda j: j["entries"]["w"]["chunks"].pop()), "key 'w': the chunks cover 4 of 6 elements "
            "(incomplete checkpoint)")
    refused(edit(lambda j: j["files"].pop()), WHERE + ": world_size is 2 but 1 data files are listed (one per rank)")


def test_plain_values():
    assert decode_value({"kind": "int", "value": -(1 << 63)}, "k") == -(1 << 63)
    assert decode_value(float_json(2.5), "k") == 2.5
    neg0 = decode_value(float_json(-0.0), "k")
    assert neg0 == 0.0 and struct.pack(">d", neg0) == struct.pack(">d", -0.0)
    nan = {"kind": "float", "bits": "7ff8000000000001", "value": None}
    assert struct.pack(">d", decode_value(nan, "k")).hex() == "7ff8000000000001"  # the payload kept
    assert decode_value({"kind": "bytes", "hex": "00ff"}, "k") == b"\x00\xff"
    assert decode_value({"kind": "dict"}, "k") == {}
    cases = [
        ({"kind": "float", "bits": struct.pack(">d", -0.0).hex(), "value": 0.0}, "k: float value 0.0 disagrees with its bits"),
        ({"kind": "float", "bits": "7ff8000000000000", "value": 1}, "disagrees with its bits"),
        ({"kind": "float", "bits": "7ff80000000000zz"}, 'k: bad hex digit in float bits "7ff80000000000zz"'),
        ({"kind": "int", "value": 1 << 63}, "k value is 9223372036854775808, outside"),
        ({"kind": "int", "value": "1"}, "k: int value has a missing or bad 'value'"),
        ({"kind": "bytes", "hex": "0"}, "k: bad hex in bytes value"),
        ({"kind": "complex"}, "k: unknown value kind 'complex'"),
        ({"value": 1}, "k: value has no kind"),
    ]
    for j, words in cases:
        with pytest.raises(CheckpointError) as e:
            decode_value(j, "k")
        assert words in str(e.value), (j, str(e.value))


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "a\0b", "é" * 128])
def test_file_names_must_be_plain(name):
    with pytest.raises(CheckpointError, match="is not a plain name inside the checkpoint directory"):
        check_plain_name(name, "m")


def test_plain_file_names():
    assert check_plain_name(data_file_name(0), "m") == "data-rank00000.safetensors"
    assert check_plain_name("x" * 255, "m") == "x" * 255
    assert METADATA_FILE == "tessera-checkpoint.json"


def tiling_error(e, boxes, word="chunk"):
    with pytest.raises(CheckpointError) as err:
        check_tiling("w", e, "M", [Box(o, s) for o, s in boxes], word)
    return str(err.value)


def test_check_tiling():
    e = Entry("sharded", "F32", [4, 3])
    check_tiling("w", e, "M", [Box([2, 0], [2, 3]), Box([0, 0], [2, 3]), Box([4, 0], [0, 3])])  # empty: ignored
    assert tiling_error(e, [([0, 0], [2, 3]), ([1, 0], [3, 3])]) == "M: key 'w': chunks [0:2, 0:3] and [1:4, 0:3] overlap"
    assert tiling_error(e, [([0, 0], [3, 3])], "piece") == "M: key 'w': the pieces cover 9 of 12 elements (incomplete checkpoint)"
    assert tiling_error(e, [([0, 0], [5, 3])]) == "M: key 'w': chunk [0:5, 0:3] lies outside the shape [4, 3]"
    assert tiling_error(e, [([0], [4])]) == "M: key 'w': chunk [0:4] has the wrong number of dimensions for shape [4, 3]"
    # an overlap before a bad box is named first, as a box-by-box check meets it
    assert "overlap" in tiling_error(e, [([0, 0], [2, 3]), ([1, 0], [1, 3]), ([3, 0], [9, 3])])
    assert "outside" in tiling_error(e, [([0, 0], [2, 3]), ([3, 0], [9, 3]), ([1, 0], [1, 3])])
    with pytest.raises(CheckpointError, match=r"M: key 'w': shape \[4611686018427387904, 2\]: shape too large"):
        check_tiling("w", Entry("sharded", "F32", [1 << 62, 2]), "M", [])


# ---------------------------------------------------------------- version 3: tp, interleaved groups


def v3_with(layout, shape, world_size=4):
    ents = {"model.t": {"kind": "sharded", "dtype": "F32", "shape": shape, "layout": layout}}
    return v2_text(v2(ents, version=3, world_size=world_size))


def tp(inner, files=None, dim=0, stripes=3, t=2):
    return {"rule": "tp", "dim": dim, "stripes": stripes, "tp": t, "inner": inner,
            "files": files or {"first": 0, "step": 1}}


def test_a_version_3_tp_layout_parsed():
    # qkv of 3 stripes of 4 rows, tp 2, FSDP over 2 with per-TP-piece units
    flat = {"rule": "flat", "numel": [30, 40], "offset": [0, 10], "pieces": 2}
    m = parse_metadata(v3_with(tp(flat), [12, 5]), "DIR")
    lay = m.entries["model.t"].layout
    assert (lay.rule, lay.dim, lay.stripes, lay.tp, lay.inner, lay.pieces) == ("tp", 0, 3, 2, "flat", 2)
    assert (lay.inner_numel, lay.inner_offset, lay.count(), lay.holders()) == ([30, 40], [0, 10], 12, 4)
    assert lay.describe() == "tp dim 0, 3 stripes, tp 2, inner flat over 2"
    # holder q = p*2 + t in file q: pieces [3q, 3q + 3)
    assert [lay.pieces_in_file(f) for f in range(5)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], []]
    # one per TP piece is accepted as a scalar too
    whole = parse_metadata(v3_with(tp({"rule": "whole"}, dim=1, stripes=1), [3, 4]), "DIR").entries["model.t"].layout
    assert [whole.box(i) for i in range(2)] == [([0, 0], [3, 2]), ([0, 2], [3, 2])]
    chunk = parse_metadata(v3_with(tp({"rule": "chunk", "dim": 1, "pieces": 2}, stripes=2), [4, 3]), "DIR")
    assert chunk.entries["model.t"].layout.inner_dim == 1


def test_interleaved_groups_at_version_3():
    # 2 dp groups interleaved over a (2 x 2) mesh: piece i in file 2i + (i mod 2)
    files = {"first": 0, "step": 2, "replicas": 2, "replica_step": 1, "shift": 0}
    lay = parse_metadata(v3_with({"rule": "chunk", "dim": 0, "pieces": 2, "files": files}, [4, 2]),
                         "DIR").entries["model.t"].layout
    assert lay.files.interleaved() and [lay.file_of(i) for i in range(2)] == [0, 3]
    assert [lay.pieces_in_file(f) for f in range(4)] == [[0], [], [], [1]]
    # groups that collide: replica_step 2 = step
    files["replica_step"] = 2
    refused(v3_with({"rule": "chunk", "dim": 0, "pieces": 2, "files": files}, [4, 2]),
            "key 'model.t': layout.files.replica_step 2 is below layout.pieces * layout.files.step = 4 (two pieces "
            "would share a file)")


@pytest.mark.parametrize("layout,shape,world,words", [
    (tp({"rule": "whole"}, dim=2), [6, 2], 4, "key 'model.t' layout.dim is 2, outside [0, 1]"),
    (tp({"rule": "whole"}), [], 4, "key 'model.t': a tp layout needs a tensor of at least one dimension"),
    (tp({"rule": "whole"}, stripes=0), [6, 2], 4, "key 'model.t' layout.stripes is 0, outside [1, 64]"),
    (tp({"rule": "whole"}, stripes=65), [6, 2], 4, "key 'model.t' layout.stripes is 65, outside [1, 64]"),
    (tp({"rule": "whole"}, stripes=4), [6, 2], 4,
     "key 'model.t': layout.stripes 4 does not divide dimension 0 of shape [6, 2] (6)"),
    (tp({"rule": "whole"}, t=0), [6, 2], 4, "key 'model.t' layout.tp is 0, outside [1, 4]"),
    (tp({"rule": "whole"}, t=5), [6, 2], 4, "key 'model.t' layout.tp is 5, outside [1, 4]"),
    (dict(tp({"rule": "whole"}), inner=[1]), [6, 2], 4, "key 'model.t': layout.inner is not an object"),
    (tp({"rule": "rows"}), [6, 2], 4, "key 'model.t': unknown layout.inner.rule \"rows\" (known: whole, chunk, flat)"),
    (tp({"rule": "tp"}), [6, 2], 4, "unknown layout.inner.rule \"tp\" (known: whole, chunk, flat)"),
    (tp({"rule": "chunk", "dim": 2, "pieces": 2}), [6, 2], 4, "key 'model.t' layout.inner.dim is 2, outside [0, 1]"),
    (tp({"rule": "chunk", "dim": 0, "pieces": 0}), [6, 2], 4, "key 'model.t' layout.inner.pieces is 0, outside [1, 4]"),
    (tp({"rule": "chunk", "dim": 0, "pieces": 3}), [6, 2], 4,
     "key 'model.t': layout.inner.pieces 3 x layout.tp 2 holders exceed world_size 4"),
    (tp({"rule": "flat", "numel": [12, 12, 12], "offset": 0, "pieces": 2}), [6, 2], 4,
     "key 'model.t' layout.inner.numel holds 3 values (1, or layout.tp = 2)"),
    (tp({"rule": "flat", "numel": 12, "offset": [0], "pieces": 2}), [6, 2], 4,
     "key 'model.t' layout.inner.offset holds 1 values (1, or layout.tp = 2)"),
    (tp({"rule": "flat", "numel": [6, -1], "offset": 0, "pieces": 2}), [6, 2], 4,
     "key 'model.t' layout.inner.numel[1] is -1, outside [0, 9223372036854775807]"),
    (tp({"rule": "flat", "numel": [6, 5], "offset": 0, "pieces": 2}), [6, 2], 4,
     "key 'model.t': layout.inner.offset 0 + the 6 elements of tensor-parallel piece 1 exceed layout.inner.numel 5"),
    (tp({"rule": "whole"}, files={"first": 3, "step": 1}), [6, 2], 4,
     "key 'model.t': layout.files reach data file 4, outside [0, 3]"),
    (tp({"rule": "chunk", "dim": 0, "pieces": 2}, files={"first": 0, "step": 1, "replicas": 2, "replica_step": 2,
                                                          "shift": 0}), [6, 2], 4,
     "key 'model.t': layout.files.replica_step 2 is below layout.inner.pieces * layout.tp * layout.files.step = 4 "
     "(two pieces would share a file)"),
])
def test_tp_layouts_refused_field_by_field(layout, shape, world, words):
    refused(v3_with(layout, shape, world), words)
