"""The narrow waist: point-to-point byte movement that every algorithm is written against.

A transport offers nonblocking buffer sends and receives, communicator splitting, a
shared-memory split and window, and a pickled all-gather for control data only. Requests
it returns have ``Test()``/``Wait()`` and class-level ``Testall``/``Waitall`` (mpi4py's
``MPI.Request`` already does), so a schedule can be driven without knowing the transport.
"""

from __future__ import annotations

from typing import Any, Protocol

import ml_dtypes
import numpy as np
from mpi4py import MPI

__all__ = ["Transport", "MPITransport"]

_BF16 = np.dtype(ml_dtypes.bfloat16)


class Transport(Protocol):
    """What an algorithm needs from the machine underneath."""

    rank: int
    size: int

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        """Start sending the contiguous array ``buf`` to ``dest``."""

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Any:
        """Start receiving into the contiguous array ``buf`` from ``source``."""

    def split(self, color: int, key: int) -> Transport:
        """Collectively split into sub-transports by ``color``, ordered by ``key``."""

    def split_shared(self) -> Transport:
        """Collectively split into groups of ranks that share memory (one per node)."""

    def shared_segments(self, nbytes: int) -> list[np.ndarray]:
        """Collectively allocate ``nbytes`` of shared memory per rank; return every rank's segment."""

    def shared_window(self, nbytes: int) -> tuple[list[np.ndarray], Any]:
        """Like :meth:`shared_segments`, also returning the window's memory fence (a callable)."""

    def allgather_obj(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank (control data only)."""


def _raw(buf: np.ndarray) -> np.ndarray:
    # MPI has no bfloat16 type; bytes are bytes on the wire
    return buf.view(np.uint8) if buf.dtype == _BF16 else buf


class MPITransport:
    """A :class:`Transport` over an mpi4py communicator, using buffer calls only.

    ``sent`` and ``received`` count the bytes of the point-to-point messages it started
    (shared-memory traffic is not counted: it is copies, not messages)."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._windows: list[MPI.Win] = []
        self.sent = 0
        self.received = 0

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> MPI.Request:
        self.sent += buf.nbytes
        return self.comm.Isend(_raw(buf), dest, tag)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> MPI.Request:
        self.received += buf.nbytes
        return self.comm.Irecv(_raw(buf), source, tag)

    def split(self, color: int, key: int) -> MPITransport:
        return MPITransport(self.comm.Split(color, key))

    def split_shared(self) -> MPITransport:
        return MPITransport(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))

    def shared_segments(self, nbytes: int) -> list[np.ndarray]:
        return self.shared_window(nbytes)[0]

    def shared_window(self, nbytes: int) -> tuple[list[np.ndarray], Any]:
        """Collectively allocate a shared window; return every rank's segment and its fence."""
        win = MPI.Win.Allocate_shared(nbytes, 1, comm=self.comm)
        # passive-target epoch for the window's lifetime; synchronisation is by messages
        win.Lock_all(MPI.MODE_NOCHECK)
        self._windows.append(win)
        segments = []
        for r in range(self.size):
            mem, _ = win.Shared_query(r)
            segments.append(np.frombuffer(mem, dtype=np.uint8, count=nbytes))
        return segments, win.Sync

    def release_window(self, segments: list[np.ndarray]) -> Any:
        """Take the window whose segments are ``segments`` out of :meth:`free`'s hands and
        return it: it then lives until MPI is finalized (a window whose memory arrays still
        view must not be unmapped under them)."""
        for i, win in enumerate(self._windows):
            mem, _ = win.Shared_query(self.rank)
            if np.frombuffer(mem, np.uint8).ctypes.data == segments[self.rank].ctypes.data:
                return self._windows.pop(i)
        raise ValueError("no window of this transport has those segments")

    def allgather_obj(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def memory_sync(self) -> None:
        """Make this rank's stores to its shared windows visible to its peers, and theirs to it."""
        for win in self._windows:
            win.Sync()

    def free(self) -> None:
        """Release windows; the communicator itself belongs to whoever made it."""
        for win in self._windows:
            win.Unlock_all()
            win.Free()
        self._windows.clear()
