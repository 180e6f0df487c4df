"""Every exception of the torch layer, in one module that imports nothing of hpcdl's, so
that every other module can raise them without an import circle.

A Horovod script catches ``hvd.HorovodInternalError``; here that is another name of
:class:`HpcdlError`, which is a ``RuntimeError`` as Horovod's is.
"""

from __future__ import annotations

__all__ = ["HpcdlError", "HorovodInternalError", "NOT_INITIALIZED"]


class HpcdlError(RuntimeError):
    """An error of the hpcdl runtime, raised on every rank it concerns."""


HorovodInternalError = HpcdlError
"""Horovod's name for the same error, so ``except hvd.HorovodInternalError`` keeps working."""

NOT_INITIALIZED = "hpcdl has not been initialized; use hpcdl.init()."
"""The text of the ``ValueError`` raised by calls that need :func:`hpcdl.init` first (the
exception type and wording follow Horovod's)."""
