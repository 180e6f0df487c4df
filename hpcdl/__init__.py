"""hpcdl: distributed deep-learning training over MPI with a Horovod-compatible torch API.

The torch layer is built on :mod:`collectives`; nothing happens on import (``init`` starts
the runtime). So far: Horovod's basics (``init``, ranks, node layout, build queries).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hpcdl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

from .basics import (
    HorovodInternalError,
    HpcdlError,
    cross_rank,
    cross_size,
    cuda_built,
    gloo_built,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    shutdown,
    size,
)

__all__ = [
    "__version__",
    "HpcdlError",
    "HorovodInternalError",
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "is_homogeneous",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "nccl_built",
    "gloo_built",
    "cuda_built",
]
