"""Collectives inside one node through one shared-memory window: the ``shm`` algorithms.

Every rank owns one segment of a window shared by the node (MPI-3
``MPI_Win_allocate_shared``, or plain arrays for the thread transport), laid out as::

    [seq][stage] [slot 0: header | small data] [slot 1: ...] [buffer 0] [buffer 1]

``seq`` counts the calls this rank has *posted*; a call posts its argument signature
(three int64 words) into slot ``seq % 2``, and for small messages the data too, then
publishes ``seq``. Once every peer's ``seq`` has reached it, each rank reads all the
signatures and raises the same error everywhere if they differ; if they agree, a small
collective is finished in that one step from the slots (each rank reduces or copies what
it needs, reading every rank's data in rank order, so results are bitwise equal). Two
slots suffice: a rank can post call ``k + 2`` only after every peer posted ``k + 1``,
which each does only after it finished reading call ``k``.

Larger messages stream through the two buffers in chunks. ``stage`` is a second counter
used as a barrier: a rank publishes it and waits until every peer has reached it. The
allreduce runs one barrier per chunk: after barrier ``i`` every rank copies the reduced
slices of chunk ``i`` out, reduces its slice of chunk ``i + 1`` and stages chunk ``i + 2``.
Each rank's buffer is cut into fixed per-rank regions, so what one rank writes and what
its peers read at the same moment never overlap (the proofs are in the comments below).

Loads and stores are ordered by the window's ``MPI_Win_sync`` around every publication.

A rank waiting for a peer's counter polls it a while (:data:`_SPIN` polls when every rank
has a core of its own, or fewer when the caller says its process has other work: see
:attr:`Channel.polite`), then sleeps on the counter with a futex (:mod:`.futex`) instead
of spinning on: it raises its ``sleeping`` flag, looks at the counter once more and
sleeps; a rank that publishes a counter looks at its peers' flags afterwards and wakes
the sleepers. Either the sleeper sees the new value or the publisher sees the flag.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from . import futex
from .layout import block_counts, offsets
from .ops import finalize, ufunc

__all__ = ["Channel", "LINE"]

Schedule = Generator[list, None, None]

LINE = 64
"""Bytes per cache line; every separately written field starts on its own line."""

_SPIN = 2000
"""Polls of a peer's counter before a waiting rank sleeps on it, when every rank of the
node has a core of its own (fewer otherwise: :func:`_spin_budget`)."""

_POLITE_SPIN = 64
"""Polls before sleeping while :attr:`Channel.polite` says the process has other work."""

_DOZE = 1e-3
"""The longest one sleep lasts before the waiter looks again (and progresses other work)."""


def _spin_budget(ranks: int) -> int:
    """:data:`_SPIN`, or 0 when the node's ranks outnumber the cores this process may run
    on: then the peer being waited for is likely not running, and spinning only delays it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return _SPIN if ranks <= cores else _POLITE_SPIN


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Channel:
    """The shared window of one node-local communicator, and this rank's counters."""

    def __init__(self, t: Any, small_bytes: int, chunk_bytes: int, progress: Callable[[], None]) -> None:
        n, me = t.size, t.rank
        self.n, self.me = n, me
        self.small = _round_up(max(small_bytes, LINE), LINE)
        self.region = _round_up(max(chunk_bytes // n, LINE), LINE)
        self.chunk = self.region * n
        slot = LINE + self.small
        self._slot0 = 2 * LINE
        self._buf0 = 2 * LINE + 2 * slot
        total = self._buf0 + 2 * self.chunk
        segs, self.fence = t.shared_window(total)
        self.segs = segs
        self.seqs = [memoryview(s[0:8]).cast("q") for s in segs]
        self.stages = [memoryview(s[LINE : LINE + 8]).cast("q") for s in segs]
        # written by its owner only, like ``seq`` beside it: 1 while the owner may be asleep
        self.sleeping = [memoryview(s[8:16]).cast("q") for s in segs]
        self._seq_addr = [s[0:8].ctypes.data for s in segs]
        self._stage_addr = [s[LINE : LINE + 8].ctypes.data for s in segs]
        self.heads = [
            [memoryview(s[self._slot0 + p * slot : self._slot0 + p * slot + 24]).cast("q") for p in (0, 1)]
            for s in segs
        ]
        self.slots = [[s[self._slot0 + p * slot + LINE : self._slot0 + (p + 1) * slot] for p in (0, 1)] for s in segs]
        self.bufs = [[s[self._buf0 + b * self.chunk : self._buf0 + (b + 1) * self.chunk] for b in (0, 1)] for s in segs]
        peers = [j for j in range(n) if j != me]
        self._my_seq = self.seqs[me]
        self._peer_seqs = [(self.seqs[j], self._seq_addr[j]) for j in peers]
        self._peer_stages = [(self.stages[j], self._stage_addr[j]) for j in peers]
        self._peer_sleeping = [self.sleeping[j] for j in peers]
        self._my_seq_addr, self._my_stage_addr = self._seq_addr[me], self._stage_addr[me]
        self._my_heads = self.heads[me]
        self._peer_heads = [[self.heads[j][p] for j in peers] for p in (0, 1)]
        self._my_slots = [memoryview(self.slots[me][p]) for p in (0, 1)]
        self.seq = 0
        self.stage = 0
        self.progress = progress
        self.spin = _spin_budget(n)
        self.polite: Callable[[], bool] | None = None
        """When set and returning True, waits poll only :data:`_POLITE_SPIN` times before
        sleeping: hpcdl's engine says so while its user thread computes."""
        self.queue: list[object] = []
        """Chunked operations in flight, oldest first: only the first uses the buffers."""
        self._views: dict[tuple, list] = {}

    # -- typed views ---------------------------------------------------------------------
    def slot_views(self, p: int, dtype: np.dtype, shape: tuple[int, ...]) -> list[np.ndarray]:
        """Every rank's slot ``p`` as an array of ``dtype`` and ``shape`` (cached)."""
        key = (p, dtype, shape)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 512:
                self._views.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            v = self._views[key] = [s[p][:nbytes].view(dtype).reshape(shape) for s in self.slots]
        return v

    def buf_views(self, b: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's buffer ``b`` as a flat array of ``dtype``."""
        key = ("b", b, dtype)
        v = self._views.get(key)
        if v is None:
            cap = self.chunk // dtype.itemsize
            v = self._views[key] = [s[b][: cap * dtype.itemsize].view(dtype) for s in self.bufs]
        return v

    # -- posting calls ---------------------------------------------------------------------
    def post(self, a: int, b: int, c: int, payload: np.ndarray | None = None) -> int:
        """Publish this rank's next call: signature words ``a, b, c`` and optionally a small
        ``payload`` (any layout); return the call's sequence number."""
        seq = self.seq + 1
        self.seq = seq
        p = seq & 1
        h = self._my_heads[p]
        h[0] = a
        h[1] = b
        h[2] = c
        if payload is not None:
            nb = payload.nbytes
            if nb:
                try:
                    self._my_slots[p][:nb] = memoryview(payload).cast("B")
                except (TypeError, ValueError):  # strided, or no buffer format (bfloat16)
                    self.slots[self.me][p][:nb] = payload.reshape(-1).view(np.uint8)
        self.fence()
        self._my_seq[0] = seq
        self._wake_sleepers(self._my_seq_addr)
        return seq

    def _wake_sleepers(self, addr: int) -> None:
        """After publishing our counter at ``addr``: wake the peers that may sleep on it."""
        if futex.OK:
            self.fence()  # the store just made before the loads below
            for f in self._peer_sleeping:
                if f[0]:
                    futex.wake(addr)
                    break

    def _budget(self) -> int:
        polite = self.polite
        return _POLITE_SPIN if polite is not None and polite() else self.spin

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
        for v, addr in self._peer_seqs:
            if v[0] >= seq:
                continue
            spins, budget = 0, self._budget()
            while v[0] < seq:
                spins += 1
                if spins % 64 == 0:
                    self.progress()
                    if spins >= budget:
                        self._doze(v, addr, seq)
        self.fence()

    def exchange(self, a: int, b: int, c: int, payload: np.ndarray | None = None, uneven: bool = False) -> int:
        """Post a call, wait for every peer's post of it and compare signatures (``b``, the
        count, may differ when ``uneven``): return the call's sequence number, negated when
        the signatures differ."""
        seq = self.post(a, b, c, payload)
        self.wait_posted(seq)
        for h in self._peer_heads[seq & 1]:
            if h[0] != a or h[2] != c or (h[1] != b and not uneven):
                return -seq
        return seq

    def words(self, seq: int) -> list[tuple[int, int, int]]:
        """Every rank's signature words for call ``seq``, by rank."""
        p = seq & 1
        return [(h[p][0], h[p][1], h[p][2]) for h in self.heads]

    # -- the stage barrier -------------------------------------------------------------------
    def arrive(self) -> None:
        """Publish that this rank has finished everything before the next barrier."""
        self.stage += 1
        self.fence()
        self.stages[self.me][0] = self.stage
        self._wake_sleepers(self._my_stage_addr)

    def await_all(self) -> Schedule:
        """Wait (yielding ``[]`` to the driver) until every peer has arrived too."""
        s = self.stage
        for v, addr in self._peer_stages:
            spins, budget = 0, self._budget()
            while v[0] < s:
                spins += 1
                if spins % 64 == 0:
                    yield []
                    if spins >= budget:
                        self._doze(v, addr, s)
        self.fence()

    def barrier(self) -> Schedule:
        """Arrive and wait: every rank has finished what it did before."""
        self.arrive()
        yield from self.await_all()

    def own(self) -> Schedule:
        """Wait for this operation's turn on the buffers, then a barrier (leave with :meth:`release`)."""
        token = object()
        self.queue.append(token)
        while self.queue[0] is not token:
            yield []
        # peers may still be reading our buffers for the operation before this one
        yield from self.barrier()

    def release(self) -> None:
        """Hand the buffers to the next operation in this rank's queue."""
        self.queue.pop(0)


MISMATCH = object()
"""What a one-step function returns when the peers' signatures differ (the caller then
reports call ``ch.seq``)."""

SLOW = object()
"""What a one-step function returns, before posting anything, when this call must take the
general path after all (an ``out`` that is not exactly right)."""

UNEVEN = object()
"""What the one-step allgather returns when a peer's rows differ from ours, or its ``out``
does not fit ours: the call is posted and agreed, and the caller finishes it (or reports
the bad ``out``) on the general path."""


def _reducer(op: str, n: int) -> Callable[[Sequence[np.ndarray], np.ndarray], None]:
    """``red(views, out)``: ``out = views[0] op views[1] op ...`` in rank order (so every rank
    gets the same bits), then the op's final step (the average's division)."""
    f = ufunc(op)
    if op in ("min", "max"):  # numpy wants their out= by keyword; add/multiply are quicker without
        g = f
        f = lambda a, b, out: g(a, b, out=out)  # noqa: E731
    avg = op == "avg"

    def red(v: Sequence[np.ndarray], out: np.ndarray) -> None:
        f(v[0], v[1], out)
        for w in v[2:]:
            f(out, w, out)
        if avg:
            finalize(out, op, n)

    return red


# Every one-step function below is built once per (signature, dtype, shape, op or root) with
# every lookup done up front. ``fn(x)`` posts ``x`` (any layout), waits for the peers, checks
# their signatures and finishes the call from the slots, reading every rank's data in rank
# order so results are bitwise equal everywhere.
def small_allreduce_fn(ch: Channel, a: int, dtype: np.dtype, shape: tuple[int, ...], op: str) -> Callable:
    """One-step allreduce: ``fn(x, out=None)`` returns the result (in ``out`` when given),
    :data:`MISMATCH`, or :data:`SLOW` without posting when ``out`` is not C-contiguous
    with x's shape and dtype."""
    count = math.prod(shape)
    views = [ch.slot_views(p, dtype, shape) for p in (0, 1)]
    red = _reducer(op, ch.n)

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        if out is None:
            out = np.empty(shape, dtype)
        elif type(out) is not np.ndarray or out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            return SLOW
        seq = ch.exchange(a, count, 0, x)
        if seq < 0:
            return MISMATCH
        red(views[seq & 1], out)
        return out

    return fn


def small_reduce_scatter_fn(ch: Channel, a: int, dtype: np.dtype, count: int, op: str) -> Callable:
    """One-step reduce-scatter of ``count`` elements: ``fn(x, out=None)`` returns this rank's
    block (MPICH's block sizes; in ``out`` when given), :data:`MISMATCH`, or :data:`SLOW`
    without posting when ``out`` is not exactly right."""
    off = offsets(block_counts(count, ch.n))
    lo, hi = off[ch.me], off[ch.me + 1]
    views = [[v[lo:hi] for v in ch.slot_views(p, dtype, (count,))] for p in (0, 1)]
    red = _reducer(op, ch.n)

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        if out is None:
            out = np.empty(hi - lo, dtype)
        elif type(out) is not np.ndarray or out.shape != (hi - lo,) or out.dtype != dtype or not out.flags.c_contiguous:
            return SLOW
        seq = ch.exchange(a, count, 0, x)
        if seq < 0:
            return MISMATCH
        if hi > lo:
            red(views[seq & 1], out)
        return out

    return fn


def small_reduce_fn(ch: Channel, a: int, dtype: np.dtype, shape: tuple[int, ...], op: str, root: int) -> Callable:
    """One-step reduce: ``fn(x)`` returns the result on ``root``, None elsewhere, or
    :data:`MISMATCH`."""
    count = math.prod(shape)
    views = [ch.slot_views(p, dtype, shape) for p in (0, 1)]
    red = _reducer(op, ch.n)
    is_root = ch.me == root

    def fn(x: np.ndarray) -> Any:
        seq = ch.exchange(a, count, 0, x)
        if seq < 0:
            return MISMATCH
        if not is_root:
            return None
        out = np.empty(shape, dtype)
        red(views[seq & 1], out)
        return out

    return fn


def small_broadcast_fn(ch: Channel, a: int, dtype: np.dtype, shape: tuple[int, ...], root: int) -> Callable:
    """One-step broadcast: ``fn(x, out=None)`` returns ``root``'s data (in ``out`` when given),
    :data:`MISMATCH`, or :data:`SLOW` without posting when ``out`` is not C-contiguous with
    x's shape and dtype; only the root posts data."""
    count = math.prod(shape)
    views = [ch.slot_views(p, dtype, shape)[root] for p in (0, 1)]
    is_root = ch.me == root

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        if out is None:
            out = np.empty(shape, dtype)
        elif type(out) is not np.ndarray or out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            return SLOW
        seq = ch.exchange(a, count, 0, x if is_root else None)
        if seq < 0:
            return MISMATCH
        if not is_root:
            out[...] = views[seq & 1]
        elif out is not x:
            out[...] = x
        return out

    return fn


def small_allgather_fn(ch: Channel, a: int, c: int, dtype: np.dtype, shape: tuple[int, ...], unit: int) -> Callable:
    """One-step allgather of ``shape`` (rows first) from every rank: ``fn(x, out=None)``
    returns the concatenation (in ``out`` when given), :data:`MISMATCH`, :data:`UNEVEN` when
    a peer's rows differ from ours or its ``out`` does not fit (the general path then says
    which), or :data:`SLOW` without posting anything when ``out`` is not exactly right.
    The count word is ``rows + (out rows + 1) * unit``."""
    rows = shape[0]
    full = (ch.n * rows, *shape[1:])
    views = [ch.slot_views(p, dtype, shape) for p in (0, 1)]
    heads = ch._peer_heads
    plain = rows
    fits = rows + (full[0] + 1) * unit
    n = ch.n
    last: list[Any] = [None, None]

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> Any:
        b = plain
        if out is not None:
            if type(out) is not np.ndarray or out.shape != full or out.dtype != dtype or not out.flags.c_contiguous:
                return SLOW
            b = fits
        seq = ch.exchange(a, b, c, x, True)
        if seq < 0:
            return MISMATCH
        p = seq & 1
        for h in heads[p]:
            w = h[1]
            if w != plain and w != fits:
                return UNEVEN
        if out is None:
            return np.concatenate(views[p])
        if out is not last[0]:  # the same out again (a training loop's buffer): blocks known
            last[:] = [out, [out[j * rows : (j + 1) * rows] for j in range(n)]]
        for o, v in zip(last[1], views[p], strict=True):
            o[...] = v
        return out

    return fn


# -- one-step collectives from the slots (after a successful post/wait/check) ---------------
def small_allreduce(ch: Channel, seq: int, out: np.ndarray, op: str) -> None:
    """Finish a posted small allreduce into ``out`` (shaped as the input)."""
    _reducer(op, ch.n)(ch.slot_views(seq & 1, out.dtype, out.shape), out)


def small_reduce_scatter(ch: Channel, seq: int, counts: tuple[int, ...], out: np.ndarray, op: str) -> None:
    """Finish a posted small reduce-scatter: this rank's block into ``out``."""
    off = offsets(counts)
    a, z = off[ch.me], off[ch.me + 1]
    if z > a:
        _reducer(op, ch.n)([v[a:z] for v in ch.slot_views(seq & 1, out.dtype, (off[-1],))], out)


def small_allgather(ch: Channel, seq: int, counts: tuple[int, ...], out: np.ndarray) -> None:
    """Finish a posted small allgather: every rank's data into ``out`` (flat), in rank order."""
    off = offsets(counts)
    for j in range(ch.n):
        if j != ch.me and counts[j]:
            out[off[j] : off[j + 1]] = ch.slot_views(seq & 1, out.dtype, (counts[j],))[j]


def small_broadcast(ch: Channel, seq: int, root: int, out: np.ndarray) -> None:
    """Finish a posted small broadcast: the root's data into ``out`` (flat)."""
    if ch.me != root:
        out[...] = ch.slot_views(seq & 1, out.dtype, (out.size,))[root]


# -- chunked collectives through the buffers ------------------------------------------------
def allreduce(ctx: Any, t: Any, buf: np.ndarray, op: str, tag: int, src: np.ndarray | None = None) -> Schedule:
    """Allreduce ``src`` (default ``buf``, in place) into ``buf``, chunk by chunk."""
    yield from _allreduce(ctx.channel(), buf, buf if src is None else src, op, root=None)


def reduce(ctx: Any, t: Any, buf: np.ndarray, root: int, op: str, tag: int) -> Schedule:
    """Reduce ``buf`` onto ``root`` in place (other ranks' ``buf`` is left as it was)."""
    yield from _allreduce(ctx.channel(), buf, buf, op, root=root)


def _allreduce(ch: Channel, out: np.ndarray, src: np.ndarray, op: str, root: int | None) -> Schedule:
    n, me = ch.n, ch.me
    yield from ch.own()
    try:
        dt = out.dtype
        per = ch.region // dt.itemsize  # elements of one rank's region
        step = per * n
        total = out.size
        chunks = [(c, min(c + step, total)) for c in range(0, total, step)]
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]
        red = _reducer(op, n)
        gather = root is None or root == me

        def stage(i: int) -> None:
            # copy chunk i of our data, all but our own slice, into our buffer's regions
            c0, c1 = chunks[i]
            off = offsets(block_counts(c1 - c0, n))
            mine = views[i & 1][me]
            for j in range(n):
                if j != me and off[j + 1] > off[j]:
                    mine[j * per : j * per + off[j + 1] - off[j]] = src[c0 + off[j] : c0 + off[j + 1]]

        def reduce_own(i: int) -> None:
            # our slice of chunk i, reduced over every rank in rank order, into our region
            c0, c1 = chunks[i]
            off = offsets(block_counts(c1 - c0, n))
            m = off[me + 1] - off[me]
            if not m:
                return
            lo = me * per
            parts = [
                src[c0 + off[me] : c0 + off[me] + m] if j == me else v[lo : lo + m] for j, v in enumerate(views[i & 1])
            ]
            red(parts, views[i & 1][me][lo : lo + m])

        def gather_out(i: int) -> None:
            c0, c1 = chunks[i]
            off = offsets(block_counts(c1 - c0, n))
            for j, v in enumerate(views[i & 1]):
                m = off[j + 1] - off[j]
                if m:
                    out[c0 + off[j] : c0 + off[j + 1]] = v[j * per : j * per + m]

        # Barrier i publishes "slice i reduced" and "chunk i + 1 staged". Between barriers
        # a rank writes only its own buffer: region `me` of buffer i % 2 (the reduction)
        # and the other regions of buffer (i + 1) % 2 (staging). The peers read, in the same
        # window, region `me` of buffer (i - 1) % 2 (gather) and region `j` of buffer i % 2
        # (reduce). Buffer (i + 1) % 2 == (i - 1) % 2, but its region `me` is not staged and
        # the other regions were last read when reducing chunk i - 1, before barrier i - 1.
        stage(0)
        yield from ch.barrier()
        for i in range(len(chunks)):
            reduce_own(i)
            if i + 1 < len(chunks):
                stage(i + 1)
            yield from ch.barrier()
            if gather:
                gather_out(i)
    finally:
        ch.release()


def reduce_scatter(
    ctx: Any, t: Any, buf: np.ndarray, counts: tuple[int, ...], op: str, tag: int, out: np.ndarray | None = None
) -> Schedule:
    """Reduce ``buf`` (blocks ``counts``) so block ``me`` is reduced: into ``out`` if given, else in place."""
    ch = ctx.channel()
    n, me = ch.n, ch.me
    off = offsets(counts)
    res = buf[off[me] : off[me + 1]] if out is None else out
    yield from ch.own()
    try:
        dt = buf.dtype
        per = ch.region // dt.itemsize
        pieces = math.ceil(max(counts) / per) if max(counts) else 0
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]
        red = _reducer(op, n)

        def stage(i: int) -> None:
            mine = views[i & 1][me]
            for j in range(n):
                a, z = off[j] + i * per, min(off[j] + (i + 1) * per, off[j + 1])
                if j != me and z > a:
                    mine[j * per : j * per + z - a] = buf[a:z]

        def reduce_own(i: int) -> None:
            a, z = off[me] + i * per, min(off[me] + (i + 1) * per, off[me + 1])
            if z <= a:
                return
            m, lo = z - a, me * per
            parts = [buf[a:z] if j == me else v[lo : lo + m] for j, v in enumerate(views[i & 1])]
            red(parts, res[i * per : i * per + m])

        # barrier i publishes piece i staged; reducing piece i reads region `me` of every
        # peer's buffer i % 2, which its owner rewrites only after barrier i + 1
        if pieces:
            stage(0)
        for i in range(pieces):
            yield from ch.barrier()
            if i + 1 < pieces:
                stage(i + 1)
            reduce_own(i)
    finally:
        ch.release()


def allgather(ctx: Any, t: Any, buf: np.ndarray, counts: tuple[int, ...], tag: int) -> Schedule:
    """Fill every block of ``buf`` from its owner; block ``me`` is already in place."""
    ch = ctx.channel()
    me = ch.me
    off = offsets(counts)
    yield from ch.own()
    try:
        dt = buf.dtype
        per = ch.chunk // dt.itemsize
        pieces = math.ceil(max(counts) / per) if max(counts) else 0
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]

        def stage(i: int) -> None:
            a, z = off[me] + i * per, min(off[me] + (i + 1) * per, off[me + 1])
            if z > a:
                views[i & 1][me][: z - a] = buf[a:z]

        def gather_in(i: int) -> None:
            for j, v in enumerate(views[i & 1]):
                a, z = off[j] + i * per, min(off[j] + (i + 1) * per, off[j + 1])
                if j != me and z > a:
                    buf[a:z] = v[: z - a]

        # barrier i publishes piece i; buffer i % 2 is restaged (piece i + 2) only after
        # barrier i + 1, which every peer passes after reading piece i
        for i in range(pieces):
            stage(i)
            yield from ch.barrier()
            gather_in(i)
    finally:
        ch.release()


def broadcast(ctx: Any, t: Any, buf: np.ndarray, root: int, tag: int) -> Schedule:
    """Copy ``root``'s ``buf`` into every rank's ``buf``."""
    ch = ctx.channel()
    me = ch.me
    yield from ch.own()
    try:
        dt = buf.dtype
        per = ch.chunk // dt.itemsize
        views = [ch.buf_views(0, dt), ch.buf_views(1, dt)]
        for i, a in enumerate(range(0, buf.size, per)):
            z = min(a + per, buf.size)
            if me == root:
                views[i & 1][root][: z - a] = buf[a:z]
            yield from ch.barrier()
            if me != root:
                buf[a:z] = views[i & 1][root][: z - a]
    finally:
        ch.release()
