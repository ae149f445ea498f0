"""_sharding_layout.py: the version-2 layout rules (docs/checkpoint-format.md §3) against brute
force: FSDP's row-aligned flat cut by an exhaustive search for the nearest row boundary, the
pieces holding some rows by trying every piece, the file map by inverting it piece by piece."""
import random

from tessera_ckpt._sharding_chunk import chunk_range
from tessera_ckpt._sharding_layout import (FileMap, PieceLayout, flat_pieces_overlapping, flat_row_cut, flat_rows)


def nearest_row(numel, offset, rows, r, pieces, k):
    """Cut k of a flat vector of `numel` elements in `pieces` (at floor(numel * k / pieces)),
    moved to the row boundary of the tensor (rows of r elements from `offset`) nearest to it,
    the later one on a tie, found by trying every boundary."""
    if k <= 0:
        return 0
    if r == 0:
        return rows  # rows of no elements: all in piece 0
    c = numel * k // pieces
    return min(range(rows + 1), key=lambda j: (abs(c - (offset + j * r)), -j))


def test_flat_row_cut_is_the_nearest_row_boundary():
    rng = random.Random(4)
    for _ in range(4000):
        rows, r = rng.randint(0, 9), rng.randint(0, 5)
        offset = rng.randint(0, 30)
        numel = offset + rows * r + rng.randint(0, 30)
        pieces = rng.randint(1, 9)
        for k in range(pieces + 1):
            want = nearest_row(numel, offset, rows, r, pieces, k)
            assert flat_row_cut(numel, offset, rows, r, pieces, k) == want, (numel, offset, rows, r, pieces, k)


def test_flat_row_cut_hand_checked():
    # 10 rows of 4 elements from element 8 of 100, in 4 pieces: cuts at 25, 50, 75 fall at rows
    # 4.25, 10.5 and 16.75 of the tensor -> 4, 10 (beyond its end: clamped) and 10
    assert [flat_row_cut(100, 8, 10, 4, 4, k) for k in range(5)] == [0, 4, 10, 10, 10]
    # a tie (the cut exactly between two boundaries) goes to the later row
    assert flat_row_cut(8, 0, 4, 2, 8, 1) == 1  # cut at element 1 of rows of 2: rows 0 and 1 equally near
    assert flat_row_cut(12, 0, 4, 3, 12, 1) == 0  # cut at element 1 of rows of 3: row 0 is nearer


def test_flat_rows_tile_the_rows():
    rng = random.Random(5)
    for _ in range(2000):
        shape = [rng.randint(0, 12)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 2))]
        n = 1
        for d in shape:
            n *= d
        offset = rng.randint(0, 20)
        numel = offset + n + rng.randint(0, 20)
        pieces = rng.randint(1, 8)
        spans = [flat_rows(numel, offset, shape, pieces, i) for i in range(pieces)]
        assert spans[0][0] == 0 and spans[-1][1] == shape[0]
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(spans, spans[1:])), spans


def test_flat_pieces_overlapping_is_every_piece_tried():
    rng = random.Random(6)
    for _ in range(3000):
        shape = [rng.randint(1, 15), rng.randint(0, 4)]
        offset = rng.randint(0, 25)
        numel = offset + shape[0] * shape[1] + rng.randint(0, 25)
        pieces = rng.randint(1, 10)
        begin = rng.randint(-2, shape[0] + 1)
        end = rng.randint(begin, shape[0] + 3)
        want = []
        for i in range(pieces):
            lo, hi = flat_rows(numel, offset, shape, pieces, i)
            if lo < hi and max(lo, begin) < min(hi, end):  # the piece's rows and [begin, end) share one
                want.append((i, lo, hi))
        assert flat_pieces_overlapping(numel, offset, shape, pieces, begin, end) == want, \
            (numel, offset, shape, pieces, begin, end)


def test_file_map_hand_checked():
    fm = FileMap(first=1, step=2)
    assert [fm.file(i) for i in range(4)] == [1, 3, 5, 7]
    # hybrid: 2 replica groups of 4 ranks, piece i in group (i + 1) mod 2
    fm = FileMap(first=0, step=1, replicas=2, replica_step=4, shift=1)
    assert [fm.file(i) for i in range(4)] == [4, 1, 6, 3]


def valid_file_maps(rng, pieces):
    for _ in range(60):
        step = rng.randint(1, 3)
        replicas = rng.randint(1, 3)
        replica_step = rng.randint(pieces * step, pieces * step + 3) if replicas > 1 else 0
        yield FileMap(rng.randint(0, 4), step, replicas, replica_step, rng.randint(0, 5))


def test_pieces_in_file_inverts_file_of():
    rng = random.Random(7)
    for pieces in range(1, 9):
        for fm in valid_file_maps(rng, pieces):
            lay = PieceLayout("chunk", [pieces * 2, 3])
            lay.pieces, lay.files = pieces, fm
            files = [lay.file_of(i) for i in range(pieces)]
            assert len(set(files)) == pieces, fm  # a valid map puts no two pieces in one file
            for f in range(max(files) + 3):
                assert lay.pieces_in_file(f) == [i for i in range(pieces) if files[i] == f], (fm, f)
            i = fm.last_file_piece(pieces)
            assert files[i] == max(files), (fm, pieces)


def chunk_layout(shape, dim, pieces):
    lay = PieceLayout("chunk", shape)
    lay.dim, lay.pieces, lay.files = dim, pieces, FileMap()
    return lay


def test_chunk_boxes_follow_torch_chunk():
    lay = chunk_layout([7, 3], 0, 3)
    assert [lay.box(i) for i in range(3)] == [([0, 0], [3, 3]), ([3, 0], [3, 3]), ([6, 0], [1, 3])]
    lay = chunk_layout([2, 5], 1, 4)  # ceil(5/4) = 2: 2, 2, 1, 0
    assert [lay.box(i) for i in range(4)] == [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([0, 4], [2, 1]),
                                              ([0, 5], [2, 0])]
    for n in range(0, 12):
        for pieces in range(1, 6):
            lay = chunk_layout([n, 2], 0, pieces)
            for i in range(pieces):
                b, e = chunk_range(n, pieces, i)
                assert lay.box(i) == ([b, 0], [e - b, 2])


def brute_overlapping(lay, begin, end):
    rows = lay.shape[0] if lay.shape else 1
    b, e = (0, rows) if begin is None else (max(begin, 0), min(end, rows))
    out = []
    for i in range(lay.count()):
        offsets, sizes = lay.box(i)
        if all(s > 0 for s in sizes) and (not lay.shape or max(offsets[0], b) < min(offsets[0] + sizes[0], e)):
            out.append(i)
    return out


def test_overlapping_and_stored_count_are_every_piece_tried():
    rng = random.Random(8)
    for _ in range(3000):
        shape = [rng.randint(0, 10), rng.randint(0, 3)]
        rule = rng.choice(("whole", "chunk", "flat", "list"))
        lay = PieceLayout(rule, shape)
        if rule == "chunk":
            lay.dim, lay.pieces, lay.files = rng.randint(0, 1), rng.randint(1, 6), FileMap()
        elif rule == "flat":
            lay.offset = rng.randint(0, 10)
            lay.numel = lay.offset + shape[0] * shape[1] + rng.randint(0, 10)
            lay.pieces, lay.files = rng.randint(1, 6), FileMap()
        elif rule == "list":  # rows cut at random points, one piece per stretch
            cuts = sorted({0, shape[0], *(rng.randint(0, shape[0]) for _ in range(3))})
            lay.boxes = [(k, [a, 0], [b - a, shape[1]]) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
            lay.pieces = len(lay.boxes)
        begin, end = (None, None) if rng.random() < 0.3 else sorted((rng.randint(-1, 11), rng.randint(-1, 11)))
        assert lay.overlapping(begin, end) == brute_overlapping(lay, begin, end), (rule, shape, begin, end)
        assert lay.stored_count() == len(brute_overlapping(lay, None, None)), (rule, shape)


def test_list_piece_names():
    lay = PieceLayout("list", [4, 2])
    lay.boxes = [(0, [0, 0], [1, 2]), (1, [1, 0], [1, 2]), (0, [2, 0], [2, 2])]
    lay.names = ["w@0", "w", "w@1"]
    assert [lay.name("w", i) for i in range(3)] == ["w@0", "w", "w@1"]
    assert chunk_layout([4], 0, 2).name("w", 1) == "w"  # the rules store one piece per file


# ---------------------------------------------------------------- version 3: the tp rule


def grid(shape):
    """A 2-D tensor of ``shape`` as rows of its elements' flat indices."""
    return [[r * shape[1] + c for c in range(shape[1])] for r in range(shape[0])]


def narrow(g, ncols, offsets, sizes):
    """The box (offsets, sizes) of 2-D grid ``g`` (``ncols`` columns, kept for 0-row grids)."""
    rows = g[offsets[0]:offsets[0] + sizes[0]]
    return [r[offsets[1]:offsets[1] + sizes[1]] for r in rows], sizes[1]


def cat(parts, dim):
    """torch.cat of 2-D grids [(rows, ncols)] along ``dim``."""
    if dim == 0:
        return [r for g, _ in parts for r in g], parts[0][1]
    rows = max((len(g) for g, _ in parts), default=0)
    return [sum((g[i] for g, _ in parts), []) for i in range(rows)], sum(n for _, n in parts)


def random_tp_layout(rng):
    """A valid tp layout as C++ TpRuleComposesTheTensorParallelCutWithAnInnerCut draws them,
    files following each other or (version 3) interleaved; and the world it needs."""
    dim, stripes, T, P = rng.randint(0, 1), rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 5)
    shape = [rng.randint(0, 7), rng.randint(1, 5)]
    shape[dim] = stripes * rng.randint(0, 6)
    lay = PieceLayout("tp", shape)
    lay.dim, lay.stripes, lay.tp = dim, stripes, T
    lay.inner = rng.choice(("whole", "chunk", "flat", "flat"))
    lay.pieces = 1 if lay.inner == "whole" else P
    if lay.inner == "chunk":
        lay.inner_dim = rng.randint(0, 1)
    elif lay.inner == "flat":
        lay.inner_numel, lay.inner_offset = [], []
        for t in range(T):
            local = lay.tp_local_shape(t)
            before = rng.randint(0, 30)
            lay.inner_offset.append(before)
            lay.inner_numel.append(before + local[0] * local[1] + rng.randint(0, 30))
        if rng.random() < 0.3:  # one value for every TP piece
            lay.inner_numel, lay.inner_offset = [max(lay.inner_numel)], [min(lay.inner_offset)]
    holders = lay.holders()
    R, step = rng.randint(1, 2), rng.randint(1, 3)
    if R > 1 and step >= R and rng.random() < 0.5:
        replica_step = 1  # interleaved: (R - 1) * 1 < step
    else:
        replica_step = holders * step + rng.randint(0, 2) if R > 1 else 0
    lay.files = FileMap(rng.randint(0, 2), step, R, replica_step, rng.randint(0, 5))
    world = lay.files.first + (holders - 1) * step + (R - 1) * replica_step + 1 + rng.randint(0, 2)
    return lay, world


def brute_overlapping_box(lay, offsets, sizes):
    out = []
    for i in range(lay.count()):
        o, z = lay.box(i)
        if all(z) and all(max(a, b) < min(a + s, b + t) for a, s, b, t in zip(o, z, offsets, sizes)):
            out.append(i)
    return out


def test_tp_rule_composes_the_tensor_parallel_cut_with_an_inner_cut():
    rng = random.Random(47)
    kinds = set()
    for trial in range(1500):
        lay, world = random_tp_layout(rng)
        shape, dim, stripes, T = lay.shape, lay.dim, lay.stripes, lay.tp
        kinds.add((lay.inner, lay.files.interleaved(), stripes > 1, dim))
        assert lay.count() == lay.holders() * stripes
        g = grid(shape)
        # the non-empty pieces tile the shape: every element in exactly one
        seen = [0] * (shape[0] * shape[1])
        for i in range(lay.count()):
            o, z = lay.box(i)
            assert all(a >= 0 and a + s <= d for a, s, d in zip(o, z, shape)), (trial, i, o, z)
            for row in narrow(g, shape[1], o, z)[0]:
                for x in row:
                    seen[x] += 1
        assert seen == [1] * len(seen), (trial, shape, lay.inner)
        # holder q = p*T + t: its stripe pieces, concatenated along dim, are inner piece p of TP
        # piece t (the t-th torch.chunk range of each of the equal stripes, concatenated)
        per = shape[dim] // stripes
        for q in range(lay.holders()):
            t, p = q % T, q // T
            ranges, parts = [], []
            for s in range(stripes):
                b, e = chunk_range(per, T, t)
                o, z = [0, 0], list(shape)
                o[dim], z[dim] = s * per + b, e - b
                ranges.append(narrow(g, shape[1], o, z))
                parts.append(narrow(g, shape[1], *lay.box(q * stripes + s)))
            local, ncols = cat(ranges, dim)
            inner = lay.tp_inner(t)
            assert inner.shape == [len(local) if dim == 0 else shape[0], ncols]
            want = narrow(local, ncols, *inner.box(p))
            got = cat(parts, dim)
            assert got[0] == want[0] and (not want[0] or got[1] == want[1]), (trial, q)
        # pieces_in_file inverts file_of; no two holders share a file
        files = [lay.file_of(i) for i in range(lay.count())]
        assert max(files) < world
        assert len({lay.files.file(q) for q in range(lay.holders())}) == lay.holders()
        for f in range(world + 2):
            assert lay.pieces_in_file(f) == [i for i in range(lay.count()) if files[i] == f], (trial, f)
        # overlapping equals trying every piece, for boxes and for rows
        for _ in range(6):
            offsets, sizes = [], []
            for d in shape:
                a = rng.randint(0, d - 1) if d else 0
                offsets.append(a)
                sizes.append(rng.randint(0, d - a) if d else 0)
            assert lay.overlapping_box(offsets, sizes) == brute_overlapping_box(lay, offsets, sizes), (trial, offsets)
            b, e = sorted((rng.randint(-1, shape[0] + 1), rng.randint(-1, shape[0] + 1)))
            assert lay.overlapping(b, e) == brute_overlapping(lay, b, e), (trial, b, e)
        assert lay.stored_count() == len(brute_overlapping(lay, None, None))
        # the names of the pieces in each file: FQN when the holder stores one non-empty piece
        for f in set(files):
            stored = [i for i in lay.pieces_in_file(f) if all(lay.box(i)[1])]
            names = [lay.name("w", i) for i in stored]
            assert names == (["w"] if len(stored) == 1 else [f"w@{k}" for k in range(len(stored))])
    # every inner rule was drawn with and without stripes, along both dims, with interleaved files
    assert {(k[0], k[1]) for k in kinds} >= {(r, x) for r in ("whole", "chunk", "flat") for x in (False, True)}
    assert {k[2:] for k in kinds} == {(False, 0), (False, 1), (True, 0), (True, 1)}


def test_tp_layout_hand_checked():
    # qkv weight [6, 2]: 3 stripes of 2 rows, tp 2 (one row each), inner whole: TP piece 0 is
    # rows 0, 2, 4 (each its own stripe piece), TP piece 1 rows 1, 3, 5
    lay = PieceLayout("tp", [6, 2])
    lay.dim, lay.stripes, lay.tp, lay.files = 0, 3, 2, FileMap()
    assert [lay.box(i)[0][0] for i in range(6)] == [0, 2, 4, 1, 3, 5]
    assert lay.pieces_in_file(1) == [3, 4, 5] and lay.name("w", 4) == "w@1"
    assert lay.overlapping(2, 4) == [1, 4]  # rows 2 and 3
    # a cut along dim 1 (row-parallel): rows [1, 2) touch both TP pieces' columns
    lay = PieceLayout("tp", [2, 4])
    lay.dim, lay.tp, lay.files = 1, 2, FileMap()
    assert [lay.box(i) for i in range(2)] == [([0, 0], [2, 2]), ([0, 2], [2, 2])]
    assert lay.overlapping(1, 2) == [0, 1] and lay.overlapping_box([0, 2], [2, 1]) == [1]


def test_interleaved_file_maps():
    # a (dp 2, tp 2) mesh: the dp group of tp rank g holds piece i in file 2i + g, g = (i + shift) mod 2
    fm = FileMap(first=0, step=2, replicas=2, replica_step=1, shift=1)
    assert fm.interleaved() and [fm.file(i) for i in range(2)] == [1, 2]
    lay = chunk_layout([4, 2], 0, 2)
    lay.files = fm
    assert [lay.pieces_in_file(f) for f in range(4)] == [[], [0], [1], []]
    assert not FileMap(0, 2, 2, 2, 0).interleaved() and not FileMap(0, 2, 3, 1, 0).interleaved()
