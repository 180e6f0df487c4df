"""One-step calls through the node channel's slots: the common small case.

A small collective is finished in one step from the channel's slots once every rank has
posted: each rank reduces or copies what it needs, reading every rank's data in rank order,
so results are bitwise equal everywhere. The compiled loop (``cslots.c``) runs a whole call
where it can (:func:`step`); the functions here are its Python twins and the finishers of
a call posted on the general path (after its arguments were agreed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..blocks import block_counts, offsets
from ..ops import OPS, dtype_code, rank_order_reducer
from .channel import Channel

__all__ = [
    "STEP_REDUCE",
    "STEP_BROADCAST",
    "STEP_ALLGATHER",
    "MISMATCH",
    "SLOW",
    "UNEVEN",
    "small_allreduce",
    "small_reduce",
    "small_reduce_scatter",
    "small_allgather",
    "small_broadcast",
]

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
            kw.get("second", 0),
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
    split = ch.split_at(count * dtype.itemsize)
    step = _step(ch, STEP_REDUCE, a, count, shape, dtype, op=op, nbytes=count * dtype.itemsize, second=split)
    if step is not None:
        return step
    views = [ch.slot_views(p, dtype, shape) for p in (0, 1)]
    red = rank_order_reducer(op, ch.n)

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        if out is None:
            out = np.empty(shape, dtype)
        elif type(out) is not np.ndarray or out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            return SLOW
        seq = ch.exchange(a, count, 0, x)
        if seq < 0:
            return MISMATCH
        if split:
            _two_step_reduce(ch, seq, count, dtype, out.reshape(-1), op, split)
        else:
            red(views[seq & 1], out)
        return out

    return fn


def small_reduce_scatter_fn(ch: Channel, a: int, dtype: np.dtype, count: int, op: str) -> Callable:
    """One-step reduce-scatter of ``count`` elements: ``fn(x, out=None)`` returns this rank's
    block (MPICH's block sizes; in ``out`` when given), :data:`MISMATCH`, or :data:`SLOW`
    without posting when ``out`` is not exactly right."""
    off = offsets(block_counts(count, ch.n))
    lo, hi = off[ch.me], off[ch.me + 1]
    step = _step(ch, STEP_REDUCE, a, count, (hi - lo,), dtype, op=op, lo=lo, hi=hi, nbytes=count * dtype.itemsize)
    if step is not None:
        return step
    views = [[v[lo:hi] for v in ch.slot_views(p, dtype, (count,))] for p in (0, 1)]
    red = rank_order_reducer(op, ch.n)

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
    :data:`MISMATCH`; in two steps as :meth:`.Channel.split_at` says (every rank reduces
    its block, the root copies them)."""
    count = math.prod(shape)
    split = ch.split_at(count * dtype.itemsize)
    step = _step(ch, STEP_REDUCE, a, count, shape, dtype, op=op, root=root, nbytes=count * dtype.itemsize, second=split)
    if step is not None:
        return step
    views = [ch.slot_views(p, dtype, shape) for p in (0, 1)]
    red = rank_order_reducer(op, ch.n)
    is_root = ch.me == root

    def fn(x: np.ndarray) -> Any:
        seq = ch.exchange(a, count, 0, x)
        if seq < 0:
            return MISMATCH
        out = np.empty(shape, dtype) if is_root else None
        if split:
            _two_step_reduce(ch, seq, count, dtype, None if out is None else out.reshape(-1), op, split)
        elif is_root:
            red(views[seq & 1], out)
        return out

    return fn


def small_broadcast_fn(ch: Channel, a: int, dtype: np.dtype, shape: tuple[int, ...], root: int) -> Callable:
    """One-step broadcast: ``fn(x, out=None)`` returns ``root``'s data (in ``out`` when given),
    :data:`MISMATCH`, or :data:`SLOW` without posting when ``out`` is not C-contiguous with
    x's shape and dtype; only the root posts data: with the call, or streamed once the call is
    agreed where :meth:`.Channel.streamed` says so."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    piece = ch.piece if ch.streamed(nbytes) else 0
    step = _step(ch, STEP_BROADCAST, a, count, shape, dtype, root=root, nbytes=nbytes, second=piece)
    if step is not None:
        return step
    views = [ch.slot_views(p, dtype, shape)[root] for p in (0, 1)]
    is_root = ch.me == root

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        if out is None:
            out = np.empty(shape, dtype)
        elif type(out) is not np.ndarray or out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            return SLOW
        seq = ch.exchange(a, count, 0, x if is_root and not piece else None)
        if seq < 0:
            return MISMATCH
        if is_root and out is not x:
            out[...] = x
        if piece:
            ch.stream(seq, root, out)
        elif not is_root:
            out[...] = views[seq & 1]
        return out

    return fn


def small_allgather_fn(
    ch: Channel, a: int, c: int, dtype: np.dtype, shape: tuple[int, ...], unit: int, single: bool = False
) -> Any:
    """One-step allgather of ``shape`` (rows first) from every rank: ``fn(x, out=None)``
    returns the concatenation (in ``out`` when given), :data:`MISMATCH`, :data:`UNEVEN` when
    a peer's rows differ from ours or its ``out`` does not fit (the general path then says
    which), or :data:`SLOW` without posting anything when ``out`` is not exactly right.
    The count word is ``rows + (out rows + 1) * unit``. With ``single`` (a size from
    :attr:`.Channel.single_copy` on): posted without data, each rank then reads the others'
    blocks out of their memory in the compiled loop; False where that loop cannot take the
    dtype (the general path does the same)."""
    rows = shape[0]
    full = (ch.n * rows, *shape[1:])
    plain = rows
    fits = rows + (full[0] + 1) * unit
    nbytes = math.prod(shape) * dtype.itemsize
    step = _step(ch, STEP_ALLGATHER, a, plain, full, dtype, c=c, fits=fits, nbytes=nbytes, second=int(single))
    if step is not None or single:
        return step or False
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
    """Finish a posted small allreduce into ``out`` (shaped as the input, C-contiguous), in
    one step or two as :meth:`.Channel.split_at` says."""
    small_reduce(ch, seq, out.size, out.dtype, out, op)


def small_reduce(ch: Channel, seq: int, count: int, dtype: np.dtype, out: np.ndarray | None, op: str) -> None:
    """Finish a posted small reduce of ``count`` elements of ``dtype`` into ``out``
    (C-contiguous; None on a rank that takes no result), in one step or two as
    :meth:`.Channel.split_at` says."""
    split = ch.split_at(count * dtype.itemsize)
    if split:
        _two_step_reduce(ch, seq, count, dtype, None if out is None else out.reshape(-1), op, split)
    elif out is not None:
        rank_order_reducer(op, ch.n)(ch.slot_views(seq & 1, dtype, out.shape), out)


def _two_step_reduce(
    ch: Channel, seq: int, count: int, dt: np.dtype, out: np.ndarray | None, op: str, split: int
) -> None:
    """Finish a posted reduction of ``count`` elements of ``dt`` in two steps (the compiled
    loop's ``split_reduce``): this rank's block reduced into its slot at byte ``split`` and
    published; then, on a rank that takes the result (``out``, flat), every rank's block
    copied once published."""
    n, me = ch.n, ch.me
    off = offsets(block_counts(count, n))
    at = split // dt.itemsize
    full = ch.slot_views(seq & 1, dt, (at + count,))
    lo, hi = off[me], off[me + 1]
    if hi > lo:
        rank_order_reducer(op, n)([v[lo:hi] for v in full], full[me][at + lo : at + hi])
    ch.publish_done(seq)
    if out is None:
        return
    ch.wait_done(seq)
    for r in range(n):
        out[off[r] : off[r + 1]] = full[r][at + off[r] : at + off[r + 1]]


def small_reduce_scatter(ch: Channel, seq: int, counts: tuple[int, ...], out: np.ndarray, op: str) -> None:
    """Finish a posted small reduce-scatter: this rank's block into ``out``."""
    off = offsets(counts)
    a, z = off[ch.me], off[ch.me + 1]
    if z > a:
        rank_order_reducer(op, ch.n)([v[a:z] for v in ch.slot_views(seq & 1, out.dtype, (off[-1],))], out)


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
