"""_sharding_spec.first_overlap, the sweep every tiling check uses, against a check of every
pair: the same first pair (the smallest j that overlaps an earlier box, then the smallest i)."""
import random

from tessera_ckpt._sharding_chunk import Box, overlaps
from tessera_ckpt._sharding_spec import first_overlap


def every_pair(boxes):
    for j in range(len(boxes)):
        if not all(boxes[j].sizes):
            continue
        for i in range(j):
            if all(boxes[i].sizes) and overlaps(boxes[i], boxes[j]):
                return i, j
    return None


def boxes_of(*spec):
    return [Box(list(o), list(s)) for o, s in spec]


def test_hand_checked_pairs():
    assert first_overlap([]) is None
    assert first_overlap(boxes_of(((0,), (4,)))) is None
    assert first_overlap(boxes_of(((0,), (2,)), ((2,), (2,)), ((4,), (1,)))) is None  # touching is no overlap
    # [3:5] overlaps both [0:4] and [4:6]: the pair with the earliest later box, then the earliest i
    assert first_overlap(boxes_of(((0,), (4,)), ((4,), (2,)), ((3,), (2,)))) == (0, 2)
    # the later pair (1, 3) is not the first one a box-by-box check meets: (0, 2) is
    assert first_overlap(boxes_of(((0,), (2,)), ((5,), (3,)), ((1,), (1,)), ((6,), (1,)))) == (0, 2)
    # empty boxes overlap nothing, wherever they are
    assert first_overlap(boxes_of(((0,), (0,)), ((0,), (3,)), ((1,), (0,)), ((3,), (2,)))) is None
    # two non-empty pieces of a scalar overlap
    assert first_overlap(boxes_of(((), ()), ((), ()))) == (0, 1)
    # 2-D: a grid with one cell moved down by one row
    grid = boxes_of(((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((3, 2), (2, 2)), ((1, 2), (1, 2)))
    assert first_overlap(grid) == (1, 4)


def random_tiling(rng, nd):
    shape = [rng.randint(1, 6) for _ in range(nd)]
    boxes = [Box([0] * nd, list(shape))]
    for _ in range(rng.randint(0, 12)):  # cut a random box in two along a random dimension
        b = boxes.pop(rng.randrange(len(boxes)))
        d = rng.randrange(nd)
        if b.sizes[d] < 2:
            boxes.append(b)
            continue
        k = rng.randint(1, b.sizes[d] - 1)
        lo, hi = Box(list(b.offsets), list(b.sizes)), Box(list(b.offsets), list(b.sizes))
        lo.sizes[d] = k
        hi.offsets[d] += k
        hi.sizes[d] -= k
        boxes += [lo, hi]
    rng.shuffle(boxes)
    return boxes


def test_against_every_pair_on_random_tilings():
    rng = random.Random(45)
    found = 0
    for trial in range(3000):
        nd = 1 + trial % 3
        boxes = random_tiling(rng, nd)
        if rng.random() < 0.7:  # move one box by one along one dimension (may make an overlap)
            b = rng.choice(boxes)
            b.offsets[rng.randrange(nd)] += rng.choice((-1, 1))
        if rng.random() < 0.2:
            boxes.insert(rng.randrange(len(boxes) + 1), Box([rng.randint(0, 3) for _ in range(nd)], [0] * nd))
        want = every_pair(boxes)
        assert first_overlap(boxes) == want, [b.box() for b in boxes]
        found += want is not None
    assert found > 500  # the moved boxes did overlap often enough to check the pairs named


def test_many_pieces_name_the_first_pair():
    rows = [Box([i], [1]) for i in range(20000)]
    assert first_overlap(rows) is None
    rows[12345] = Box([12344], [2])  # overlaps its predecessor's row
    rows[17000] = Box([3], [1])
    assert first_overlap(rows) == (12344, 12345)
