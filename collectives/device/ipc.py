"""Single-node collectives on device arrays through peers' buffers (algorithm ``ipc``).

Each rank owns one window of ``device_window_bytes``, allocated once per communicator and
exported to the node's other ranks; every rank maps every peer's window and reads it
directly. A call goes through the windows in chunks: each rank copies its piece in, every
rank reduces its block of the chunk from all windows (in rank order, so results are the
same bits on every rank and match a rank-order host reduction), and every rank copies
the reduced blocks out.

The schedules are written once over a :class:`Peers` object, which owns the windows and
the ordering between ranks' queued work: :class:`CudaPeers` (CUDA IPC memory and event
handles, CuPy kernels on the current stream) and :class:`HostPeers` (numpy over an MPI
shared window: the same schedules on host memory, which is how they are tested on
machines without a GPU). Between ranks, a stage barrier on the node channel says "every
rank has *queued* this step"; the events then make each rank's device work wait for its
peers' queued work, so the host never waits for the GPU, inside a call or at its end.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

import numpy as np

from ..blocks import block_counts, offsets
from ..errors import DeviceUnavailableError
from ..ops import finalize, ufunc
from .arrays import cupy_module

__all__ = [
    "Peers",
    "HostPeers",
    "CudaPeers",
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "combine",
    "STAGED",
    "REDUCED",
    "READ",
]

STAGED, REDUCED, READ = 0, 1, 2
"""The events each rank records: its piece is in its window; its block is reduced there;
it has finished reading its peers' windows."""

Schedule = Generator[list, None, None]


class Peers(Protocol):
    """Every node rank's window and the ordering of their queued work."""

    me: int
    nbytes: int
    views: list[Any]
    """Every node rank's window as a uint8 array of ``nbytes``, by node rank."""

    def record(self, k: int) -> None:
        """Mark event ``k`` after the work this rank has queued so far."""

    def wait(self, k: int) -> None:
        """Order this rank's later work after every peer's last event ``k``."""

    def free(self) -> None:
        """Release the windows (collective over the node)."""


class HostPeers:
    """:class:`Peers` on host memory, where a rank's work reaches its peers only as CUDA
    events make it: each rank writes its own window in private (its queued work, not yet
    visible); :meth:`record` publishes the window as it stands (the work before the event
    has completed), into an MPI shared window holding one copy per event; :meth:`wait`
    copies every peer's last published copy for that event into this rank's mirror of the
    peer's window, which is all a schedule reads of it. A missing ``record`` or ``wait``
    leaves stale bytes where a GPU would race, so the schedules' event ordering is tested
    without one."""

    def __init__(self, node: Any, nbytes: int) -> None:
        segs, self._fence = node.shared_window(3 * nbytes)  # STAGED, REDUCED, READ
        self._published = [[seg[k * nbytes : (k + 1) * nbytes] for k in range(3)] for seg in segs]
        self.me = node.rank
        self.nbytes = nbytes
        self.views = [np.zeros(nbytes, np.uint8) for _ in segs]
        """This rank's window, then mirrors of its peers' as of the events waited for."""

    def record(self, k: int) -> None:
        self._published[self.me][k][...] = self.views[self.me]
        self._fence()

    def wait(self, k: int) -> None:
        self._fence()
        for q, mirror in enumerate(self.views):
            if q != self.me:
                mirror[...] = self._published[q][k]

    def free(self) -> None:
        pass  # the window belongs to the node transport, freed with it


class CudaPeers:
    """:class:`Peers` on CUDA devices: each rank's window is ``cudaMalloc``'d (not from a
    pool, whose handles would name the pool's whole block) on its current device, exported
    with ``cudaIpcGetMemHandle`` and opened by every other rank of the node; three
    interprocess events per rank order the ranks' streams. Works for several ranks sharing
    one GPU (peer memory is then the same device's) and for one GPU per rank (opened with
    lazy peer access)."""

    def __init__(self, node: Any, nbytes: int) -> None:
        cp = cupy_module()
        rt = cp.cuda.runtime
        self._cp = cp
        self.me = node.rank
        self.nbytes = nbytes
        self.device = cp.cuda.Device().id
        self._node = node
        self._ptr = 0
        self._opened: list[int] = []
        self._peer_events: list[list[int]] = []
        error = None
        try:
            self._ptr = rt.malloc(nbytes)
            self.events = [cp.cuda.Event(block=False, disable_timing=True, interprocess=True) for _ in range(3)]
            mine = (bytes(rt.ipcGetMemHandle(self._ptr)), [bytes(rt.ipcGetEventHandle(e.ptr)) for e in self.events])
        except Exception as exc:  # noqa: BLE001 - reported collectively below
            error, mine = f"{type(exc).__name__}: {exc}", None
        everyone = node.allgather_obj((mine, error))
        self.views = []
        try:
            _raise_any(everyone, "export its device window")
            for q, (handles, _) in enumerate(everyone):
                if q == self.me:
                    ptr, evs = self._ptr, [e.ptr for e in self.events]
                else:
                    ptr = rt.ipcOpenMemHandle(handles[0], rt.cudaIpcMemLazyEnablePeerAccess)
                    self._opened.append(ptr)
                    evs = [rt.ipcOpenEventHandle(h) for h in handles[1]]
                    self._peer_events.append(evs)
                mem = cp.cuda.UnownedMemory(ptr, nbytes, self, self.device)
                self.views.append(cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0)))
        except DeviceUnavailableError:  # some rank could not export: nobody opened anything
            self._close()
            self._free_own()
            raise
        except Exception as exc:  # noqa: BLE001 - reported collectively below
            error = f"{type(exc).__name__}: {exc}"
        opened = node.allgather_obj((None, error))
        if any(e is not None for _, e in opened):
            self._close()
            _raise_any(opened, "open its peers' device windows")

    def record(self, k: int) -> None:
        self.events[k].record(self._cp.cuda.get_current_stream())

    def wait(self, k: int) -> None:
        """Also after this rank's own event ``k``: a call on another stream than the last
        one's must not overwrite the window while the last call's work still reads it."""
        rt = self._cp.cuda.runtime
        stream = self._cp.cuda.get_current_stream().ptr
        rt.streamWaitEvent(stream, self.events[k].ptr, 0)
        for evs in self._peer_events:
            rt.streamWaitEvent(stream, evs[k], 0)

    def _close(self) -> None:
        rt = self._cp.cuda.runtime
        for ptr in self._opened:
            rt.ipcCloseMemHandle(ptr)
        for evs in self._peer_events:
            for ev in evs:
                rt.eventDestroy(ev)
        self._opened, self._peer_events, self.views = [], [], []

    def free(self) -> None:
        """Close the peers' windows, wait until every peer has closed this rank's, free it."""
        self._cp.cuda.runtime.deviceSynchronize()  # calls on any stream may still read the windows
        self._close()
        self._node.allgather_obj(None)  # an owner frees its window only once nobody maps it
        self._free_own()

    def _free_own(self) -> None:
        if self._ptr:
            self._cp.cuda.runtime.free(self._ptr)
            self._ptr = 0


def _raise_any(everyone: list[tuple[Any, str | None]], what: str) -> None:
    bad = [(q, e) for q, (_, e) in enumerate(everyone) if e is not None]
    if bad:
        said = "; ".join(f"node rank {q}: {e}" for q, e in bad)
        raise DeviceUnavailableError(f"ipc: not every rank could {what} ({said})")


# -- the kernels ---------------------------------------------------------------------------
def combine(parts: list[Any], out: Any, op: str) -> None:
    """``out`` = ``parts[0] op parts[1] op ...``, left to right (rank order), with the
    numpy ufunc of ``op`` (CuPy arrays take it through ``__array_ufunc__``); ``out`` may
    be one of the parts."""
    uf = ufunc(op)
    if len(parts) == 1:
        if parts[0] is not out:
            out[...] = parts[0]
        return
    uf(parts[0], parts[1], out=out)
    for p in parts[2:]:
        uf(out, p, out=out)


def _typed(view: Any, dtype: np.dtype, count: int, start: int = 0) -> Any:
    """Elements ``[start, start + count)`` of a uint8 window as ``dtype``."""
    isz = dtype.itemsize
    return view[start * isz : (start + count) * isz].view(dtype)


# -- the schedules -------------------------------------------------------------------------
def _begin(ch: Any) -> Schedule:
    yield from ch.own(barrier=False)


def _step(peers: Peers, ch: Any, k: int) -> Schedule:
    """Record event ``k``, then the barrier: every rank has queued what comes before."""
    peers.record(k)
    yield from ch.barrier()


def _chunk_elements(peers: Peers, itemsize: int) -> int:
    """Elements per chunk so that the chunk and the largest block of it fit one window."""
    n = len(peers.views)
    cap = peers.nbytes // itemsize
    return max(1, (cap - 1) * n // (n + 1))


def allreduce(ch: Any, peers: Peers, src: Any, out: Any, op: str) -> Schedule:
    """Reduce every node rank's flat ``src`` into its flat ``out`` (may be ``src``)."""
    yield from _reduce_chunks(ch, peers, src, out, op, None)


def reduce(ch: Any, peers: Peers, src: Any, out: Any | None, root: int, op: str) -> Schedule:
    """Reduce every node rank's flat ``src`` into the flat ``out`` of node rank ``root``."""
    yield from _reduce_chunks(ch, peers, src, out, op, root)


def _reduce_chunks(ch: Any, peers: Peers, src: Any, out: Any | None, op: str, root: int | None) -> Schedule:
    """Allreduce (``root`` None) or reduce: each chunk staged, each rank's block of it
    reduced from every window into its own window past the chunk (the staged chunk is
    still read by the rank-order reduction), then copied out."""
    yield from _begin(ch)
    try:
        n, me, dtype = len(peers.views), peers.me, src.dtype
        step = _chunk_elements(peers, dtype.itemsize)
        for s in range(0, src.size, step):
            c = min(step, src.size - s)
            off = offsets(block_counts(c, n))
            peers.wait(READ)  # peers have finished reading this rank's window
            _typed(peers.views[me], dtype, c)[...] = src[s : s + c]
            yield from _step(peers, ch, STAGED)
            peers.wait(STAGED)
            lo, hi = off[me], off[me + 1]
            if hi > lo:
                mine = _typed(peers.views[me], dtype, hi - lo, c)
                combine([_typed(v, dtype, hi - lo, lo) for v in peers.views], mine, op)
                finalize(mine, op, n)
            yield from _step(peers, ch, REDUCED)
            if root is None or me == root:
                peers.wait(REDUCED)
                for q in range(n):
                    out[s + off[q] : s + off[q + 1]] = _typed(peers.views[q], dtype, off[q + 1] - off[q], c)
            yield from _step(peers, ch, READ)
    finally:
        ch.release()


def reduce_scatter(ch: Any, peers: Peers, src: Any, counts: tuple[int, ...], out: Any, op: str) -> Schedule:
    """Reduce every node rank's flat ``src``; node rank r gets block r (``counts[r]``
    elements, at the offsets of ``counts``) in its flat ``out``."""
    yield from _begin(ch)
    try:
        n, me, dtype = len(peers.views), peers.me, src.dtype
        off = offsets(counts)
        piece = max(1, peers.nbytes // (dtype.itemsize * n))  # each block's share of a window
        for j in range(0, max(counts), piece):
            peers.wait(READ)
            for q in range(n):
                c = max(0, min(piece, counts[q] - j))
                if c:
                    _typed(peers.views[me], dtype, c, q * piece)[...] = src[off[q] + j : off[q] + j + c]
            yield from _step(peers, ch, STAGED)
            c = max(0, min(piece, counts[me] - j))
            if c:
                peers.wait(STAGED)
                dst = out[j : j + c]
                combine([_typed(v, dtype, c, me * piece) for v in peers.views], dst, op)
                finalize(dst, op, n)
            yield from _step(peers, ch, READ)
    finally:
        ch.release()


def allgather(ch: Any, peers: Peers, src: Any, counts: tuple[int, ...], out: Any) -> Schedule:
    """Every node rank's flat ``src`` (``counts[r]`` elements) into every flat ``out``, in
    rank order."""
    yield from _begin(ch)
    try:
        n, me, dtype = len(peers.views), peers.me, out.dtype
        off = offsets(counts)
        step = peers.nbytes // dtype.itemsize
        for j in range(0, max(counts), step):
            peers.wait(READ)
            c = max(0, min(step, counts[me] - j))
            if c:
                _typed(peers.views[me], dtype, c)[...] = src[j : j + c]
            yield from _step(peers, ch, STAGED)
            peers.wait(STAGED)
            for q in range(n):
                c = max(0, min(step, counts[q] - j))
                if c:
                    out[off[q] + j : off[q] + j + c] = _typed(peers.views[q], dtype, c)
            yield from _step(peers, ch, READ)
    finally:
        ch.release()


def broadcast(ch: Any, peers: Peers, buf: Any, root: int) -> Schedule:
    """Node rank ``root``'s flat ``buf`` into every rank's."""
    yield from _begin(ch)
    try:
        me, dtype = peers.me, buf.dtype
        step = peers.nbytes // dtype.itemsize
        for s in range(0, buf.size, step):
            c = min(step, buf.size - s)
            if me == root:
                peers.wait(READ)
                _typed(peers.views[me], dtype, c)[...] = buf[s : s + c]
            yield from _step(peers, ch, STAGED)
            if me != root:
                peers.wait(STAGED)
                buf[s : s + c] = _typed(peers.views[root], dtype, c)
            yield from _step(peers, ch, READ)
    finally:
        ch.release()
