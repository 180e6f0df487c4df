"""Larger collectives inside one node, streamed through the node channel's two buffers
(:mod:`.channel`): the ``shm`` algorithm's general path.

Messages stream through the channel's buffers in chunks, one barrier per chunk: after
barrier ``i`` every rank copies the reduced slices of chunk ``i`` out, reduces its slice of
chunk ``i + 1`` and stages chunk ``i + 2``. Each rank's buffer is cut into fixed per-rank
regions, so what one rank writes and what its peers read at the same moment never overlap
(the proofs are in the comments below).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..blocks import block_counts, offsets
from ..ops import rank_order_reducer
from .channel import Channel, Schedule

__all__ = ["allreduce", "reduce", "reduce_scatter", "allgather", "broadcast"]


def allreduce(ctx: Any, t: Any, buf: np.ndarray, op: str, tag: int, src: np.ndarray | None = None) -> Schedule:
    """Allreduce ``src`` (default ``buf``, in place) into ``buf``, chunk by chunk."""
    yield from _allreduce(ctx.channel(), buf, buf if src is None else src, op, root=None)


def reduce(ctx: Any, t: Any, buf: np.ndarray, root: int, op: str, tag: int, src: np.ndarray | None = None) -> Schedule:
    """Reduce ``src`` (default ``buf``, in place) onto ``root``'s ``buf``; other ranks only
    read: their ``buf`` is left as it was (with ``src`` given, it may be empty)."""
    yield from _allreduce(ctx.channel(), buf, buf if src is None else src, op, root=root)


def _allreduce(ch: Channel, out: np.ndarray, src: np.ndarray, op: str, root: int | None) -> Schedule:
    n, me = ch.n, ch.me
    yield from ch.own()
    try:
        dt = src.dtype
        per = ch.region // dt.itemsize  # elements of one rank's region
        step = per * n
        total = src.size
        chunks = [(c, min(c + step, total)) for c in range(0, total, step)]
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]
        red = rank_order_reducer(op, n)
        gather = root is None or root == me
        copied, isz = ch.copied, dt.itemsize

        def stage(i: int) -> None:
            # copy chunk i of our data, all but our own slice, into our buffer's regions
            c0, c1 = chunks[i]
            off = offsets(block_counts(c1 - c0, n))
            mine = views[i & 1][me]
            for j in range(n):
                if j != me and off[j + 1] > off[j]:
                    ch.put(mine[j * per : j * per + off[j + 1] - off[j]], src[c0 + off[j] : c0 + off[j + 1]])
            copied[0] += (c1 - c0 - off[me + 1] + off[me]) * isz

        def reduce_own(i: int) -> None:
            # our slice of chunk i, reduced over every rank in rank order, into our region
            c0, c1 = chunks[i]
            off = offsets(block_counts(c1 - c0, n))
            m = off[me + 1] - off[me]
            if not m:
                return
            lo = me * per
            parts = [
                src[c0 + off[me] : c0 + off[me] + m] if j == me else v[lo : lo + m] for j, v in enumerate(views[i & 1])
            ]
            red(parts, views[i & 1][me][lo : lo + m])
            copied[1] += m * isz

        def gather_out(i: int) -> None:
            c0, c1 = chunks[i]
            off = offsets(block_counts(c1 - c0, n))
            for j, v in enumerate(views[i & 1]):
                m = off[j + 1] - off[j]
                if m:
                    ch.take(out[c0 + off[j] : c0 + off[j + 1]], v[j * per : j * per + m], out.nbytes)
            copied[2] += (c1 - c0) * isz

        # Barrier i publishes "slice i reduced" and "chunk i + 1 staged". Between barriers
        # a rank writes only its own buffer: region `me` of buffer i % 2 (the reduction)
        # and the other regions of buffer (i + 1) % 2 (staging). The peers read, in the same
        # window, region `me` of buffer (i - 1) % 2 (gather) and region `j` of buffer i % 2
        # (reduce). Buffer (i + 1) % 2 == (i - 1) % 2, but its region `me` is not staged and
        # the other regions were last read when reducing chunk i - 1, before barrier i - 1.
        stage(0)
        yield from ch.barrier()
        for i in range(len(chunks)):
            reduce_own(i)
            if i + 1 < len(chunks):
                stage(i + 1)
            yield from ch.barrier()
            if gather:
                gather_out(i)
    finally:
        ch.release()


def reduce_scatter(
    ctx: Any, t: Any, buf: np.ndarray, counts: tuple[int, ...], op: str, tag: int, out: np.ndarray | None = None
) -> Schedule:
    """Reduce ``buf`` (blocks ``counts``) so block ``me`` is reduced: into ``out`` if given, else in place."""
    ch = ctx.channel()
    n, me = ch.n, ch.me
    off = offsets(counts)
    res = buf[off[me] : off[me + 1]] if out is None else out
    yield from ch.own()
    try:
        dt = buf.dtype
        per = ch.region // dt.itemsize
        pieces = math.ceil(max(counts) / per) if max(counts) else 0
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]
        red = rank_order_reducer(op, n)

        def stage(i: int) -> None:
            mine = views[i & 1][me]
            for j in range(n):
                a, z = off[j] + i * per, min(off[j] + (i + 1) * per, off[j + 1])
                if j != me and z > a:
                    ch.put(mine[j * per : j * per + z - a], buf[a:z])

        def reduce_own(i: int) -> None:
            a, z = off[me] + i * per, min(off[me] + (i + 1) * per, off[me + 1])
            if z <= a:
                return
            m, lo = z - a, me * per
            parts = [buf[a:z] if j == me else v[lo : lo + m] for j, v in enumerate(views[i & 1])]
            red(parts, res[i * per : i * per + m])

        # barrier i publishes piece i staged; reducing piece i reads region `me` of every
        # peer's buffer i % 2, which its owner rewrites only after barrier i + 1
        if pieces:
            stage(0)
        for i in range(pieces):
            yield from ch.barrier()
            if i + 1 < pieces:
                stage(i + 1)
            reduce_own(i)
    finally:
        ch.release()


def allgather(
    ctx: Any, t: Any, buf: np.ndarray, counts: tuple[int, ...], tag: int, src: np.ndarray | None = None
) -> Schedule:
    """Fill every block of ``buf`` from its owner; block ``me`` is already in place, or is
    ``src`` (flat), copied in piece by piece as each piece is staged (one read of ``src``)."""
    ch = ctx.channel()
    me = ch.me
    off = offsets(counts)
    yield from ch.own()
    try:
        dt = buf.dtype
        per = ch.chunk // dt.itemsize
        pieces = math.ceil(max(counts) / per) if max(counts) else 0
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]

        def stage(i: int) -> None:
            a, z = off[me] + i * per, min(off[me] + (i + 1) * per, off[me + 1])
            if z > a:
                if src is None:
                    ch.put(views[i & 1][me][: z - a], buf[a:z])
                    return
                piece = src[a - off[me] : z - off[me]]
                ch.put(views[i & 1][me][: z - a], piece)
                buf[a:z] = piece

        def gather_in(i: int) -> None:
            for j, v in enumerate(views[i & 1]):
                a, z = off[j] + i * per, min(off[j] + (i + 1) * per, off[j + 1])
                if j != me and z > a:
                    ch.take(buf[a:z], v[: z - a], buf.nbytes)

        # barrier i publishes piece i; buffer i % 2 is restaged (piece i + 2) only after
        # barrier i + 1, which every peer passes after reading piece i
        for i in range(pieces):
            stage(i)
            yield from ch.barrier()
            gather_in(i)
    finally:
        ch.release()


def broadcast(ctx: Any, t: Any, buf: np.ndarray, root: int, tag: int) -> Schedule:
    """Copy ``root``'s ``buf`` into every rank's ``buf``."""
    ch = ctx.channel()
    me = ch.me
    yield from ch.own()
    try:
        dt = buf.dtype
        per = ch.chunk // dt.itemsize
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]
        for i, a in enumerate(range(0, buf.size, per)):
            z = min(a + per, buf.size)
            if me == root:
                ch.put(views[i & 1][root][: z - a], buf[a:z])
            yield from ch.barrier()
            if me != root:
                ch.take(buf[a:z], views[i & 1][root][: z - a], buf.nbytes)
    finally:
        ch.release()
