"""Window-resident buffers, the public face of the node's arena (:mod:`.node.arena`): arrays that
live in this rank's part of the node's shared window, so the ``shm`` algorithms read every
rank's buffers where they lie instead of staging a copy of them.

:func:`empty` allocates such an array, :func:`is_shared` tells whether an array is one, and
:func:`copied_bytes` counts the bytes the ``shm`` collectives still copied, which is how a
caller (or a test) sees that buffers were read in place. Allocation is local, never
collective; a communicator without a node window (several nodes, one rank) hands out
ordinary memory, so code written for window buffers runs everywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .context import get_context
from .node.arena import allocate

__all__ = ["empty", "is_shared", "copied_bytes"]


def empty(shape: Any, dtype: Any = np.float32, *, comm: Any = None) -> np.ndarray:
    """An uninitialised C-contiguous array in this rank's part of the node's shared window.

    Collectives whose every rank passes such arrays (the input; for ``allreduce`` also
    ``out``, which may be the input) read them where they lie: no rank stages a copy of its
    input into the window, and results are copied straight from their owner's output
    (algorithm ``shm``, or ``auto`` where it picks ``shm``). Other arrays work as always.

    Allocation is local (not collective) and thread-safe; the memory returns to the window
    when the last array viewing it is garbage collected. An array that outlives ``comm``
    stays valid (its window is then kept until MPI is finalized).
    Where ``comm``'s ranks are not all on one node, it has a single rank, or the window
    (``HPCDL_SHM_ARENA_BYTES`` per rank) is full, the array is ordinary memory:
    :func:`is_shared` tells.

    Args:
        shape: the array's shape (an int or a tuple).
        dtype: its dtype.
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``) or a transport.
    """
    return allocate(get_context(comm).arena, shape, dtype)


def is_shared(a: np.ndarray, *, comm: Any = None) -> bool:
    """True when all of ``a`` lies in this rank's part of ``comm``'s node window (from
    :func:`empty`) and is C-contiguous, so the ``shm`` algorithms can read it in place."""
    arena = get_context(comm).arena
    return arena is not None and isinstance(a, np.ndarray) and arena.where(a) > 0


def copied_bytes(comm: Any = None) -> dict[str, int]:
    """Bytes this rank has written in ``comm``'s single-node ``shm`` collectives so far, by
    kind: ``staged`` (its input copied into the window), ``reduced`` (reduction results)
    and ``copied_out`` (results copied into its output). Calls finished in one step through
    the control slots are not counted."""
    ch = get_context(comm).chan
    staged, reduced, out = ch.copied if ch is not None else (0, 0, 0)
    return {"staged": staged, "reduced": reduced, "copied_out": out}
