"""Recursive-doubling allreduce and allgather (Thakur, Rabenseifner & Gropp, 2005).

Non-power-of-two sizes fold first (see :class:`~collectives.blocks.Fold`): the extra even
ranks hand their data to a partner and receive the result at the end. In the allreduce
both partners of an exchange compute ``a op b`` from the same two operands, and IEEE
addition and multiplication commute exactly, so every rank ends bitwise equal.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from ..blocks import Fold, offsets
from ..ops import reduce_into

Schedule = Generator[list, None, None]


def allreduce(ctx, t, buf: np.ndarray, op: str, tag: int) -> Schedule:
    """Reduce ``buf`` in place over all ranks by pairwise exchanges of the whole vector."""
    n, r = t.size, t.rank
    if n == 1:
        return
    f = Fold(r, n)
    tmp = ctx.scratch.get(buf.size, buf.dtype)
    try:
        if r < 2 * f.rem:
            if r % 2 == 0:
                yield [t.isend(buf, r + 1, tag)]
                yield [t.irecv(buf, r + 1, tag)]
                return
            yield [t.irecv(tmp, r - 1, tag)]
            reduce_into(buf, tmp, op)
        mask = 1
        while mask < f.p:
            peer = f.actual(f.new ^ mask)
            yield [t.irecv(tmp, peer, tag), t.isend(buf, peer, tag)]
            reduce_into(buf, tmp, op)
            mask <<= 1
        if r < 2 * f.rem:
            yield [t.isend(buf, r - 1, tag)]
    finally:
        ctx.scratch.put(tmp)


def allgather(ctx, t, buf: np.ndarray, counts: tuple[int, ...], tag: int) -> Schedule:
    """Fill every rank's block of ``buf`` (block ``t.rank`` already in place).

    Each new rank holds a contiguous run of blocks that doubles every step, so every
    exchange sends and receives one contiguous slice straight into ``buf``.
    """
    n, r = t.size, t.rank
    if n == 1:
        return
    f = Fold(r, n)
    off = offsets(counts)
    if r < 2 * f.rem:
        if r % 2 == 0:
            yield [t.isend(buf[off[r] : off[r + 1]], r + 1, tag)]
            yield [t.irecv(buf, r + 1, tag)]
            return
        yield [t.irecv(buf[off[r - 1] : off[r]], r - 1, tag)]
    yield from doubling_exchange(t, f, buf, off, tag)
    if r < 2 * f.rem:
        yield [t.isend(buf, r - 1, tag)]


def doubling_exchange(t, f: Fold, buf: np.ndarray, off: tuple[int, ...], tag: int) -> Schedule:
    """Among the folded ranks, gather every new rank's region of ``buf`` in log2(p) steps.

    New rank ``k``'s region is ``buf[off[f.first(k)] : off[f.first(k + 1)]]``; it must already
    hold its own region.
    """
    k = f.new
    mask = 1
    while mask < f.p:
        peer_new = k ^ mask
        mine = k & ~(mask - 1)
        theirs = peer_new & ~(mask - 1)
        a, b = off[f.first(mine)], off[f.first(mine + mask)]
        c, d = off[f.first(theirs)], off[f.first(theirs + mask)]
        peer = f.actual(peer_new)
        yield [t.irecv(buf[c:d], peer, tag), t.isend(buf[a:b], peer, tag)]
        mask <<= 1
