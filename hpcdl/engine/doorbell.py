"""The engine's doorbells: how a rank tells the others to start a negotiation cycle, and how
an idle engine waits for that or for work of its own.

:class:`MPIDoorbell` rings with a small message to every peer; the idle engine waits on its
condition variable (which the user thread notifies) and polls for arrived messages, every
200 us after a cycle and less often later. That polling is what an idle engine costs: on a
machine whose cores all compute (two ranks on two cores), every wake-up is taken from the
training step.

:class:`ShmDoorbell` is used when every rank is on one node and futexes are available
(:mod:`collectives.node.futex`). Each rank owns a line of a small shared window holding ``bell``
(the highest cycle a peer asked it to start) and ``wake`` (a counter the engine sleeps
on). Ringing writes the cycle number into each peer's ``bell``, bumps its ``wake`` and
wakes it; the user thread bumps its own engine's ``wake`` when it submits. The engine
reads ``wake``, then looks for work and bells, then sleeps until ``wake`` changes, so a
ring or submit after the look changes the word it sleeps on and cannot be missed. It
sleeps until the next real deadline (the cycle time, the stall inspector), at most
:data:`_LONGEST`, and costs nothing while idle.
"""

from __future__ import annotations

import threading

import numpy as np
from mpi4py import MPI

from collectives.node import futex

__all__ = ["MPIDoorbell", "ShmDoorbell", "make_doorbell"]

_TAG_BELL = 17
_LINE = 64
_LONGEST = 0.05
"""The longest an idle engine sleeps without looking (a safety net: wake-ups are not lost)."""


class MPIDoorbell:
    """Doorbells as messages: a pre-posted receive from anyone, counted per peer and
    drained when the engine stops."""

    sleeps = False
    """The engine waits on its condition variable and polls :meth:`heard`."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.buf = np.zeros(1, np.int64)
        self.status = MPI.Status()
        self.req = comm.Irecv(self.buf, MPI.ANY_SOURCE, _TAG_BELL)
        self.sent = [0] * self.size
        self.got = [0] * self.size
        self.top = 0

    def ring(self, cycle: int) -> None:
        """Ask every other rank to start cycle ``cycle``."""
        k = np.array([cycle], np.int64)
        for r in range(self.size):
            if r != self.rank:
                self.comm.Send(k, r, _TAG_BELL)
                self.sent[r] += 1

    def heard(self) -> int:
        """The highest cycle any peer has asked this rank to start."""
        while self.req.Test(self.status):
            self.got[self.status.Get_source()] += 1
            self.top = max(self.top, int(self.buf[0]))
            self.req = self.comm.Irecv(self.buf, MPI.ANY_SOURCE, _TAG_BELL)
        return self.top

    def arm(self) -> int:
        return 0

    def sleep(self, seen: int, timeout: float) -> None:  # pragma: no cover - not used: sleeps is False
        raise NotImplementedError

    def poke(self) -> None:
        """The user thread has news; it notifies the condition variable itself."""

    def close(self) -> None:
        """Collective (every rank, same cycle): receive every bell still on its way."""
        self.req.Cancel()
        self.req.Wait(self.status)
        if not self.status.Is_cancelled():
            self.got[self.status.Get_source()] += 1
        expected = self.comm.alltoall(self.sent)
        for r, want in enumerate(expected):
            for _ in range(want - self.got[r]):
                self.comm.Recv(self.buf, r, _TAG_BELL)


class ShmDoorbell:
    """Doorbells through a shared window and futexes (every rank on one node)."""

    sleeps = True
    """The engine sleeps in :meth:`sleep` instead of on its condition variable."""

    def __init__(self, node: MPI.Comm) -> None:
        self.node = node
        self.rank, self.size = node.rank, node.size
        self.win = MPI.Win.Allocate_shared(_LINE, 8, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.bells: list[np.ndarray] = []
        self.wakes: list[np.ndarray] = []
        for r in range(self.size):
            mem, _ = self.win.Shared_query(r)
            words = np.frombuffer(mem, dtype=np.int64, count=_LINE // 8)
            self.bells.append(words[0:1])
            self.wakes.append(words[1:2])
        self.bells[self.rank][0] = 0
        self.wakes[self.rank][0] = 0
        self._addr = [w.ctypes.data for w in self.wakes]
        self._poke_lock = threading.Lock()
        self._closed = False
        node.Barrier()  # every line zeroed before anyone rings

    def ring(self, cycle: int) -> None:
        for r in range(self.size):
            if r != self.rank:
                self.bells[r][0] = cycle  # every ringer of a cycle writes the same number
        self.win.Sync()  # the bells before the wake counters
        for r in range(self.size):
            if r != self.rank:
                self.wakes[r][0] += 1
                futex.wake(self._addr[r])

    def heard(self) -> int:
        return int(self.bells[self.rank][0])

    def arm(self) -> int:
        """Read the wake counter before looking for work: :meth:`sleep` sleeps only while it
        still holds this value."""
        seen = int(self.wakes[self.rank][0])
        self.win.Sync()  # the counter before the bells and queue looked at next
        return seen

    def sleep(self, seen: int, timeout: float) -> None:
        futex.wait(self._addr[self.rank], seen, min(timeout, _LONGEST))

    def poke(self) -> None:
        """Called by the user thread after queueing work (no MPI call: the engine thread may
        be in one): bump our own wake counter and wake the engine."""
        with self._poke_lock:
            if self._closed:  # the engine has stopped and freed the window
                return
            self.wakes[self.rank][0] += 1
            futex.wake(self._addr[self.rank])

    def close(self) -> None:
        """Collective (every rank, same cycle): free the window and its communicator."""
        self.node.Barrier()  # nobody rings a freed window
        with self._poke_lock:
            self._closed = True
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()


def make_doorbell(comm: MPI.Comm, shm: bool) -> MPIDoorbell | ShmDoorbell:
    """Collective over ``comm``: a :class:`ShmDoorbell` when ``shm`` is asked for, futexes
    work and every rank shares this rank's node; else an :class:`MPIDoorbell`. Every rank
    decides alike (the node test is a reduction)."""
    if comm.size > 1:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        if comm.allreduce(bool(shm and futex.OK and node.size == comm.size), op=MPI.LAND):
            return ShmDoorbell(node)
        node.Free()
    return MPIDoorbell(comm)
