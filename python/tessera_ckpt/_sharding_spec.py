"""The overlap check of a set of boxes (C++: src/tessera/sharding/spec.cpp first_overlap),
shared by the metadata's chunk tiling (version 1), list layouts (version 2) and the DCP
Writer's pieces: a sweep, not a comparison of every pair."""
import bisect
import heapq

from ._sharding_chunk import overlaps


def first_overlap(boxes):
    """The first two non-empty boxes of ``boxes`` (objects with ``offsets`` and ``sizes``, of
    one rank) that overlap, as (i, j) with i < j, in the order a box-by-box check meets them
    (the smallest j that overlaps an earlier box, then the smallest such i); None when no two
    overlap. The C++ sharding::first_overlap's sweep: along the dimension whose offsets differ
    most, each box compared only with the boxes still open at its start there, kept ordered
    along a second dimension, so boxes of one or two dimensions cost O(P log P), not every
    pair (134 million at 16,384 pieces); naming the first pair takes O(log P) more sweeps."""
    nonempty = [i for i, b in enumerate(boxes) if all(s > 0 for s in b.sizes)]
    if len(nonempty) < 2:
        return None
    nd = len(boxes[nonempty[0]].sizes)
    if nd == 0:
        return nonempty[0], nonempty[1]  # two non-empty pieces of a scalar
    distinct = [len({boxes[i].offsets[d] for i in nonempty}) for d in range(nd)]
    dim = max(range(nd), key=lambda d: (distinct[d], -d))
    others = [d for d in range(nd) if d != dim]
    dim2 = max(others, key=lambda d: (distinct[d], -d)) if others else dim
    longest2 = max(boxes[i].sizes[dim2] for i in nonempty)
    order = sorted(nonempty, key=lambda i: boxes[i].offsets[dim])  # stable: ties by index

    def sweep(limit):
        # The open boxes (started at or before the current start along dim, not yet ended)
        # all contain that start, so no two of them overlap elsewhere. Kept by their offset
        # along dim2, a box is compared with those starting before its end there, the last
        # first, down to the ones that must end before its start (starting longest2 or more
        # before it). Of two dimensions they are disjoint along dim2, so only the last can
        # overlap it; of one, dim2 == dim and at most one box is open.
        closing = []  # heap of (end along dim, index)
        open_ = []  # sorted (offset along dim2, index)
        for i in order:
            if i >= limit:
                continue
            b = boxes[i]
            while closing and closing[0][0] <= b.offsets[dim]:
                k = heapq.heappop(closing)[1]
                del open_[bisect.bisect_left(open_, (boxes[k].offsets[dim2], k))]
            at = bisect.bisect_left(open_, (b.offsets[dim2] + b.sizes[dim2],))
            while at > 0:
                at -= 1
                start2, k = open_[at]
                if start2 + longest2 <= b.offsets[dim2]:
                    break
                if overlaps(boxes[k], b):
                    return min(k, i), max(k, i)
                if nd <= 2:
                    break
            bisect.insort(open_, (b.offsets[dim2], i))
            heapq.heappush(closing, (b.offsets[dim] + b.sizes[dim], i))
        return None

    found = sweep(len(boxes))
    if found is None:
        return None
    # The smallest ``bad`` such that boxes below it overlap (none below ``good`` do): sweeps
    # over growing prefixes, then bisection; a pair found lowers ``bad`` past its later box.
    good, bad = 1, found[1] + 1
    while good * 2 < bad:
        p = sweep(good * 2)
        if p:
            bad = p[1] + 1
            break
        good *= 2
    while good + 1 < bad:
        mid = good + (bad - good) // 2
        p = sweep(mid)
        if p:
            bad = p[1] + 1
        else:
            good = mid
    j = bad - 1
    for i in range(j):
        if all(s > 0 for s in boxes[i].sizes) and overlaps(boxes[i], boxes[j]):
            return i, j
    raise AssertionError(f"first_overlap: box {j} overlaps no earlier box")
