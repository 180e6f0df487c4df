"""Collective algorithms over MPI on numpy arrays: ring, tree, recursive doubling and
halving, hierarchical and shared-memory, with the MPI library's own calls as a baseline.

Nothing happens on import; a communicator's state is set up on its first call.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .api import (
    Request,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    iallgather,
    iallreduce,
    ibroadcast,
    ireduce_scatter,
    reduce,
    reduce_scatter,
)
from .buffers import copied_bytes, empty, is_shared
from .context import reset
from .errors import (
    CollectiveError,
    CollectiveMismatchError,
    ConfigError,
    InvalidArgumentError,
    InvalidRootError,
    OutputMismatchError,
    PeerInputError,
    StallError,
    UnknownAlgorithmError,
    UnsupportedDtypeError,
    UnsupportedOpError,
)
from .ops import DTYPES, OPS
from .select import algorithms

try:
    __version__ = version("hpcdl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "alltoall",
    "iallreduce",
    "ireduce_scatter",
    "iallgather",
    "ibroadcast",
    "Request",
    "empty",
    "is_shared",
    "copied_bytes",
    "reset",
    "algorithms",
    "OPS",
    "DTYPES",
    "CollectiveError",
    "CollectiveMismatchError",
    "ConfigError",
    "InvalidArgumentError",
    "InvalidRootError",
    "OutputMismatchError",
    "PeerInputError",
    "StallError",
    "UnknownAlgorithmError",
    "UnsupportedDtypeError",
    "UnsupportedOpError",
]
