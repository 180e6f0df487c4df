"""What travels between workers and servers: tags, control messages and a polite wait.

Control messages are small pickled named tuples on :data:`CTRL` (to a server:
:class:`Register` with a :class:`TableSpec`, :class:`Ask`, :class:`Load`, :class:`Stats`,
:class:`Release`, :class:`Bye`) and :data:`CTRL_REPLY` (to a worker: a :class:`Reply`).
Data never is pickled: each partition of a table
(one :class:`~hpcdl.optim.HybridOptimizer`) has its own pair of tags, one for pushes
and one for replies, so a server posts its receives straight into the buffers that sum
them and a worker its receives straight into the buffers that hold the results; MPI
keeps the messages of one tag from one sender in order, which numbers the clocks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from collectives.launcher import waits_poll, yield_core
from collectives.link import testall

__all__ = [
    "CTRL",
    "CTRL_REPLY",
    "MAX_TABLES",
    "TableSpec",
    "Register",
    "Ask",
    "Load",
    "Stats",
    "Release",
    "Bye",
    "Reply",
    "Tags",
    "wait_politely",
    "NAP",
    "POLL_WINDOW",
    "wait_nap",
    "Counter",
    "as_bytes",
]

CTRL, CTRL_REPLY = 1, 2
MAX_TABLES = 64
"""Tables (optimizers) a server may hold at once; each picks a slot for its tables, whose
data tags are disjoint."""

_FIRST = 16


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """What every worker registers with a server for one
    :class:`~hpcdl.optim.HybridOptimizer`: the table's name, mode and layout, and for ssp
    and async the optimizer the server steps with. Every worker's must be equal but for
    ``init``, the starting values of this server's partitions (from worker 0 only)."""

    name: str
    mode: str  # "sync", "ssp" or "async"
    staleness: int
    bucket_numels: list[int]
    itemsize: int
    dtype: str  # a torch dtype's name
    node_ranks: int  # workers per node
    nodes: list[list[int]]  # each node's workers
    partition_bytes: int
    servers: list[int]
    workers: list[int]
    optimizer: type | None = None  # ssp and async: the optimizer class, and its groups
    groups: list[dict[str, Any]] | None = None
    hyper_keys: list[tuple[int, str, int]] | None = None  # (group, key, values) of each hyperparameter
    bucket_group: list[int] | None = None  # each bucket's parameter group
    init: dict[int, Any] | None = None

    def differences(self, other: TableSpec) -> list[str]:
        """The fields (``init`` aside) in which ``other`` differs."""
        names = [f.name for f in dataclasses.fields(self) if f.name != "init"]
        return [n for n in names if getattr(self, n) != getattr(other, n)]


class Register(NamedTuple):
    """Worker to server: build the table of ``spec`` (once every worker of it asked)."""

    spec: TableSpec


class Ask(NamedTuple):
    """Worker to server: ``what`` ("state" or "params") of the table in ``slot``, once its
    partitions have taken the updates ``need`` counts."""

    what: str
    slot: int
    need: Any


class Load(NamedTuple):
    """Worker to server: load ``pieces`` (a checkpoint's partitions) at clock ``clock``."""

    slot: int
    pieces: dict[int, Any]
    clock: int


class Stats(NamedTuple):
    """Worker to server: the table's staleness counts and the server's bytes and CPU time."""

    slot: int


class Release(NamedTuple):
    """Worker to server: drop the table in ``slot`` (the optimizer was closed)."""

    slot: int


class Bye(NamedTuple):
    """Worker to server: this worker is done with the server."""


class Reply(NamedTuple):
    """Server to worker: ``value``, or the error message of a request that failed."""

    ok: bool
    value: Any


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a uint8 numpy array (any dtype, bfloat16 too):
    what a partition's message carries."""
    return t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


class Tags:
    """The data tags of the table in slot ``slot`` (of the server it is exchanged with)
    with ``pieces`` partitions."""

    def __init__(self, slot: int, pieces: int) -> None:
        stride = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - _FIRST) // MAX_TABLES
        if 2 * pieces + 1 > stride:
            raise ValueError(
                f"{pieces} partitions are more than this MPI's tags allow ({stride // 2 - 1}); raise partition_bytes"
            )
        self.base = _FIRST + (slot % MAX_TABLES) * stride
        self.hyper = self.base + 2 * pieces

    def push(self, piece: int) -> int:
        """Worker to server: a partition's gradient."""
        return self.base + 2 * piece

    def reply(self, piece: int) -> int:
        """Server to worker: a partition's sum (sync) or parameters (ssp, async)."""
        return self.base + 2 * piece + 1


class Counter:
    """Bytes this process sent and received on the parameter-server path (data only)."""

    __slots__ = ("sent", "received")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0


NAP = 1e-3
"""The longest sleep between polls of a worker or a dedicated server that waits where the
ranks of its host outnumber the cores they may run on (:func:`wait_nap`)."""


POLL_WINDOW = 5e-3
"""Where every rank has a core (:func:`wait_nap` 0), how long an idle dedicated server polls
without sleeping after its last message: through the gaps between one step's messages, not
through the workers' compute between steps."""


def wait_nap(spin: int, placement: list[tuple[str, list[int]]]) -> float:
    """The longest sleep between polls of a worker waiting on the dedicated servers, and of
    an idle server: :data:`NAP` where the ranks of some host outnumber the cores they may
    run on together (``placement``: each rank's host and the CPUs it may run on), so that
    a waiting rank leaves its core to the one it waits for; 0, only yielding between polls,
    where every rank has a core of its own, as MPI's own waits poll (an idle server then
    polls for :data:`POLL_WINDOW` after its last message, and sleeps after that). ``spin``
    (``HPCDL_SHM_SPIN``, as for the collectives' waits) decides instead where it is not -1:
    0 sleeps, more polls (:func:`collectives.launcher.waits_poll`, host by host)."""
    hosts: dict[str, list[list[int]]] = {}
    for host, cpus in placement:
        hosts.setdefault(host, []).append(list(cpus))
    return 0.0 if all(waits_poll(cpus, spin) for cpus in hosts.values()) else NAP


def wait_politely(
    reqs: list[Any],
    stall: Callable[[float], None] | None = None,
    spin: float = 50e-6,
    nap: float = 1e-3,
    progress: Callable[[], None] | None = None,
) -> None:
    """Wait for every request in ``reqs`` without holding a core: poll, and once nothing
    has completed for ``spin`` seconds sleep between polls, up to ``nap`` seconds (a
    rank that waits on a server shares the machine with it). ``nap=0`` only yields the
    core between polls (:func:`collectives.launcher.yield_core`): for a rank with a core
    of its own, and for a process whose own thread serves the requests (a co-located
    server), which a napping waiter would have to win the GIL back from at every wake-up. ``progress()``, where
    given, is called at every poll (the co-located server's :meth:`.Server.serve_once`).
    ``stall(seconds)`` is called about once a second while the wait goes on."""
    if not reqs:
        return
    if testall(reqs):
        return
    start = told = time.perf_counter()
    sleep = 0.0
    while not testall(reqs):
        if progress is not None:
            progress()
        now = time.perf_counter()
        if now - start > spin:
            if nap:
                sleep = min(nap, max(sleep * 2, 20e-6))
                time.sleep(sleep)
            else:
                yield_core()
        if stall is not None and now - told >= 1.0:
            told = now
            stall(now - start)
