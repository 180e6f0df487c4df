"""What travels through the engine: a :class:`Request`, its descriptor, and the tables of
what each kind's signature holds.

A request's *descriptor* is what the other ranks learn about it in negotiation:
``(name, kind, process set id, signature, var, error)``. The signature is the tuple every
rank's must equal (dtype, shape, op, ...; see :data:`SIG_FIELDS`); ``var`` is carried but
may differ (a timeline's path); ``error`` is this rank's problem with its arguments, which
makes the request fail on every rank.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np

import collectives

__all__ = ["Request", "ProcessSetInfo", "SIG_FIELDS", "DATA_KINDS", "JOIN_OK", "CONTROL_KINDS", "DTYPES", "identity"]

SIG_FIELDS: dict[str, tuple[str, ...]] = {
    "allreduce": ("dtype", "shape", "op", "prescale_factor", "postscale_factor", "memory"),
    "reducescatter": ("dtype", "shape", "op", "prescale_factor", "postscale_factor", "memory"),
    "allgather": ("dtype", "shape after the first dimension", "memory"),
    "broadcast": ("dtype", "shape", "root_rank", "memory"),
    "alltoall": ("dtype", "shape after the first dimension", "memory"),
    "barrier": (),
    "add_process_set": ("ranks",),
    "remove_process_set": ("process set",),
    "start_timeline": ("mark_cycles",),
    "stop_timeline": (),
}
"""The compared fields of each kind's signature, in order, for error messages. A data
kind's last field is its buffers' memory: ``"host"``, or ``"device"`` where CUDA tensors
stay on their GPU (CuPy views); ranks must agree on it, as Horovod's on CPU or GPU."""

DATA_KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
"""Kinds that move data through :mod:`collectives`."""

JOIN_OK = ("allreduce", "barrier")
"""Kinds that run while some ranks have joined (a joined rank contributes the op's
identity), as in Horovod; any other is an error on the ranks that submitted it."""

CONTROL_KINDS = ("add_process_set", "remove_process_set", "start_timeline", "stop_timeline")
"""Kinds every rank runs, members of the request's process set or not."""

DTYPES: dict[str, np.dtype] = {str(d): d for d in collectives.DTYPES} | {"bool": np.dtype(np.uint8)}
"""Torch dtype names (as signatures carry them) to the numpy dtype that holds them."""


def identity(op: str, dtype: np.dtype) -> Any:
    """The value a joined rank contributes to a reduction with ``op``."""
    if op in ("sum", "avg", "adasum"):  # adasum(a, 0) = a
        return 0
    if op == "prod":
        return 1
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if op == "min" else info.min
    inf = float(ml_dtypes.finfo(dtype).max) if dtype == np.dtype(ml_dtypes.bfloat16) else np.inf
    return inf if op == "min" else -inf


class Request:
    """One submitted operation: its descriptor, its numpy buffers, and its completion."""

    __slots__ = (
        "name",
        "kind",
        "set_id",
        "sig",
        "var",
        "error",
        "x",
        "out",
        "args",
        "nbytes",
        "result",
        "exc",
        "event",
        "t_submit",
        "t_announce",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        set_id: int,
        sig: tuple,
        *,
        var: Any = None,
        error: str | None = None,
        x: np.ndarray | None = None,
        out: np.ndarray | None = None,
        **args: Any,
    ) -> None:
        self.name, self.kind, self.set_id, self.sig, self.var, self.error = name, kind, set_id, sig, var, error
        self.x, self.out, self.args = x, out, args
        self.nbytes = 0 if x is None else x.nbytes
        self.result: Any = None
        self.exc: BaseException | None = None
        self.event = threading.Event()
        self.t_submit = time.perf_counter()
        self.t_announce = 0.0

    @property
    def desc(self) -> tuple:
        """What the other ranks learn about this request (hashable; the cache key)."""
        return (self.name, self.kind, self.set_id, self.sig, self.var, self.error)

    def finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        """Record the outcome and wake whoever waits on the request."""
        self.result, self.exc = result, exc
        self.event.set()


@dataclasses.dataclass(slots=True)
class ProcessSetInfo:
    """A registered process set: its ranks (of the runtime's communicator) and, on its
    members, its communicator, the node window its buffers may live in (a
    :class:`collectives.arena.Arena`, or None where its ranks span nodes) and the engine's
    fusion buffer for it."""

    ranks: tuple[int, ...]
    comm: Any  # MPI.Comm on members, None elsewhere
    arena: Any = None
    fusion: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint8))
    device_fusion: Any = None
    """The fusion buffer of allreduces kept on the GPU (a CuPy array), made on first use."""
