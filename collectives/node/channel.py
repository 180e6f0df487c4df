"""The node channel: one MPI-3 shared-memory window per node-local communicator, with
the counters, slots and buffers the ``shm`` algorithms (:mod:`.slots`, :mod:`.staged`) move data through.

Every rank owns one segment of the window (``MPI_Win_allocate_shared``, or plain arrays
for the thread transport), laid out as::

    [seq done streamed taken stores][stage sleeping abort]
    [slot 0: header, tiny data][data ...] [slot 1: ...] [buffer 0] [buffer 1]

``seq`` counts the calls this rank has *posted*; a call posts its argument signature
(three int64 words) and where its input and output lie in the node's arena (two more:
:meth:`.arena.Arena.where`) into the header of slot ``seq % 2``, and for small messages
the data too (up to :data:`HEAD_DATA` bytes on the header's line, more from the next line:
:meth:`Channel.payload`); then it stores ``seq`` in the header's last word and publishes it
in ``seq``. The compiled loop waits for a peer's post of a one-step broadcast, or of a call
whose payload lies on the header's line, on that header word, whose cache line also holds
the signature and such a payload, so that a tiny call needs one line from each peer; other
calls, and the Python loop, wait on ``seq``. The first line of the segment holds the words
written in every call, the second those written only in barriers, sleeps and stalls,
which therefore stay in the caches that read them. Two slots suffice: a rank can post
call ``k + 2`` only after every peer posted ``k + 1``, which each does only after it
finished reading call ``k``. ``stage`` is
a second counter used as a barrier: a rank publishes it and waits until every peer has
reached it. ``done`` counts the allreduces that finish in two steps through the slots
(:meth:`Channel.split_at`): each rank reduces its block of the call into its slot, past the
data, and publishes the call there; the peers copy the block once it is. ``streamed``
counts the pieces of a broadcast or allgather streamed through a slot (:meth:`Channel.stream`,
:meth:`Channel.gather`), and ``taken`` the rounds of an allgather's pieces a rank has copied out.
``stores`` has bit 0 set while the compiled loop's measured stores into the slots call for
non-temporal ones on that rank, bit 1 while those into the chunk buffers do
(:attr:`Channel.measured_stores`): every rank then takes them there.
Loads and stores are ordered by the window's ``MPI_Win_sync`` around every publication.

A rank waiting for a peer's counter polls it a while (:data:`SPIN` polls when every rank
has a core of its own, or fewer when the caller says its process has other work: see
:attr:`Channel.polite`), then sleeps on the counter with a futex (:mod:`.futex`) instead
of spinning on: it raises its ``sleeping`` flag, looks at the counter once more and
sleeps; a rank that publishes a counter looks at its peers' flags afterwards and wakes
the sleepers. Either the sleeper sees the new value or the publisher sees the flag.

A wait for one peer that lasts longer than the stall timeout (``HPCDL_STALL_TIMEOUT``)
means the ranks fell out of step: one raised, or skipped or reordered a collective. The
waiter then writes its ``abort`` word (beside its counter) and raises
:class:`~.errors.StallError`; every other rank's wait sees that word and raises too, and
so does every later call on the channel, on every rank, until :func:`collectives.reset`.

Where the compiled loop (``collectives.node.cslots``, built at install) is present, it posts,
waits and finishes one-step calls on the same words with the same protocol
(:attr:`Channel.core`); the methods here are then its pure-Python twin, and ranks on
either interoperate.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from ..blocks import block_counts
from ..errors import ConfigError, StallError
from ..launcher import node_cores, process_cpus
from ..ops import OPS, dtype_code, rank_order_reducer
from . import futex

try:
    from .cslots import Core
    from .cslots import forget as _forget_paths
except ImportError:  # not built (no compiler where it was installed): the Python loop below
    Core = _forget_paths = None
try:
    from .cslots import line_round_trip as _line_round_trip
except ImportError:  # not built, or built before it: not measured
    _line_round_trip = None


def forget_calls() -> None:
    """Make every public collective's compiled front door (:func:`.onestep.call_path`)
    forget the last call it remembers: called as a context's channel goes away, so that no
    later call runs a one-step function of a freed channel."""
    if _forget_paths is not None:
        _forget_paths()


__all__ = [
    "Channel",
    "forget_calls",
    "line_round_trips",
    "LINE",
    "SPIN",
    "POLITE_SPIN",
    "spin_budget",
    "node_cores",
    "Schedule",
]

Schedule = Generator[list, None, None]

LINE = 64
"""Bytes per cache line; every separately written field starts on its own line."""

HEAD_WORDS = 6
"""Words of a slot's header: the signature ``a, b, c``, the arena words ``win, wout``, and
the call that posted them (:data:`POSTED`), stored last."""

POSTED = 5
"""The header word that announces its call (the compiled loop's constant)."""

HEAD = 8 * HEAD_WORDS
"""Bytes of a slot's header."""

HEAD_DATA = LINE - HEAD
"""A payload of up to this many bytes lies on its header's line, after the header (a peer
then reads one line of the call); a larger one in the slot's data, from the next line, so
that its copies and reductions run on whole lines (:meth:`Channel.payload`)."""

# Byte offsets in a rank's segment: the words written in every call on the first line, those
# written only in barriers, sleeps and stalls on the second.
_SEQ, _DONE, _STREAM, _TAKE, _STORES = 0, 8, 16, 24, 32
_STAGE, _SLEEPING, _ABORT = LINE, LINE + 8, LINE + 16

SPIN = 2000
"""Polls of a peer's counter before a waiting rank sleeps on it, when every rank of the
node has a core of its own (fewer otherwise: :func:`spin_budget`)."""

POLITE_SPIN = 64
"""Polls before sleeping while :attr:`Channel.polite` says the process has other work."""

_DOZE = 1e-3
"""The longest one sleep lasts before the waiter looks again (and progresses other work)."""

_STALL_POLLS = 4095
"""A spinning wait looks at the peers' abort words and the clock when its poll count has
none of these bits set, every 4096 polls (a sleeping wait looks after every sleep). A stall
is a matter of seconds; a look every 64 polls cost 256 KiB allreduces at 2 ranks about 2 %. The
clock starts at a wait's first look, so a stall is declared up to one spin budget late."""


STREAM_SHIFT = 24
"""A ``streamed`` word holds ``call << STREAM_SHIFT | pieces`` (the compiled loop's constant)."""

STREAM_PIECE = 16 << 10
"""Bytes per piece of a broadcast streamed through the root's slot (:meth:`Channel.stream`;
a slot smaller than this is one piece)."""

REDUCE_READ_PIECE = 256 << 10
"""Bytes of each peer's block a reduce-scatter read by single copy reads at a time
(:meth:`Channel.reduce_scatter_read`; the compiled loop's ``REDUCE_PIECE``): its scratch
holds one such piece per peer."""

RESTAGE_EVERY = 16
"""Where measured stores decide whether staging is slow (:meth:`Channel.staging_slow`),
every this-many-th large reduction that asks stages anyway: its copies into the window
probe the stores again, which the single copy's never do, so a choice taken from a
disturbed probe, or before the machine changed, does not stay. Counted over those
reductions alone (:attr:`Channel.reductions_voted`), not over the call numbers, which a
loop with an even number of calls a step would visit only half of."""


def spin_budget(ranks: int, cores: int) -> int:
    """:data:`SPIN`, or :data:`POLITE_SPIN` when the node's ranks outnumber the ``cores``
    they may run on together (:func:`node_cores`: the union of the ranks' CPUs, so that
    ranks bound to a core each, as ``srun`` and ``mpiexec --bind-to core`` place them, still
    spin): then the peer being waited for is likely not running, and spinning only delays it."""
    return SPIN if ranks <= cores else POLITE_SPIN


def line_round_trips(comm: Any, rounds: int = 20000, timeout: float = 10.0) -> list[float] | None:
    """Seconds one cache line takes from ``comm``'s rank 0 to each other rank and back, in
    rank order from rank 1, the same list on every rank (collective over ``comm``, an
    mpi4py communicator of ranks that share a node; each pair in turn, ``rounds`` round
    trips, the compiled loop's ``line_round_trip``).

    This is the floor under every wait of the channel: a small call's ranks exchange at
    least one line each way, so no call that waits for a peer takes less than half of it.
    It differs from pair to pair where some pairs share a last-level cache or a socket and
    others do not, and on a virtual machine whose virtual CPUs the host moves between cores.

    None where the compiled loop is not built, or where the ranks outnumber the cores they
    may run on together (:func:`node_cores`), where a pair spinning on one core would time
    the scheduler. :class:`TimeoutError` on every rank where a pair's other side did not
    answer within about ``timeout`` seconds of its last answer."""
    from mpi4py import MPI

    n, me = comm.Get_size(), comm.Get_rank()
    if rounds < 1:
        raise ValueError(f"line_round_trips: rounds={rounds} must be >= 1")
    cpus = comm.allgather(process_cpus())
    if _line_round_trip is None or n < 2 or n > node_cores(cpus):
        return None
    span = 4 * LINE  # a pair's two words two lines apart, the pairs a line further
    win = MPI.Win.Allocate_shared(span * (n - 1) if me == 0 else 0, 1, comm=comm)
    try:
        mem = np.frombuffer(win.Shared_query(0)[0], np.uint8)
        if me == 0:
            mem[:] = 0
        comm.Barrier()
        seconds, late = [], []
        for r in range(1, n):
            comm.Barrier()
            if me in (0, r):
                try:
                    seconds.append(_line_round_trip(mem[(r - 1) * span : r * span], int(me == r), rounds, timeout))
                except TimeoutError:
                    late.append(r)
        late = sorted(set().union(*comm.allgather(late)))
        if late:
            raise TimeoutError(
                f"line_round_trips: rank 0 and rank(s) {late} did not answer each other within {timeout} s "
                "(a core each, not shared with other busy processes?)"
            )
        return comm.bcast(seconds if me == 0 else None, root=0)
    finally:
        win.Free()


NONTEMPORAL = 4096
"""Copies into the shared window from this many bytes up use non-temporal stores by default:
a broadcast's root's on any node (:func:`nontemporal_broadcast_bytes`), every other where
the node's ranks may run on cores that share no last-level cache (:func:`nontemporal_bytes`)."""


def last_level_caches(cpus: Any = None) -> dict[str, int]:
    """The last-level caches of ``cpus`` (default: the CPUs this process may run on): each
    named by the CPUs that share it, with its size in bytes (Linux sysfs); empty where sysfs
    does not say."""
    cpus = process_cpus() if cpus is None else cpus
    out: dict[str, int] = {}
    seen: set[int] = set()
    for cpu in sorted(cpus):
        if cpu in seen:  # under a cache already read
            continue
        base = f"/sys/devices/system/cpu/cpu{cpu}/cache"
        try:
            levels = []
            for name in os.listdir(base):
                if name.startswith("index"):
                    with open(f"{base}/{name}/level", encoding="ascii") as fh:
                        levels.append((int(fh.read()), name))
            top = f"{base}/{max(levels)[1]}"
            with open(f"{top}/shared_cpu_list", encoding="ascii") as fh, open(f"{top}/size", encoding="ascii") as sz:
                size = sz.read().strip()
                units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
                shared = fh.read().strip()
                out[shared] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
            for part in shared.split(","):  # "0-7,16-23"
                lo, _, hi = part.partition("-")
                seen.update(range(int(lo), int(hi or lo) + 1))
        except (OSError, ValueError):
            return {}
    return out


def nontemporal_bytes(setting: int, caches: list[dict[str, int]]) -> int:
    """The size from which the compiled loop copies into the window with non-temporal stores,
    for the ``HPCDL_SHM_NONTEMPORAL_BYTES`` ``setting`` on a node whose ranks may run on
    ``caches`` (:func:`last_level_caches`, each rank's): the setting itself, or for -1
    :data:`NONTEMPORAL` where together they span more than one last-level cache, else 0.

    A plain store into a line a peer read last first pulls the line back from that peer's
    cache; between cores that share a last-level cache that is cheap, between others
    (another CCX or socket) several times slower than writing to memory, which is what a
    non-temporal store does. Where sysfs says nothing, or names one cache (a VM may move its
    virtual CPUs between cores that share one and cores that do not while its caches name
    one), the compiled loop measures: each rank times plain and non-temporal stores in its
    own copies now and then, into the slots and into the chunk buffers apart, and every
    rank takes non-temporal ones into either while plain ones take several times as long
    there on any rank (:attr:`Channel.measured_stores`, :attr:`.cslots.Core.stores`,
    :attr:`.cslots.Core.staged_stores`)."""
    if setting >= 0:
        return setting
    if any(not c for c in caches):
        return 0
    return NONTEMPORAL if len(set().union(*caches)) > 1 else 0


def nontemporal_broadcast_bytes(setting: int) -> int:
    """The size from which a broadcast's root copies into the window with non-temporal
    stores, for the ``HPCDL_SHM_NONTEMPORAL_BYTES`` ``setting``: the setting itself, or for
    -1 :data:`NONTEMPORAL` on any node. Only the readers hold the root's lines, so a plain
    store must take each back from them first. At 2 ranks on the reference machine, whose
    two cores sometimes share a cache and sometimes do not: where they share none,
    non-temporal stores took 0.4-0.6 x as long from 16 KiB on; where they share one,
    0.75-0.9 x at 16-64 KiB and 1.1-1.25 x at 256 KiB-4 MiB (still 0.55-0.85 x MPICH's at
    256 KiB-1 MiB) (``benchmarks.stores``)."""
    return setting if setting >= 0 else NONTEMPORAL


def nontemporal_out_bytes(setting: int, caches: list[dict[str, int]]) -> int:
    """The message size from which the compiled loop copies out of the window into the
    caller's buffer with non-temporal stores, for the ``HPCDL_SHM_NONTEMPORAL_OUT_BYTES``
    ``setting`` on a node whose ranks may run on ``caches``: the setting itself, or for -1
    three quarters of a last-level cache's share per rank (its size over the ranks it
    holds), as glibc's memcpy decides for one large copy; 0 where sysfs says nothing.

    A message that large no longer stays in the cache, and a plain store reads each line of
    the destination from memory before writing it; a non-temporal store does not. One large
    memcpy skips that read by itself, but a message copied out piece by piece never looks
    large to it."""
    if setting >= 0:
        return setting
    if any(not c for c in caches):
        return 0
    spanned = {}
    for c in caches:
        spanned.update(c)
    share = min(spanned.values()) * len(spanned) // len(caches)
    return max(share * 3 // 4, LINE)


SINGLE_COPY_PROBE = (64 << 10, 2 << 20)
"""Sizes at which the ranks time a broadcast through the root's slot and by single copy when
the channel is made (:meth:`Channel.measure_broadcasts`): one within a slot, one that wraps it."""

SINGLE_COPY_CEILING = 64 << 20
"""Past this size a measured crossover counts as none (single-copy broadcasts never)."""


def broadcast_single_copy_bytes(slots: tuple[float, float], single: tuple[float, float]) -> int:
    """From what size a broadcast is faster copied once, with cross-memory attach, than
    through the root's slot, given the seconds each took at the two :data:`SINGLE_COPY_PROBE`
    sizes: where the lines through the two points cross, no smaller than the smaller size
    (the kernel's fixed cost is not extrapolated below it); 0 (never) where single copy is
    slower at the larger size and its line crosses the slots' only past
    :data:`SINGLE_COPY_CEILING`, or not at all."""
    (s1, s2), (y1, y2), (x1, x2) = SINGLE_COPY_PROBE, slots, single
    dy, dx = (y2 - y1) / (s2 - s1), (x2 - x1) / (s2 - s1)
    if dx >= dy:  # single copy gains nothing with size: only where it already wins at both
        return s1 if x2 < y2 and x1 < y1 else 0
    cross = s1 + (x1 - y1) / (dy - dx)
    if cross > SINGLE_COPY_CEILING:
        return 0
    return max(s1, -(-int(cross) // 4096) * 4096)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _agree_layout(t: Any, settings: dict[str, int], caches: bool) -> tuple[list[dict[str, int]], int]:
    """Raise :class:`~.errors.ConfigError` on every rank when the node's ranks were given
    different channel ``settings`` (by name): their windows and their choices of path would
    differ, and the ranks would wait for one another forever instead of failing. Return
    every rank's last-level caches where ``caches`` asks (the non-temporal settings decided
    by them) and the cores the ranks may run on together (:func:`node_cores`), gathered at
    once."""
    everyone = t.allgather_obj((list(settings.values()), last_level_caches() if caches else {}, process_cpus()))
    for k, name in enumerate(settings):
        values = [e[0][k] for e in everyone]
        if len(set(values)) > 1:
            said = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ConfigError(f"{name} differs between the ranks of a node ({said}); give every rank the same")
    return [e[1] for e in everyone], node_cores([e[2] for e in everyone])


class Channel:
    """The shared window of one node-local communicator, and this rank's counters."""

    def __init__(
        self,
        t: Any,
        small_bytes: int,
        chunk_bytes: int,
        progress: Callable[[], None],
        compiled: bool = True,
        copy_small_bytes: int = 0,
        stall_timeout: float = 0.0,
        split_bytes: int = 0,
        nontemporal: int = 0,
        nontemporal_out: int = 0,
        single_copy: int = 0,
        single_copy_broadcast: int = 0,
        single_copy_reductions: tuple[int, int] = (0, 0),
    ) -> None:
        self.n, self.me = t.size, t.rank
        settings = {
            "shm_small_bytes": small_bytes,
            "shm_copy_small_bytes": copy_small_bytes,
            "shm_chunk_bytes": chunk_bytes,
            "shm_split_bytes": split_bytes,
            "shm_single_copy_bytes": single_copy,
            "shm_single_copy_broadcast_bytes": single_copy_broadcast,
            "shm_single_copy_reduce_scatter_bytes": single_copy_reductions[0],
            "shm_single_copy_allreduce_bytes": single_copy_reductions[1],
        }
        caches, cores = _agree_layout(t, settings, min(nontemporal, nontemporal_out) < 0)
        self.nontemporal = nontemporal_bytes(nontemporal, caches)
        """Copies into the window from this many bytes use non-temporal stores, in the
        compiled loop (0: never): :func:`nontemporal_bytes` of the setting."""
        self.measured_stores = nontemporal < 0 and not self.nontemporal
        """Whether the compiled loop's other copies into the window measure their stores."""
        self.nontemporal_broadcast = nontemporal_broadcast_bytes(nontemporal)
        """And a broadcast root's copies: :func:`nontemporal_broadcast_bytes` of the setting."""
        self.nontemporal_out = nontemporal_out_bytes(nontemporal_out, caches)
        """Copies out of the window into messages of this many bytes use non-temporal stores,
        in the compiled loop (0: never): :func:`nontemporal_out_bytes` of the setting."""
        self.small = _round_up(max(small_bytes, LINE), LINE)
        """Reductions up to this many bytes per rank finish in one step through the slots."""
        self.copy_small = _round_up(max(copy_small_bytes, LINE), LINE) if copy_small_bytes else self.small
        """Broadcasts and allgathers up to this many bytes per rank finish in one step."""
        self.slot_bytes = max(self.small, self.copy_small)
        """What one slot holds: the larger of the two."""
        self.piece = min(STREAM_PIECE, self.slot_bytes)
        """Bytes per piece of a broadcast streamed through a slot (:meth:`stream`)."""
        self.split_bytes = split_bytes
        """From 3 ranks, a one-step allreduce finishes in two steps once ``(ranks - 2) x bytes``
        reaches this (0: never): see :meth:`split_at`."""
        self.region = _round_up(max(chunk_bytes // self.n, LINE), LINE)
        self.chunk = self.region * self.n
        slot = LINE + self.slot_bytes  # the header's line, then the data
        self._slot0 = 2 * LINE
        self._buf0 = 2 * LINE + 2 * slot
        total = self._buf0 + 2 * self.chunk
        segs, self.fence = t.shared_window(total)
        self.segs = segs
        self._map_counters(segs)
        self.stall_timeout = stall_timeout
        """Seconds a wait for one peer lasts before it ends in a :class:`~.errors.StallError` (0: never)."""
        self._map_slots(segs, slot)
        self.stage, self.progress = 0, progress
        self._cores = cores
        """The cores the node's ranks may run on together (:func:`node_cores`)."""
        self._spin = spin_budget(self.n, cores)
        self._polite: Callable[[], bool] | None = None
        self.core: Any = None
        """The compiled loop (:mod:`.cslots`) on this window, when built and ``compiled``: it
        then posts, waits and finishes one-step calls; None: the Python methods below do."""
        if compiled and Core is not None:
            self._attach_core(segs, slot, stall_timeout)
        self.queue: list[object] = []
        """Chunked operations in flight, oldest first: only the first uses the buffers."""
        self._views: dict[tuple, list] = {}
        self._scratch: np.ndarray | None = None
        self.copied = [0, 0, 0]
        """Bytes this rank wrote in the chunked, in-place and single-copy-allreduce paths, by
        kind: staged (its input into the window), reduced (reduction results) and copied out
        (results into its output). One-step calls are not counted."""
        self._single_copy(t, single_copy, single_copy_broadcast, single_copy_reductions)

    def _map_slots(self, segs: list[np.ndarray], slot: int) -> None:
        """Every rank's two slots (``slot`` bytes each with the header) and two chunk buffers
        in the window, and the views the posts and waits use."""
        at = [self._slot0 + p * slot for p in (0, 1)]
        self.heads = [[memoryview(s[a : a + HEAD]).cast("q") for a in at] for s in segs]
        self.slots = [[s[a + LINE : a + LINE + self.slot_bytes] for a in at] for s in segs]
        self._inline = [[s[a + HEAD : a + LINE] for a in at] for s in segs]
        self.bufs = [[s[self._buf0 + b * self.chunk : self._buf0 + (b + 1) * self.chunk] for b in (0, 1)] for s in segs]
        peers = [j for j in range(self.n) if j != self.me]
        self._my_heads = self.heads[self.me]
        self.peer_heads = [[self.heads[j][p] for j in peers] for p in (0, 1)]
        """Slot ``p``'s signature words of every peer, in rank order without this rank."""
        self._my_slots = [memoryview(self.slots[self.me][p]) for p in (0, 1)]
        self._my_inline = [memoryview(self._inline[self.me][p]) for p in (0, 1)]

    def _map_counters(self, segs: list[np.ndarray]) -> None:
        """Every rank's counter words in the window (the first two lines of its segment),
        their addresses, and the peers' as the waits walk them."""
        me = self.me

        def words(at: int) -> list[memoryview]:
            return [memoryview(s[at : at + 8]).cast("q") for s in segs]

        def addrs(at: int) -> list[int]:
            return [s[at : at + 8].ctypes.data for s in segs]

        # every word is written by its owner only
        self.seqs = words(_SEQ)
        # the last call whose reduced block the rank published (split_at)
        self.dones = words(_DONE)
        # call << STREAM_SHIFT | the pieces it streamed (stream, gather)
        self.streams = words(_STREAM)
        # call << STREAM_SHIFT | the rounds of pieces it took (gather)
        self.takes = words(_TAKE)
        self.stages = words(_STAGE)
        # 1 while the owner may be asleep
        self.sleeping = words(_SLEEPING)
        # written once: the call it gave up on after a stall (0: none)
        self.aborts = words(_ABORT)
        self._seq_addr = addrs(_SEQ)
        self._done_addr = addrs(_DONE)
        self._stream_addr = addrs(_STREAM)
        self._take_addr = addrs(_TAKE)
        self._stage_addr = addrs(_STAGE)
        self._sleeping_addr = addrs(_SLEEPING)
        self._abort_addr = addrs(_ABORT)
        self._stores_addr = addrs(_STORES)
        peers = [j for j in range(self.n) if j != me]
        self._peer_aborts = [self.aborts[j] for j in peers]
        self._my_seq = self.seqs[me]
        self._peer_seqs = [(j, self.seqs[j], self._seq_addr[j]) for j in peers]
        self._peer_dones = [(j, self.dones[j], self._done_addr[j]) for j in peers]
        self._peer_streams = [(j, self.streams[j], self._stream_addr[j]) for j in peers]
        self._peer_takes = [(j, self.takes[j], self._take_addr[j]) for j in peers]
        self._peer_stages = [(self.stages[j], self._stage_addr[j]) for j in peers]
        self._peer_sleeping = [self.sleeping[j] for j in peers]
        self._my_seq_addr = self._seq_addr[me]

    def _attach_core(self, segs: list[np.ndarray], slot: int, stall_timeout: float) -> None:
        """Run one-step calls in the compiled loop: the same protocol on the same words,
        without the interpreter in the loop (``slot``: the bytes of one slot with its head)."""
        self.core = core = Core(
            self.me,
            self._seq_addr,
            self._sleeping_addr,
            [s[self._slot0 + p * slot :].ctypes.data for s in segs for p in (0, 1)],
            [s[self._slot0 + p * slot + LINE :].ctypes.data for s in segs for p in (0, 1)],
            self.slot_bytes,
            self._spin,
            self.progress,
            np.ascontiguousarray,
            futex.OK,
            self._abort_addr,
            self.stalled,
            self._done_addr,
            self._stream_addr,
            self._take_addr,
            self._stores_addr,
        )
        core.stall = stall_timeout
        core.nontemporal = self.nontemporal
        core.measured = self.measured_stores
        core.nontemporal_broadcast = self.nontemporal_broadcast
        core.nontemporal_out = self.nontemporal_out
        self.post, self.exchange, self.wait_posted = core.post, core.exchange, core.wait_posted

    def _can_read_peers(self, t: Any, wanted: bool) -> bool:
        """True where single copy is ``wanted`` and every rank of the node runs the compiled
        loop and can read and write a peer's memory with cross-memory attach (Linux's
        ``process_vm_readv`` and ``process_vm_writev``: the kernel refuses them under a strict
        ``ptrace_scope`` or a container's seccomp profile); the same on every rank. Each rank
        reads its next peer's process id out of that peer's memory, and writes it back."""
        me, n = self.me, self.n
        if not wanted or n == 1:  # the settings are agreed: every rank returns here alike
            return False
        mark = self.slots[me][1][:8].view(np.int64)  # slot 1's data: unused until the first call
        mark[0] = os.getpid()
        everyone = t.allgather_obj((os.getpid(), mark.ctypes.data, self.core is not None))
        ok = all(e[2] for e in everyone)
        if ok:
            pid, addr = everyone[(me + 1) % n][:2]
            got = np.zeros(1, np.int64)
            try:
                self.core.cma_read(pid, addr, got)
                ok = int(got[0]) == pid
                self.core.cma_write(pid, addr, got)  # the same value: the peer sees no change
            except OSError:
                ok = False
        self._pids = [e[0] for e in everyone]
        return all(t.allgather_obj(ok))

    def map_arena(self, t: Any, segments: list[np.ndarray]) -> None:
        """Tell the compiled loop where every rank's segment of the node's arena (every
        rank's, by rank, as mapped here) lies in that rank's own process, so that a
        single-copy read or write whose data lies in a peer's segment copies through the
        mapping: the kernel's cross-memory attach pins those shared 4 KiB pages one by one
        (a 16 MiB read took twice a copy's time on the reference machine). Collective, over
        ``t``, the node's transport."""
        mine = segments[self.me]
        there = t.allgather_obj(mine.ctypes.data if mine.size else 0)
        if self.core is not None and mine.size:
            self.core.segments([seg.ctypes.data for seg in segments], there, mine.size)

    def _single_copy(self, t: Any, allgathers: int, broadcasts: int, reductions: tuple[int, int]) -> None:
        """Set the single-copy sizes from their settings where every rank can read its
        peers' memory (else 0), and give them to the compiled loop; the broadcasts' measured
        first where their setting is -1, or never where the node's ranks may run on fewer
        cores than there are ranks (oversubscribed)."""
        cma = self._can_read_peers(t, allgathers != 0 or broadcasts != 0)
        self.single_copy = allgathers if cma else 0
        """Agreed allgathers from this many bytes per rank read the sender's memory with
        cross-memory attach, one copy (0: never): see :meth:`_can_read_peers`."""
        self.single_copy_reduce_scatter = reductions[0] if self.single_copy else 0
        """Agreed reduce-scatters from this many bytes of input may read the peers' blocks by
        single copy (:meth:`reduce_scatter_read`; 0: never)."""
        self.single_copy_allreduce = reductions[1] if self.single_copy else 0
        """Agreed allreduces from this many bytes into a separate output may read the peers'
        memory by single copy (:meth:`allreduce_read`; 0: never)."""
        self.reductions_voted = 0
        """The agreed large reductions that asked :meth:`staging_slow` so far: the same count
        on every rank, which makes every :data:`RESTAGE_EVERY`-th of them stage everywhere."""
        self.single_copy_broadcast = broadcasts if cma else 0
        """And agreed broadcasts from this many bytes read the root's (0: never); measured
        when the setting is -1: see :meth:`measure_broadcasts`."""
        self.broadcast_times: dict[str, list[float]] = {}
        """Where :attr:`single_copy_broadcast` was measured: the seconds a broadcast took at
        the :data:`SINGLE_COPY_PROBE` sizes, through the root's slot (``"slots"``) and by
        single copy (``"single"``), averaged over the ranks."""
        if not cma:
            return
        if self.single_copy_broadcast < 0 and self._cores < self.n:
            self.single_copy_broadcast = 0  # ranks share cores: the times would tell nothing
        elif self.single_copy_broadcast < 0:
            self.broadcast_times = self.measure_broadcasts(t)
            self.single_copy_broadcast = broadcast_single_copy_bytes(
                self.broadcast_times["slots"], self.broadcast_times["single"]
            )
        self.core.single_copy(self._pids, self.single_copy, self.single_copy_broadcast)

    def measure_broadcasts(self, t: Any, rounds: int = 3, calls: int = 4) -> dict[str, list[float]]:
        """Time broadcasts from rank 0 at the :data:`SINGLE_COPY_PROBE` sizes, through the
        root's slot (with the call, up to :attr:`small`) and by single copy (collective; the
        compiled loop, with single copy allowed): each call by itself after a collective of
        the transport, as OSU times one after an MPI barrier, so that the ranks start it as
        unevenly as they do there (single copy starts copying only once both root and
        reader have come; through the slot the root copies in as soon as it comes) and a
        root that returns before its readers are done counts as such; the seconds per call
        of the fastest of ``rounds`` rounds of ``calls`` calls (after one call to warm up),
        averaged over the ranks, as ``{"slots": [...], "single": [...]}``. Each call is
        posted and agreed as a broadcast is; where a rank stalls it raises as any call
        would."""
        buf = np.ones(max(SINGLE_COPY_PROBE), np.uint8)  # written: not the kernel's one page of zeros
        mine: list[float] = []
        try:
            for single in (0, 1):
                self.core.single_copy(self._pids, self.single_copy, single)
                for size in SINGLE_COPY_PROBE:
                    best = math.inf
                    for r in range(rounds + 1):
                        took = 0.0
                        for _ in range(calls if r else 1):
                            t.allgather_obj(None)
                            start = time.perf_counter()
                            if single or size > self.small:
                                seq = self.exchange(0, size, single)
                                self.core.stream(seq, 0, buf[:size], self.piece)
                            else:  # within the one-step size the data goes with the call, as
                                # a broadcast's root copies it in (non-temporal from its size)
                                self.core.nontemporal = self.nontemporal_broadcast
                                seq = self.exchange(0, size, single, None if self.me else buf[:size])
                                self.core.nontemporal = self.nontemporal
                                if self.me:
                                    buf[:size] = self.payload(0, seq & 1, size)
                            took += time.perf_counter() - start
                        best = min(best, took / calls) if r else best
                    mine.append(best)
        finally:
            self.core.nontemporal = self.nontemporal
            self.core.single_copy(self._pids, self.single_copy, max(self.single_copy_broadcast, 0))
        mean = np.mean(np.array(t.allgather_obj(mine)), axis=0).tolist()
        k = len(SINGLE_COPY_PROBE)
        return {"slots": mean[:k], "single": mean[k:]}

    @property
    def seq(self) -> int:
        """The number of calls this rank has posted (its published counter)."""
        return self._my_seq[0]

    @property
    def oversubscribed(self) -> bool:
        """Whether the node's ranks outnumber the cores they may run on together
        (:func:`node_cores`): the same on every rank. ``auto`` then may follow tuning rows
        measured that way, which a node with a core per rank does not (:func:`.select.rules`)."""
        return self.n > self._cores

    @property
    def spin(self) -> int:
        """Polls of a peer's counter before a wait sleeps, while not :attr:`polite`."""
        return self._spin

    @spin.setter
    def spin(self, value: int) -> None:
        self._spin = value
        if self.core is not None:
            self.core.spin = value

    @property
    def polite(self) -> Callable[[], bool] | None:
        """When set and returning True, waits poll only :data:`POLITE_SPIN` times before
        sleeping: hpcdl's engine says so while its user thread computes."""
        return self._polite

    @polite.setter
    def polite(self, busy: Callable[[], bool] | None) -> None:
        self._polite = busy
        if self.core is not None:
            self.core.polite = busy

    # -- typed views ---------------------------------------------------------------------
    def slot_views(self, p: int, dtype: np.dtype, shape: tuple[int, ...]) -> list[np.ndarray]:
        """Every rank's slot ``p`` as an array of ``dtype`` and ``shape`` (cached)."""
        key = (p, dtype, shape)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 512:
                self._views.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            v = self._views[key] = [self.payload(r, p, nbytes).view(dtype).reshape(shape) for r in range(self.n)]
        return v

    def payload(self, r: int, p: int, nbytes: int) -> np.ndarray:
        """Rank ``r``'s payload of ``nbytes`` in its slot ``p`` (bytes): on the line of the
        slot's header up to :data:`HEAD_DATA` bytes, else at the start of the slot's data."""
        return (self._inline if nbytes <= HEAD_DATA else self.slots)[r][p][:nbytes]

    def buf_views(self, b: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's buffer ``b`` as a flat array of ``dtype``."""
        key = ("b", b, dtype)
        v = self._views.get(key)
        if v is None:
            cap = self.chunk // dtype.itemsize
            v = self._views[key] = [s[b][: cap * dtype.itemsize].view(dtype) for s in self.bufs]
        return v

    def put(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` into ``dst``, a view of the shared window that peers read next (both
        contiguous, of one dtype and size): with non-temporal stores from :attr:`nontemporal`
        bytes, or as the compiled loop measures where :attr:`measured_stores` (:meth:`_copy`)."""
        self._copy(dst, src, dst.nbytes >= self.nontemporal > 0 or self.measured_stores)

    def take(self, dst: np.ndarray, src: np.ndarray, total: int) -> None:
        """Copy ``src``, a view of the window, into ``dst``, a piece of the caller's message
        of ``total`` bytes (both contiguous, of one dtype and size): with non-temporal stores
        once ``total`` reaches :attr:`nontemporal_out` (:meth:`_copy`)."""
        self._copy(dst, src, total >= self.nontemporal_out > 0, total)

    def _copy(self, dst: np.ndarray, src: np.ndarray, streaming: bool, *total: int) -> None:
        """``src`` into ``dst``: where ``streaming`` and the compiled loop is built, through its
        ``put`` (which decides the stores as :meth:`put` and :meth:`take` say); else, or for
        a dtype without a buffer format (bfloat16), numpy's copy."""
        if streaming and self.core is not None:
            try:
                self.core.put(dst, src, *total)
                return
            except (BufferError, ValueError):
                pass
        dst[...] = src

    # -- posting calls ---------------------------------------------------------------------
    def post(self, a: int, b: int, c: int, payload: np.ndarray | None = None, win: int = 0, wout: int = 0) -> int:
        """Publish this rank's next call: signature words ``a, b, c``, where its input and
        output lie in the arena (``win``, ``wout``; 0: not there) and optionally a small
        ``payload`` (any layout); return the call's sequence number."""
        seq = self._my_seq[0] + 1
        p = seq & 1
        if self.aborts[self.me][0]:
            self.stalled(self.me, seq, 2)
        if payload is not None and payload.nbytes:
            nb = payload.nbytes
            try:
                (self._my_inline if nb <= HEAD_DATA else self._my_slots)[p][:nb] = memoryview(payload).cast("B")
            except (TypeError, ValueError):  # any other layout, or no buffer format (bfloat16)
                slot = self.payload(self.me, p, nb).view(payload.dtype).reshape(payload.shape)
                np.copyto(slot, payload)
        # the call counts as posted only below: a payload that could not be copied posts nothing
        h = self._my_heads[p]
        h[0] = a
        h[1] = b
        h[2] = c
        h[3] = win
        h[4] = wout
        self.fence()
        h[POSTED] = seq
        self._my_seq[0] = seq
        self._wake_sleepers(self._my_seq_addr)
        return seq

    def _publish(self, ctrs: list[memoryview], addrs: list[int], value: int) -> None:
        """Publish ``value`` in this rank's counter of ``ctrs`` (at ``addrs``): after a fence,
        so that what the counter announces is in memory first; then wake the peers that may
        sleep on it."""
        self.fence()
        ctrs[self.me][0] = value
        self._wake_sleepers(addrs[self.me])

    def _wake_sleepers(self, addr: int) -> None:
        """After publishing our counter at ``addr``: wake the peers that may sleep on it."""
        if futex.OK:
            self.fence()  # the store just made before the loads below
            for f in self._peer_sleeping:
                if f[0]:
                    futex.wake(addr)
                    break

    def budget(self) -> int:
        """Polls before a wait sleeps: :data:`POLITE_SPIN` while :attr:`polite` says so, else :attr:`spin`."""
        polite = self._polite
        return POLITE_SPIN if polite is not None and polite() else self.spin

    def _doze(self, v: memoryview, addr: int, want: int) -> None:
        """Sleep (at most :data:`_DOZE`) until the peer counter ``v`` at ``addr`` reaches ``want``."""
        flag = self.sleeping[self.me]
        flag[0] = 1
        self.fence()  # the flag before the look below (the publisher fences the other way)
        seen = v[0]
        if seen < want:
            futex.wait(addr, seen, _DOZE)
        flag[0] = 0

    def wait_posted(self, seq: int) -> None:
        """Block until every peer has posted call ``seq`` (progressing other work meanwhile)."""
        self._wait_peers(self._peer_seqs, seq, 0)

    def _wait_peers(self, ctrs: list[tuple[int, memoryview, int]], want: int, kind: int) -> None:
        """Block until every counter in ``ctrs`` (rank, counter, its address) reaches
        ``want``; ``kind`` names the counters in a stall's error (:meth:`stalled`)."""
        for rank, v, addr in ctrs:
            if v[0] >= want:
                continue
            spins, budget, start = 0, self.budget(), 0.0
            while v[0] < want:
                spins += 1
                if spins % 64:
                    continue
                self.progress()
                if spins >= budget:
                    self._doze(v, addr, want)
                elif spins & _STALL_POLLS:
                    continue
                start = self._check_stall(rank, want, start, kind)
        self.fence()

    # -- allreduces in two steps -----------------------------------------------------------
    def split_at(self, nbytes: int) -> int:
        """Where in a slot a one-step allreduce (or reduce) of ``nbytes`` per rank puts its
        reduced blocks when it finishes in two steps, or 0 when it finishes in one.

        In one step every rank reduces every rank's whole message: ``n x nbytes`` read per
        rank, which from a few ranks up costs more than a second wait. In two steps each
        rank reduces only its block (MPICH's block sizes) into its own slot past the data,
        publishes ``done`` (:meth:`publish_done`), and copies every rank's block once they
        are published: ``2 x nbytes`` read. The results are the same bits (each element is
        reduced in rank order either way). Two steps are taken from 3 ranks, once
        ``(n - 2) x nbytes`` reaches :attr:`split_bytes`, where data and blocks fit a slot
        (and never for a payload on its header's line: :data:`HEAD_DATA`)."""
        if self.split_bytes <= 0 or self.n < 3 or (self.n - 2) * nbytes < self.split_bytes or nbytes <= HEAD_DATA:
            return 0
        at = _round_up(nbytes, LINE)
        return at if at + nbytes <= self.slot_bytes else 0

    def one_step(self, collective: str, nbytes: int) -> bool:
        """True when a call of ``collective`` with ``nbytes`` per rank finishes through the
        slots (posted with its data): broadcasts and allgathers up to :attr:`copy_small`;
        reductions up to :attr:`small`, and beyond it where a rank reads little more than
        the message: a reduce-scatter up to a slot (each rank reduces only its block), an
        allreduce or a reduce that takes two steps (:meth:`split_at`), or of 2 ranks up to
        a slot (its one step reads both messages, as two steps would)."""
        if collective in ("broadcast", "allgather"):
            return nbytes <= self.copy_small
        if nbytes <= self.small:
            return True
        if collective == "reduce_scatter" or (collective in ("allreduce", "reduce") and self.n == 2):
            return nbytes <= self.slot_bytes
        return collective in ("allreduce", "reduce") and self.split_at(nbytes) > 0

    def publish_done(self, seq: int) -> None:
        """Publish that this rank's reduced block of call ``seq`` is in its slot."""
        self._publish(self.dones, self._done_addr, seq)

    def wait_done(self, seq: int) -> None:
        """Block until every peer has published its reduced block of call ``seq``."""
        self._wait_peers(self._peer_dones, seq, 4)

    # -- broadcasts streamed through the root's slot -----------------------------------------
    def streams_bytes(self, nbytes: int) -> bool:
        """True when a broadcast of ``nbytes`` can go through :meth:`stream`."""
        return -(-nbytes // self.piece) < 1 << STREAM_SHIFT

    def streamed(self, nbytes: int) -> bool:
        """True when an agreed broadcast of ``nbytes`` goes through :meth:`stream` once its
        call is agreed, rather than with its call: past :attr:`small`, or from
        :attr:`single_copy_broadcast` (read from the root's memory)."""
        return (nbytes > self.small or 0 < self.single_copy_broadcast <= nbytes) and self.streams_bytes(nbytes)

    def stream(self, seq: int, root: int, buf: np.ndarray, src: np.ndarray | None = None) -> None:
        """Move the agreed broadcast ``seq`` from ``root``'s ``buf`` into every other rank's
        (C-contiguous, as many bytes), through the root's slot of the call used as a ring of
        :attr:`piece`-byte pieces: the root copies piece k in and publishes ``seq <<
        STREAM_SHIFT | k + 1`` as its ``streamed`` word; a reader copies the piece out once it
        sees that, so the copies in and out overlap. Where the message wraps the ring, a
        reader also publishes each piece it has copied, and the root waits for every
        reader's before it overwrites a place; from :attr:`single_copy_broadcast` bytes the
        readers read the root's memory instead (a root in place writing the last 1/n of it
        into each reader's meanwhile). ``src`` (the root's, C-contiguous, as many
        bytes): its data where it lies when not yet in ``buf``, which the root copies into
        ``buf`` while the others read it: piece by piece after publishing each, or, read by
        single copy, all at once. The compiled loop's ``stream`` where it is
        built; this method's loop, the same protocol, elsewhere."""
        if self.core is not None:
            self.core.stream(seq, root, buf, self.piece, src)
            return
        me, piece = self.me, self.piece
        raw = buf.reshape(-1).view(np.uint8)
        tee = src.reshape(-1).view(np.uint8) if src is not None and me == root else None
        ring = self.slots[root][seq & 1]
        places, count = self.slot_bytes // piece, -(-raw.size // piece)
        base, wraps = seq << STREAM_SHIFT, count > places
        source = [(root, self.streams[root], self._stream_addr[root])]
        for k in range(count):
            off, at = k * piece, (k % places) * piece
            n = min(piece, raw.size - off)
            if me == root:
                if k >= places:
                    self._wait_peers(self._peer_streams, base + k - places + 1, 5)
                if tee is not None:  # published first, then into buf while the piece is in the cache
                    ring[at : at + n] = tee[off : off + n]
                    self._publish(self.streams, self._stream_addr, base + k + 1)
                    raw[off : off + n] = tee[off : off + n]
                    continue
                ring[at : at + n] = raw[off : off + n]
            else:
                self._wait_peers(source, base + k + 1, 5)
                raw[off : off + n] = ring[at : at + n]
                if not wraps:
                    continue
            self._publish(self.streams, self._stream_addr, base + k + 1)

    def gather(self, seq: int, buf: np.ndarray, offsets: list[int], src: np.ndarray | None = None) -> None:
        """Fill bytes ``offsets[r]`` to ``offsets[r + 1]`` of this rank's ``buf`` (C-contiguous)
        with rank ``r``'s, for the agreed allgather ``seq``; this rank's own block is ``src``
        (C-contiguous, not overlapping ``buf``), copied in as it goes, or where None already
        in ``buf``. From :attr:`single_copy` bytes per rank, each rank reads the others'
        blocks straight from their memory; below it, every rank's slot of the call is a
        ring of :attr:`piece`-byte pieces, as :meth:`stream`'s is. In round k each rank
        copies piece k of its own block in and publishes it in its ``streamed`` word, then
        copies piece k of every peer's block out as each is published; where a block wraps
        the ring, it publishes the round in its ``taken`` word, which each rank waits for
        before it overwrites a place. The compiled loop's ``gather`` where it is built."""
        if self.core is not None:
            self.core.gather(seq, buf, offsets, self.piece, src)
            return
        me, piece, off = self.me, self.piece, offsets
        if src is not None:
            buf.reshape(-1).view(np.uint8)[off[me] : off[me + 1]] = src.reshape(-1).view(np.uint8)
        raw = buf.reshape(-1).view(np.uint8)
        places = self.slot_bytes // piece
        rounds = max(-(-(off[r + 1] - off[r]) // piece) for r in range(self.n))
        base, wraps, p = seq << STREAM_SHIFT, rounds > places, seq & 1
        ring = self.slots[me][p]
        for k in range(rounds):
            at, start = (k % places) * piece, k * piece
            if off[me] + start < off[me + 1]:
                n = min(piece, off[me + 1] - off[me] - start)
                if k >= places:
                    self._wait_peers(self._peer_takes, base + k - places + 1, 6)
                ring[at : at + n] = raw[off[me] + start : off[me] + start + n]
                self._publish(self.streams, self._stream_addr, base + k + 1)
            for rank, v, addr in self._peer_streams:
                if off[rank] + start >= off[rank + 1]:
                    continue
                n = min(piece, off[rank + 1] - off[rank] - start)
                self._wait_peers([(rank, v, addr)], base + k + 1, 5)
                raw[off[rank] + start : off[rank] + start + n] = self.slots[rank][p][at : at + n]
            if wraps:
                self._publish(self.takes, self._take_addr, base + k + 1)

    def allreduce_read(self, seq: int, src: np.ndarray, out: np.ndarray, op: str) -> bool:
        """Finish the agreed allreduce ``seq`` of ``src`` into ``out`` (flat, as long) by single
        copy (:attr:`single_copy_allreduce` on), where every rank's ``src`` is C-contiguous
        and apart from its ``out`` and every rank's staging is slow (:meth:`staging_slow`;
        each rank says whether its is; a rank in place says no): each rank reduces its block
        of every rank's input, read piece by piece out of the peers' memory, into its
        ``out``, then reads each peer's reduced pieces out of the peer's ``out`` as they are
        published. The compiled loop's ``allreduce``. False, where a rank says no, or where
        numpy must reduce the dtype and op: every rank then stages the call through the
        window."""
        code = dtype_code(src.dtype)
        if code < 0 or op not in OPS:
            return False
        apart = src.flags.c_contiguous and not np.may_share_memory(src, out)
        vote = self.staging_slow() and apart  # asked on every rank, apart or not
        if not self.core.allreduce(seq, src if apart else out, out, code, OPS.index(op), vote):
            return False
        mine = block_counts(out.size, self.n)[self.me] * out.itemsize
        self.copied[1] += mine  # its reduced block, and the peers' blocks, into its output
        self.copied[2] += out.nbytes - mine
        return True

    def staging_slow(self) -> bool:
        """Whether this rank's copies into the chunk buffers take non-temporal stores, asked
        once for each agreed large reduction on every rank (:attr:`reductions_voted`): from
        :attr:`nontemporal` bytes (the setting, or ranks spanning more than one last-level
        cache), or where the compiled loop's measured stores call for them on any rank
        (plain ones several times as slow: cores that share no cache; the peers' calls read
        again here), but for every :data:`RESTAGE_EVERY`-th ask, which stages to probe them
        again. Staging a large reduction then writes lines the other core holds, and reading
        an allreduce by single copy took 0.49-0.91 x the staged time at 16 MiB on the 2-vCPU
        reference machine, on huge pages and on 4 KiB ones. Where the cores share a cache
        staging is cheap: single copy took 1.33-1.50 x as long there on 4 KiB pages, which
        the kernel pins one by one (0.82-1.01 x on huge ones), and on a 16-core node
        1.11-1.38 x on arrays in the heap (0.60-0.85 x on fresh ones). A rank cannot tell
        cheaply where a caller's pages lie, so this alone decides."""
        self.reductions_voted += 1
        if self.nontemporal > 0:
            return True
        if not self.measured_stores or self.reductions_voted % RESTAGE_EVERY == 0:
            return False
        self.core.note_stores(0, 0, True)
        return bool(self.core.staged_stores[0])

    def reads_peers(self, collective: str, nbytes: int) -> bool:
        """True when an agreed ``collective`` with ``nbytes`` per rank of input goes to
        :meth:`reduce_scatter_read` or :meth:`allreduce_read`, which read the peers' memory
        by single copy where every rank votes for it: a reduce-scatter from
        :attr:`single_copy_reduce_scatter` bytes, an allreduce from
        :attr:`single_copy_allreduce`, of 2 ranks, or of more where broadcasts read the
        root's memory too (each rank's input is then read by every peer at once, as a root's
        is, and the kernel's copies from one process contend on some nodes: the broadcasts'
        measurement says whether they do)."""
        sizes = {"reduce_scatter": self.single_copy_reduce_scatter, "allreduce": self.single_copy_allreduce}
        return 0 < sizes.get(collective, 0) <= nbytes and (self.n == 2 or self.single_copy_broadcast > 0)

    def reduce_scatter_read(
        self, seq: int, src: np.ndarray, counts: tuple[int, ...], out: np.ndarray, op: str, apart: bool = True
    ) -> bool:
        """Reduce block ``me`` (elements by ``counts``) of every rank's ``src`` (flat,
        C-contiguous) with ``op`` into ``out`` for the agreed reduce-scatter ``seq``, reading
        the peers' blocks straight out of their memory (cross-memory attach;
        :attr:`single_copy_reduce_scatter` on), where every rank votes for it: its ``out``
        is ``apart`` from its ``src`` and its staging is slow (:meth:`staging_slow`). Each
        rank offers its ``src`` as an allgather's single copy does, with its vote; then,
        piece by piece, it reads its block of every peer's into a scratch buffer and reduces
        them with its own in rank order, so only the blocks move, once, and nothing is
        staged. It returns True once every peer has read its block; False, where a rank
        voted against it (every rank then stages the call). The compiled loop's
        ``reduce_scatter`` where it has a kernel for the dtype and op and ``out`` is
        C-contiguous; this method's loop, the same protocol, with numpy's reduction
        elsewhere."""
        me, n, p = self.me, self.n, seq & 1
        lo = sum(counts[:me])
        hi, isz = lo + counts[me], src.itemsize
        vote = self.staging_slow() and apart  # asked on every rank, apart or not
        code = dtype_code(src.dtype)
        if out.flags.c_contiguous and code >= 0 and op in OPS and self.core.has_kernel(code, OPS.index(op)):
            return bool(self.core.reduce_scatter(seq, src, lo * isz, hi * isz, out, code, OPS.index(op), vote))
        red = rank_order_reducer(op, n)
        done = (seq << STREAM_SHIFT) + 1
        words = self.slots[me][p][:32].view(np.int64)
        words[3] = vote
        words[0] = src.ctypes.data
        self._publish(self.streams, self._stream_addr, done)
        self._wait_peers(self._peer_streams, done, 5)
        heads = [self.slots[r][p][:32].view(np.int64) for r in range(n)]
        if not all(h[3] for h in heads):
            return False
        addrs = [int(h[0]) for h in heads]
        piece = max(1, REDUCE_READ_PIECE // isz)
        if self._scratch is None or self._scratch.nbytes < (n - 1) * min(piece, counts[me]) * isz:
            self._scratch = np.empty((n - 1) * min(piece, counts[me]) * isz, np.uint8)
        parts: list[np.ndarray] = [src] * n
        for a in range(lo, hi, piece):
            m = min(piece, hi - a)
            for k in range(1, n):  # each rank starts at its next peer: the reads spread over the ranks
                r = (me + k) % n
                raw = self._scratch[(k - 1) * m * isz : k * m * isz]
                self.core.cma_read(self._pids[r], addrs[r] + a * isz, raw)
                parts[r] = raw.view(src.dtype)
            parts[me] = src[a : a + m]
            red(parts, out[a - lo : a - lo + m])
        self._publish(self.takes, self._take_addr, done)
        self._wait_peers(self._peer_takes, done, 6)
        return True

    def _check_stall(self, rank: int, want: int, start: float, kind: int) -> float:
        """Raise the stall's error if a peer gave up, or the wait for ``rank`` has lasted the
        stall timeout since ``start`` (0: since now, the first look); ``kind`` 0 waits on
        its counter, 3 on its stage, 4 on its reduced block, 5 on its streamed pieces, 6 on
        the pieces it took.
        Returns the start."""
        self._check_peers(want >> STREAM_SHIFT if kind >= 5 else want)
        now = time.monotonic()
        if not start:
            return now
        if self.stall_timeout > 0 and now - start >= self.stall_timeout:
            self.stalled(rank, want, kind)
        return start

    def _check_peers(self, want: int) -> None:
        """Raise the stall's error if a peer gave up (its abort word is set)."""
        for j, f in enumerate(self._peer_aborts):
            if f[0]:
                self.stalled(j + (j >= self.me), want, 1)

    def stalled(self, rank: int, want: int, kind: int) -> None:
        """Give up on this channel after a stall and raise :class:`~.errors.StallError`:
        kind 0, this rank waited the stall timeout for ``rank`` to post call ``want`` (3:
        to reach barrier ``want``; 4: to publish its reduced block of call ``want``; 5: to
        stream piece ``want & (2**STREAM_SHIFT - 1)`` of call ``want >> STREAM_SHIFT``; 6: to
        take that piece of every peer); 1, ``rank`` gave up; 2, this rank gave up before."""
        call = want >> STREAM_SHIFT if kind >= 5 else want
        mine = self.aborts[self.me]
        if mine[0] == 0:
            mine[0] = max(call, 1)
            self.fence()
        how = "stopped on every rank of the node; call collectives.reset(comm) on every rank to use it again"
        if kind in (0, 3, 4, 5, 6):
            what = {0: "call", 3: "barrier", 4: "the reduced blocks of call"}.get(kind, "the streamed pieces of call")
            ctrs = {0: self.seqs, 3: self.stages, 4: self.dones}.get(kind)
            # (streamed pieces are published only where needed: name the rank waited for)
            late = [j for j in range(self.n) if j != self.me and ctrs is not None and ctrs[j][0] < want] or [rank]
            raise StallError(
                f"collective stalled: waited {self.stall_timeout:g} s (HPCDL_STALL_TIMEOUT) for rank(s) {late} "
                f"to reach {what} {call} on this node; the ranks fell out of step (a rank raised, or skipped or "
                f"reordered a collective). The communicator's collectives are {how}"
            )
        if kind == 1:
            raise StallError(
                f"rank {rank} gave up on a collective after a stall (its error names the ranks it waited for), "
                f"so this rank's call {want} cannot complete; the communicator's collectives are {how}"
            )
        raise StallError(
            f"this communicator's collectives stopped after a stall at call {mine[0]}; call "
            "collectives.reset(comm) on every rank to use it again"
        )

    def exchange(
        self,
        a: int,
        b: int,
        c: int,
        payload: np.ndarray | None = None,
        uneven: bool = False,
        win: int = 0,
        wout: int = 0,
    ) -> int:
        """Post a call, wait for every peer's post of it and compare signatures (``b``, the
        count, may differ when ``uneven``): return the call's sequence number, negated when
        the signatures differ."""
        seq = self.post(a, b, c, payload, win, wout)
        self.wait_posted(seq)
        self._check_peers(seq)  # every peer posted, but one may have given up meanwhile
        for h in self.peer_heads[seq & 1]:
            if h[0] != a or h[2] != c or (h[1] != b and not uneven):
                return -seq
        return seq

    def words(self, seq: int) -> list[tuple[int, int, int]]:
        """Every rank's signature words for call ``seq``, by rank."""
        p = seq & 1
        return [(h[p][0], h[p][1], h[p][2]) for h in self.heads]

    def wheres(self, seq: int) -> list[tuple[int, int]]:
        """Every rank's arena words (input, output) for call ``seq``, by rank; read them before
        this rank posts again."""
        p = seq & 1
        return [(h[p][3], h[p][4]) for h in self.heads]

    # -- the stage barrier -------------------------------------------------------------------
    def arrive(self) -> None:
        """Publish that this rank has finished everything before the next barrier."""
        self.stage += 1
        self._publish(self.stages, self._stage_addr, self.stage)

    def await_all(self) -> Schedule:
        """Wait (yielding ``[]`` to the driver) until every peer has arrived too."""
        s = self.stage
        for i, (v, addr) in enumerate(self._peer_stages):
            spins, budget, start = 0, self.budget(), 0.0
            while v[0] < s:
                spins += 1
                if spins % 64:
                    continue
                yield []
                if spins >= budget:
                    self._doze(v, addr, s)
                elif spins & _STALL_POLLS:
                    continue
                start = self._check_stall(i + (i >= self.me), s, start, 3)
        self.fence()

    def barrier(self) -> Schedule:
        """Arrive and wait: every rank has finished what it did before."""
        self.arrive()
        yield from self.await_all()

    def own(self, barrier: bool = True) -> Schedule:
        """Wait for this operation's turn on the buffers, then a barrier unless told not to
        (an operation that writes no buffer needs none); leave with :meth:`release`."""
        token = object()
        self.queue.append(token)
        while self.queue[0] is not token:
            yield []
        if barrier:  # peers may still be reading our buffers for the operation before this one
            yield from self.barrier()

    def release(self) -> None:
        """Hand the buffers to the next operation in this rank's queue."""
        self.queue.pop(0)
