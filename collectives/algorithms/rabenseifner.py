"""Rabenseifner's allreduce: recursive-halving reduce-scatter, recursive-doubling allgather.

Also the standalone recursive-halving reduce-scatter. Both fold non-power-of-two sizes
(:class:`~collectives.blocks.Fold`); blocks stay in the MPICH layout, and each folded rank
owns the contiguous blocks of the actual ranks it stands for. Every element is reduced on
one rank only, so results are bitwise equal everywhere.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from ..blocks import Fold, block_counts, offsets
from ..ops import reduce_into
from .recursive_doubling import doubling_exchange

Schedule = Generator[list, None, None]


def _fold_in(ctx, t, f: Fold, buf: np.ndarray, op: str, tag: int) -> Schedule:
    # extra even ranks hand over their whole vector; their odd partner reduces it
    r = t.rank
    if r % 2 == 0:
        yield [t.isend(buf, r + 1, tag)]
        return
    tmp = ctx.scratch.get(buf.size, buf.dtype)
    try:
        yield [t.irecv(tmp, r - 1, tag)]
        reduce_into(buf, tmp, op)
    finally:
        ctx.scratch.put(tmp)


def _halving(ctx, t, f: Fold, buf: np.ndarray, off: tuple[int, ...], op: str, tag: int) -> Schedule:
    """Leave new rank ``f.new``'s region of ``buf`` reduced over all folded ranks."""
    k = f.new
    lo, hi = 0, f.p
    tmp = ctx.scratch.get(off[-1], buf.dtype)
    try:
        mask = f.p // 2
        while mask > 0:
            mid = lo + mask
            if k < mid:
                keep, give = (lo, mid), (mid, hi)
            else:
                keep, give = (mid, hi), (lo, mid)
            a, b = off[f.first(keep[0])], off[f.first(keep[1])]
            c, d = off[f.first(give[0])], off[f.first(give[1])]
            peer = f.actual(k ^ mask)
            yield [t.irecv(tmp[: b - a], peer, tag), t.isend(buf[c:d], peer, tag)]
            reduce_into(buf[a:b], tmp[: b - a], op)
            lo, hi = keep
            mask >>= 1
    finally:
        ctx.scratch.put(tmp)


def reduce_scatter(ctx, t, buf: np.ndarray, counts: tuple[int, ...], op: str, tag: int) -> Schedule:
    """Leave block ``t.rank`` of ``buf`` (blocks given by ``counts``) fully reduced."""
    n, r = t.size, t.rank
    if n == 1:
        return
    f = Fold(r, n)
    off = offsets(counts)
    if r < 2 * f.rem:
        yield from _fold_in(ctx, t, f, buf, op, tag)
        if r % 2 == 0:
            yield [t.irecv(buf[off[r] : off[r + 1]], r + 1, tag)]
            return
    yield from _halving(ctx, t, f, buf, off, op, tag)
    if r < 2 * f.rem:
        yield [t.isend(buf[off[r - 1] : off[r]], r - 1, tag)]


def allreduce(ctx, t, buf: np.ndarray, op: str, tag: int) -> Schedule:
    """Reduce ``buf`` in place over all ranks (Rabenseifner)."""
    n, r = t.size, t.rank
    if n == 1:
        return
    f = Fold(r, n)
    off = offsets(block_counts(buf.size, n))
    if r < 2 * f.rem:
        yield from _fold_in(ctx, t, f, buf, op, tag)
        if r % 2 == 0:
            yield [t.irecv(buf, r + 1, tag)]
            return
    yield from _halving(ctx, t, f, buf, off, op, tag)
    yield from doubling_exchange(t, f, buf, off, tag)
    if r < 2 * f.rem:
        yield [t.isend(buf, r - 1, tag)]
