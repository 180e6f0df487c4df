"""Pairwise-exchange alltoall: every rank posts a receive from and a send to every peer."""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from ..blocks import offsets

Schedule = Generator[list, None, None]


def alltoall(ctx, t, send: np.ndarray, sendcounts, recv: np.ndarray, recvcounts, tag: int) -> Schedule:
    """Send byte block ``j`` of ``send`` to rank ``j``; receive rank ``j``'s into block ``j`` of ``recv``."""
    so, ro = offsets(tuple(sendcounts)), offsets(tuple(recvcounts))
    s, d = send.view(np.uint8), recv.view(np.uint8)
    r, n = t.rank, t.size
    d[ro[r] : ro[r + 1]] = s[so[r] : so[r + 1]]
    reqs = []
    for k in range(1, n):
        src, dst = (r - k) % n, (r + k) % n
        reqs.append(t.irecv(d[ro[src] : ro[src + 1]], src, tag))
        reqs.append(t.isend(s[so[dst] : so[dst + 1]], dst, tag))
    if reqs:
        yield reqs
