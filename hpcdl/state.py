"""The runtime's one context object: what ``init`` built and ``shutdown`` ends.

:class:`Runtime` holds the communicator, this rank's place in the job, the engine and what
the torch layer keeps per process (the handle table, counters of unnamed requests, the
registered process sets). :func:`current` is the accessor every other module uses; only
:mod:`hpcdl.basics` installs and removes the object.
"""

from __future__ import annotations

import threading
from typing import Any

from mpi4py import MPI

from collectives.context import get_context

from .config import Config
from .errors import NOT_INITIALIZED, HpcdlError

__all__ = ["Runtime", "current", "running", "peek", "install", "take", "LOCK", "servers_ended", "mark_servers_ended"]


class Runtime:
    """The initialized runtime of this process.

    Attributes:
        comm: the runtime's communicator.
        owned: True when ``init`` created ``comm`` (from a list of ranks): ``shutdown`` frees it.
        config: the runtime's :class:`~hpcdl.Config`, agreed across ranks.
        rank, size, local_rank, local_size, cross_rank, cross_size, homogeneous: the layout.
        engine: the background engine (:class:`hpcdl.engine.Engine`).
        handles: handle number to pending operation (:mod:`hpcdl.handles`).
        counters: per (kind, process set) count of unnamed requests, for their names.
        process_sets: the registered :class:`~hpcdl.ProcessSet` objects (unregistered at shutdown).
        grid: the most recently built ``hpcdl.parallel.Grid`` (None before one is built).
        ps: the job's dedicated parameter servers (:class:`hpcdl.ps.PSJob`), or None.
        at_shutdown: callables ``shutdown`` runs before it stops the engine (co-located
            parameter servers say goodbye there).
    """

    def __init__(self, comm: MPI.Comm, owned: bool, config: Config) -> None:
        self.comm = comm
        self.config = config
        self.owned = owned
        lay = get_context(comm).topology()
        self.rank, self.size = comm.rank, comm.size
        self.local_rank, self.local_size = lay.node.rank, lay.node.size
        self.cross_rank, self.cross_size = lay.cross.rank, lay.cross.size
        self.homogeneous = lay.homogeneous
        self.engine: Any = None
        self.handles: dict[int, Any] = {}
        self.next_handle = 1
        self.counters: dict[tuple[str, int], int] = {}
        self.process_sets: list[Any] = []
        self.grid: Any = None
        self.ps: Any = None
        self.at_shutdown: list[Any] = []


_current: Runtime | None = None
_servers_ended = False  # this job's dedicated parameter servers have exited (part of the runtime's record)

LOCK = threading.Lock()
"""Held by ``init`` and ``shutdown`` while they build or end the runtime."""


def peek() -> Runtime | None:
    """The runtime, or None before ``init`` and after ``shutdown``."""
    return _current


def current() -> Runtime:
    """The runtime; raises ``ValueError`` (as Horovod does) before ``init``."""
    rt = _current
    if rt is None:
        raise ValueError(NOT_INITIALIZED)
    return rt


def running() -> Runtime:
    """The runtime, checking that its engine runs (for calls that submit requests)."""
    rt = current()
    if rt.engine is None:
        raise HpcdlError("hpcdl's engine is not running; call hpcdl.init()")
    return rt


def install(rt: Runtime) -> None:
    """Make ``rt`` the runtime (``init``, under :data:`LOCK`)."""
    global _current
    _current = rt


def take() -> Runtime | None:
    """Remove the runtime and return it (``shutdown``, under :data:`LOCK`)."""
    global _current
    rt, _current = _current, None
    return rt


def mark_servers_ended() -> None:
    """Record that this job's dedicated parameter servers were told to end (``shutdown``)."""
    global _servers_ended
    _servers_ended = True


def servers_ended() -> bool:
    """True once this job's dedicated parameter servers have ended: their ranks are gone, so
    no collective over the world can run again in this job."""
    return _servers_ended
