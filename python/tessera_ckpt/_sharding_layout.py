"""Version-2 layouts (C++: src/tessera/sharding/layout.cpp, docs/checkpoint-format.md §3):
where the pieces of a tensor live, as a rule evaluated alone: `whole`, `chunk` (torch.chunk's
rule), `flat` (FSDP's row-aligned cut of a flat vector) and `list` (explicit boxes), and which
data file holds each piece. Pure integer arithmetic; parse_layout (_format_metadata.py) builds
and checks a PieceLayout from the metadata's JSON."""
from ._sharding_chunk import chunk_range

RULES = ("whole", "chunk", "flat", "list")
MAX_PIECES = 1 << 20  # a chunk or flat layout's piece count (the launcher's limit on ranks)


def flat_row_cut(numel, offset, rows, row_numel, pieces, k):
    """Dim-0 row of cut k (0 <= k <= pieces) of a tensor of ``rows`` rows of ``row_numel``
    elements that is elements [offset, offset + rows * row_numel) of a flat vector of ``numel``
    elements cut into ``pieces`` stretches at floor(numel * k / pieces), a cut inside the
    tensor moved to its nearest row boundary, every cut clamped to the tensor
    (docs/checkpoint-format.md §3). O(1). Piece i is rows [cut(i), cut(i + 1)). Rows of no
    elements (row_numel == 0) are all in piece 0."""
    if k <= 0:
        return 0
    if row_numel == 0:
        return rows
    c = numel if k >= pieces else numel * k // pieces
    moved = offset + (c - offset + row_numel // 2) // row_numel * row_numel  # floor division
    return (min(max(moved, offset), offset + rows * row_numel) - offset) // row_numel


def flat_rows(numel, offset, shape, pieces, i):
    """(begin, end): the dim-0 rows of piece i of a ``flat`` layout of a tensor of ``shape``
    (at least one dimension; parse_layout refuses a flat 0-dimensional tensor). O(1)."""
    rows, r = _rows_of(shape)
    return (flat_row_cut(numel, offset, rows, r, pieces, i), flat_row_cut(numel, offset, rows, r, pieces, i + 1))


def _rows_of(shape):
    if not shape:
        return 1, 1  # one row of one element, as FSDP sees it (a flat layout of one is refused)
    r = 1
    for d in shape[1:]:
        r *= d
    return shape[0], r


def _first_above(cut, lo, hi, value):
    """The smallest k in [lo, hi] with cut(k) > value (cut non-decreasing, cut(hi) > value)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) > value:
            hi = mid
        else:
            lo = mid + 1
    return lo


def flat_pieces_overlapping(numel, offset, shape, pieces, begin, end):
    """The non-empty pieces of a ``flat`` layout that hold some of dim-0 rows [begin, end),
    ascending, with their rows: [(i, row_begin, row_end)]. Binary search over the cuts: O(log P)
    per piece returned, never a loop over every piece."""
    rows, r = _rows_of(shape)
    begin, end = max(begin, 0), min(end, rows)
    out = []
    if begin >= end:
        return out

    def cut(k):
        return flat_row_cut(numel, offset, rows, r, pieces, k)

    # piece i = k - 1 for the first cut k above `begin`: cut(i) <= begin < cut(i + 1)
    k = _first_above(cut, 1, pieces, begin)
    while True:
        lo, hi = cut(k - 1), cut(k)
        out.append((k - 1, lo, hi))
        if hi >= end or k == pieces:
            return out
        # the next non-empty piece starts at `hi`: the last of the pieces whose cut is `hi`
        k = _first_above(cut, k + 1, pieces, hi)


class FileMap:
    """A chunk or flat layout's `files`: piece i is in data file
    first + i*step + ((i + shift) mod replicas) * replica_step."""

    __slots__ = ("first", "step", "replicas", "replica_step", "shift")

    def __init__(self, first=0, step=1, replicas=1, replica_step=0, shift=0):
        self.first, self.step, self.replicas, self.replica_step, self.shift = first, step, replicas, replica_step, shift

    def file(self, i):
        return self.first + i * self.step + ((i + self.shift) % self.replicas) * self.replica_step

    def last_file_piece(self, pieces):
        """The piece whose file is the highest-numbered: O(1). With replicas > 1 and
        replica_step >= pieces*step the replica term dominates, so it is the last piece of the
        highest replica group (i + shift) mod replicas that some piece reaches."""
        if self.replicas == 1:
            return pieces - 1
        i0 = (self.replicas - 1 - self.shift) % self.replicas  # first piece in the last group
        if i0 > pieces - 1:
            return pieces - 1  # the groups the pieces reach do not wrap: the last piece's is highest
        return i0 + (pieces - 1 - i0) // self.replicas * self.replicas

    def __repr__(self):
        return (f"FileMap(first={self.first}, step={self.step}, replicas={self.replicas}, "
                f"replica_step={self.replica_step}, shift={self.shift})")


class PieceLayout:
    """A version-2 tensor's `layout`: how the tensor of ``shape`` is cut into pieces and which
    data file (rank) holds each. Built by parse_layout, which checks it."""

    __slots__ = ("rule", "shape", "pieces", "file", "dim", "numel", "offset", "files", "boxes", "names")

    def __init__(self, rule, shape):
        self.rule, self.shape = rule, list(shape)
        self.pieces = 1  # P, empty pieces included
        self.file = 0  # whole
        self.dim = 0  # chunk
        self.numel = self.offset = 0  # flat: T, o
        self.files = None  # chunk, flat: FileMap
        self.boxes = None  # list: [(file, offsets, sizes)]
        self.names = None  # list: each piece's tensor name in its file (None for an empty piece)

    def count(self):
        """Pieces, empty ones included."""
        return self.pieces

    def file_of(self, i):
        if self.rule == "whole":
            return self.file
        if self.rule == "list":
            return self.boxes[i][0]
        return self.files.file(i)

    def box(self, i):
        """(offsets, sizes) of piece i."""
        shape = self.shape
        if self.rule == "whole":
            return [0] * len(shape), list(shape)
        if self.rule == "list":
            return list(self.boxes[i][1]), list(self.boxes[i][2])
        if self.rule == "chunk":
            b, e = chunk_range(shape[self.dim], self.pieces, i)
            offsets, sizes = [0] * len(shape), list(shape)
            offsets[self.dim], sizes[self.dim] = b, max(0, e - b)
            return offsets, sizes
        b, e = flat_rows(self.numel, self.offset, shape, self.pieces, i)
        return [b] + [0] * (len(shape) - 1), [e - b] + list(shape[1:])

    def pieces_in_file(self, f):
        """The pieces (empty ones included) that data file ``f`` stores, ascending: the inverse
        of file_of, O(1) for the rules (a valid layout: with replicas > 1, replica_step >=
        pieces*step, so the replica groups' files do not interleave), one pass for a list."""
        if self.rule == "whole":
            return [0] if self.file == f else []
        if self.rule == "list":
            return [i for i, b in enumerate(self.boxes) if b[0] == f]
        fm = self.files
        rel, group = f - fm.first, 0
        if rel < 0 or fm.step < 1:
            return []
        if fm.replicas > 1:
            if fm.replica_step < 1:
                return [i for i in range(self.pieces) if fm.file(i) == f]
            group = rel // fm.replica_step
            if group >= fm.replicas:
                return []
            rel -= group * fm.replica_step
        if rel % fm.step:
            return []
        i = rel // fm.step
        return [i] if i < self.pieces and fm.file(i) == f else []

    def name(self, fqn, i):
        """The tensor name of (non-empty) piece i in its data file: FQN when it is the entry's
        only piece there (always, for the rules), else FQN@k."""
        if self.rule == "list":
            return self.names[i]
        return fqn

    def overlapping(self, begin=None, end=None):
        """The non-empty pieces holding some of dim-0 rows [begin, end) (None: the whole
        tensor), ascending. Chunk and flat need no loop over every piece."""
        shape = self.shape
        if any(d == 0 for d in shape):
            return []  # a zero-element tensor has no stored piece
        whole = begin is None
        rows = shape[0] if shape else 1
        if whole:
            begin, end = 0, rows
        begin, end = max(begin, 0), min(end, rows)
        if begin >= end:
            return []
        if self.rule == "whole":
            return [0]
        if self.rule == "chunk":
            n = shape[self.dim]
            c = -(-n // self.pieces)
            last = -(-n // c) - 1  # the last non-empty piece
            if self.dim != 0:
                return list(range(last + 1))  # every piece holds part of every row
            return list(range(begin // c, min(last, (end - 1) // c) + 1))
        if self.rule == "flat":
            return [i for i, _, _ in flat_pieces_overlapping(self.numel, self.offset, shape, self.pieces, begin, end)]
        out = []
        for i, (_, offsets, sizes) in enumerate(self.boxes):
            if all(sizes) and (not shape or (offsets[0] < end and offsets[0] + sizes[0] > begin)):
                out.append(i)
        return out

    def stored_count(self):
        """How many non-empty (stored) pieces."""
        if any(d == 0 for d in self.shape):
            return 0
        if self.rule == "whole":
            return 1
        if self.rule == "chunk":
            n = self.shape[self.dim]
            return -(-n // -(-n // self.pieces))
        return len(self.overlapping())
