"""Chunk arithmetic (C++: src/tessera/sharding/chunk.cpp): torch.chunk's split of a
dimension, boxes (offsets + sizes) in a global tensor and how messages print them. Pure
integer arithmetic: no file is read here."""


def chunk_range(n, pieces, i):
    """torch.chunk's rule: [begin, end) of piece i of a dimension of n split into ``pieces``
    (c = ceil(n / pieces) each; trailing pieces may be empty, their begin clamped to n)."""
    c = -(-n // pieces)
    return min(i * c, n), min((i + 1) * c, n)


def box_text(offsets, sizes):
    """How messages print a box: "[0:3, 0:4]" (C++ Box::to_string)."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def shape_string(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


class Box:
    """A box in a tensor of some global shape: one offset and one size per dimension."""

    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets, sizes):
        self.offsets, self.sizes = offsets, sizes

    def box(self):
        return box_text(self.offsets, self.sizes)

    def numel(self):
        n = 1
        for s in self.sizes:
            n *= s
        return n


def overlaps(a, b):
    """Whether boxes ``a`` and ``b`` (of one rank) share an element (C++ intersect)."""
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        if max(ao, bo) >= min(ao + asz, bo + bsz):
            return False
    return True
