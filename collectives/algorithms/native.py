"""The MPI library's own collectives, as a baseline and a fallback.

Always the nonblocking call: MPI never matches a blocking collective with a nonblocking
one, and whether other operations are in flight differs between ranks, so the choice
must not depend on it. Waiting on the request with others in flight keeps them
progressing. bfloat16
has no MPI datatype: it travels as 16-bit words reduced by a user-defined op.
"""

from __future__ import annotations

from collections.abc import Generator

import ml_dtypes
import numpy as np
from mpi4py import MPI

from ..blocks import offsets
from ..errors import InvalidArgumentError
from ..ops import reduce_into

Schedule = Generator[list, None, None]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
_user_ops: dict[str, MPI.Op] = {}


def mpi_op(op: str) -> MPI.Op:
    """The MPI library's predefined op for the reduction ``op`` (avg: SUM, divided after)."""
    return _MPI_OP[op]


def _bf16_op(op: str) -> MPI.Op:
    if op not in _user_ops:

        def fn(inbuf, inoutbuf, datatype):  # noqa: ARG001 - MPI's signature
            reduce_into(np.frombuffer(inoutbuf, dtype=_BF16), np.frombuffer(inbuf, dtype=_BF16), op)

        _user_ops[op] = MPI.Op.Create(fn, commute=True)
    return _user_ops[op]


def _spec(buf: np.ndarray, op: str | None = None):
    """Buffer spec and op for mpi4py, mapping bfloat16 onto 16-bit words."""
    if buf.dtype == _BF16:
        return [buf.view(np.uint16), MPI.UINT16_T], (_bf16_op(op) if op else None)
    return buf, (mpi_op(op) if op else None)


def _comm(t):
    comm = getattr(t, "comm", None)
    if comm is None:
        raise InvalidArgumentError("algorithm 'native' needs an MPI communicator, not a " + type(t).__name__)
    return comm


def allreduce(ctx, t, buf: np.ndarray, op: str, tag: int, src: np.ndarray | None = None) -> Schedule:
    """``MPI_Allreduce`` of ``src`` (or in place) into ``buf``."""
    comm = _comm(t)
    recv, mop = _spec(buf, op)
    send = MPI.IN_PLACE if src is None or src is buf else _spec(src)[0]
    yield [comm.Iallreduce(send, recv, mop)]


def reduce_scatter(ctx, t, buf: np.ndarray, counts: tuple[int, ...], op: str, tag: int) -> Schedule:
    """``MPI_Reduce_scatter`` of ``buf``; this rank's block lands in place in ``buf``."""
    comm = _comm(t)
    off = offsets(counts)
    r = t.rank
    tmp = ctx.scratch.get(counts[r], buf.dtype)
    try:
        send, mop = _spec(buf, op)
        recv, _ = _spec(tmp)
        yield [comm.Ireduce_scatter(send, recv, list(counts), mop)]
        buf[off[r] : off[r + 1]] = tmp
    finally:
        ctx.scratch.put(tmp)


def allgather(ctx, t, buf: np.ndarray, counts: tuple[int, ...], tag: int) -> Schedule:
    """``MPI_Allgatherv`` in place into ``buf`` (blocks given by ``counts``)."""
    comm = _comm(t)
    raw = buf.view(np.uint8)
    k = buf.itemsize
    spec = [raw, ([c * k for c in counts], [o * k for o in offsets(counts)[:-1]]), MPI.BYTE]
    yield [comm.Iallgatherv(MPI.IN_PLACE, spec)]


def broadcast(ctx, t, buf: np.ndarray, root: int, tag: int) -> Schedule:
    """``MPI_Bcast`` of ``buf`` from ``root``."""
    comm = _comm(t)
    raw = buf.view(np.uint8)
    yield [comm.Ibcast(raw, root)]


def reduce(ctx, t, buf: np.ndarray, root: int, op: str, tag: int) -> Schedule:
    """``MPI_Reduce`` of ``buf`` onto ``root`` in place."""
    comm = _comm(t)
    spec, mop = _spec(buf, op)
    send = MPI.IN_PLACE if t.rank == root else spec
    recv = spec if t.rank == root else None
    yield [comm.Ireduce(send, recv, mop, root)]


def alltoall(ctx, t, send: np.ndarray, sendcounts, recv: np.ndarray, recvcounts, tag: int) -> Schedule:
    """``MPI_Alltoallv`` of byte blocks."""
    comm = _comm(t)
    s = [send.view(np.uint8), (list(sendcounts), list(offsets(tuple(sendcounts))[:-1])), MPI.BYTE]
    r = [recv.view(np.uint8), (list(recvcounts), list(offsets(tuple(recvcounts))[:-1])), MPI.BYTE]
    yield [comm.Ialltoallv(s, r)]
