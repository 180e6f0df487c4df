"""Exceptions raised by the collectives layer.

Every error a caller can provoke has its own class, so callers can catch exactly what
they mean; all derive from :class:`CollectiveError`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "UnsupportedDtypeError",
    "UnsupportedOpError",
    "UnknownAlgorithmError",
    "InvalidRootError",
    "OutputMismatchError",
    "InvalidArgumentError",
    "PeerInputError",
    "ConfigError",
    "DeviceUnavailableError",
    "StallError",
    "combined_problem",
    "rank_ranges",
]


class CollectiveError(RuntimeError):
    """Base class of every error raised by :mod:`collectives`."""


class UnsupportedDtypeError(CollectiveError, TypeError):
    """The array's dtype is not one the collectives support."""


class UnsupportedOpError(CollectiveError, ValueError):
    """The reduction op name is not one of sum, avg, min, max, prod."""


class UnknownAlgorithmError(CollectiveError, ValueError):
    """No algorithm of that name is registered for the collective."""


class InvalidRootError(CollectiveError, ValueError):
    """The root rank is outside ``[0, size)``."""


class OutputMismatchError(CollectiveError, ValueError):
    """``out`` has the wrong shape, dtype or memory layout."""


class InvalidArgumentError(CollectiveError, ValueError):
    """Another argument is invalid (for example alltoall splits)."""


class CollectiveMismatchError(CollectiveError):
    """Ranks called the same collective with different arguments.

    Attributes:
        field: the first argument that differs (``"count"``, ``"dtype"``, ...).
        values: mapping of each distinct value to the ranks that passed it.
    """

    def __init__(self, message: str, field: str = "", values: dict | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.values = values or {}


class PeerInputError(CollectiveError):
    """Another rank's input was rejected, so this rank's call was abandoned too."""


class ConfigError(CollectiveError, ValueError):
    """A configuration value or ``HPCDL_*`` environment variable is invalid."""


class DeviceUnavailableError(CollectiveError):
    """A device-array collective cannot run here: CuPy or NCCL is missing, there is no GPU,
    or NCCL refuses the ranks' placement (the message says which, and what to do)."""


class StallError(CollectiveError):
    """A collective waited longer than the stall timeout (``HPCDL_STALL_TIMEOUT``) for other
    ranks, or another rank gave up after such a wait: the ranks fell out of step (one raised,
    or skipped or reordered a collective). The communicator's collectives then stop on every
    rank, each raising this, until :func:`collectives.reset` is called on every rank."""


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    parts = []
    for _, run in itertools.groupby(enumerate(sorted(ranks)), key=lambda pair: pair[1] - pair[0]):
        rs = [r for _, r in run]
        parts.append(str(rs[0]) if len(rs) == 1 else f"{rs[0]}-{rs[-1]}")
    return ",".join(parts)


def combined_problem(problems: Sequence[str | None], ranks: Sequence[int] | None = None) -> str | None:
    """One message for what each rank found wrong (``problems[i]``: rank ``ranks[i]``'s
    problem, or None; ``ranks`` defaults to ``0..n-1``), the same text on every rank that
    computes it from the same list: None when no rank has a problem, the problem itself when
    every rank found the same one, else ``"rank 1: <a>; rank 3: <b>"`` for the ranks that
    found one."""
    ranks = range(len(problems)) if ranks is None else ranks
    found = {r: p for r, p in zip(ranks, problems, strict=True) if p is not None}
    if not found:
        return None
    if len(found) == len(problems) and len(set(found.values())) == 1:
        return next(iter(found.values()))
    return "; ".join(f"rank {r}: {p}" for r, p in found.items())
