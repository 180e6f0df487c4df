"""In-place collectives inside one node: every rank's buffers lie in the node's arena
(:mod:`.arena`), and the ranks read one another's buffers where they lie.

The call's post (its signature and arena words) is the start: every rank's input was
written before it posted. A closing barrier keeps every rank's buffers untouched until its
peers have read them. No channel buffer is written, so these take their turn in the queue
without the opening barrier.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..blocks import block_counts, offsets
from ..ops import rank_order_reducer
from .channel import Schedule

__all__ = [
    "COPY_INPLACE_MAX",
    "inplace_allreduce",
    "inplace_reduce_scatter",
    "inplace_reduce",
    "inplace_allgather",
    "inplace_broadcast",
]

COPY_INPLACE_MAX = 8 << 20
"""The largest result (bytes per rank) allgather and broadcast copy straight from their
peers' buffers; beyond it the chunked path, whose owners stage while their peers copy,
wins (2 ranks on the reference machine: 0.8 x the chunked time at 4 MiB, 1.0-1.7 x from
16 MiB)."""

_PIECE = 1 << 16
"""Elements reduced at a time through scratch when the output is one of the inputs."""


def _reduce_to(parts: list[np.ndarray], dst: np.ndarray, red: Callable, scratch: Any) -> None:
    """``red(parts, dst)``, also when ``dst`` is the memory of ``parts[k]`` for some k >= 2
    (which the rank-order reduction would overwrite before reading): then piece by piece
    through scratch."""
    if not any(np.may_share_memory(dst, p) for p in parts[2:]):
        red(parts, dst)
        return
    m = dst.size
    tmp = scratch.get(min(m, _PIECE), dst.dtype)
    try:
        for a in range(0, m, _PIECE):
            z = min(a + _PIECE, m)
            red([p[a:z] for p in parts], tmp[: z - a])
            dst[a:z] = tmp[: z - a]
    finally:
        scratch.put(tmp)


def inplace_allreduce(ctx: Any, out: np.ndarray, wheres: list[tuple[int, int]], op: str) -> Schedule:
    """Allreduce every rank's input into every rank's ``out`` (flat), reading both where
    they lie in the arena: rank ``me`` reduces slice ``me`` of every input into its own
    ``out``, piece by piece (a channel region each); after the barrier that ends piece
    ``i``, every rank copies piece ``i`` of the other slices from their owners' ``out``,
    while it is still in their caches."""
    ch, arena = ctx.chan, ctx.arena
    n, me = ch.n, ch.me
    dt, count = out.dtype, out.size
    off = offsets(block_counts(count, n))
    srcs = [arena.peer(j, w[0], dt, count) for j, w in enumerate(wheres)]
    outs = [arena.peer(j, w[1], dt, count) for j, w in enumerate(wheres)]
    copied, isz = ch.copied, dt.itemsize
    per = ch.region // isz
    red = rank_order_reducer(op, n)
    yield from ch.own(barrier=False)
    try:
        # Piece i of slice j is written only by rank j, before barrier i, and read by the
        # others only after it. A rank's gather of piece i writes piece i of the slices it
        # does not own, which their owners (reading this rank's input, when out is the
        # input) finished reducing before barrier i.
        for i in range(math.ceil(max(block_counts(count, n)) / per)):
            a, z = off[me] + i * per, min(off[me] + (i + 1) * per, off[me + 1])
            if z > a:
                _reduce_to([s[a:z] for s in srcs], out[a:z], red, ctx.scratch)
                copied[1] += (z - a) * isz
            yield from ch.barrier()
            for j in range(n):
                a, z = off[j] + i * per, min(off[j] + (i + 1) * per, off[j + 1])
                if j != me and z > a:
                    out[a:z] = outs[j][a:z]
                    copied[2] += (z - a) * isz
        yield from ch.barrier()
    finally:
        ch.release()


def inplace_reduce_scatter(
    ctx: Any, counts: tuple[int, ...], out: np.ndarray, dtype: np.dtype, wheres: list[tuple[int, int]], op: str
) -> Schedule:
    """Reduce block ``me`` of every rank's input (read where it lies in the arena) into ``out``."""
    ch = ctx.chan
    n, me = ch.n, ch.me
    off = offsets(counts)
    a, z = off[me], off[me + 1]
    parts = [ctx.arena.peer(j, w[0], dtype, off[-1])[a:z] for j, w in enumerate(wheres)]
    yield from ch.own(barrier=False)
    try:
        if z > a:
            _reduce_to(parts, out, rank_order_reducer(op, n), ctx.scratch)
            ch.copied[1] += (z - a) * dtype.itemsize
        yield from ch.barrier()
    finally:
        ch.release()


def inplace_reduce(
    ctx: Any, out: np.ndarray | None, count: int, dtype: np.dtype, wheres: list[tuple[int, int]], op: str, root: int
) -> Schedule:
    """Reduce every rank's input (read where it lies in the arena) into ``root``'s ``out``."""
    ch = ctx.chan
    parts = [ctx.arena.peer(j, w[0], dtype, count) for j, w in enumerate(wheres)]
    yield from ch.own(barrier=False)
    try:
        if ch.me == root:
            _reduce_to(parts, out, rank_order_reducer(op, ch.n), ctx.scratch)
            ch.copied[1] += count * dtype.itemsize
        yield from ch.barrier()
    finally:
        ch.release()


def inplace_allgather(ctx: Any, buf: np.ndarray, counts: tuple[int, ...], wheres: list[tuple[int, int]]) -> Schedule:
    """Fill every block of ``buf`` but this rank's (in place already) from the same block of
    its owner's output, read where it lies in the arena."""
    ch = ctx.chan
    me = ch.me
    off = offsets(counts)
    dt = buf.dtype
    yield from ch.own()  # the opening barrier: every rank's own block is in place
    try:
        for j, w in enumerate(wheres):
            if j != me and counts[j]:
                buf[off[j] : off[j + 1]] = ctx.arena.peer(j, w[1], dt, off[-1])[off[j] : off[j + 1]]
        ch.copied[2] += (off[-1] - counts[me]) * dt.itemsize
        yield from ch.barrier()
    finally:
        ch.release()


def inplace_broadcast(ctx: Any, buf: np.ndarray, root: int, wheres: list[tuple[int, int]]) -> Schedule:
    """Copy ``root``'s input, read where it lies in the arena, into ``buf`` on every other rank."""
    ch = ctx.chan
    yield from ch.own(barrier=False)
    try:
        if ch.me != root:
            buf[...] = ctx.arena.peer(root, wheres[root][0], buf.dtype, buf.size)
            ch.copied[2] += buf.nbytes
        yield from ch.barrier()
    finally:
        ch.release()
