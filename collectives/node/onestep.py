"""One-step calls: the common small case on one node, with less Python.

A call small enough to finish in one step through the node channel's slots posts its
signature words and its data together, waits for the peers and finishes from the slots.
The function that does this is built once per (collective, dtype, shape, op or root,
algorithm) with every lookup done up front, and posts exactly the words the general path
(:mod:`.agreement`) would, so ranks on either path match one another.

Each public collective reaches its function through a front door (:func:`call_path`). The
compiled one (:class:`.cslots.Path`) remembers the last call's communicator, dtype, shape,
op or root and algorithm with their function, so that a loop of like calls skips the
context, the cache key and the lookup: 0.2 µs of Python a call where they cost 0.5.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from ..agreement import OP_CODES, ROWS, Call, word
from ..context import Context, get_context
from ..ops import dtype_code
from ..select import choose
from . import slots

try:
    from .cslots import Path
except ImportError:  # not built: every call looks its function up (PythonPath)
    Path = None

__all__ = ["onestep_fn", "remember", "raise_mismatch", "call_key", "lookup", "call_path", "PythonPath"]


def onestep_fn(ctx: Context, key: tuple) -> Any:
    """The one-step function for ``key`` = (collective, dtype, shape, op or root, algorithm),
    or False when such calls take the general path (:func:`remember` keeps it in ``ctx.fast``).

    It exists exactly when the general path would finish the call in one step through the
    node channel's slots, and it posts the same signature words, so ranks on either path
    match one another.
    """
    coll, dtype, shape, arg, algorithm = key
    ch = ctx.chan
    fn: Any = False
    if ch is None or algorithm not in ("auto", "shm") or dtype_code(dtype) < 0:
        return fn
    nbytes = math.prod(shape) * dtype.itemsize
    # an allgather read from every rank's memory (single copy) needs no slot either
    single = coll == "allgather" and 0 < ch.single_copy <= nbytes and ch.core is not None
    if not (ch.one_step(coll, nbytes) or single):
        return fn
    op, root = (arg, None) if coll in ("allreduce", "reduce_scatter") else (None, arg)
    if coll == "reduce":
        op, root = arg
    if coll in ("allreduce", "reduce_scatter", "reduce") and op not in OP_CODES:
        return fn  # the general path names the bad op
    if coll in ("broadcast", "reduce") and not (type(root) is int and 0 <= root < ch.n):
        return fn  # the general path names the bad root
    if coll == "allgather":
        # resolved after agreement from the total; the signature carries the algorithm as given
        if not shape or (choose(ctx, coll, nbytes * ch.n) if algorithm == "auto" else "shm") != "shm":
            return fn
        c = zlib.crc32(repr(tuple(shape[1:])).encode()) if len(shape) > 1 else 0
        if shape[0] >= ROWS:
            return fn
        fn = slots.small_allgather_fn(
            ch, word(coll, algorithm, algorithm, None, dtype, None), c, dtype, shape, ROWS, single
        )
    elif (choose(ctx, coll, nbytes) if algorithm == "auto" else "shm") == "shm":
        a = word(coll, algorithm, "shm", op, dtype, root)
        if coll == "allreduce":
            fn = slots.small_allreduce_fn(ch, a, dtype, shape, op)
        elif coll == "reduce_scatter":
            fn = slots.small_reduce_scatter_fn(ch, a, dtype, math.prod(shape), op)
        elif coll == "broadcast":
            fn = slots.small_broadcast_fn(ch, a, dtype, shape, root)
        else:
            fn = slots.small_reduce_fn(ch, a, dtype, shape, op, root)
    return fn


def remember(ctx: Context, key: tuple) -> Any:
    """``key``'s one-step function (or False), built and kept in ``ctx.fast``: the caller
    looks ``ctx.fast[key]`` up itself first, and calls this on a miss. An unhashable ``key``
    raises TypeError (the general path then says what is wrong with the argument)."""
    if len(ctx.fast) > 256:
        ctx.fast.clear()
    fn = ctx.fast[key] = onestep_fn(ctx, key)
    return fn


def raise_mismatch(ctx: Context, key: tuple, x: np.ndarray) -> None:
    """Raise the agreement error of the one-step call ``key`` whose signatures differed (its
    function returned :data:`.slots.MISMATCH`)."""
    coll, _, _, arg, algorithm = key
    if coll in ("allreduce", "reduce_scatter"):
        call = Call(ctx, coll, x, algorithm, op=arg)
    elif coll == "reduce":
        call = Call(ctx, coll, x, algorithm, op=arg[0], root=arg[1])
    else:
        call = Call(ctx, coll, x, algorithm, root=arg)
    if coll != "allgather":
        call.resolved = "shm"
    call.seq = ctx.chan.seq
    call.mismatch_from_channel()


def call_key(name: str, x: np.ndarray, arg: Any, algorithm: str) -> tuple:
    """The key of the call ``name`` on ``x`` in the context's cache of one-step functions
    (``ctx.fast``), as :func:`onestep_fn` and :func:`raise_mismatch` take it."""
    return (name, x.dtype, x.shape, arg, algorithm)


def lookup(name: str, x: np.ndarray, arg: Any, algorithm: str, comm: Any) -> Any:
    """The one-step function of the call ``name`` on the host array ``x`` (from the
    context's cache, built on a miss), or False where it takes the general path: no such
    function, or an unhashable argument, which the general path names."""
    ctx = get_context(comm)
    key = call_key(name, x, arg, algorithm)
    try:
        return ctx.fast[key]
    except KeyError:
        return remember(ctx, key)
    except TypeError:
        return False


class PythonPath:
    """A public collective's front door in Python: ``path(x, arg, algorithm, out, comm,
    agreed)`` runs the call through the one-step function ``lookup(name, x, arg, algorithm,
    comm)`` gives (:func:`lookup`; False: none), and hands it to
    ``general(x, arg, algorithm, out, comm, agreed, why)`` where there is none, ``x`` is not
    an ndarray, or the function returned :data:`.slots.SLOW`, :data:`.slots.MISMATCH` or
    :data:`.slots.UNEVEN` (``why``: that result, or SLOW). ``agreed`` is only passed on.
    The compiled :class:`.cslots.Path` does the same, and remembers the last call's
    function."""

    __slots__ = ("name", "lookup", "general")
    remembered = False

    def __init__(self, name: str, lookup: Any, general: Any) -> None:
        self.name, self.lookup, self.general = name, lookup, general

    def __call__(self, x: Any, arg: Any, algorithm: str, out: Any, comm: Any, agreed: Any) -> Any:
        if type(x) is np.ndarray and (fn := self.lookup(self.name, x, arg, algorithm, comm)):
            res = fn(x) if out is None else fn(x, out)
            if res is not slots.SLOW and res is not slots.MISMATCH and res is not slots.UNEVEN:
                return res
            return self.general(x, arg, algorithm, out, comm, agreed, res)
        return self.general(x, arg, algorithm, out, comm, agreed, slots.SLOW)


def call_path(name: str, general: Any, compiled: bool = True) -> Any:
    """The front door of the public collective ``name``: ``path(x, arg, algorithm, out,
    comm, agreed)`` (:class:`PythonPath` says what it does). Compiled where the extension
    is built and ``compiled``: it then remembers the last call's communicator, dtype, shape,
    arg and algorithm with their one-step function, and a call like the last skips the
    lookup; every context's :meth:`~collectives.context.Context.free` makes it forget
    (:func:`.channel.forget_calls`)."""
    if compiled and Path is not None:
        return Path(name, lookup, general, np.ndarray, slots.SLOW, slots.MISMATCH, slots.UNEVEN)
    return PythonPath(name, lookup, general)
