"""Every exception of the torch layer, in one module that imports nothing of hpcdl's, so
that every other module can raise them without an import circle.

A Horovod script catches ``hvd.HorovodInternalError``; here that is another name of
:class:`HpcdlError`, which is a ``RuntimeError`` as Horovod's is. A bad argument raises
:class:`HpcdlArgumentError`, which is also a ``ValueError``, as Horovod users catch
argument errors.
"""

from __future__ import annotations

__all__ = ["HpcdlError", "HpcdlArgumentError", "PipelineError", "HorovodInternalError", "NOT_INITIALIZED"]


class HpcdlError(RuntimeError):
    """An error of the hpcdl runtime, raised on every rank it concerns."""


class HpcdlArgumentError(HpcdlError, ValueError):
    """A bad argument (a name already in flight, duplicate parameter names, alltoall splits
    that do not add up, ...): an :class:`HpcdlError` and a ``ValueError``. Raised on every
    rank when the argument travels with a request."""


class PipelineError(HpcdlError):
    """A pipeline stage failed (its layers raised, or a neighbour's did): raised on every
    stage of the pipeline, naming the stage and its error."""


HorovodInternalError = HpcdlError
"""Horovod's name for the same error, so ``except hvd.HorovodInternalError`` keeps working."""

NOT_INITIALIZED = "hpcdl has not been initialized; use hpcdl.init()."
"""The text of the ``ValueError`` raised by calls that need :func:`hpcdl.init` first (the
exception type and wording follow Horovod's)."""
