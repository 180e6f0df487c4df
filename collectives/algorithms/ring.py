"""Ring reduce-scatter, allgather and allreduce (Patarasuk & Yuan, 2009).

The reduce-scatter is pipelined: each block is cut into segments, and a segment is
forwarded to the right neighbour as soon as it has been reduced, while the next one is
still arriving. Every block is reduced on exactly one rank, so all ranks end bitwise equal.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from ..blocks import block_counts, offsets
from ..ops import reduce_into

Schedule = Generator[list, None, None]


def _segments(lo: int, hi: int, seg: int) -> list[tuple[int, int]]:
    return [(s, min(s + seg, hi)) for s in range(lo, hi, seg)] if hi > lo else []


def reduce_scatter(ctx, t, buf: np.ndarray, counts: tuple[int, ...], op: str, tag: int) -> Schedule:
    """Leave block ``t.rank`` of ``buf`` (blocks given by ``counts``) fully reduced."""
    n, r = t.size, t.rank
    if n == 1:
        return
    off = offsets(counts)
    right, left = (r + 1) % n, (r - 1) % n
    seg = max(1, ctx.config.segment_bytes // buf.itemsize)
    scratch = ctx.scratch.get(max(counts), buf.dtype)
    try:
        # step s: send block (r - s - 1), receive block (r - s - 2) and reduce it; a reduced
        # segment goes on to the right at once, so steps overlap segment by segment
        b = (r - 1) % n
        sends = [t.isend(buf[a:z], right, tag) for a, z in _segments(off[b], off[b + 1], seg)]
        for s in range(n - 1):
            rb = (r - s - 2) % n
            lo, hi = off[rb], off[rb + 1]
            parts = _segments(lo, hi, seg)
            recvs = [t.irecv(scratch[a - lo : z - lo], left, tag) for a, z in parts]
            last = s == n - 2
            for (a, z), req in zip(parts, recvs, strict=True):
                yield [req]
                reduce_into(buf[a:z], scratch[a - lo : z - lo], op)
                if not last:
                    sends.append(t.isend(buf[a:z], right, tag))
        # blocks once sent are never written again, so sends may finish last
        if sends:
            yield sends
    finally:
        ctx.scratch.put(scratch)


def allgather(ctx, t, buf: np.ndarray, counts: tuple[int, ...], tag: int) -> Schedule:
    """Fill every block of ``buf`` from its owner; block ``t.rank`` is already in place."""
    n, r = t.size, t.rank
    if n == 1:
        return
    off = offsets(counts)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        sb, rb = (r - s) % n, (r - s - 1) % n
        yield [t.irecv(buf[off[rb] : off[rb + 1]], left, tag), t.isend(buf[off[sb] : off[sb + 1]], right, tag)]


def allreduce(ctx, t, buf: np.ndarray, op: str, tag: int) -> Schedule:
    """Reduce ``buf`` in place over all ranks: ring reduce-scatter, then ring allgather."""
    counts = block_counts(buf.size, t.size)
    yield from reduce_scatter(ctx, t, buf, counts, op, tag)
    yield from allgather(ctx, t, buf, counts, tag)
