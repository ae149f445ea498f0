"""_sharding_chunk.py: torch.chunk's split of a dimension and boxes, against hand-checked
values and a brute force that hands out elements one at a time."""
import itertools

import pytest

from tessera_ckpt._sharding_chunk import Box, box_text, chunk_range, overlaps, shape_string


def greedy_chunks(n, pieces):
    """torch.chunk by hand: every piece takes up to ceil(n / pieces) of the elements left, in
    order, so the trailing pieces may get none."""
    per = -(-n // pieces)
    out, left, begin = [], n, 0
    for _ in range(pieces):
        size = min(per, left)
        out.append((begin, begin + size))
        begin, left = begin + size, left - size
    return out


@pytest.mark.parametrize("n,pieces,want", [
    (6, 4, [(0, 2), (2, 4), (4, 6), (6, 6)]),  # chunk.h's example: 2, 2, 2, 0
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (7, 2, [(0, 4), (4, 7)]),
    (3, 5, [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]),
    (0, 3, [(0, 0), (0, 0), (0, 0)]),
    (10, 1, [(0, 10)]),
    (9, 4, [(0, 3), (3, 6), (6, 9), (9, 9)]),  # ceil(9/4) = 3: the fourth piece is empty
])
def test_chunk_range_hand_checked(n, pieces, want):
    assert [chunk_range(n, pieces, i) for i in range(pieces)] == want


def test_chunk_range_is_torch_chunks_rule():
    for n in range(0, 40):
        for pieces in range(1, 12):
            got = [chunk_range(n, pieces, i) for i in range(pieces)]
            assert got == greedy_chunks(n, pieces), (n, pieces)


def test_box_text_and_shape_string():
    assert box_text([0, 4], [3, 2]) == "[0:3, 4:6]"
    assert box_text([], []) == "[]"
    assert shape_string([2, 0, 7]) == "[2, 0, 7]"
    assert shape_string([]) == "[]"
    b = Box([1, 2], [3, 4])
    assert b.box() == "[1:4, 2:6]"
    assert b.numel() == 12
    assert Box([5], [0]).numel() == 0
    assert Box([], []).numel() == 1  # a 0-dimensional tensor has one element


def cells(b):
    return set(itertools.product(*[range(o, o + s) for o, s in zip(b.offsets, b.sizes)]))


def test_overlaps_is_sharing_an_element():
    spans = [(o, s) for o in range(0, 4) for s in range(0, 3)]
    for (ao, asz), (bo, bsz), (co, csz) in itertools.product(spans, spans, [(0, 2), (1, 1), (2, 0)]):
        a, b = Box([ao, co], [asz, csz]), Box([bo, 1], [bsz, 2])
        assert overlaps(a, b) == bool(cells(a) & cells(b)), (a.box(), b.box())
