"""The public collectives on numpy arrays.

Every call first checks its arguments locally, then (with more than one rank) exchanges a
small signature with the other ranks, so that bad input on any rank, or ranks calling
with different arguments, raises on every rank before any data moves, and the
communicator stays usable.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import node, recursive_doubling
from .context import Context, Pending, get_context
from .errors import (
    CollectiveError,
    CollectiveMismatchError,
    InvalidArgumentError,
    InvalidRootError,
    OutputMismatchError,
    PeerInputError,
    UnknownAlgorithmError,
)
from .layout import block_counts, offsets
from .ops import DTYPES, OPS, check_dtype, check_op, dtype_code, finalize
from .select import REGISTRY, choose

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

_COLLECTIVES = tuple(REGISTRY)
_FIELDS = ("collective", "algorithm", "resolved", "op", "dtype", "count", "root", "item shape", "error")
_F = {name: i for i, name in enumerate(_FIELDS)}
_COLL_CODES = {c: i for i, c in enumerate(_COLLECTIVES)}
_ALG_CODES = {c: {a: i for i, a in enumerate([*names, "auto"])} for c, names in REGISTRY.items()}
_OP_CODES = {o: i for i, o in enumerate(OPS)}
#: fields that may differ between ranks, per collective
_MAY_DIFFER = {"allgather": {"count"}, "alltoall": {"count"}}


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


# -- argument checks -------------------------------------------------------------------
class _Call:
    """One call's arguments, checked; the first local error is kept, not raised yet."""

    def __init__(
        self,
        ctx: Context,
        collective: str,
        x: Any,
        algorithm: str,
        op: str | None = None,
        root: int | None = None,
        agreed: list[int] | None = None,
    ) -> None:
        self.ctx = ctx
        self.agreed = agreed
        """Every rank's ``count``, when the caller agreed the arguments already (see
        :mod:`.agreed`): then only a call finished in one step through the node channel
        posts its signature, since its data travels with it."""
        self.t = ctx.transport
        self.collective = collective
        self.error: CollectiveError | None = None
        self.x = x if isinstance(x, np.ndarray) else np.asarray(x)
        self.op = op
        self.root = root
        self.algorithm = algorithm
        self.resolved = algorithm
        self.seq = 0
        self._counts: list[int] | None = None
        try:
            check_dtype(self.x.dtype)
            if op is not None:
                check_op(op)
            names = REGISTRY[collective]
            if algorithm != "auto" and algorithm not in names:
                raise UnknownAlgorithmError(
                    f"{collective}: no algorithm {algorithm!r}; registered: {', '.join([*names, 'auto'])}"
                )
            if root is not None and not (isinstance(root, (int, np.integer)) and 0 <= root < self.t.size):
                raise InvalidRootError(
                    f"{collective}: root={root!r} is not a rank of a {self.t.size}-rank communicator"
                )
            if algorithm == "native" and getattr(self.t, "comm", None) is None:
                raise InvalidArgumentError(f"{collective}: algorithm 'native' needs an MPI communicator")
            if algorithm == "shm" and collective != "allreduce" and ctx.layout().nodes > 1:
                raise InvalidArgumentError(f"{collective}: algorithm 'shm' needs every rank on one node")
        except CollectiveError as exc:
            self.error = exc

    def fail(self, exc: CollectiveError) -> None:
        if self.error is None:
            self.error = exc

    def resolve(self, nbytes: int) -> None:
        if self.error is None and self.algorithm == "auto":
            self.resolved = choose(self.ctx, self.collective, nbytes)

    def signature(self, count: int, item_shape: tuple[int, ...] = ()) -> list[int]:
        names = _ALG_CODES[self.collective]
        return [
            _COLL_CODES[self.collective],
            names.get(self.algorithm, -1),
            names.get(self.resolved, -1),
            _OP_CODES.get(self.op, -1),  # type: ignore[arg-type]
            dtype_code(self.x.dtype),
            count,
            self.root if isinstance(self.root, (int, np.integer)) else -2,
            zlib.crc32(repr(tuple(item_shape)).encode()) if item_shape else 0,
            0 if self.error is None else 1,
        ]

    def agree(
        self, count: int, item_shape: tuple[int, ...] = (), payload: np.ndarray | None = None, one_step: bool = False
    ) -> None:
        """Check arguments on every rank; raise the same way everywhere on any problem.

        On a single-node communicator the signature (and ``payload``, a small message's
        data, when given) goes through the node channel; elsewhere through a nonblocking
        all-gather. Afterwards :meth:`counts` gives every rank's ``count``. ``one_step``
        (or a ``payload``) says the call finishes in one step through the node channel;
        an agreed call posts only then.
        """
        t = self.t
        if t.size == 1 or (self.agreed is not None and not (one_step or payload is not None)):
            if self.error is not None:
                raise self.error
            self._counts = [count] if t.size == 1 else self.agreed
            return
        sig = self.signature(count, item_shape)
        ch = self.ctx.chan
        if ch is not None:
            a, b, c = _pack(sig)
            seq = ch.exchange(a, b, c, payload if self.error is None else None, self.collective in _MAY_DIFFER)
            self.seq = abs(seq)
            if seq > 0:
                if self.error is not None:
                    raise self.error
                return
            seq = -seq
            table = np.array([_unpack(w) for w in ch.words(seq)], np.int64)
        else:
            mine = np.array(sig, np.int64)
            k = mine.size
            table = np.empty((t.size, k), np.int64)
            comm = getattr(t, "comm", None)
            if comm is not None:
                # nonblocking, whatever is in flight here: blocking and nonblocking collectives
                # never match, and what is in flight differs between ranks
                self.ctx.run(_once(comm.Iallgather(mine, table)))
            else:
                flat = table.reshape(-1)
                flat[t.rank * k : (t.rank + 1) * k] = mine
                self.ctx.run(recursive_doubling.allgather(self.ctx, t, flat, (k,) * t.size, self.ctx.next_tag()))
        self._counts = [int(v) for v in table[:, _F["count"]]]
        self._judge(table)

    def _judge(self, table: np.ndarray) -> None:
        differ = (table != table[0]).any(axis=0)
        if differ.any():
            if differ[_F["error"]]:
                self._raise_input_errors(table)
            skip = _MAY_DIFFER.get(self.collective, ())
            for name in _FIELDS:
                if differ[_F[name]] and name not in skip:
                    raise _mismatch(table, name)
        if self.error is not None:
            raise self.error

    def mismatch_from_channel(self) -> None:
        """Raise the error for a posted call whose signatures differ between ranks."""
        table = np.array([_unpack(w) for w in self.ctx.chan.words(self.seq)], np.int64)
        self._judge(table)
        raise AssertionError("signatures differ but no field does")  # pragma: no cover

    def counts(self) -> list[int]:
        """Every rank's ``count`` from the last :meth:`agree`, by rank."""
        if self._counts is None:
            self._counts = [w[1] for w in self.ctx.chan.words(self.seq)]
        return self._counts

    def small(self, nbytes: int) -> bool:
        """True when this call finishes in one step through the node channel's slots."""
        ch = self.ctx.chan
        return ch is not None and self.resolved == "shm" and nbytes <= ch.small and self.error is None

    def _raise_input_errors(self, table: np.ndarray) -> None:
        # rare path: gather the messages so every rank can say what went wrong where
        msgs = self.t.allgather_obj(None if self.error is None else f"{type(self.error).__name__}: {self.error}")
        if self.error is not None:
            raise self.error
        bad = "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m is not None)
        raise PeerInputError(f"{self.collective} abandoned because of bad input on other ranks ({bad})")


def _counts_of(ctx: Context, x: Any) -> list[int]:
    """Every rank's count in an agreed call whose counts are equal (this rank's, n times)."""
    return [int(np.size(x))] * ctx.transport.size


def _once(req):
    yield [req]


def _pack(sig: list[int]) -> tuple[int, int, int]:
    """Fold a signature into three int64 words: small fields, count, item-shape hash."""
    coll, alg, res, op, dt, count, root, shape, err = sig
    a = 0
    for v in (coll, alg, res, op, dt):
        a = (a << 6) | (v + 2)
    a = (((a << 1) | err) << 32) | (root + 2)
    return a, count, shape


def _unpack(words: tuple[int, int, int]) -> list[int]:
    a, count, shape = words
    root = (a & 0xFFFFFFFF) - 2
    a >>= 32
    err = a & 1
    a >>= 1
    small = []
    for _ in range(5):
        small.append((a & 63) - 2)
        a >>= 6
    coll, alg, res, op, dt = reversed(small)
    return [coll, alg, res, op, dt, count, root, shape, err]


def _describe(table: np.ndarray, name: str, value: int) -> str:
    if name == "collective":
        return _COLLECTIVES[value]
    coll = _COLLECTIVES[int(table[0, _F["collective"]])]
    if name in ("algorithm", "resolved"):
        names = [*REGISTRY[coll], "auto"]
        return names[value] if 0 <= value < len(names) else "?"
    if name == "op":
        return OPS[value] if 0 <= value < len(OPS) else "none"
    if name == "dtype":
        return str(DTYPES[value]) if 0 <= value < len(DTYPES) else "unsupported"
    if name == "item shape":
        return f"shape#{value:08x}"
    if name == "root" and value == -2:
        return "none"
    return str(value)


def _mismatch(table: np.ndarray, name: str) -> CollectiveMismatchError:
    col = table[:, _F[name]]
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(col):
        groups.setdefault(_describe(table, name, int(v)), []).append(r)
    parts = "; ".join(
        f"ranks {rs} passed {v}" if len(rs) > 1 else f"rank {rs[0]} passed {v}" for v, rs in groups.items()
    )
    return CollectiveMismatchError(
        f"collective arguments differ between ranks in field {name!r}: {parts}", field=name, values=groups
    )


def _check_out(call: _Call, out: np.ndarray | None, shape: tuple[int, ...]) -> None:
    if out is None or call.error is not None:
        return
    if not isinstance(out, np.ndarray):
        call.fail(OutputMismatchError(f"{call.collective}: out must be a numpy array, not {type(out).__name__}"))
    elif out.shape != shape or out.dtype != call.x.dtype:
        call.fail(
            OutputMismatchError(
                f"{call.collective}: out has shape {out.shape} and dtype {out.dtype}; "
                f"expected shape {shape} and dtype {call.x.dtype}"
            )
        )
    elif not out.flags.c_contiguous:
        call.fail(OutputMismatchError(f"{call.collective}: out must be C-contiguous"))


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


# -- one-step calls -----------------------------------------------------------------------
def _word(collective: str, algorithm: str, resolved: str, op: str | None, dtype: np.dtype, root: int | None) -> int:
    """The first signature word a call with these arguments posts (see :meth:`_Call.signature`)."""
    names = _ALG_CODES[collective]
    sig = [
        _COLL_CODES[collective],
        names[algorithm],
        names[resolved],
        _OP_CODES.get(op, -1),  # type: ignore[arg-type]
        dtype_code(dtype),
        0,
        -2 if root is None else root,
        0,
        0,
    ]
    return _pack(sig)[0]


def _fast_fn(ctx: Context, key: tuple) -> Any:
    """The one-step function for ``key`` = (collective, dtype, shape, op or root, algorithm),
    or False when such calls take the general path (:func:`_fast` caches it in ``ctx.fast``).

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
    if nbytes > ch.small:
        return fn
    op, root = (arg, None) if coll in ("allreduce", "reduce_scatter") else (None, arg)
    if coll == "reduce":
        op, root = arg
    if op is not None and op not in _OP_CODES:
        return fn
    if root is not None and not (type(root) is int and 0 <= root < ch.n):
        return fn
    if coll == "allgather":
        # resolved after agreement from the total; the signature carries the algorithm as given
        if not shape or (choose(ctx, coll, nbytes * ch.n) if algorithm == "auto" else "shm") != "shm":
            return fn
        c = zlib.crc32(repr(tuple(shape[1:])).encode()) if len(shape) > 1 else 0
        if shape[0] >= _ROWS:
            return fn
        fn = node.small_allgather_fn(ch, _word(coll, algorithm, algorithm, None, dtype, None), c, dtype, shape, _ROWS)
    elif (choose(ctx, coll, nbytes) if algorithm == "auto" else "shm") == "shm":
        a = _word(coll, algorithm, "shm", op, dtype, root)
        if coll == "allreduce":
            fn = node.small_allreduce_fn(ch, a, dtype, shape, op)
        elif coll == "reduce_scatter":
            fn = node.small_reduce_scatter_fn(ch, a, dtype, math.prod(shape), op)
        elif coll == "broadcast":
            fn = node.small_broadcast_fn(ch, a, dtype, shape, root)
        else:
            fn = node.small_reduce_fn(ch, a, dtype, shape, op, root)
    return fn


_SLOW = node.SLOW


def _fast(comm: Any, key: tuple, x: np.ndarray, out: np.ndarray | None = None) -> Any:
    """Run ``key``'s one-step function on ``x``, or return ``_SLOW`` when there is none (the
    caller then takes the general path). Raises the agreement error on a mismatch."""
    ctx = get_context(comm)
    try:
        fn = ctx.fast.get(key)
    except TypeError:  # an unhashable argument: the general path says what is wrong with it
        return _SLOW
    if fn is None:
        if len(ctx.fast) > 256:
            ctx.fast.clear()
        fn = ctx.fast[key] = _fast_fn(ctx, key)
    if not fn:
        return _SLOW
    res = fn(x) if out is None else fn(x, out)
    if res is node.MISMATCH:
        coll, _, _, arg, algorithm = key
        if coll in ("allreduce", "reduce_scatter"):
            call = _Call(ctx, coll, x, algorithm, op=arg)
        elif coll == "reduce":
            call = _Call(ctx, coll, x, algorithm, op=arg[0], root=arg[1])
        else:
            call = _Call(ctx, coll, x, algorithm, root=arg)
        if coll != "allgather":
            call.resolved = "shm"
        call.seq = ctx.chan.seq
        call.mismatch_from_channel()
    if res is node.UNEVEN:
        return _allgather(x, key[4], out, comm, True, posted=True)
    return res


# -- allreduce ---------------------------------------------------------------------------
def _aliases(a: np.ndarray, b: np.ndarray) -> bool:
    """True when ``a`` and ``b`` are the same elements (equal views of one buffer)."""
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.strides == b.strides
        and a.dtype == b.dtype
    )


def _allreduce(x, op, algorithm, out, comm, blocking, agreed=False):
    ctx = get_context(comm)
    call = _Call(ctx, "allreduce", x, algorithm, op, agreed=_counts_of(ctx, x) if agreed else None)
    x = call.x
    _check_out(call, out, x.shape)
    call.resolve(x.nbytes)
    small = call.small(x.nbytes)
    call.agree(x.size, payload=np.ascontiguousarray(x) if small else None)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    elif out is not x and _aliases(out, x):
        x = out  # two views of the same memory: in place (MPI refuses aliased buffers)
    elif out is not x and np.may_share_memory(out, x):
        x = x.copy()  # overlapping differently: the input must survive the writes to out
    n = ctx.transport.size
    if n == 1 or x.size == 0:
        if out is not x:
            np.copyto(out, x)
        return _done(out, blocking, ctx)
    buf = _flat(out)
    if small:
        node.small_allreduce(ctx.chan, call.seq, out, op)
        return _done(out, blocking, ctx)
    fn = REGISTRY["allreduce"][call.resolved]
    on_done = lambda: finalize(buf, op, n)
    if call.resolved == "shm":
        # shared windows are allocated collectively: here, in call order, not mid-schedule
        if ctx.layout().nodes == 1:
            ctx.channel()
            on_done = None  # the node algorithm finalizes each slice itself
        else:
            ctx.shm_segments()
    if call.resolved in ("native", "shm") and x.flags.c_contiguous and out is not x:
        gen = fn(ctx, ctx.transport, buf, op, 0, src=_flat(x))
    else:
        if out is not x:
            np.copyto(out, x)
        gen = fn(ctx, ctx.transport, buf, op, ctx.next_tag())
    return _launch(ctx, gen, blocking, out, on_done)


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
    if type(x) is np.ndarray:
        # the common small case on one node: the same posts as the general path, less Python
        res = _fast(comm, ("allreduce", x.dtype, x.shape, op, algorithm), x, out)
        if res is not _SLOW:
            return res
    return _allreduce(x, op, algorithm, out, comm, True)


def iallreduce(
    x: np.ndarray, *, op: str = "sum", algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> Request:
    """Start :func:`allreduce`; ``wait()`` on the returned request gives the result."""
    return _allreduce(x, op, algorithm, out, comm, False)


# -- reduce_scatter ----------------------------------------------------------------------
def _reduce_scatter(x, op, algorithm, out, comm, blocking, agreed=False):
    ctx = get_context(comm)
    call = _Call(ctx, "reduce_scatter", x, algorithm, op, agreed=_counts_of(ctx, x) if agreed else None)
    x = call.x
    t = ctx.transport
    n, r = t.size, t.rank
    counts = block_counts(x.size, n)
    off = offsets(counts)
    _check_out(call, out, (counts[r],))
    call.resolve(x.nbytes)
    small = call.small(x.nbytes)
    src = np.ascontiguousarray(x) if (small or call.resolved == "shm") and call.error is None else x
    call.agree(x.size, payload=src if small else None)
    result = np.empty(counts[r], x.dtype) if out is None else out
    if n == 1 or x.size == 0:
        result[...] = _flat(x)
        return _done(result, blocking, ctx)
    if small:
        node.small_reduce_scatter(ctx.chan, call.seq, counts, result, op)
        return _done(result, blocking, ctx)
    if call.resolved == "shm":
        ctx.channel()  # collective allocation, in call order
        gen = node.reduce_scatter(ctx, t, _flat(src), counts, op, 0, out=result)
        return _launch(ctx, gen, blocking, result)
    work = ctx.scratch.get(x.size, x.dtype)
    np.copyto(work, _flat(x))  # one copy, also of non-contiguous input
    gen = REGISTRY["reduce_scatter"][call.resolved](ctx, t, work, counts, op, ctx.next_tag())

    def on_done() -> None:
        result[...] = work[off[r] : off[r + 1]]
        ctx.scratch.put(work)
        finalize(result, op, n)

    return _launch(ctx, gen, blocking, result, on_done)


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
    if type(x) is np.ndarray:
        res = _fast(comm, ("reduce_scatter", x.dtype, x.shape, op, algorithm), x, out)
        if res is not _SLOW:
            return res
    return _reduce_scatter(x, op, algorithm, out, comm, True)


def ireduce_scatter(
    x: np.ndarray, *, op: str = "sum", algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> Request:
    """Start :func:`reduce_scatter`; ``wait()`` on the returned request gives the block."""
    return _reduce_scatter(x, op, algorithm, out, comm, False)


# -- allgather ---------------------------------------------------------------------------
_ROWS = 1 << 31
"""Allgather's count word carries this rank's rows plus ``(out rows + 1) * _ROWS`` (0: no
``out``), so every rank can check every rank's ``out`` against the agreed total."""


def _allgather(x, algorithm, out, comm, blocking, posted=False, rows=None):
    ctx = get_context(comm)
    call = _Call(ctx, "allgather", x, algorithm, agreed=None if rows is None else [int(r) for r in rows])
    x = call.x
    if call.error is None and x.ndim == 0:
        call.fail(InvalidArgumentError("allgather: x must have at least one dimension to concatenate along"))
    rows = x.shape[0] if x.ndim else 1
    item = x.shape[1:]
    if call.error is None and rows >= _ROWS:
        call.fail(InvalidArgumentError(f"allgather: {rows} rows; at most {_ROWS - 1}"))
    out_rows = -1
    if out is not None and call.error is None:
        _check_out(call, out, (out.shape[0] if getattr(out, "ndim", 0) else -1, *item))
        out_rows = out.shape[0] if call.error is None else -1
        if out_rows >= _ROWS:
            out_rows = _ROWS - 2
    t = ctx.transport
    # the algorithm depends on every rank's rows, so it is resolved after agreement; a
    # small payload goes along in case every rank's is small
    ch = ctx.chan
    src = np.ascontiguousarray(x)
    attach = ch is not None and call.error is None and x.nbytes <= ch.small and algorithm in ("auto", "shm")
    if posted:  # a one-step attempt posted and agreed this call already
        call.seq = ch.seq
    else:
        call.agree((rows % _ROWS) + (out_rows + 1) * _ROWS, item, payload=src if attach else None)
    words = call.counts()
    all_rows = [w % _ROWS for w in words]
    total = sum(all_rows)
    if call.agreed is not None and out is not None and out.shape[0] != total:
        raise OutputMismatchError(f"allgather: out must have {total} rows (the sum over ranks), not {out.shape[0]}")
    bad = {q: w // _ROWS - 1 for q, w in enumerate(words) if w >= _ROWS and w // _ROWS - 1 != total}
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
    if not _aliases(mine, _flat(src)):  # x may be its block of out already
        mine[...] = _flat(src)
    if t.size == 1 or buf.size == 0:
        return _done(out, blocking, ctx)
    if call.resolved == "shm" and ch is not None and max(counts) * x.itemsize <= ch.small:
        node.small_allgather(ch, call.seq, counts, buf)
        return _done(out, blocking, ctx)
    if call.resolved == "shm":
        ctx.channel()  # collective allocation, in call order
    gen = REGISTRY["allgather"][call.resolved](ctx, t, buf, counts, ctx.next_tag())
    return _launch(ctx, gen, blocking, out)


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
    if type(x) is np.ndarray:
        res = _fast(comm, ("allgather", x.dtype, x.shape, None, algorithm), x, out)
        if res is not _SLOW:
            return res
    return _allgather(x, algorithm, out, comm, True)


def iallgather(x: np.ndarray, *, algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None) -> Request:
    """Start :func:`allgather`; ``wait()`` on the returned request gives the result."""
    return _allgather(x, algorithm, out, comm, False)


# -- broadcast ---------------------------------------------------------------------------
def _broadcast(x, root, algorithm, out, comm, blocking, agreed=False):
    ctx = get_context(comm)
    call = _Call(ctx, "broadcast", x, algorithm, root=root, agreed=_counts_of(ctx, x) if agreed else None)
    x = call.x
    _check_out(call, out, x.shape)
    call.resolve(x.nbytes)
    small = call.small(x.nbytes)
    is_root = ctx.transport.rank == root
    call.agree(x.size, payload=np.ascontiguousarray(x) if small and is_root else None, one_step=small)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    if out is not x and is_root:
        np.copyto(out, x)
    if ctx.transport.size == 1 or x.size == 0:
        return _done(out, blocking, ctx)
    if small:
        node.small_broadcast(ctx.chan, call.seq, root, _flat(out))
        return _done(out, blocking, ctx)
    if call.resolved == "shm":
        ctx.channel()  # collective allocation, in call order
    gen = REGISTRY["broadcast"][call.resolved](ctx, ctx.transport, _flat(out), root, ctx.next_tag())
    return _launch(ctx, gen, blocking, out)


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
    if type(x) is np.ndarray:
        res = _fast(comm, ("broadcast", x.dtype, x.shape, root, algorithm), x, out)
        if res is not _SLOW:
            return res
    return _broadcast(x, root, algorithm, out, comm, True)


def ibroadcast(
    x: np.ndarray, root: int = 0, *, algorithm: str = "auto", out: np.ndarray | None = None, comm: Any = None
) -> Request:
    """Start :func:`broadcast`; ``wait()`` on the returned request gives the result."""
    return _broadcast(x, root, algorithm, out, comm, False)


# -- calls whose arguments the caller agreed already (collectives.agreed) ---------------
def allreduce_agreed(x: np.ndarray, *, op: str = "sum", out: np.ndarray | None = None, comm: Any = None) -> np.ndarray:
    """:func:`collectives.allreduce` with ``algorithm="auto"``, without the signature exchange
    (see :mod:`collectives.agreed`)."""
    if type(x) is np.ndarray:
        res = _fast(comm, ("allreduce", x.dtype, x.shape, op, "auto"), x, out)
        if res is not _SLOW:
            return res
    return _allreduce(x, op, "auto", out, comm, True, agreed=True)


def reduce_scatter_agreed(
    x: np.ndarray, *, op: str = "sum", out: np.ndarray | None = None, comm: Any = None
) -> np.ndarray:
    """:func:`collectives.reduce_scatter` with ``algorithm="auto"``, without the signature exchange
    (see :mod:`collectives.agreed`)."""
    if type(x) is np.ndarray:
        res = _fast(comm, ("reduce_scatter", x.dtype, x.shape, op, "auto"), x, out)
        if res is not _SLOW:
            return res
    return _reduce_scatter(x, op, "auto", out, comm, True, agreed=True)


def broadcast_agreed(x: np.ndarray, root: int = 0, *, out: np.ndarray | None = None, comm: Any = None) -> np.ndarray:
    """:func:`collectives.broadcast` with ``algorithm="auto"``, without the signature exchange
    (see :mod:`collectives.agreed`)."""
    if type(x) is np.ndarray:
        res = _fast(comm, ("broadcast", x.dtype, x.shape, root, "auto"), x, out)
        if res is not _SLOW:
            return res
    return _broadcast(x, root, "auto", out, comm, True, agreed=True)


def allgather_agreed(
    x: np.ndarray, rows: Sequence[int], *, out: np.ndarray | None = None, comm: Any = None
) -> np.ndarray:
    """:func:`collectives.allgather` with ``algorithm="auto"``, given every rank's rows
    (``rows[r]``: the first dimension of rank r's ``x``), without the signature exchange
    (see :mod:`collectives.agreed`)."""
    if type(x) is np.ndarray:
        res = _fast(comm, ("allgather", x.dtype, x.shape, None, "auto"), x, out)
        if res is not _SLOW:
            return res
    return _allgather(x, "auto", out, comm, True, rows=rows)


# -- reduce ------------------------------------------------------------------------------
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
    if type(x) is np.ndarray:
        res = _fast(comm, ("reduce", x.dtype, x.shape, (op, root), algorithm), x)
        if res is not _SLOW:
            return res
    ctx = get_context(comm)
    call = _Call(ctx, "reduce", x, algorithm, op, root=root)
    x = call.x
    call.resolve(x.nbytes)
    small = call.small(x.nbytes)
    call.agree(x.size, payload=np.ascontiguousarray(x) if small else None)
    t = ctx.transport
    is_root = t.rank == root
    out = np.empty(x.shape, x.dtype) if is_root else None
    if t.size == 1 or x.size == 0:
        if is_root:
            np.copyto(out, x)
        return out
    if small:
        if is_root:
            node.small_allreduce(ctx.chan, call.seq, out, op)
        return out
    if call.resolved == "shm":
        ctx.channel()  # collective allocation, in call order
    work = _flat(out) if is_root else ctx.scratch.get(x.size, x.dtype)
    np.copyto(work, _flat(x))
    try:
        ctx.run(REGISTRY["reduce"][call.resolved](ctx, t, work, root, op, ctx.next_tag()))
    finally:
        if not is_root:
            ctx.scratch.put(work)
    if is_root and call.resolved != "shm":  # the node algorithm finalizes each slice itself
        finalize(work, op, t.size)
    return out


# -- alltoall ----------------------------------------------------------------------------
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
    ctx = get_context(comm)
    t = ctx.transport
    call = _Call(ctx, "alltoall", x, algorithm)
    x = call.x
    rows = x.shape[0] if x.ndim else 0
    send_rows = np.zeros(t.size, np.int64)
    if call.error is None:
        if x.ndim == 0:
            call.fail(InvalidArgumentError("alltoall: x must have at least one dimension"))
        elif splits is None:
            if rows % t.size:
                call.fail(
                    InvalidArgumentError(f"alltoall: {rows} rows do not split evenly over {t.size} ranks; pass splits")
                )
            else:
                send_rows[:] = rows // t.size
        else:
            sp = np.asarray(splits, dtype=np.int64).reshape(-1)
            if sp.size != t.size or (sp < 0).any() or sp.sum() != rows:
                call.fail(
                    InvalidArgumentError(
                        f"alltoall: splits={list(sp)} must be {t.size} non-negative row counts summing to {rows}"
                    )
                )
            else:
                send_rows[:] = sp
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
