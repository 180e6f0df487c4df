"""The public collectives on numpy arrays (and device arrays, which :mod:`.device.api` takes).

Every call first checks its arguments locally, then (with more than one rank) agrees them
with the other ranks (:mod:`.agreement`), so that bad input on any rank, or ranks calling
with different arguments, raises on every rank before any data moves, and the
communicator stays usable. Small calls on one node finish in one step (:mod:`.node.onestep`).

Every public call goes the same way: a blocking call goes through its collective's front
door (:func:`_front`), which finishes a host array's small call in one step; then
:func:`_dispatch` sends a device array to :mod:`.device.api` and anything else (or a call
the one step does not cover) along the collective's general path. A collective's row
(:func:`_paths`) names those two; its nonblocking form is the same row returning a
:class:`Request` (:func:`_nonblocking`). The window-resident buffers that
the in-place paths read are allocated by :mod:`.buffers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .agreement import ROWS, Call, check_out, equal_counts
from .blocks import block_counts, offsets
from .context import Context, Pending, get_context
from .device import api as gpu
from .device.arrays import is_device
from .errors import InvalidArgumentError, OutputMismatchError
from .node import inplace, slots, staged
from .node.arena import address
from .node.onestep import call_key, call_path, raise_mismatch
from .ops import finalize
from .select import REGISTRY

__all__ = [
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "alltoall",
    "iallreduce",
    "ireduce_scatter",
    "iallgather",
    "ibroadcast",
    "Request",
    "allreduce_agreed",
    "reduce_scatter_agreed",
    "allgather_agreed",
    "broadcast_agreed",
]

_SLOW, _MISMATCH, _UNEVEN = slots.SLOW, slots.MISMATCH, slots.UNEVEN
_ndarray = np.ndarray
"""``np.ndarray`` for the dispatch: CPython does not specialize attribute reads on a module
that defines ``__getattr__``, as numpy's does, so a global name is the cheaper lookup on
every call."""


class Request:
    """A collective in flight: ``wait()`` returns its result, ``test()`` says if it is done."""

    __slots__ = ("_ctx", "_pending", "_result")

    def __init__(self, ctx: Context, pending: Pending, result: Any) -> None:
        self._ctx, self._pending, self._result = ctx, pending, result

    def test(self) -> bool:
        """Make progress; return True once the operation has finished."""
        if not self._pending.done:
            self._ctx.progress()
        if self._pending.done and self._pending.error is not None:
            raise self._pending.error
        return self._pending.done

    def wait(self) -> Any:
        """Block until the operation has finished and return its result."""
        self._ctx.wait(self._pending)
        return self._result


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _launch(ctx: Context, gen, blocking: bool, result: Any, on_done=None):
    if blocking:
        ctx.run(gen)
        if on_done is not None:
            on_done()
        return result
    return Request(ctx, ctx.start(gen, on_done), result)


def _done(result: Any, blocking: bool, ctx: Context):
    if blocking:
        return result
    p = Pending(iter(()))
    p.done = True
    return Request(ctx, p, result)


def _where(ctx: Context, call: Call, small: bool, x: np.ndarray | None, out: np.ndarray | None) -> tuple[int, int]:
    """The arena words a call posts: where ``x`` and ``out`` lie in the node's arena (0: not
    there, or not a call that could read them in place). ``auto`` reads buffers in place
    whatever its table says: on one node nothing moves fewer bytes."""
    arena = ctx.arena
    if arena is None or small or call.algorithm not in ("auto", "shm") or call.error is not None or x is None:
        return (0, 0)
    return (arena.where(x), arena.where(out))


# -- dispatch ----------------------------------------------------------------------------
def _paths(device: Callable[..., Any], general: Callable[..., Any]) -> tuple:
    """A collective's row for :func:`_dispatch`, the plain tuple ``(device, general,
    blocking)`` (which unpacks faster than a named one: every call unpacks it).

    Each path takes the call's arguments in one order: ``x``, ``arg`` (the op, the root,
    ``(op, root)`` for reduce, the splits for alltoall, None for allgather), ``algorithm``,
    ``out``, ``comm``.

    Args:
        device: ``device(x, arg, algorithm, out, comm)``, the call on a device array (:mod:`.device.api`).
        general: ``general(x, arg, algorithm, out, comm, blocking, agreed)``, everything else.
    """
    return (device, general, True)


def _nonblocking(paths: tuple) -> tuple:
    """The row of ``paths``' nonblocking form, which returns a :class:`Request`."""
    device, general, _ = paths
    return (device, general, False)


def _front(name: str, paths: tuple) -> Any:
    """The front door of the blocking collective ``name``, ``path(x, arg, algorithm, out,
    comm, agreed)`` (:func:`.node.onestep.call_path`): the common small case on one node
    finished in one step by the function the context caches for it (:mod:`.node.onestep`),
    which posts the same words as the general path; anything else along ``paths``
    (:func:`_dispatch`). Ranks whose one-step signatures differ raise the agreement error,
    and an allgather whose ranks' rows differ, posted and agreed already, is finished on
    the general path."""

    def general(x, arg, algorithm, out, comm, agreed, why):
        if why is _MISMATCH:
            raise_mismatch(get_context(comm), call_key(name, x, arg, algorithm), x)
        if why is _UNEVEN:
            return _allgather(x, None, algorithm, out, comm, True, None, posted=True)
        return _dispatch(paths, x, arg, algorithm, out, comm, agreed)

    return call_path(name, general)


def _dispatch(paths: tuple, x: Any, arg: Any, algorithm: str, out: Any, comm: Any, agreed: Any) -> Any:
    """Run one call along ``paths`` (after the one step, where it applies): a device array
    on its device, anything else on the general path (which checks and agrees it).

    ``agreed`` is None, or what the caller agreed across ranks already (True; every rank's
    rows for allgather): the general path then skips the signature exchange.
    """
    device, general, blocking = paths
    if type(x) is not _ndarray and is_device(x):
        res = device(x, arg, algorithm, out, comm)
        return res if blocking else _done(res, False, get_context(comm))
    return general(x, arg, algorithm, out, comm, blocking, agreed)


# -- allreduce ---------------------------------------------------------------------------
def _aliases(a: np.ndarray, b: np.ndarray) -> bool:
    """True when ``a`` and ``b`` are the same elements (equal views of one buffer)."""
    return address(a) == address(b) and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype


def _allreduce(x, op, algorithm, out, comm, blocking, agreed):
    ctx = get_context(comm)
    call = Call(ctx, "allreduce", x, algorithm, op, agreed=equal_counts(ctx, x) if agreed else None)
    x = call.x
    check_out(call, out, x.shape)
    call.resolve(x.nbytes)
    small = call.small(x.nbytes)
    overlap = out is not None and out is not x and not _aliases(out, x) and np.may_share_memory(out, x)
    where = _where(ctx, call, small, x if not overlap else None, out)
    call.agree(x.size, payload=np.ascontiguousarray(x) if small else None, where=where)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    elif out is not x and _aliases(out, x):
        x = out  # two views of the same memory: in place (MPI refuses aliased buffers)
    elif overlap:
        x = x.copy()  # overlapping differently: the input must survive the writes to out
    n = ctx.transport.size
    if n == 1 or x.size == 0:
        if out is not x:
            np.copyto(out, x)
        return _done(out, blocking, ctx)
    buf = _flat(out)
    if small:
        slots.small_allreduce(ctx.chan, call.seq, out, op)
        return _done(out, blocking, ctx)
    ws = call.inplace(output=True)
    if ws is not None:  # every rank's input and output lie in the arena: read them there
        return _launch(ctx, inplace.inplace_allreduce(ctx, buf, ws, op), blocking, out)
    ch = ctx.chan
    if (
        call.resolved == "shm"
        and ch is not None
        and ch.reads_peers("allreduce", x.nbytes)
        and ctx.topology().nodes == 1
    ):
        # where every rank's input and output are apart, each reads the others' data where
        # it lies (single copy), nothing staged; else every rank stages it below
        if ch.allreduce_read(call.seq, _flat(x), buf, op):
            return _done(out, blocking, ctx)
    fn = REGISTRY["allreduce"][call.resolved]
    on_done = lambda: finalize(buf, op, n)
    if call.resolved == "shm":
        # shared windows are allocated collectively: here, in call order, not mid-schedule
        if ctx.topology().nodes == 1:
            ctx.channel()
            on_done = None  # the node algorithm finalizes each slice itself
        else:
            ctx.shm_segments()
    # every rank draws the tag, whichever branch its own input's layout takes: a tag drawn
    # on some ranks only puts the next point-to-point collective on different tags
    tag = ctx.next_tag()
    if call.resolved in ("native", "shm") and x.flags.c_contiguous and out is not x:
        gen = fn(ctx, ctx.transport, buf, op, tag, src=_flat(x))
    else:
        if out is not x:
            np.copyto(out, x)
        gen = fn(ctx, ctx.transport, buf, op, tag)
    return _launch(ctx, gen, blocking, out, on_done)


def _gpu_allreduce(x, op, algorithm, out, comm):
    return gpu.allreduce(x, op, algorithm, out, comm, allreduce)


_ALLREDUCE = _paths(_gpu_allreduce, _allreduce)
_ALLREDUCE_CALL = _front("allreduce", _ALLREDUCE)
_IALLREDUCE = _nonblocking(_ALLREDUCE)


def allreduce(
    x: np.ndarray, *, op: str = "sum", algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> np.ndarray:
    """Reduce ``x`` elementwise over all ranks; every rank gets the result.

    Args:
        x: this rank's array (any shape; non-contiguous input is copied once).
        op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"`` or ``"prod"``.
        algorithm: a name from ``algorithms("allreduce")``; ``"auto"`` picks by size.
        out: C-contiguous array of x's shape and dtype for the result (``out=x``: in place).
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``) or a transport.

    Returns:
        The reduced array, of x's shape and dtype (``out`` when given).
    """
    return _ALLREDUCE_CALL(x, op, algorithm, out, comm, None)


def iallreduce(
    x: np.ndarray, *, op: str = "sum", algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> Request:
    """Start :func:`allreduce`; ``wait()`` on the returned request gives the result."""
    return _dispatch(_IALLREDUCE, x, op, algorithm, out, comm, None)


# -- reduce_scatter ----------------------------------------------------------------------
def _reduce_scatter(x, op, algorithm, out, comm, blocking, agreed):
    ctx = get_context(comm)
    call = Call(ctx, "reduce_scatter", x, algorithm, op, agreed=equal_counts(ctx, x) if agreed else None)
    x = call.x
    t = ctx.transport
    n, r = t.size, t.rank
    counts = block_counts(x.size, n)
    off = offsets(counts)
    check_out(call, out, (counts[r],))
    call.resolve(x.nbytes)
    small = call.small(x.nbytes)
    src = np.ascontiguousarray(x) if (small or call.resolved == "shm") and call.error is None else x
    overlap = isinstance(out, np.ndarray) and np.may_share_memory(out, x)
    call.agree(x.size, payload=src if small else None, where=_where(ctx, call, small, None if overlap else x, None))
    result = np.empty(counts[r], x.dtype) if out is None else out
    if n == 1 or x.size == 0:
        result[...] = _flat(x)
        return _done(result, blocking, ctx)
    if small:
        slots.small_reduce_scatter(ctx.chan, call.seq, counts, result, op)
        return _done(result, blocking, ctx)
    ws = call.inplace(output=False)
    if ws is not None:  # every rank's input lies in the arena: read it there
        return _launch(ctx, inplace.inplace_reduce_scatter(ctx, counts, result, x.dtype, ws, op), blocking, result)
    ch = ctx.chan
    if call.resolved == "shm" and ch is not None and ch.reads_peers("reduce_scatter", x.nbytes):
        # each rank reads its block of the others' inputs where they lie (single copy), where
        # every rank's output is apart from its input and its staging slow; else all stage
        if ch.reduce_scatter_read(call.seq, _flat(src), counts, result, op, apart=not overlap):
            return _done(result, blocking, ctx)
    if call.resolved == "shm":
        ctx.channel()  # collective allocation, in call order
        gen = staged.reduce_scatter(ctx, t, _flat(src), counts, op, 0, out=result)
        return _launch(ctx, gen, blocking, result)
    work = ctx.scratch.get(x.size, x.dtype)
    np.copyto(work, _flat(x))  # one copy, also of non-contiguous input
    gen = REGISTRY["reduce_scatter"][call.resolved](ctx, t, work, counts, op, ctx.next_tag())

    def on_done() -> None:
        result[...] = work[off[r] : off[r + 1]]
        ctx.scratch.put(work)
        finalize(result, op, n)

    return _launch(ctx, gen, blocking, result, on_done)


def _gpu_reduce_scatter(x, op, algorithm, out, comm):
    return gpu.reduce_scatter(x, op, algorithm, out, comm, reduce_scatter)


_REDUCE_SCATTER = _paths(_gpu_reduce_scatter, _reduce_scatter)
_REDUCE_SCATTER_CALL = _front("reduce_scatter", _REDUCE_SCATTER)
_IREDUCE_SCATTER = _nonblocking(_REDUCE_SCATTER)


def reduce_scatter(
    x: np.ndarray, *, op: str = "sum", algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> np.ndarray:
    """Reduce ``x`` over all ranks and return this rank's block of the flattened result.

    Blocks follow MPICH/OSU: ``count // size`` elements each, one more on the first
    ``count % size`` ranks.

    Args:
        x: this rank's array (any shape; reduced as if flattened).
        op: reduction op name.
        algorithm: a name from ``algorithms("reduce_scatter")`` or ``"auto"``.
        out: C-contiguous 1-D array of x's dtype and this rank's block size for the result.
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``) or a transport.

    Returns:
        A 1-D array: this rank's block (``out`` when given).
    """
    return _REDUCE_SCATTER_CALL(x, op, algorithm, out, comm, None)


def ireduce_scatter(
    x: np.ndarray, *, op: str = "sum", algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> Request:
    """Start :func:`reduce_scatter`; ``wait()`` on the returned request gives the block."""
    return _dispatch(_IREDUCE_SCATTER, x, op, algorithm, out, comm, None)


# -- allgather ---------------------------------------------------------------------------
def _allgather(x, arg, algorithm, out, comm, blocking, rows, posted=False):
    """The general allgather (``arg`` is None: an allgather has neither op nor root); ``rows``:
    every rank's rows when the caller agreed them, ``posted``: a one-step attempt posted and
    agreed this call already."""
    ctx = get_context(comm)
    call = Call(ctx, "allgather", x, algorithm, agreed=None if rows is None else [int(r) for r in rows])
    x = call.x
    if call.error is None and x.ndim == 0:
        call.fail(InvalidArgumentError("allgather: x must have at least one dimension to concatenate along"))
    rows = x.shape[0] if x.ndim else 1
    item = x.shape[1:]
    if call.error is None and rows >= ROWS:
        call.fail(InvalidArgumentError(f"allgather: {rows} rows; at most {ROWS - 1}"))
    out_rows = -1
    if out is not None and call.error is None:
        check_out(call, out, (out.shape[0] if getattr(out, "ndim", 0) else -1, *item))
        out_rows = out.shape[0] if call.error is None else -1
        if out_rows >= ROWS:
            out_rows = ROWS - 2
    t = ctx.transport
    # the algorithm depends on every rank's rows, so it is resolved after agreement; a
    # small payload goes along in case every rank's is small
    ch = ctx.chan
    src = np.ascontiguousarray(x)
    attach = ch is not None and call.error is None and x.nbytes <= ch.copy_small and algorithm in ("auto", "shm")
    where = _where(ctx, call, attach, src, out)  # the peers read this rank's block of out
    if posted:  # a one-step attempt posted and agreed this call already
        call.seq = ch.seq
    else:
        call.agree((rows % ROWS) + (out_rows + 1) * ROWS, item, payload=src if attach else None, where=where)
    words = call.counts()
    all_rows = [w % ROWS for w in words]
    total = sum(all_rows)
    if call.agreed is not None and out is not None and out.shape[0] != total:
        raise OutputMismatchError(f"allgather: out must have {total} rows (the sum over ranks), not {out.shape[0]}")
    bad = {q: w // ROWS - 1 for q, w in enumerate(words) if w >= ROWS and w // ROWS - 1 != total}
    if bad:
        raise OutputMismatchError(
            "allgather: out must have "
            + str(total)
            + " rows (the sum over ranks); "
            + "; ".join(f"rank {q} passed {v}" for q, v in bad.items())
        )
    per_row = math.prod(item)
    counts = tuple(rw * per_row for rw in all_rows)
    call.resolve(sum(counts) * x.itemsize)
    if out is None:
        out = np.empty((total, *item), x.dtype)
    buf = _flat(out)
    off = offsets(counts)
    mine = buf[off[t.rank] : off[t.rank + 1]]
    own = None if _aliases(mine, _flat(src)) else _flat(src)  # x may be its block of out already
    small = call.resolved == "shm" and ch is not None and max(counts) * x.itemsize <= ch.copy_small
    ws = call.inplace(output=True, inputs=False) if buf.nbytes <= inplace.COPY_INPLACE_MAX and not small else None
    chunked = call.resolved == "shm" and not small and ws is None and t.size > 1
    # above the one-step size every rank streams its block through its slot while copying
    # the others' out as they come (the chunked path's pieces wait for each other instead)
    stream = chunked and ch is not None and ch.streams_bytes(max(counts) * x.itemsize)
    # streamed, or staged blocking: x is copied into out piece by piece as it goes (read once,
    # from cache); single copy: the peers read x, or past the cache size this rank's out block
    read_as_it_goes = stream or (blocking and chunked)
    if own is not None and (not read_as_it_goes or np.may_share_memory(own, buf)):
        mine[...] = own
        own = None
    if t.size == 1 or buf.size == 0:
        return _done(out, blocking, ctx)
    if small:
        slots.small_allgather(ch, call.seq, counts, buf)
        return _done(out, blocking, ctx)
    if ws is not None:  # every rank's out lies in the arena, its own block in place: read them there
        return _launch(ctx, inplace.inplace_allgather(ctx, buf, counts, ws), blocking, out)
    if stream:
        ch.gather(call.seq, buf, [o * x.itemsize for o in off], own)
        return _done(out, blocking, ctx)
    if call.resolved == "shm":
        ctx.channel()  # collective allocation, in call order
        gen = staged.allgather(ctx, t, buf, counts, ctx.next_tag(), src=own)
    else:
        gen = REGISTRY["allgather"][call.resolved](ctx, t, buf, counts, ctx.next_tag())
    return _launch(ctx, gen, blocking, out)


def _gpu_allgather(x, arg, algorithm, out, comm):
    return gpu.allgather(x, algorithm, out, comm, allgather)


_ALLGATHER = _paths(_gpu_allgather, _allgather)
_ALLGATHER_CALL = _front("allgather", _ALLGATHER)
_IALLGATHER = _nonblocking(_ALLGATHER)


def allgather(x: np.ndarray, *, algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None) -> np.ndarray:
    """Concatenate every rank's ``x`` along axis 0, in rank order; every rank gets it.

    The first dimension may differ between ranks; the others and the dtype may not.

    Args:
        x: this rank's array, at least 1-D.
        algorithm: a name from ``algorithms("allgather")`` or ``"auto"``.
        out: C-contiguous array of x's dtype for the result, with the sum of every rank's
            rows and x's other dimensions (checked on every rank after agreement).
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``) or a transport.

    Returns:
        The concatenation (``out`` when given).
    """
    return _ALLGATHER_CALL(x, None, algorithm, out, comm, None)


def iallgather(x: np.ndarray, *, algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None) -> Request:
    """Start :func:`allgather`; ``wait()`` on the returned request gives the result."""
    return _dispatch(_IALLGATHER, x, None, algorithm, out, comm, None)


# -- broadcast ---------------------------------------------------------------------------
def _broadcast(x, root, algorithm, out, comm, blocking, agreed):
    ctx = get_context(comm)
    call = Call(ctx, "broadcast", x, algorithm, root=root, agreed=equal_counts(ctx, x) if agreed else None)
    x = call.x
    check_out(call, out, x.shape)
    call.resolve(x.nbytes)
    small = call.small(x.nbytes)
    ch = ctx.chan
    # above the reductions' one-step size the root streams its data through its slot once
    # the call is agreed, and the others copy each piece out as it comes (as the one-step
    # function does, and so from the single-copy size, where the others read the root's
    # memory); above the one-step size a root whose input lies in the arena posts where
    # instead, and the others read it there
    stream = call.resolved == "shm" and ch is not None and ch.streamed(x.nbytes)
    is_root = ctx.transport.rank == root
    overlap = isinstance(out, np.ndarray) and out is not x and np.may_share_memory(out, x)
    where = _where(ctx, call, small, x if is_root and not overlap else None, None)
    attach = small and is_root and not stream
    call.agree(x.size, payload=np.ascontiguousarray(x) if attach else None, one_step=small, where=where)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    many = ctx.transport.size > 1 and x.size > 0
    # a streaming root copies its contiguous x into out itself, while the others read x
    # where single copy applies (x is not in the arena: the call is not read in place)
    tee = stream and many and is_root and out is not x and not overlap and not where[0] and x.flags.c_contiguous
    if out is not x and is_root and not tee:
        np.copyto(out, x)
    if not many:
        return _done(out, blocking, ctx)
    ws = call.inplace(output=False, only=root) if not small and x.nbytes <= inplace.COPY_INPLACE_MAX else None
    if ws is not None:  # the root's input lies in the arena: read it there
        return _launch(ctx, inplace.inplace_broadcast(ctx, _flat(out), root, ws), blocking, out)
    if stream:  # out holds the root's data on the root, or x does (tee)
        ch.stream(call.seq, root, _flat(out), _flat(x) if tee else None)
        return _done(out, blocking, ctx)
    if small:  # the root posted its data with the call
        slots.small_broadcast(ctx.chan, call.seq, root, _flat(out))
        return _done(out, blocking, ctx)
    if call.resolved == "shm":
        ctx.channel()  # collective allocation, in call order
    gen = REGISTRY["broadcast"][call.resolved](ctx, ctx.transport, _flat(out), root, ctx.next_tag())
    return _launch(ctx, gen, blocking, out)


def _gpu_broadcast(x, root, algorithm, out, comm):
    return gpu.broadcast(x, root, algorithm, out, comm, broadcast)


_BROADCAST = _paths(_gpu_broadcast, _broadcast)
_BROADCAST_CALL = _front("broadcast", _BROADCAST)
_IBROADCAST = _nonblocking(_BROADCAST)


def broadcast(
    x: np.ndarray, root: int = 0, *, algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> np.ndarray:
    """Return ``root``'s ``x`` on every rank (every rank passes an array of the same shape).

    Args:
        x: the data on ``root``; elsewhere an array of the same shape and dtype.
        root: the rank whose data is sent.
        algorithm: a name from ``algorithms("broadcast")`` or ``"auto"``.
        out: array for the result (``out=x``: in place).
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``) or a transport.

    Returns:
        The root's data (``out`` when given).
    """
    return _BROADCAST_CALL(x, root, algorithm, out, comm, None)


def ibroadcast(
    x: np.ndarray, root: int = 0, *, algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> Request:
    """Start :func:`broadcast`; ``wait()`` on the returned request gives the result."""
    return _dispatch(_IBROADCAST, x, root, algorithm, out, comm, None)


# -- calls whose arguments the caller agreed already (collectives.unchecked) ---------------
def allreduce_agreed(x: np.ndarray, *, op: str = "sum", out: np.ndarray | None = None, comm: Any = None) -> np.ndarray:
    """:func:`collectives.allreduce` with ``algorithm="auto"``, without the signature exchange
    (see :mod:`collectives.unchecked`). Device arrays are agreed again: a rank may have passed
    a host one."""
    return _ALLREDUCE_CALL(x, op, "auto", out, comm, True)


def reduce_scatter_agreed(
    x: np.ndarray, *, op: str = "sum", out: np.ndarray | None = None, comm: Any = None
) -> np.ndarray:
    """:func:`collectives.reduce_scatter` with ``algorithm="auto"``, without the signature exchange
    (see :mod:`collectives.unchecked`)."""
    return _REDUCE_SCATTER_CALL(x, op, "auto", out, comm, True)


def broadcast_agreed(x: np.ndarray, root: int = 0, *, out: np.ndarray | None = None, comm: Any = None) -> np.ndarray:
    """:func:`collectives.broadcast` with ``algorithm="auto"``, without the signature exchange
    (see :mod:`collectives.unchecked`)."""
    return _BROADCAST_CALL(x, root, "auto", out, comm, True)


def allgather_agreed(
    x: np.ndarray, rows: Sequence[int], *, out: np.ndarray | None = None, comm: Any = None
) -> np.ndarray:
    """:func:`collectives.allgather` with ``algorithm="auto"``, given every rank's rows
    (``rows[r]``: the first dimension of rank r's ``x``), without the signature exchange
    (see :mod:`collectives.unchecked`). On device arrays the rows are agreed again, with the
    memory kind."""
    return _ALLGATHER_CALL(x, None, "auto", out, comm, rows)


# -- reduce ------------------------------------------------------------------------------
def _reduce(x, arg, algorithm, out, comm, blocking, agreed):
    """The general reduce of ``arg`` = ``(op, root)``; a reduce is blocking, has no ``out``
    and no agreed form, so it leaves ``out``, ``blocking`` and ``agreed`` aside."""
    op, root = arg
    ctx = get_context(comm)
    call = Call(ctx, "reduce", x, algorithm, op, root=root)
    x = call.x
    call.resolve(x.nbytes)
    small = call.small(x.nbytes)
    call.agree(x.size, payload=np.ascontiguousarray(x) if small else None, where=_where(ctx, call, small, x, None))
    t = ctx.transport
    is_root = t.rank == root
    out = np.empty(x.shape, x.dtype) if is_root else None
    if t.size == 1 or x.size == 0:
        if is_root:
            np.copyto(out, x)
        return out
    if small:
        slots.small_reduce(ctx.chan, call.seq, x.size, x.dtype, out, op)
        return out
    ws = call.inplace(output=False)
    if ws is not None:  # every rank's input lies in the arena: read it there
        ctx.run(inplace.inplace_reduce(ctx, None if out is None else _flat(out), x.size, x.dtype, ws, op, root))
        return out
    if call.resolved == "shm":
        ctx.channel()  # collective allocation, in call order
        # the node algorithm reads the input where it lies (and finalizes each slice itself)
        src = _flat(x)
        ctx.run(REGISTRY["reduce"]["shm"](ctx, t, _flat(out) if is_root else src[:0], root, op, ctx.next_tag(), src))
        return out
    work = _flat(out) if is_root else ctx.scratch.get(x.size, x.dtype)
    np.copyto(work, _flat(x))
    try:
        ctx.run(REGISTRY["reduce"][call.resolved](ctx, t, work, root, op, ctx.next_tag()))
    finally:
        if not is_root:
            ctx.scratch.put(work)
    if is_root:
        finalize(work, op, t.size)
    return out


def _gpu_reduce(x, arg, algorithm, out, comm):
    op, root = arg
    return gpu.reduce(x, root, op, algorithm, comm, reduce)


_REDUCE = _paths(_gpu_reduce, _reduce)
_REDUCE_CALL = _front("reduce", _REDUCE)


def reduce(
    x: np.ndarray, root: int = 0, *, op: str = "sum", algorithm: str = "auto", comm: Any = None
) -> np.ndarray | None:
    """Reduce ``x`` over all ranks onto ``root``.

    Args:
        x: this rank's array.
        root: the rank that receives the result.
        op: reduction op name.
        algorithm: a name from ``algorithms("reduce")`` or ``"auto"``.
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``) or a transport.

    Returns:
        The reduced array of x's shape on ``root``; None on every other rank.
    """
    return _REDUCE_CALL(x, (op, root), algorithm, None, comm, None)


# -- alltoall ----------------------------------------------------------------------------
def _send_rows(call: Call, x: np.ndarray, splits: Any, size: int) -> np.ndarray:
    """The rows of ``x`` for each of ``size`` ranks, as ``splits`` gives them (all zero, and
    ``call`` failed, when ``x`` or ``splits`` will not do)."""
    rows = x.shape[0] if x.ndim else 0
    send_rows = np.zeros(size, np.int64)
    if call.error is None:
        if x.ndim == 0:
            call.fail(InvalidArgumentError("alltoall: x must have at least one dimension"))
        elif splits is None:
            if rows % size:
                call.fail(
                    InvalidArgumentError(f"alltoall: {rows} rows do not split evenly over {size} ranks; pass splits")
                )
            else:
                send_rows[:] = rows // size
        else:
            try:
                sp = np.asarray(splits).reshape(-1)
                if sp.dtype.kind not in "iu" and not (sp.dtype.kind == "f" and (sp == np.round(sp)).all()):
                    raise ValueError
                sp = sp.astype(np.int64)
            except (TypeError, ValueError):
                call.fail(InvalidArgumentError(f"alltoall: splits={splits!r} must be a sequence of row counts"))
            else:
                if sp.size != size or (sp < 0).any() or sp.sum() != rows:
                    call.fail(
                        InvalidArgumentError(
                            f"alltoall: splits={[int(v) for v in sp]} must be {size} non-negative row counts "
                            f"summing to {rows}"
                        )
                    )
                else:
                    send_rows[:] = sp
    return send_rows


def _alltoall(x, splits, algorithm, out, comm, blocking, agreed):
    """The general alltoall; an alltoall is blocking, has no ``out`` and no agreed form, so it
    leaves ``out``, ``blocking`` and ``agreed`` aside."""
    ctx = get_context(comm)
    t = ctx.transport
    call = Call(ctx, "alltoall", x, algorithm)
    x = call.x
    rows = x.shape[0] if x.ndim else 0
    send_rows = _send_rows(call, x, splits, t.size)
    item = x.shape[1:]
    call.resolve(x.nbytes)
    call.agree(rows, item)
    row_bytes = math.prod(item) * x.itemsize
    recv_rows = np.empty(t.size, np.int64)
    if t.size == 1:
        recv_rows[:] = send_rows
    else:
        ctx.run(
            REGISTRY["alltoall"]["pairwise"](ctx, t, send_rows, (8,) * t.size, recv_rows, (8,) * t.size, ctx.next_tag())
        )
    out = np.empty((int(recv_rows.sum()), *item), x.dtype)
    src = np.ascontiguousarray(x)
    if t.size == 1:
        out[...] = src
        return out
    ctx.run(
        REGISTRY["alltoall"][call.resolved](
            ctx,
            t,
            _flat(src),
            tuple(int(v) * row_bytes for v in send_rows),
            _flat(out),
            tuple(int(v) * row_bytes for v in recv_rows),
            ctx.next_tag(),
        )
    )
    return out


def _gpu_alltoall(x, splits, algorithm, out, comm):
    return gpu.alltoall(x, splits, algorithm, comm, alltoall)


_ALLTOALL = _paths(_gpu_alltoall, _alltoall)


def alltoall(x: np.ndarray, splits: Any = None, *, algorithm: str = "auto", comm: Any = None) -> np.ndarray:
    """Send rows of ``x`` to every rank and return the rows received, in rank order.

    Args:
        x: this rank's array, at least 1-D.
        splits: rows of ``x`` for each rank, in order (sum = ``x.shape[0]``); by default
            ``x.shape[0]`` must divide evenly by the number of ranks.
        algorithm: ``"pairwise"``, ``"native"`` or ``"auto"``.
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``) or a transport.

    Returns:
        The rows received from rank 0, then rank 1, ..., concatenated along axis 0.
    """
    return _dispatch(_ALLTOALL, x, splits, algorithm, None, comm, None)
