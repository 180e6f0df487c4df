"""What travels through the engine: a :class:`Submission`, its :class:`Descriptor`, and the
signature types of each kind.

A request's *descriptor* is what the other ranks learn about it in negotiation: its name,
kind, process set, *signature*, ``var`` and ``error``. The signature (a :class:`ReduceSig`,
:class:`GatherSig`, :class:`BroadcastSig`, :class:`SetSig`, :class:`SetIdSig`,
:class:`TimelineSig`, or ``()`` for a kind without arguments) is what every rank's must
equal; ``var`` is carried but may differ (a rank's allgather rows, a timeline's path);
``error`` is this rank's problem with its arguments, which makes the request fail on every
rank. Every one is a named tuple: hashable and equal by value, so descriptors key the
response cache and compare across ranks as plain tuples would, and are read by field name.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

import collectives

__all__ = [
    "Submission",
    "Descriptor",
    "ReduceSig",
    "GatherSig",
    "BroadcastSig",
    "SetSig",
    "SetIdSig",
    "TimelineSig",
    "field_label",
    "ProcessSetInfo",
    "DATA_KINDS",
    "JOIN_OK",
    "CONTROL_KINDS",
    "DTYPES",
    "identity",
]


class ReduceSig(NamedTuple):
    """An allreduce's or reducescatter's signature. ``memory`` (in every data kind's
    signature) is where the buffers are: ``"host"``, or ``"device"`` where CUDA tensors
    stay on their GPU (CuPy views); ranks must agree on it, as Horovod's on CPU or GPU."""

    dtype: str
    shape: tuple[int, ...]
    op: str
    prescale_factor: float
    postscale_factor: float
    memory: str


class GatherSig(NamedTuple):
    """An allgather's or alltoall's signature: the rows (first dimension) may differ."""

    dtype: str
    item_shape: tuple[int, ...]
    memory: str


class BroadcastSig(NamedTuple):
    """A broadcast's signature."""

    dtype: str
    shape: tuple[int, ...]
    root_rank: int  # -1: not a rank
    memory: str


class SetSig(NamedTuple):
    """add_process_set's signature: the new set's ranks."""

    ranks: tuple[int, ...]


class SetIdSig(NamedTuple):
    """remove_process_set's signature: the set's id."""

    process_set: int


class TimelineSig(NamedTuple):
    """start_timeline's signature."""

    mark_cycles: bool


_LABELS = {"item_shape": "shape after the first dimension", "process_set": "process set"}


def field_label(field: str) -> str:
    """A signature field's name as error messages show it."""
    return _LABELS.get(field, field)


def _on_device(sig: tuple) -> bool:
    """Whether a signature's buffers stay on a GPU: its ``memory`` field (host where it has none)."""
    return getattr(sig, "memory", "host") == "device"


class Descriptor(NamedTuple):
    """What the other ranks learn about a request in negotiation (the response cache's key)."""

    name: str
    kind: str
    set_id: int
    sig: tuple  # one of the signature types above, or () for a kind without arguments
    var: Any = None
    error: str | None = None

    @property
    def on_device(self) -> bool:
        """Whether the request's buffers stay on a GPU (the device path)."""
        return _on_device(self.sig)


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


class Submission:
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
    def desc(self) -> Descriptor:
        """What the other ranks learn about this request (hashable; the cache key)."""
        return Descriptor(self.name, self.kind, self.set_id, self.sig, self.var, self.error)

    @property
    def on_device(self) -> bool:
        """Whether this request's buffers stay on a GPU (CuPy views of CUDA tensors)."""
        return _on_device(self.sig)

    def finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        """Record the outcome and wake whoever waits on the request."""
        self.result, self.exc = result, exc
        self.event.set()


@dataclasses.dataclass(slots=True)
class ProcessSetInfo:
    """A registered process set: its ranks (of the runtime's communicator) and, on its
    members, its communicator, the node window its buffers may live in (a
    :class:`collectives.node.arena.Arena`, or None where its ranks span nodes) and the engine's
    fusion buffer for it."""

    ranks: tuple[int, ...]
    comm: Any  # MPI.Comm on members, None elsewhere
    arena: Any = None
    fusion: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint8))
    device_fusion: Any = None
    """The fusion buffer of allreduces kept on the GPU (a CuPy array), made on first use."""
