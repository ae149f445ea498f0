"""Version-2 and -3 layouts (C++: src/tessera/sharding/layout.cpp, docs/checkpoint-format.md §3):
where the pieces of a tensor live, as a rule evaluated alone: `whole`, `chunk` (torch.chunk's
rule), `flat` (FSDP's row-aligned cut of a flat vector), `list` (explicit boxes) and, version 3,
`tp` (a tensor-parallel cut composed with an inner whole, chunk or flat cut), and which data
file holds each piece. Pure integer arithmetic; parse_layout (_format_metadata.py) builds and
checks a PieceLayout from the metadata's JSON."""
from ._sharding_chunk import chunk_range

RULES = ("whole", "chunk", "flat", "list")  # version 2
RULES_V3 = RULES + ("tp",)
INNER_RULES = ("whole", "chunk", "flat")  # a tp layout's inner rule
MAX_PIECES = 1 << 20  # a chunk or flat layout's piece count (the launcher's limit on ranks)
MAX_STRIPES = 64  # a tp layout's stripes (C++ kMaxStripes: fused weights have 2 or 3)


def tp_range(n, stripes, tp, t, s):
    """(begin, size): the range of stripe s of TP piece t along a tp layout's dimension of n
    (n / stripes per stripe, each cut by torch.chunk's rule into tp ranges)."""
    per = n // stripes
    b, e = chunk_range(per, tp, t)
    return s * per + b, e - b


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

    def interleaved(self):
        """The replica groups interleave inside each step (version 3: the data-parallel groups
        of a (dp, tp) mesh, one per tp rank: step = tp, replica_step = 1)."""
        return self.replicas > 1 and self.replica_step >= 1 and (self.replicas - 1) * self.replica_step < self.step

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
    """A version-2 or -3 tensor's `layout`: how the tensor of ``shape`` is cut into pieces and
    which data file (rank) holds each. Built by parse_layout, which checks it.

    A ``tp`` layout (C++ Layout::Rule::Tp): dimension ``dim`` is ``stripes`` equal stripes, each
    cut by torch.chunk's rule into ``tp`` ranges; TP piece t is the t-th range of every stripe,
    concatenated; the inner rule (``inner``: whole, chunk along ``inner_dim``, or flat with
    ``inner_numel`` / ``inner_offset``, one value or one per TP piece) cuts each TP piece into
    ``pieces`` inner pieces. Piece i = (p*tp + t)*stripes + s is the part of inner piece p of TP
    piece t inside stripe s (a box, possibly empty); holder q = p*tp + t stores pieces
    [q*stripes, (q+1)*stripes) in data file files.file(q)."""

    __slots__ = ("rule", "shape", "pieces", "file", "dim", "numel", "offset", "files", "boxes", "names",
                 "tp", "stripes", "inner", "inner_dim", "inner_numel", "inner_offset")

    def __init__(self, rule, shape):
        self.rule, self.shape = rule, list(shape)
        self.pieces = 1  # P, empty pieces included (tp: the inner rule's pieces)
        self.file = 0  # whole
        self.dim = 0  # chunk; tp: the tensor-parallel dimension
        self.numel = self.offset = 0  # flat: T, o
        self.files = None  # chunk, flat, tp (over holders): FileMap
        self.boxes = None  # list: [(file, offsets, sizes)]
        self.names = None  # list: each piece's tensor name in its file (None for an empty piece)
        self.tp, self.stripes = 1, 1  # tp
        self.inner, self.inner_dim = "whole", 0  # tp: the inner rule, its chunk dimension
        self.inner_numel, self.inner_offset = [0], [0]  # tp, inner flat: one value, or one per TP piece

    def count(self):
        """Pieces, empty ones included."""
        if self.rule == "tp":
            return self.pieces * self.tp * self.stripes
        return self.pieces

    def holders(self):
        """The pieces of the files map: a tp layout's holders (inner pieces * tp), else count()."""
        return self.pieces * self.tp if self.rule == "tp" else self.count()

    def pieces_per_holder(self):
        return self.stripes if self.rule == "tp" else 1

    def file_of(self, i):
        if self.rule == "whole":
            return self.file
        if self.rule == "list":
            return self.boxes[i][0]
        if self.rule == "tp":
            return self.files.file(i // self.stripes)
        return self.files.file(i)

    # -- tp
    def tp_local_shape(self, t):
        """The shape of TP piece t: the tensor's, with ``dim`` of stripes * (the t-th range's size)."""
        out = list(self.shape)
        out[self.dim] = self.stripes * tp_range(self.shape[self.dim], self.stripes, self.tp, t, 0)[1]
        return out

    def tp_inner(self, t):
        """The inner layout cutting TP piece t (a whole, chunk or flat PieceLayout of its shape)."""
        lay = PieceLayout(self.inner, self.tp_local_shape(t))
        if self.inner == "chunk":
            lay.dim, lay.pieces, lay.files = self.inner_dim, self.pieces, FileMap()
        elif self.inner == "flat":
            lay.pieces, lay.files = self.pieces, FileMap()
            lay.numel = self.inner_numel[0 if len(self.inner_numel) == 1 else t]
            lay.offset = self.inner_offset[0 if len(self.inner_offset) == 1 else t]
        return lay

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
        if self.rule == "tp":
            s, q = i % self.stripes, i // self.stripes
            t, p = q % self.tp, q // self.tp
            d = self.dim
            offsets, sizes = self.tp_inner(t).box(p)
            # The inner piece's range along `dim` (TP piece t's coordinates), clipped to stripe s
            # and moved to the global tensor (C++ Layout::box).
            g0, gn = tp_range(shape[d], self.stripes, self.tp, t, s)
            lo, hi = max(offsets[d], s * gn), min(offsets[d] + sizes[d], (s + 1) * gn)
            offsets[d] = g0 + max(0, lo - s * gn)
            sizes[d] = max(0, hi - lo)
            return offsets, sizes
        b, e = flat_rows(self.numel, self.offset, shape, self.pieces, i)
        return [b] + [0] * (len(shape) - 1), [e - b] + list(shape[1:])

    def pieces_in_file(self, f):
        """The pieces (empty ones included) that data file ``f`` stores, ascending: the inverse
        of file_of, O(1) for the rules (a valid layout: with replicas > 1 the replica groups'
        files follow each other, replica_step >= holders*step, or interleave inside each step;
        a tp layout's holder q stores pieces [q*stripes, (q+1)*stripes)), one pass for a list."""
        if self.rule == "whole":
            return [0] if self.file == f else []
        if self.rule == "list":
            return [i for i, b in enumerate(self.boxes) if b[0] == f]
        fm = self.files
        holders, per = self.holders(), self.pieces_per_holder()

        def stored(qs):
            return [q * per + s for q in qs for s in range(per)]

        rel, group = f - fm.first, 0
        if rel < 0 or fm.step < 1:
            return []
        if fm.replicas > 1:
            if fm.replica_step < 1:  # not a valid layout: the plain inverse
                return stored([q for q in range(holders) if fm.file(q) == f])
            if fm.interleaved():
                within = rel % fm.step
                if within % fm.replica_step:
                    return []
                group = within // fm.replica_step
                if group >= fm.replicas:
                    return []
                rel -= within
            else:
                group = rel // fm.replica_step
                if group >= fm.replicas:
                    return []
                rel -= group * fm.replica_step
        if rel % fm.step:
            return []
        q = rel // fm.step
        return stored([q]) if q < holders and fm.file(q) == f else []

    def name(self, fqn, i):
        """The tensor name of (non-empty) piece i in its data file: FQN when it is the entry's
        only non-empty piece there (always, for whole, chunk and flat), else FQN@k, k counting
        the entry's non-empty pieces in that file in piece order (list and tp)."""
        if self.rule == "list":
            return self.names[i]
        if self.rule != "tp":
            return fqn
        k = total = 0
        for j in self.pieces_in_file(self.file_of(i)):
            if all(self.box(j)[1]):
                k += j < i
                total += 1
        return fqn if total == 1 else f"{fqn}@{k}"

    def overlapping_box(self, region_offsets, region_sizes):
        """The non-empty pieces that share an element with the box (region_offsets,
        region_sizes) inside the shape, ascending (C++ Layout::overlapping). Chunk and flat need
        no loop over every piece; tp asks its inner rule once per TP piece and stripe."""
        shape = self.shape
        if any(d == 0 for d in shape) or any(s <= 0 for s in region_sizes):
            return []  # a zero-element tensor has no stored piece; an empty region meets none
        if self.rule == "whole":
            return [0]
        if self.rule == "chunk":
            d = self.dim
            n = shape[d]
            c = -(-n // self.pieces)
            a, b = region_offsets[d], region_offsets[d] + region_sizes[d]
            last = -(-n // c) - 1  # the last non-empty piece
            return list(range(a // c, min(last, (b - 1) // c) + 1))
        if self.rule == "flat":
            a, b = region_offsets[0], region_offsets[0] + region_sizes[0]
            return [i for i, _, _ in flat_pieces_overlapping(self.numel, self.offset, shape, self.pieces, a, b)]
        if self.rule == "tp":
            d, out = self.dim, []
            for t in range(self.tp):
                inner = self.tp_inner(t)
                for s in range(self.stripes):
                    g0, gn = tp_range(shape[d], self.stripes, self.tp, t, s)
                    a = max(g0, region_offsets[d])
                    b = min(g0 + gn, region_offsets[d] + region_sizes[d])
                    if b <= a:
                        continue
                    ro, rs = list(region_offsets), list(region_sizes)
                    ro[d], rs[d] = s * gn + (a - g0), b - a
                    out += [(p * self.tp + t) * self.stripes + s for p in inner.overlapping_box(ro, rs)]
            return sorted(out)
        out = []
        for i, (_, offsets, sizes) in enumerate(self.boxes):
            if all(sizes) and all(max(o, ro) < min(o + z, ro + rz)
                                  for o, z, ro, rz in zip(offsets, sizes, region_offsets, region_sizes)):
                out.append(i)
        return out

    def overlapping(self, begin=None, end=None):
        """The non-empty pieces holding some of dim-0 rows [begin, end) (None: the whole
        tensor), ascending: overlapping_box of those rows, every other dimension whole (a piece
        of a chunk along dim 1 or of a tp layout holds part of the rows' columns)."""
        shape = self.shape
        if not shape:
            return self.overlapping_box([], [])
        rows = shape[0]
        if begin is None:
            begin, end = 0, rows
        begin, end = max(begin, 0), min(end, rows)
        if begin >= end:
            return []
        return self.overlapping_box([begin] + [0] * (len(shape) - 1), [end - begin] + list(shape[1:]))

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

    def describe(self):
        """The rule in words, as `tessera ckpt inspect` prints it: "chunk dim 0, 4 pieces",
        "tp dim 0, 3 stripes, tp 2, inner flat over 2"."""
        if self.rule == "whole":
            return f"whole in file {self.file}"
        if self.rule == "chunk":
            return f"chunk dim {self.dim}, {self.pieces} pieces"
        if self.rule == "flat":
            return f"flat over {self.pieces}"
        if self.rule == "list":
            return f"list of {self.pieces} pieces"
        inner = {"whole": "whole", "chunk": f"chunk dim {self.inner_dim} over {self.pieces}",
                 "flat": f"flat over {self.pieces}"}[self.inner]
        return f"tp dim {self.dim}, {self.stripes} stripes, tp {self.tp}, inner {inner}"
