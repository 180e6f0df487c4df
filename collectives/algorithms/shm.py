"""Shared-memory allreduce over several nodes, through an MPI-3 shared window per node.

With every rank on one node, ``allreduce`` here hands over to :mod:`collectives.node.staged`.

Each rank copies its vector into its own window segment; after a barrier, rank ``i``
reduces slice ``i`` by reading that slice straight from every peer's segment (in rank
order) and leaves it in its own segment; after another barrier every rank copies all
reduced slices out. Across nodes, the reduced slices are allreduced among ranks of the
same local rank (uneven nodes: by the node leaders). Vectors larger than the window go
through in window-sized chunks. Only one shm operation uses the window at a time.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from ..blocks import block_counts, offsets
from ..node import staged
from ..ops import reduce_into
from .hierarchical import cross_allreduce

Schedule = Generator[list, None, None]

_EMPTY = np.empty(0, np.uint8)


def barrier(t, tag: int) -> Schedule:
    """Dissemination barrier by zero-byte messages (Hensgen, Finkel & Manber, 1988)."""
    n, r = t.size, t.rank
    d = 1
    while d < n:
        yield [t.irecv(_EMPTY, (r - d) % n, tag), t.isend(_EMPTY, (r + d) % n, tag)]
        d <<= 1


def allreduce(ctx, t, buf: np.ndarray, op: str, tag: int, src: np.ndarray | None = None) -> Schedule:
    """Reduce ``src`` (default: ``buf`` in place) over all ranks into ``buf`` through shared memory.

    One node: :func:`collectives.node.staged.allreduce` (which also applies ``avg``'s division).
    Several: each node's sum is made in its window and allreduced across nodes.
    """
    if ctx.topology().nodes == 1:
        yield from staged.allreduce(ctx, t, buf, op, tag, src)
        return
    if src is not None:
        np.copyto(buf, src)
    yield from _windowed(ctx, t, buf, op, tag)


def _windowed(ctx, t, buf: np.ndarray, op: str, tag: int) -> Schedule:
    lay = ctx.topology()
    node = lay.node
    token = object()
    ctx.shm_queue.append(token)
    try:
        while ctx.shm_queue[0] is not token:
            yield []  # an earlier shm operation still owns the window
        segs = ctx.shm_segments()
        sync = lay.node_sync
        cap = len(segs[0]) // buf.itemsize
        views = [s[: cap * buf.itemsize].view(buf.dtype) for s in segs]
        me = node.rank
        for c0 in range(0, buf.size, cap):
            chunk = buf[c0 : c0 + cap]
            m = chunk.size
            off = offsets(block_counts(m, node.size))
            a, b = off[me], off[me + 1]
            # peers may still be reading our segment from the previous chunk or call
            yield from barrier(node, tag)
            views[me][:m] = chunk
            sync()
            yield from barrier(node, tag)
            sync()
            mine = views[me][a:b]
            for j in range(node.size):
                if j != me:
                    reduce_into(mine, views[j][a:b], op)
            if lay.nodes > 1:
                if lay.homogeneous:
                    yield from cross_allreduce(ctx, lay.cross, mine, op, tag)
                else:
                    sync()
                    yield from barrier(node, tag)
                    sync()
                    if me == 0:
                        yield from _leaders(ctx, lay, views, off, m, op, tag)
            sync()
            yield from barrier(node, tag)
            sync()
            for j in range(node.size):
                chunk[off[j] : off[j + 1]] = views[j][off[j] : off[j + 1]]
    finally:
        ctx.shm_queue.remove(token)


def _leaders(ctx, lay, views, off, m: int, op: str, tag: int) -> Schedule:
    # uneven nodes: the leader assembles the node's sum, allreduces it with the other
    # leaders, and writes each slice back where its owner will read it
    tmp = ctx.scratch.get(m, views[0].dtype)
    try:
        for j in range(lay.node.size):
            tmp[off[j] : off[j + 1]] = views[j][off[j] : off[j + 1]]
        yield from cross_allreduce(ctx, lay.cross, tmp, op, tag)
        for j in range(lay.node.size):
            views[j][off[j] : off[j + 1]] = tmp[off[j] : off[j + 1]]
    finally:
        ctx.scratch.put(tmp)
