"""Per-communicator state: transport, node topology, scratch buffers and in-flight schedules.

A context is cached on its MPI communicator as an MPI attribute (freed with the
communicator), or on a test transport as a plain attribute; there is no global table.

Schedules are generators that yield lists of requests to wait for (an empty list means
"not yet, try later"). A blocking call with nothing else in flight just waits on each
list; otherwise every in-flight schedule on the communicator is progressed together, so
that ranks waiting on different operations never wait on each other.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
from mpi4py import MPI

from .config import Config, load_config
from .cost import parse_link
from .link import emulate, located_nodes
from .node.arena import Arena
from .node.channel import Channel, forget_calls
from .transport import MPITransport

__all__ = ["Context", "get_context", "reset", "node_transport", "node_groups", "Pending", "Topology"]


class ScratchPool:
    """Reusable byte buffers, so steady-state calls allocate nothing."""

    def __init__(self, keep: int = 8) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep

    def get(self, count: int, dtype: np.dtype) -> np.ndarray:
        """Return a buffer of ``count`` elements of ``dtype`` (contents undefined)."""
        nbytes = count * np.dtype(dtype).itemsize
        best = -1
        for i, b in enumerate(self._free):
            if b.nbytes >= nbytes and (best < 0 or b.nbytes < self._free[best].nbytes):
                best = i
        raw = self._free.pop(best) if best >= 0 else np.empty(max(nbytes, 64), np.uint8)
        return raw[:nbytes].view(dtype)[:count]

    def put(self, buf: np.ndarray) -> None:
        """Give a buffer from :meth:`get` back."""
        base = buf.base if buf.base is not None else buf
        while base.base is not None:
            base = base.base
        if len(self._free) >= self._keep:
            self._free.sort(key=lambda b: b.nbytes)
            if self._free[0].nbytes >= base.nbytes:
                return
            self._free.pop(0)
        self._free.append(base)


@dataclasses.dataclass(slots=True)
class Topology:
    """Where this rank sits among nodes (real or simulated by ``ranks_per_node``)."""

    node: Any
    """Transport over the ranks of this rank's node."""
    cross: Any
    """Transport over the ranks with this rank's local rank, one per node."""
    nodes: int
    homogeneous: bool
    """True when every node has the same number of ranks."""
    node_sync: Callable[[], None]
    """Memory fence for the node's shared window."""


class Pending:
    """One in-flight schedule."""

    __slots__ = ("gen", "reqs", "done", "error", "on_done")

    def __init__(self, gen: Generator, on_done: Callable[[], Any] | None = None) -> None:
        self.gen = gen
        self.reqs: list | None = None
        self.done = False
        self.error: BaseException | None = None
        self.on_done = on_done

    def advance(self) -> bool:
        """Run the schedule as far as it goes without blocking; return True when finished."""
        try:
            if not self.reqs:  # not started yet, or it asked to be polled again
                self.reqs = next(self.gen)
            while self.reqs and self.reqs[0].Testall(self.reqs):
                self.reqs = next(self.gen)
            return False
        except StopIteration:
            self._finish()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the waiter
            self.error = exc
            self._finish()
        return True

    def _finish(self) -> None:
        self.done = True
        self.reqs = None
        if self.on_done is not None and self.error is None:
            try:
                self.on_done()
            except BaseException as exc:  # noqa: BLE001
                self.error = exc


class Context:
    """Everything cached per communicator."""

    def __init__(self, transport: Any, config: Config | None = None) -> None:
        self.config = config or load_config()
        if self.config.link and type(transport) is MPITransport:  # messages between nodes take the link's time
            transport = emulate(
                transport, parse_link(self.config.link), self.config.ranks_per_node, self.config.shm_spin
            )
        self.transport = transport
        self.scratch = ScratchPool()
        self.inflight: list[Pending] = []
        self.shm_queue: collections.deque = collections.deque()
        self.tuning: Any = None
        self.picks: dict[str, list[tuple[int | None, str]]] = {}
        """``auto``'s rules per collective as :func:`.select.choose` applies them here."""
        self.device: dict[str, Any] = {}
        """Device-array state (:mod:`.device.api`): IPC windows, the NCCL communicator, plans;
        values with a ``free()`` are freed with the context."""
        self.broken = ""
        """Why this communicator's collectives stopped (a stall seen outside the node
        channel, whose own abort words say so there); empty while they run."""
        self.fast: dict[tuple, Any] = {}
        """One-step allreduce functions by (dtype, shape, op, algorithm); False: not eligible."""
        self._seq = 0
        self._tag_ub = 32767
        comm = getattr(transport, "comm", None)
        if comm is not None:
            ub = comm.Get_attr(MPI.TAG_UB)
            self._tag_ub = int(ub) if ub else 32767
        self._topology: Topology | None = None
        self._segments: list[np.ndarray] | None = None
        self._channel: Channel | None = None
        self.agree_comm: MPI.Comm | None = None
        """A duplicate of the communicator that argument agreement gathers over where there
        is no node channel, so that a gather a stall abandoned never meets another call."""
        self.agree_calls = 0
        """Gathers this rank has posted on :attr:`agree_comm`."""
        self.agree_width = 0
        """Words per rank of each such gather (the signature's length)."""
        self.stalled_request: Any = None
        """The gather a stall abandoned, completed by :func:`reset`."""
        self._told: list = []
        # collective, so done here, where every rank's first call on the communicator
        # meets, and never later where ranks might disagree about what they are calling
        lay = self.topology()
        self.chan: Channel | None = None
        """The node channel, when every rank is on one node: it carries argument agreement."""
        self.arena: Arena | None = None
        """Window-resident buffers (:mod:`.node.arena`), when every rank is on one node."""
        if comm is not None and transport.size > 1 and lay.nodes == 1:
            self.chan = self.channel()
            if self.config.shm_arena_bytes:
                segs, _ = lay.node.shared_window(self.config.shm_arena_bytes)
                self.arena = Arena(segs, lay.node.rank)
                self.chan.map_arena(lay.node, segs)
        elif comm is not None and transport.size > 1:
            self.agree_comm = comm.Dup()

    # -- tags and driving -------------------------------------------------------------
    def next_tag(self) -> int:
        """Return the tag of the next operation; every rank starts operations in one order."""
        self._seq = self._seq % (self._tag_ub - 1) + 1
        return self._seq

    def run(self, gen: Generator) -> None:
        """Drive ``gen`` to completion (blocking)."""
        if not self.inflight:
            for reqs in gen:
                if reqs:
                    reqs[0].Waitall(reqs)
            return
        p = self.start(gen)
        self.wait(p)

    def start(self, gen: Generator, on_done: Callable[[], Any] | None = None) -> Pending:
        """Begin ``gen`` and return it in flight; it makes its first moves at once."""
        p = Pending(gen, on_done)
        self.inflight.append(p)
        if p.advance():
            self.inflight.remove(p)
        return p

    def progress(self) -> None:
        """Advance every in-flight schedule as far as it goes without blocking."""
        for p in list(self.inflight):
            if p.advance():
                self.inflight.remove(p)

    def wait(self, p: Pending) -> None:
        """Progress everything until ``p`` is finished; re-raise its error."""
        while not p.done:
            if len(self.inflight) == 1 and p.reqs:
                # alone in flight: block instead of spinning
                p.reqs[0].Waitall(p.reqs)
            self.progress()
        if p.error is not None:
            raise p.error

    # -- node topology and shared memory -------------------------------------------------
    def topology(self) -> Topology:
        """Where this rank sits among nodes, computed collectively on first use."""
        if self._topology is None:
            t = self.transport
            node = node_transport(t, self.config.ranks_per_node)
            cross = t.split(node.rank, t.rank)
            info = t.allgather_obj((node.rank, node.size))
            nodes = sum(1 for lr, _ in info if lr == 0)
            homogeneous = len({ls for _, ls in info}) == 1
            self._topology = Topology(node, cross, nodes, homogeneous, getattr(node, "memory_sync", _no_sync))
        return self._topology

    def channel(self) -> Channel:
        """Return the node's shared-memory channel, allocating it collectively on first use."""
        if self._channel is None:
            cfg = self.config
            self._channel = Channel(
                self.topology().node,
                cfg.shm_small_bytes,
                cfg.shm_chunk_bytes,
                self._progress_if_busy,
                cfg.compiled_channel,
                cfg.shm_copy_small_bytes,
                cfg.stall_timeout,
                cfg.shm_split_bytes,
                cfg.shm_nontemporal_bytes,
                cfg.shm_nontemporal_out_bytes,
                cfg.shm_single_copy_bytes,
                cfg.shm_single_copy_broadcast_bytes,
                (cfg.shm_single_copy_reduce_scatter_bytes, cfg.shm_single_copy_allreduce_bytes),
            )
            if cfg.shm_spin >= 0:
                self._channel.spin = cfg.shm_spin
        return self._channel

    def _progress_if_busy(self) -> None:
        if self.inflight:
            self.progress()

    def shm_segments(self) -> list[np.ndarray]:
        """Return every node peer's shared window segment, allocating them on first use."""
        if self._segments is None:
            self._segments = self.topology().node.shared_segments(self.config.shm_bytes)
        return self._segments

    def free(self) -> None:
        """Release sub-communicators and windows."""
        forget_calls()  # the public calls' remembered one-step functions may use this channel
        for obj in list(self.device.values()):
            if hasattr(obj, "free"):
                obj.free()  # before the node transport its windows were exchanged over
        self.device.clear()
        lay, self._topology, self._segments = self._topology, None, None
        arena, self._channel, self.chan, self.arena = self.arena, None, None, None
        if arena is not None and isinstance(lay.node, MPITransport):
            # arrays from the arena that outlive the communicator (a model's parameters in
            # ZeroOptimizer's buffers) keep their memory: such a window is never freed
            if lay.node.comm.allreduce(arena.in_use > 0, op=MPI.LOR):
                arena.window = lay.node.release_window(arena.segments)
        if lay is not None:
            for sub in (lay.node, lay.cross):
                if isinstance(sub, MPITransport):
                    sub.free()
                    sub.comm.Free()
        if self.agree_comm is not None:
            self.agree_comm.Free()
            self.agree_comm = None

    def tell_gave_up(self) -> None:
        """Tell every other rank, on :attr:`agree_comm`, that this rank gave up after a stall
        (:meth:`gave_up` reads it), so that a late rank's next call raises instead of meeting
        the gather this rank abandoned."""
        comm = self.agree_comm
        note = np.array([comm.rank], np.int64)
        self._told = [note, *(comm.Isend(note, dest=q, tag=_GAVE_UP) for q in range(comm.size) if q != comm.rank)]

    def gave_up(self) -> int:
        """The rank that told this one it gave up after a stall (:meth:`tell_gave_up`), or -1."""
        status = MPI.Status()
        if not self.agree_comm.Iprobe(MPI.ANY_SOURCE, _GAVE_UP, status):
            return -1
        note = np.empty(1, np.int64)
        self.agree_comm.Recv(note, status.Get_source(), _GAVE_UP)
        self.broken = f"rank {int(note[0])} gave up after a stall"
        return int(note[0])

    def catch_up(self) -> None:
        """Complete every gather on :attr:`agree_comm` (collective, for :func:`reset`): the
        ranks that posted fewer than others (those a stall left behind) post the missing
        ones, so that none stays pending."""
        if self.agree_comm is None:
            return
        posted = self.transport.comm.allgather((self.agree_calls, self.agree_width))
        k = len(posted)
        missing = max(c for c, _ in posted) - self.agree_calls
        width = max(w for _, w in posted)
        bufs = [(np.zeros(width, np.int64), np.empty((k, width), np.int64)) for _ in range(missing)]
        reqs = [self.agree_comm.Iallgather(a, b) for a, b in bufs]
        if self.stalled_request is not None:
            reqs.append(self.stalled_request)
        MPI.Request.Waitall(reqs)
        self.transport.comm.Barrier()  # every note sent before any rank reads the last of them
        while self.gave_up() >= 0:
            pass
        MPI.Request.Waitall(self._told[1:])
        self._told = []


def _no_sync() -> None:
    pass


def _delete_context(comm: MPI.Comm, keyval: int, ctx: Context) -> None:
    global _LAST
    if _LAST[1] is ctx:
        _LAST = (None, None)
    if not MPI.Is_finalized():
        ctx.free()


_GAVE_UP = 1
"""The tag of :meth:`Context.tell_gave_up`'s notes on the agreement communicator."""

_KEYVAL: int | None = None
_WORLD: Context | None = None
"""COMM_WORLD's context, for calls without ``comm`` (it lives until MPI is finalized)."""
_LAST: tuple[Any, Context | None] = (None, None)
"""The last communicator object looked up and its context (freeing the communicator clears
it): the attribute lookup is an MPI call, and small collectives feel it."""


def reset(comm: Any = None) -> None:
    """Drop the collectives' state of ``comm`` (default ``MPI.COMM_WORLD``): its node channel,
    windows and sub-communicators, so that its next call starts anew, as it must after a
    :class:`~.errors.StallError`. Collective: call it on every rank of ``comm`` with nothing
    of it in flight. Arrays from :func:`collectives.empty` on it keep their memory."""
    global _WORLD, _LAST
    if comm is None:
        comm = MPI.COMM_WORLD
    if _LAST[0] is comm:
        _LAST = (None, None)
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_WORLD:
            _WORLD = None
        ctx = comm.Get_attr(_KEYVAL) if _KEYVAL is not None else None
        if ctx is not None:
            ctx.catch_up()
            comm.Delete_attr(_KEYVAL)  # frees the context (_delete_context)
        return
    ctx = getattr(comm, "_collectives_context", None)
    if ctx is not None:
        del comm._collectives_context
        ctx.free()


def node_transport(t: Any, ranks_per_node: int) -> Any:
    """The transport over the ranks of ``t`` on this rank's node (collective over ``t``):
    those sharing its memory, cut into nodes of ``ranks_per_node`` ranks where that is set
    (``HPCDL_RANKS_PER_NODE``, simulated nodes). Where every rank of ``t`` was located
    (:func:`.link.locate`) with these ``ranks_per_node``, its nodes are those: a subset of
    the located ranks cannot tell from its own shared-memory split where the cuts fall."""
    comm = getattr(t, "comm", None)
    nodes = located_nodes(comm, ranks_per_node) if isinstance(comm, MPI.Comm) else None
    if nodes is not None:
        return t.split(nodes[t.rank], t.rank)
    node = t.split_shared()
    if ranks_per_node:
        cut = node.split(node.rank // ranks_per_node, node.rank)
        if isinstance(node, MPITransport):
            node.comm.Free()
        node = cut
    return node


def node_groups(comm: MPI.Comm) -> list[list[int]]:
    """The ranks of ``comm`` grouped by node as the collectives see the nodes (real, or
    simulated by ``HPCDL_RANKS_PER_NODE``), each group in rank order and the groups in the
    order of their lowest rank. Collective over ``comm``; leaves nothing allocated."""
    t = MPITransport(comm)
    node = node_transport(t, load_config().ranks_per_node)
    mine = node.allgather_obj(t.rank)
    node.comm.Free()
    groups: list[list[int]] = []
    for g in t.allgather_obj(mine):
        if g not in groups:
            groups.append(g)
    return groups


def get_context(comm: Any = None, config: Config | None = None) -> Context:
    """Return the context of ``comm`` (an mpi4py communicator or a transport).

    ``config`` applies only when the context is created (the first call on ``comm``);
    by default the configuration comes from the ``HPCDL_*`` environment.
    """
    global _KEYVAL, _WORLD, _LAST
    if comm is None:
        if _WORLD is not None and config is None:
            return _WORLD
        comm = MPI.COMM_WORLD
    last = _LAST  # one read: another thread may replace it between two
    if comm is last[0] and config is None:
        return last[1]  # type: ignore[return-value]
    if isinstance(comm, MPI.Comm):
        if _KEYVAL is None:
            _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_context)
        ctx = comm.Get_attr(_KEYVAL)
        if ctx is None:
            ctx = Context(MPITransport(comm), config)
            comm.Set_attr(_KEYVAL, ctx)
        if comm == MPI.COMM_WORLD:
            _WORLD = ctx
        _LAST = (comm, ctx)
        return ctx
    ctx = getattr(comm, "_collectives_context", None)
    if ctx is None:
        if not all(hasattr(comm, a) for a in ("rank", "size", "isend", "irecv", "split_shared")):
            raise TypeError(f"comm must be an mpi4py communicator or a transport, not {type(comm).__name__}")
        ctx = Context(comm, config)
        comm._collectives_context = ctx
    return ctx
