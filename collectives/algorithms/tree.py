"""Binomial-tree reduce and broadcast, and allreduce as reduce to rank 0 plus broadcast.

Both trees use ranks relative to the root, ``v = (rank - root) % n``: in the reduce, rank
``v`` receives from ``v + 2**k`` for each ``k`` below its lowest set bit, then sends to
``v - lowbit(v)``; the broadcast runs the same edges the other way.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from ..ops import reduce_into

Schedule = Generator[list, None, None]


def reduce(ctx, t, buf: np.ndarray, root: int, op: str, tag: int) -> Schedule:
    """Reduce ``buf`` onto ``root`` in place (other ranks' ``buf`` becomes scratch)."""
    n = t.size
    if n == 1:
        return
    v = (t.rank - root) % n
    tmp = ctx.scratch.get(buf.size, buf.dtype)
    try:
        mask = 1
        while mask < n:
            if v & mask:
                yield [t.isend(buf, (v - mask + root) % n, tag)]
                break
            child = v | mask
            if child < n:
                yield [t.irecv(tmp, (child + root) % n, tag)]
                reduce_into(buf, tmp, op)
            mask <<= 1
    finally:
        ctx.scratch.put(tmp)


def broadcast(ctx, t, buf: np.ndarray, root: int, tag: int) -> Schedule:
    """Copy ``root``'s ``buf`` into every rank's ``buf``."""
    n = t.size
    if n == 1:
        return
    v = (t.rank - root) % n
    mask = 1
    while mask < n:
        if v & mask:
            yield [t.irecv(buf, (v - mask + root) % n, tag)]
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:
        if v + mask < n:
            sends.append(t.isend(buf, (v + mask + root) % n, tag))
        mask >>= 1
    if sends:
        yield sends


def allreduce(ctx, t, buf: np.ndarray, op: str, tag: int) -> Schedule:
    """Reduce onto rank 0 along a binomial tree, then broadcast the result back."""
    yield from reduce(ctx, t, buf, 0, op, tag)
    yield from broadcast(ctx, t, buf, 0, tag)
