"""Window-resident buffers: arrays that live in the node's shared window, so the ``shm``
algorithms read a peer's input where it lies instead of staging a copy of it.

Each single-node communicator's context owns one :class:`Arena`: a second MPI-3 shared
window (``MPI_Win_allocate_shared``), allocated collectively with the node channel when the
communicator is first used, of ``shm_arena_bytes`` per rank. The pages are the operating
system's only once touched, so an arena nobody allocates from costs address space, not
memory.

Allocation is local and thread-safe: :meth:`Arena.empty` cuts a block from this rank's own
segment (first fit, 64-byte aligned) and the block returns to the free list when the last
array viewing it is garbage collected. No rank needs to know what its peers allocated:
a collective posts, beside its signature, where its input and output lie in its segment
(:meth:`Arena.where`), and a peer that finds every rank's buffers there reads them in
place (:mod:`.staged`, :mod:`.inplace`).

Freeing the communicator frees the window too, unless some rank still holds arrays in
it: then the window is kept, and its arrays stay valid, until MPI is finalized.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import threading
import weakref
from typing import Any

import numpy as np

try:
    from .cslots import address as _address
except ImportError:  # not built: numpy's interface below
    _address = None

__all__ = ["Arena", "ALIGN", "allocate", "address"]

ALIGN = 64
"""Alignment of every block, in bytes (a cache line)."""


def allocate(arena: Arena | None, shape: Any, dtype: Any) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` in ``arena`` when there is one with room, else in
    ordinary memory (contents undefined either way)."""
    a = arena.empty(shape, dtype) if arena is not None else None
    return np.empty(shape, dtype) if a is None else a


def address(a: np.ndarray) -> int:
    """Where ``a``'s first element lies in memory: the compiled loop's ``address`` (about
    0.2 µs) where it is built, numpy's ``__array_interface__`` (about 3 µs) elsewhere."""
    if _address is not None:
        at = _address(a)
        if at is not None:
            return at
    return a.__array_interface__["data"][0]


class Arena:
    """This rank's view of one shared window: every rank's segment, and a free list over
    its own.

    Args:
        segments: every rank's segment (uint8 arrays of equal size), by rank.
        rank: this rank's index among them.
    """

    def __init__(self, segments: list[np.ndarray], rank: int) -> None:
        self.segments = segments
        self.rank = rank
        mine = segments[rank]
        self.capacity = mine.size
        self._base = mine.ctypes.data if mine.size else 0
        self._lock = threading.Lock()
        # free blocks as sorted starts with their sizes; adjacent blocks are merged on free
        self._starts: list[int] = [0] if self.capacity else []
        self._sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self.in_use = 0
        """Bytes of this rank's segment held by live arrays."""
        self.window: Any = None
        """The MPI window, once its communicator was freed while arrays still viewed it (kept
        until MPI is finalized)."""

    # -- allocation ------------------------------------------------------------------------
    def empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray | None:
        """A C-contiguous array of ``shape`` and ``dtype`` in this rank's segment (contents
        undefined), or None when no free block is large enough."""
        dt = np.dtype(dtype)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dt.itemsize
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            for start in self._starts:
                have = self._sizes[start]
                if have >= size:
                    break
            else:
                return None
            self._starts.remove(start)
            del self._sizes[start]
            if have > size:
                self._insert(start + size, have - size)
            self.in_use += size
        holder = (ctypes.c_char * size).from_address(self._base + start)
        holder.segment = self.segments[self.rank]  # the window's memory outlives the views
        weakref.finalize(holder, self._free, start, size)
        return np.frombuffer(holder, dt, math.prod(shape)).reshape(shape)

    def _insert(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._sizes[start] = size

    def _free(self, start: int, size: int) -> None:
        with self._lock:
            self.in_use -= size
            i = bisect.bisect_left(self._starts, start)
            nxt = self._starts[i] if i < len(self._starts) else None
            if nxt is not None and start + size == nxt:  # merge with the block after
                size += self._sizes.pop(nxt)
                self._starts.pop(i)
            if i > 0:
                prev = self._starts[i - 1]
                if prev + self._sizes[prev] == start:  # and with the block before
                    self._sizes[prev] += size
                    return
            self._insert(start, size)

    # -- where arrays lie -------------------------------------------------------------------
    def where(self, a: np.ndarray | None) -> int:
        """``1 +`` the byte offset of ``a`` in this rank's segment when all of ``a`` lies there
        and is C-contiguous, else 0 (the word a collective posts for a peer to find it)."""
        if a is None or not self.capacity:
            return 0
        off = address(a) - self._base
        if off < 0 or off + a.nbytes > self.capacity or not a.flags.c_contiguous:
            return 0
        return off + 1

    def peer(self, rank: int, where: int, dtype: np.dtype, count: int) -> np.ndarray:
        """The ``count`` elements of ``dtype`` that rank ``rank`` posted as lying at ``where``."""
        off = where - 1
        return self.segments[rank][off : off + count * dtype.itemsize].view(dtype)
