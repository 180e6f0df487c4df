"""Exceptions raised by the collectives layer.

Every error a caller can provoke has its own class, so callers can catch exactly what
they mean; all derive from :class:`CollectiveError`.
"""

from __future__ import annotations

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
