"""Emulated links between nodes (``HPCDL_LINK``).

On one machine every byte moves at memory speed, so the algorithms built for clusters —
hierarchical allreduce, parameter servers across nodes — can only lose there. With a link
set (``HPCDL_LINK="latency=5us,bandwidth=12.5GB/s"`` or a name from
:data:`.cost.LINKS`), every point-to-point message of the collectives between two ranks of
different nodes (real ones, or the simulated nodes of ``HPCDL_RANKS_PER_NODE``) costs what
it would on that link:

- each node has one port out (a NIC), shared by every message that leaves the node: a
  message of ``S`` bytes occupies it for ``S / bandwidth`` from when it is free, so two
  flows leaving at once get half the bandwidth each;
- it arrives ``latency`` after it has left the port: MPI carries its bytes at once, with
  that arrival time beside them, and the receive completes no earlier (the send, no
  earlier than the bytes have left the port).

Only timing changes: the bytes are MPI's, so results are bitwise what they are without a
link. Messages inside a node go straight through; so do MPI's own collective calls, which
``auto`` therefore leaves across emulated nodes. The port's clock lives in a shared window
of the node's ranks, reserved by MPI's atomic compare-and-swap. Where ranks share cores a
waiting rank sleeps rather than polls, so that they do not slow each other's emulated time;
where each has a core of its own it polls (:func:`.launcher.waits_poll`), so that a latency
of a few microseconds holds too.

The same link applies outside the collectives, to communicators wrapped by
:func:`emulate_comm` (a :class:`LinkComm`: the parameter servers' data and the pipeline's
point-to-point): their ``Isend``/``Irecv``/``Mprobe`` take the link's time, and
:func:`testall`, :func:`waitall` and :func:`testsome` wait on their requests and MPI's
alike. Everything crossing a node shares one port: :func:`locate`, collective over the
job's ranks, numbers the nodes and makes each node's port once, and every emulated
transport and communicator of its ranks takes both from there (without it, each
collectives context makes its own).
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .cost import AlphaBeta
from .errors import ConfigError
from .launcher import process_cpus, waits_poll, yield_core
from .transport import MPITransport

__all__ = [
    "LinkComm",
    "LinkRequest",
    "LinkTransport",
    "Located",
    "Port",
    "emulate",
    "emulate_comm",
    "locate",
    "located",
    "testall",
    "testsome",
    "waitall",
]


class Port:
    """One node's port out: the time (``time.perf_counter_ns``) until which it is busy, in a
    shared window of the node's ranks (collective over ``node``, an intracommunicator of
    the ranks sharing the port)."""

    def __init__(self, node: MPI.Comm) -> None:
        self.win = MPI.Win.Allocate_shared(8 if node.Get_rank() == 0 else 0, 8, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        if node.Get_rank() == 0:
            mem, _ = self.win.Shared_query(0)
            np.frombuffer(mem, np.int64, count=1)[0] = 0
        self.win.Sync()
        node.Barrier()
        self._seen = np.zeros(1, np.int64)
        self._want = np.zeros(1, np.int64)
        self._old = np.zeros(1, np.int64)
        self._lock = threading.Lock()  # a rank's threads (engine, server, training) share the buffers

    def reserve(self, nanoseconds: int, now: int) -> int:
        """Occupy the port for ``nanoseconds`` from when it is next free (``now`` at the
        earliest); the time the occupation ends."""
        with self._lock:
            return self._reserve(nanoseconds, now)

    def _reserve(self, nanoseconds: int, now: int) -> int:
        self.win.Get(self._seen, 0, 0)
        self.win.Flush(0)
        while True:
            start = max(now, int(self._seen[0]))
            self._want[0] = start + nanoseconds
            self.win.Compare_and_swap(self._want, self._seen, self._old, 0, 0)
            self.win.Flush(0)
            if self._old[0] == self._seen[0]:
                return int(self._want[0])
            self._seen[0] = self._old[0]


class LinkRequest:
    """A request of :class:`LinkTransport`; quacks like ``MPI.Request``. It completes when
    its MPI requests have and the clock (``perf_counter_ns``) has passed ``at``: for a send
    across nodes, when its bytes have left the port; for a receive, when they arrive, a
    time the sender passes along with them (``stamp``). ``poll``: whether a wait on it
    polls (:func:`.launcher.waits_poll`)."""

    __slots__ = ("at", "poll", "reqs", "stamp")

    def __init__(self, reqs: list[Any], at: int = 0, stamp: np.ndarray | None = None, poll: bool = False) -> None:
        self.reqs, self.at, self.stamp, self.poll = reqs, at, stamp, poll  # a send keeps its stamp alive, at set

    def _due(self) -> int:
        return self.at if self.at else int(self.stamp[0]) if self.stamp is not None else 0

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling
        return MPI.Request.Testall(self.reqs) and time.perf_counter_ns() >= self._due()

    def Wait(self) -> None:  # noqa: N802
        LinkRequest.Waitall([self])

    def Cancel(self) -> None:  # noqa: N802
        for r in self.reqs:
            r.Cancel()

    @classmethod
    def Testall(cls, reqs: list[LinkRequest]) -> bool:  # noqa: N802
        return all([r.Test() for r in reqs])

    @classmethod
    def Waitall(cls, reqs: list[LinkRequest]) -> None:  # noqa: N802
        # the receives' arrival times first (they come at once), then sleep until the last
        # is due; MPI's own wait would poll the core that a rank sharing it may need to send
        # what this one waits for, so there this one looks every 20 µs and sleeps in between
        poll = any(r.poll for r in reqs)
        _sleep_while_pending([r.reqs[1] for r in reqs if r.stamp is not None and not r.at], poll)
        _sleep_until(max(r._due() for r in reqs))
        _sleep_while_pending([q for r in reqs for q in r.reqs], poll)


def _poll_of(comm: MPI.Comm, spin: int) -> bool:
    """Whether this rank's waits on the link poll (collective over ``comm``): as
    :func:`.launcher.waits_poll` says for the ranks of ``comm`` on this rank's machine. Else
    they sleep 20 µs between looks, a timer's sleep (77 µs on a virtual machine, which an
    emulated latency of 5 µs would drown in)."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return waits_poll(shared.allgather(process_cpus()), spin)
    finally:
        shared.Free()


def _sleep_while_pending(reqs: list[Any], poll: bool) -> None:
    while reqs and not MPI.Request.Testall(reqs):
        if poll:
            yield_core()
        else:
            time.sleep(20e-6)


def _sleep_until(at: int) -> None:
    """Wait until ``at``: sleep half the time left while more than 300 µs is (a sleep can
    overshoot by a few hundred µs), then poll, yielding the core to any rank that shares it."""
    while (late := at - time.perf_counter_ns()) > 0:
        if late > 300_000:
            time.sleep(late / 2e9)
        else:
            yield_core()


class LinkTransport(MPITransport):
    """An :class:`MPITransport` whose messages between ranks of different nodes take the
    time ``link`` says (module docstring): each goes at once, with its arrival time on a
    duplicate of the communicator, and the receive completes no earlier. ``nodes``: each
    rank's node, by rank; ``port``: this rank's node's :class:`Port`; ``poll``: whether its
    waits poll (:func:`.launcher.waits_poll`)."""

    def __init__(self, comm: MPI.Comm, link: AlphaBeta, nodes: list[Any], port: Port, poll: bool = False) -> None:
        super().__init__(comm)
        self.link, self.nodes, self.port, self.poll = link, nodes, port, poll
        self.wire = LinkComm(comm, link, nodes, port, poll)
        """Times the messages: the transport's are stamped as :class:`LinkComm`'s are."""

    @property
    def crossed(self) -> int:
        """Bytes this rank sent to other nodes."""
        return self.wire.crossed

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> LinkRequest:
        return self.wire.stamp_send(super().isend(buf, dest, tag), buf.nbytes, dest, tag)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> LinkRequest:
        return self.wire.stamp_recv(super().irecv(buf, source, tag), source, tag)

    def split(self, color: int, key: int) -> LinkTransport:
        sub = self.comm.Split(color, key)
        return LinkTransport(sub, self.link, sub.allgather(self.nodes[self.rank]), self.port, self.poll)

    def split_shared(self) -> LinkTransport:
        sub = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        return LinkTransport(sub, self.link, sub.allgather(self.nodes[self.rank]), self.port, self.poll)

    def free(self) -> None:
        super().free()
        self.wire.stamps.Free()


class Located(NamedTuple):
    """Where :func:`locate` put this process: its ``node`` (a number, the same on every rank
    of the node), the node's :class:`Port`, the emulated ``link`` (None without one), the
    ``ranks_per_node`` that cut the nodes and whether waits on the link ``poll``
    (:func:`.launcher.waits_poll`, decided by every rank of the job on this machine)."""

    node: int
    port: Port | None
    link: AlphaBeta | None
    ranks_per_node: int
    poll: bool = False


_LOCATED: Located | None = None


def located() -> Located | None:
    """This process's :class:`Located`, once :func:`locate` has run (else None)."""
    return _LOCATED


def locate(comm: MPI.Comm, ranks_per_node: int, link: AlphaBeta | None, spin: int = -1) -> Located:
    """Number the nodes of ``comm``'s ranks as the collectives see them (the ranks sharing
    memory, cut into ``ranks_per_node`` where that is set) and, with a ``link``, make each
    node's :class:`Port`; collective over ``comm``. Contexts and :func:`emulate_comm` made
    afterwards over any subset of these ranks take their nodes, and port, from here: a
    subset's own shared-memory split would not know where the cuts between nodes fall.
    ``spin``: as for :func:`.launcher.waits_poll`.

    Raises:
        ConfigError: on every rank, where the ranks' links differ.
    """
    global _LOCATED
    _agree_link(comm, link)
    key, node = _node_of(comm, ranks_per_node)
    poll = _poll_of(comm, spin)
    keys = comm.allgather(key)
    port = Port(node) if link is not None else None  # lives as long as MPI
    node.Free()
    _LOCATED = Located(sorted(set(keys)).index(key), port, link, ranks_per_node, poll)
    return _LOCATED


def _agree_link(comm: MPI.Comm, link: AlphaBeta | None) -> None:
    """Raise :class:`ConfigError` on every rank of ``comm`` (collective) where the ranks'
    links differ."""
    links = set(comm.allgather(None if link is None else tuple(link)))
    if len(links) > 1:
        raise ConfigError(
            f"link: the ranks' links differ: {sorted(links, key=str)}; set HPCDL_LINK alike on every rank"
        )


def _node_of(comm: MPI.Comm, ranks_per_node: int) -> tuple[tuple[int, int], MPI.Comm]:
    """This rank's node among ``comm``'s (collective): its key, (the lowest rank of ``comm``
    on this machine, the cut of ``ranks_per_node`` on it), and a communicator of its ranks."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cut = shared.Get_rank() // ranks_per_node if ranks_per_node else 0
    leader = shared.bcast(comm.Get_rank(), root=0)  # names the machine; cut, the node on it
    node = shared.Split(cut, shared.Get_rank())
    shared.Free()
    return (leader, cut), node


def located_nodes(comm: MPI.Comm, ranks_per_node: int, link: Any = False) -> list[int] | None:
    """Each rank's node as :func:`locate` numbered it, by rank of ``comm``, where every
    rank of it was located with this ``ranks_per_node`` (and this ``link``, unless False);
    else None (collective over ``comm``)."""
    mine = _LOCATED
    ok = mine is not None and mine.ranks_per_node == ranks_per_node and (link is False or mine.link == link)
    nodes = comm.allgather(mine.node if ok else None)  # type: ignore[union-attr]
    return None if None in nodes else nodes


def emulate(t: MPITransport, link: AlphaBeta, ranks_per_node: int, spin: int = -1) -> LinkTransport:
    """``t`` with its messages between nodes taking ``link``'s time (collective over ``t``).
    The nodes are those the collectives see: :func:`locate`'s, with its ports, where every
    rank was located with this link and ``ranks_per_node``; else the ranks sharing memory,
    cut into ``ranks_per_node`` where that is set, with ports of their own. Each rank's
    link must be the same.

    Its waits poll or sleep as :func:`locate` decided, or else as
    :func:`.launcher.waits_poll` says for ``t``'s ranks (``spin`` as there).

    Raises:
        ConfigError: on every rank, where the ranks' links differ.
    """
    _agree_link(t.comm, link)
    nodes = located_nodes(t.comm, ranks_per_node, link)
    if nodes is not None:
        return LinkTransport(t.comm, link, nodes, _LOCATED.port, _LOCATED.poll)  # type: ignore[union-attr,arg-type]
    key, node = _node_of(t.comm, ranks_per_node)
    port = Port(node)  # lives as long as MPI: every transport split from this one shares it
    node.Free()
    return LinkTransport(t.comm, link, t.comm.allgather(key), port, _poll_of(t.comm, spin))


class LinkMessage:
    """A matched message of :meth:`LinkComm.Mprobe`; its ``Recv`` returns once the bytes have
    arrived across the link."""

    __slots__ = ("msg", "stamp")

    def __init__(self, msg: Any, stamp: np.ndarray | None) -> None:
        self.msg, self.stamp = msg, stamp

    def Recv(self, buf: Any) -> None:  # noqa: N802 - mpi4py's spelling
        self.msg.Recv(buf)
        if self.stamp is not None:
            _sleep_until(int(self.stamp[0]))


def _nbytes(buf: Any) -> int:
    """The bytes of an mpi4py buffer argument: an array, or ``[array, datatype]``."""
    return memoryview(buf[0] if isinstance(buf, (list, tuple)) else buf).nbytes


class LinkComm:
    """An mpi4py communicator whose ``Isend``, ``Irecv`` and ``Mprobe`` between ranks of
    different nodes take the time ``link`` says (module docstring), through ``port`` (this
    rank's node's); everything else (pickled ``send``/``recv``, probes, attributes) is the
    communicator's own, untimed. ``nodes``: each rank's node, by rank. Wait on its requests
    with :func:`testall`, :func:`waitall` or :func:`testsome`, which poll where ``poll``
    (:func:`.launcher.waits_poll`)."""

    def __init__(self, comm: MPI.Comm, link: AlphaBeta, nodes: list[Any], port: Port, poll: bool = False) -> None:
        self.comm, self.link, self.nodes, self.port, self.poll = comm, link, nodes, port, poll
        self.me = nodes[comm.Get_rank()]
        self.stamps = comm.Dup()
        """Where each message across nodes sends its arrival time (same peer and tag)."""
        self.crossed = 0
        """Bytes this rank sent to other nodes."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def __eq__(self, other: object) -> bool:  # as its communicator (MPI.COMM_NULL once freed)
        return self.comm == (other.comm if isinstance(other, LinkComm) else other)

    def __hash__(self) -> int:
        return id(self)

    def stamp_send(self, req: Any, nbytes: int, dest: int, tag: int) -> LinkRequest:
        """The started send ``req`` of ``nbytes`` to ``dest``, timed: across nodes it takes
        the port for its bytes and sends its arrival time beside them."""
        if self.nodes[dest] == self.me:
            return LinkRequest([req], poll=self.poll)
        self.crossed += nbytes
        left = self.port.reserve(round(nbytes / self.link.beta * 1e9), time.perf_counter_ns())
        stamp = np.array([left + round(self.link.alpha * 1e9)], np.int64)
        return LinkRequest([req, self.stamps.Isend(stamp, dest, tag)], left, stamp, self.poll)

    def stamp_recv(self, req: Any, source: int, tag: int) -> LinkRequest:
        """The started receive ``req`` from ``source``, timed: across nodes it completes no
        earlier than the arrival time the sender passes along."""
        if self.nodes[source] == self.me:
            return LinkRequest([req], poll=self.poll)
        stamp = np.zeros(1, np.int64)
        return LinkRequest([req, self.stamps.Irecv(stamp, source, tag)], 0, stamp, self.poll)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> LinkRequest:  # noqa: N802
        return self.stamp_send(self.comm.Isend(buf, dest, tag), _nbytes(buf), dest, tag)

    def Irecv(self, buf: Any, source: int, tag: int = MPI.ANY_TAG) -> LinkRequest:  # noqa: N802
        if source < 0 or tag < 0:
            raise ValueError("an emulated link's receive names its source and tag")
        return self.stamp_recv(self.comm.Irecv(buf, source, tag), source, tag)

    def Mprobe(self, source: int, tag: int = MPI.ANY_TAG, status: MPI.Status | None = None) -> LinkMessage:  # noqa: N802
        status = status if status is not None else MPI.Status()
        msg = self.comm.Mprobe(source, tag, status)
        src = status.Get_source()
        if self.nodes[src] == self.me:
            return LinkMessage(msg, None)
        stamp = np.zeros(1, np.int64)
        self.stamps.Recv(stamp, src, status.Get_tag())
        return LinkMessage(msg, stamp)

    def Dup(self) -> LinkComm:  # noqa: N802
        return LinkComm(self.comm.Dup(), self.link, self.nodes, self.port, self.poll)

    def Free(self) -> None:  # noqa: N802
        self.stamps.Free()
        self.comm.Free()


def emulate_comm(comm: MPI.Comm) -> Any:
    """``comm`` as a :class:`LinkComm` where :func:`locate` set a link up on every rank of it,
    else ``comm`` itself (collective over ``comm``)."""
    mine = _LOCATED
    link = mine.link if mine is not None else None
    nodes = located_nodes(comm, mine.ranks_per_node if mine is not None else -1, link)
    if nodes is None or link is None:
        return comm
    return LinkComm(comm, _LOCATED.link, nodes, _LOCATED.port, _LOCATED.poll)  # type: ignore[union-attr,arg-type]


def _plain(reqs: list[Any]) -> bool:
    return not any(type(r) is LinkRequest for r in reqs)


def testall(reqs: list[Any]) -> bool:
    """``MPI.Request.Testall`` for MPI's requests and :class:`LinkRequest` objects alike."""
    return MPI.Request.Testall(reqs) if _plain(reqs) else all([r.Test() for r in reqs])


def waitall(reqs: list[Any]) -> None:
    """``MPI.Request.Waitall`` for MPI's requests and :class:`LinkRequest` objects alike."""
    if _plain(reqs):
        MPI.Request.Waitall(reqs)
    else:
        LinkRequest.Waitall([r if type(r) is LinkRequest else LinkRequest([r]) for r in reqs])


def testsome(reqs: list[Any]) -> list[int]:
    """The indices of the requests in ``reqs`` that have completed, as
    ``MPI.Request.Testsome`` gives them (a request reported once is done with), for MPI's
    requests and :class:`LinkRequest` objects alike."""
    if _plain(reqs):
        return MPI.Request.Testsome(reqs) or []
    return [i for i, r in enumerate(reqs) if r.Test()]
