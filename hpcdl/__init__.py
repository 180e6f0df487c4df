"""hpcdl: distributed deep-learning training over MPI with a Horovod-compatible torch API.

The torch layer is built on :mod:`collectives`; nothing happens on import.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hpcdl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
