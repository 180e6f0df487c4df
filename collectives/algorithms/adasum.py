"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training
with Adaptive Summation", MLSys 2021), by recursive vector halving and distance doubling.

Two vectors combine as ``adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``: their
sum where they are orthogonal, their mean where they are parallel. The ranks combine in a
binary tree, pairs of neighbours first (``r`` with ``r ^ 1``), then pairs of pairs (``r ^ 2``),
...; so the number of ranks must be a power of two, as Horovod requires.

At distance ``d`` each rank holds one segment of its subtree's vector. It swaps half of
that segment with ``r ^ d`` and keeps the other half, so that it holds its half of both
subtrees' vectors (the *left* one from the ranks with bit ``d`` clear). The dot product
and both squared norms are sums over the ``2d`` ranks of the two subtrees: each adds its
partial sums by recursive doubling with partners ``r ^ 1, r ^ 2, ..., r ^ d``, and every
rank of the group ends with bitwise the same three numbers (floating-point addition
commutes). Each rank then combines its half. Finally the halves travel back by distance
halving, so every rank holds the whole result, each element computed by one rank.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

__all__ = ["allreduce", "combine", "NORM_FLOOR"]

Schedule = Generator[list, None, None]

NORM_FLOOR = 1e-8
"""A squared norm below this leaves its vector's coefficient at 1 (Horovod's guard)."""


def combine(left: np.ndarray, right: np.ndarray, dot: float, left_sq: float, right_sq: float, out: np.ndarray) -> None:
    """``out = adasum(left, right)`` given the full vectors' dot product and squared norms
    (``left`` and ``right`` may be pieces of longer vectors)."""
    lc = 1.0 - dot / (2.0 * left_sq) if left_sq >= NORM_FLOOR else 1.0
    rc = 1.0 - dot / (2.0 * right_sq) if right_sq >= NORM_FLOOR else 1.0
    np.add(left * lc, right * rc, out=out)


def allreduce(ctx, t, buf: np.ndarray, tag: int, sum_tag: int) -> Schedule:
    """Replace ``buf`` (a float array) on every rank by the Adasum of every rank's ``buf``
    (``tag`` for the vector pieces, ``sum_tag`` for the partial sums). The caller has
    checked that the number of ranks is a power of two."""
    n, r = t.size, t.rank
    if n == 1:
        return
    acc = buf.astype(np.float64)  # the combine runs in float64 whatever the dtype
    lo, hi = 0, acc.size
    segments = []
    peer_piece = np.empty(acc.size, np.float64)
    partial = np.empty(3, np.float64)
    other = np.empty(3, np.float64)
    d = 1
    while d < n:
        peer = r ^ d
        mid = lo + (hi - lo) // 2
        low_side = (r & d) == 0
        keep = (lo, mid) if low_side else (mid, hi)
        give = (mid, hi) if low_side else (lo, mid)
        recv = peer_piece[: keep[1] - keep[0]]
        yield [t.irecv(recv, peer, tag), t.isend(np.ascontiguousarray(acc[give[0] : give[1]]), peer, tag)]
        mine = acc[keep[0] : keep[1]]
        left, right = (mine, recv) if low_side else (recv, mine)
        partial[0] = float(np.dot(left, right))
        partial[1] = float(np.dot(left, left))
        partial[2] = float(np.dot(right, right))
        e = 1
        while e <= d:  # sum over the 2d ranks of the two subtrees
            yield [t.irecv(other, r ^ e, sum_tag), t.isend(partial.copy(), r ^ e, sum_tag)]
            partial += other
            e <<= 1
        combine(left, right, partial[0], partial[1], partial[2], mine)
        segments.append((lo, hi, keep))
        lo, hi = keep
        d <<= 1
    # distance halving: each step doubles the segment this rank holds of the result
    while segments:
        d >>= 1
        seg_lo, seg_hi, keep = segments.pop()
        peer = r ^ d
        theirs = (seg_lo, keep[0]) if keep[0] > seg_lo else (keep[1], seg_hi)
        got = peer_piece[: theirs[1] - theirs[0]]
        yield [t.irecv(got, peer, tag), t.isend(np.ascontiguousarray(acc[keep[0] : keep[1]]), peer, tag)]
        acc[theirs[0] : theirs[1]] = got
    np.copyto(buf, acc, casting="unsafe")
