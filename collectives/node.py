"""Collectives inside one node through the node channel (:mod:`.channel`): the ``shm``
algorithms.

A small collective is finished in one step from the channel's slots once every rank has
posted (each rank reduces or copies what it needs, reading every rank's data in rank
order, so results are bitwise equal). Larger messages stream through the channel's two
buffers in chunks, one barrier per chunk: after barrier ``i`` every rank copies the
reduced slices of chunk ``i`` out, reduces its slice of chunk ``i + 1`` and stages chunk
``i + 2``. Each rank's buffer is cut into fixed per-rank regions, so what one rank writes
and what its peers read at the same moment never overlap (the proofs are in the comments
below).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .channel import Channel, Schedule
from .layout import block_counts, offsets
from .ops import OPS, dtype_code, finalize, ufunc

__all__ = ["MISMATCH", "SLOW", "UNEVEN", "allreduce", "reduce", "reduce_scatter", "allgather", "broadcast"]

MISMATCH = object()
"""What a one-step function returns when the peers' signatures differ (the caller then
reports call ``ch.seq``)."""

SLOW = object()
"""What a one-step function returns, before posting anything, when this call must take the
general path after all (an ``out`` that is not exactly right)."""

UNEVEN = object()
"""What the one-step allgather returns when a peer's rows differ from ours, or its ``out``
does not fit ours: the call is posted and agreed, and the caller finishes it (or reports
the bad ``out``) on the general path."""


def _reducer(op: str, n: int) -> Callable[[Sequence[np.ndarray], np.ndarray], None]:
    """``red(views, out)``: ``out = views[0] op views[1] op ...`` in rank order (so every rank
    gets the same bits), then the op's final step (the average's division)."""
    f = ufunc(op)
    if op in ("min", "max"):  # numpy wants their out= by keyword; add/multiply are quicker without
        g = f
        f = lambda a, b, out: g(a, b, out=out)  # noqa: E731
    avg = op == "avg"

    def red(v: Sequence[np.ndarray], out: np.ndarray) -> None:
        f(v[0], v[1], out)
        for w in v[2:]:
            f(out, w, out)
        if avg:
            finalize(out, op, n)

    return red


STEP_REDUCE, STEP_BROADCAST, STEP_ALLGATHER = 0, 1, 2
"""The compiled loop's kinds of one-step call (``cslots.c``'s enum, which the module also
exports under these names; a test keeps the two equal)."""


def _step(ch: Channel, kind: int, a: int, b: int, shape: tuple[int, ...], dtype: np.dtype, **kw: Any) -> Any:
    """The compiled one-step call (:meth:`.cslots.Core.step`) with the signature words ``a,
    b`` (and ``c``, ``fits``), whose result has ``shape`` and ``dtype``; None where there is
    no compiled loop, or it cannot finish this call itself (half-precision types, and min
    and max of floats, which numpy reduces)."""
    core = ch.core
    if core is None:
        return None
    op = kw.get("op")
    if kind == STEP_REDUCE and (op not in OPS or not core.has_kernel(dtype_code(dtype), OPS.index(op))):
        return None
    lo, hi = kw.get("lo", 0), kw.get("hi", math.prod(shape))
    try:
        return core.step(
            kind,
            a,
            b,
            kw.get("c", 0),
            kw.get("fits", b),
            np.empty(shape, dtype),
            dtype_code(dtype),
            OPS.index(op) if kind == STEP_REDUCE else 0,
            lo,
            hi,
            kw.get("root", -1),
            kw.get("nbytes", 0),
            np.empty,
            SLOW,
            MISMATCH,
            UNEVEN,
        )
    except (BufferError, ValueError):  # no buffer format (bfloat16): the Python function below
        return None


# Every one-step function below is built once per (signature, dtype, shape, op or root) with
# every lookup done up front. ``fn(x)`` posts ``x`` (any layout), waits for the peers, checks
# their signatures and finishes the call from the slots, reading every rank's data in rank
# order so results are bitwise equal everywhere.
def small_allreduce_fn(ch: Channel, a: int, dtype: np.dtype, shape: tuple[int, ...], op: str) -> Callable:
    """One-step allreduce: ``fn(x, out=None)`` returns the result (in ``out`` when given),
    :data:`MISMATCH`, or :data:`SLOW` without posting when ``out`` is not C-contiguous
    with x's shape and dtype."""
    count = math.prod(shape)
    step = _step(ch, STEP_REDUCE, a, count, shape, dtype, op=op)
    if step is not None:
        return step
    views = [ch.slot_views(p, dtype, shape) for p in (0, 1)]
    red = _reducer(op, ch.n)

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        if out is None:
            out = np.empty(shape, dtype)
        elif type(out) is not np.ndarray or out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            return SLOW
        seq = ch.exchange(a, count, 0, x)
        if seq < 0:
            return MISMATCH
        red(views[seq & 1], out)
        return out

    return fn


def small_reduce_scatter_fn(ch: Channel, a: int, dtype: np.dtype, count: int, op: str) -> Callable:
    """One-step reduce-scatter of ``count`` elements: ``fn(x, out=None)`` returns this rank's
    block (MPICH's block sizes; in ``out`` when given), :data:`MISMATCH`, or :data:`SLOW`
    without posting when ``out`` is not exactly right."""
    off = offsets(block_counts(count, ch.n))
    lo, hi = off[ch.me], off[ch.me + 1]
    step = _step(ch, STEP_REDUCE, a, count, (hi - lo,), dtype, op=op, lo=lo, hi=hi)
    if step is not None:
        return step
    views = [[v[lo:hi] for v in ch.slot_views(p, dtype, (count,))] for p in (0, 1)]
    red = _reducer(op, ch.n)

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        if out is None:
            out = np.empty(hi - lo, dtype)
        elif type(out) is not np.ndarray or out.shape != (hi - lo,) or out.dtype != dtype or not out.flags.c_contiguous:
            return SLOW
        seq = ch.exchange(a, count, 0, x)
        if seq < 0:
            return MISMATCH
        if hi > lo:
            red(views[seq & 1], out)
        return out

    return fn


def small_reduce_fn(ch: Channel, a: int, dtype: np.dtype, shape: tuple[int, ...], op: str, root: int) -> Callable:
    """One-step reduce: ``fn(x)`` returns the result on ``root``, None elsewhere, or
    :data:`MISMATCH`."""
    count = math.prod(shape)
    step = _step(ch, STEP_REDUCE, a, count, shape, dtype, op=op, root=root)
    if step is not None:
        return step
    views = [ch.slot_views(p, dtype, shape) for p in (0, 1)]
    red = _reducer(op, ch.n)
    is_root = ch.me == root

    def fn(x: np.ndarray) -> Any:
        seq = ch.exchange(a, count, 0, x)
        if seq < 0:
            return MISMATCH
        if not is_root:
            return None
        out = np.empty(shape, dtype)
        red(views[seq & 1], out)
        return out

    return fn


def small_broadcast_fn(ch: Channel, a: int, dtype: np.dtype, shape: tuple[int, ...], root: int) -> Callable:
    """One-step broadcast: ``fn(x, out=None)`` returns ``root``'s data (in ``out`` when given),
    :data:`MISMATCH`, or :data:`SLOW` without posting when ``out`` is not C-contiguous with
    x's shape and dtype; only the root posts data."""
    count = math.prod(shape)
    step = _step(ch, STEP_BROADCAST, a, count, shape, dtype, root=root, nbytes=count * dtype.itemsize)
    if step is not None:
        return step
    views = [ch.slot_views(p, dtype, shape)[root] for p in (0, 1)]
    is_root = ch.me == root

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        if out is None:
            out = np.empty(shape, dtype)
        elif type(out) is not np.ndarray or out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            return SLOW
        seq = ch.exchange(a, count, 0, x if is_root else None)
        if seq < 0:
            return MISMATCH
        if not is_root:
            out[...] = views[seq & 1]
        elif out is not x:
            out[...] = x
        return out

    return fn


def small_allgather_fn(ch: Channel, a: int, c: int, dtype: np.dtype, shape: tuple[int, ...], unit: int) -> Callable:
    """One-step allgather of ``shape`` (rows first) from every rank: ``fn(x, out=None)``
    returns the concatenation (in ``out`` when given), :data:`MISMATCH`, :data:`UNEVEN` when
    a peer's rows differ from ours or its ``out`` does not fit (the general path then says
    which), or :data:`SLOW` without posting anything when ``out`` is not exactly right.
    The count word is ``rows + (out rows + 1) * unit``."""
    rows = shape[0]
    full = (ch.n * rows, *shape[1:])
    plain = rows
    fits = rows + (full[0] + 1) * unit
    step = _step(ch, STEP_ALLGATHER, a, plain, full, dtype, c=c, fits=fits, nbytes=math.prod(shape) * dtype.itemsize)
    if step is not None:
        return step
    views = [ch.slot_views(p, dtype, shape) for p in (0, 1)]
    heads = ch.peer_heads
    n = ch.n
    last: list[Any] = [None, None]

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        b = plain
        if out is not None:
            if type(out) is not np.ndarray or out.shape != full or out.dtype != dtype or not out.flags.c_contiguous:
                return SLOW
            b = fits
        seq = ch.exchange(a, b, c, x, True)
        if seq < 0:
            return MISMATCH
        p = seq & 1
        for h in heads[p]:
            w = h[1]
            if w != plain and w != fits:
                return UNEVEN
        if out is None:
            return np.concatenate(views[p])
        if out is not last[0]:  # the same out again (a training loop's buffer): blocks known
            last[:] = [out, [out[j * rows : (j + 1) * rows] for j in range(n)]]
        for o, v in zip(last[1], views[p], strict=True):
            o[...] = v
        return out

    return fn


# -- one-step collectives from the slots (after a successful post/wait/check) ---------------
def small_allreduce(ch: Channel, seq: int, out: np.ndarray, op: str) -> None:
    """Finish a posted small allreduce into ``out`` (shaped as the input)."""
    _reducer(op, ch.n)(ch.slot_views(seq & 1, out.dtype, out.shape), out)


def small_reduce_scatter(ch: Channel, seq: int, counts: tuple[int, ...], out: np.ndarray, op: str) -> None:
    """Finish a posted small reduce-scatter: this rank's block into ``out``."""
    off = offsets(counts)
    a, z = off[ch.me], off[ch.me + 1]
    if z > a:
        _reducer(op, ch.n)([v[a:z] for v in ch.slot_views(seq & 1, out.dtype, (off[-1],))], out)


def small_allgather(ch: Channel, seq: int, counts: tuple[int, ...], out: np.ndarray) -> None:
    """Finish a posted small allgather: every rank's data into ``out`` (flat), in rank order."""
    off = offsets(counts)
    for j in range(ch.n):
        if j != ch.me and counts[j]:
            out[off[j] : off[j + 1]] = ch.slot_views(seq & 1, out.dtype, (counts[j],))[j]


def small_broadcast(ch: Channel, seq: int, root: int, out: np.ndarray) -> None:
    """Finish a posted small broadcast: the root's data into ``out`` (flat)."""
    if ch.me != root:
        out[...] = ch.slot_views(seq & 1, out.dtype, (out.size,))[root]


# -- chunked collectives through the buffers ------------------------------------------------
def allreduce(ctx: Any, t: Any, buf: np.ndarray, op: str, tag: int, src: np.ndarray | None = None) -> Schedule:
    """Allreduce ``src`` (default ``buf``, in place) into ``buf``, chunk by chunk."""
    yield from _allreduce(ctx.channel(), buf, buf if src is None else src, op, root=None)


def reduce(ctx: Any, t: Any, buf: np.ndarray, root: int, op: str, tag: int) -> Schedule:
    """Reduce ``buf`` onto ``root`` in place (other ranks' ``buf`` is left as it was)."""
    yield from _allreduce(ctx.channel(), buf, buf, op, root=root)


def _allreduce(ch: Channel, out: np.ndarray, src: np.ndarray, op: str, root: int | None) -> Schedule:
    n, me = ch.n, ch.me
    yield from ch.own()
    try:
        dt = out.dtype
        per = ch.region // dt.itemsize  # elements of one rank's region
        step = per * n
        total = out.size
        chunks = [(c, min(c + step, total)) for c in range(0, total, step)]
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]
        red = _reducer(op, n)
        gather = root is None or root == me
        copied, isz = ch.copied, dt.itemsize

        def stage(i: int) -> None:
            # copy chunk i of our data, all but our own slice, into our buffer's regions
            c0, c1 = chunks[i]
            off = offsets(block_counts(c1 - c0, n))
            mine = views[i & 1][me]
            for j in range(n):
                if j != me and off[j + 1] > off[j]:
                    mine[j * per : j * per + off[j + 1] - off[j]] = src[c0 + off[j] : c0 + off[j + 1]]
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
                    out[c0 + off[j] : c0 + off[j + 1]] = v[j * per : j * per + m]
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
        red = _reducer(op, n)

        def stage(i: int) -> None:
            mine = views[i & 1][me]
            for j in range(n):
                a, z = off[j] + i * per, min(off[j] + (i + 1) * per, off[j + 1])
                if j != me and z > a:
                    mine[j * per : j * per + z - a] = buf[a:z]

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
                    views[i & 1][me][: z - a] = buf[a:z]
                    return
                piece = src[a - off[me] : z - off[me]]
                views[i & 1][me][: z - a] = piece
                buf[a:z] = piece

        def gather_in(i: int) -> None:
            for j, v in enumerate(views[i & 1]):
                a, z = off[j] + i * per, min(off[j] + (i + 1) * per, off[j + 1])
                if j != me and z > a:
                    buf[a:z] = v[: z - a]

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
                views[i & 1][root][: z - a] = buf[a:z]
            yield from ch.barrier()
            if me != root:
                buf[a:z] = views[i & 1][root][: z - a]
    finally:
        ch.release()


# -- in-place collectives: every rank's buffers lie in the node's arena ----------------------
# The call's post (its signature and arena words) is the start: every rank's input was
# written before it posted. The ranks read one another's buffers where they lie; a closing
# barrier keeps every rank's buffers untouched until its peers have read them. No channel
# buffer is written, so these take their turn in the queue without the opening barrier.
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
    red = _reducer(op, n)
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
            _reduce_to(parts, out, _reducer(op, n), ctx.scratch)
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
            _reduce_to(parts, out, _reducer(op, ch.n), ctx.scratch)
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
