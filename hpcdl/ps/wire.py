"""What travels between workers and servers: tags, control messages and a polite wait.

Control messages are small pickled tuples on :data:`CTRL` (to a server) and
:data:`CTRL_REPLY` (to a worker). Data never is pickled: each partition of a table
(one :class:`~hpcdl.optim.HybridOptimizer`) has its own pair of tags, one for pushes
and one for replies, so a server posts its receives straight into the buffers that sum
them and a worker its receives straight into the buffers that hold the results; MPI
keeps the messages of one tag from one sender in order, which numbers the clocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["CTRL", "CTRL_REPLY", "MAX_TABLES", "Tags", "wait_politely", "Counter", "as_bytes"]

CTRL, CTRL_REPLY = 1, 2
MAX_TABLES = 64
"""Tables (optimizers) a server may hold at once; each picks a slot for its tables, whose
data tags are disjoint."""

_FIRST = 16


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


def wait_politely(
    reqs: list[Any], stall: Callable[[float], None] | None = None, spin: float = 50e-6, nap: float = 1e-3
) -> None:
    """Wait for every request in ``reqs`` without holding a core: poll, and once nothing
    has completed for ``spin`` seconds sleep between polls, up to ``nap`` seconds (a
    rank that waits on a server shares the machine with it). ``nap=0`` only yields the
    interpreter between polls: for a process whose own thread serves the requests (a
    co-located server), which a napping waiter would have to win the GIL back from at
    every wake-up. ``stall(seconds)`` is called about once a second while the wait goes on."""
    if not reqs:
        return
    if MPI.Request.Testall(reqs):
        return
    start = told = time.perf_counter()
    sleep = 0.0
    while not MPI.Request.Testall(reqs):
        now = time.perf_counter()
        if now - start > spin:
            sleep = min(nap, max(sleep * 2, 20e-6)) if nap else 0.0
            time.sleep(sleep)
        if stall is not None and now - told >= 1.0:
            told = now
            stall(now - start)
