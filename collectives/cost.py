"""Cost models of communication: a call of ``S`` bytes takes ``alpha + S / beta`` seconds
(Hockney's α-β model), fitted to measured times.

:func:`fit` takes ``(bytes, seconds)`` points, as a benchmark or the node report measures
them for one collective on one communicator, and returns the :class:`AlphaBeta` that
predicts them best in relative terms (each point weighs by the inverse square of its own
time, so the latency of small calls and the bandwidth of large ones both count).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["AlphaBeta", "fit"]


class AlphaBeta(NamedTuple):
    """``alpha`` seconds per call plus ``nbytes / beta`` (``beta`` in bytes per second)."""

    alpha: float
    beta: float

    def time(self, nbytes: float, calls: float = 1.0) -> float:
        """Seconds for ``calls`` calls carrying ``nbytes`` bytes in all."""
        return calls * self.alpha + nbytes / self.beta


def fit(points: Iterable[tuple[float, float]]) -> AlphaBeta:
    """The α-β model nearest ``points`` (``(bytes, seconds)``, at least two sizes) in
    relative error: least squares of ``(alpha + S / beta) / t - 1``. A negative intercept
    (the smallest calls cost nothing beyond bandwidth) is clamped to 0 and the bandwidth
    refitted alone; so is a bandwidth that comes out infinite or negative (every size took
    the same time), which leaves the latency alone.

    Raises:
        ValueError: fewer than two distinct sizes, or a time that is not positive.
    """
    pts = [(float(s), float(t)) for s, t in points]
    if len({s for s, _ in pts}) < 2:
        raise ValueError(f"fit: needs at least two distinct sizes, not {sorted({s for s, _ in pts})}")
    if any(not t > 0 or s < 0 for s, t in pts):
        raise ValueError("fit: every time must be positive and every size non-negative")
    # minimise sum((a / t + s / t * g - 1)^2) over a and g = 1 / beta: 2 x 2 normal equations
    xa = [1 / t for _, t in pts]
    xg = [s / t for s, t in pts]
    saa = sum(u * u for u in xa)
    sgg = sum(v * v for v in xg)
    sag = sum(u * v for u, v in zip(xa, xg, strict=True))
    sa, sg = sum(xa), sum(xg)
    det = saa * sgg - sag * sag
    a, g = ((sa * sgg - sg * sag) / det, (sg * saa - sa * sag) / det) if det > 0 else (-1.0, -1.0)
    if a < 0:
        a, g = 0.0, sg / sgg
    if g <= 0:
        a, g = sa / saa, 0.0
    return AlphaBeta(a, math.inf if g == 0 else 1 / g)
