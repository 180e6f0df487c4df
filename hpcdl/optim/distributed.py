"""``DistributedOptimizer``: data-parallel training by wrapping the optimizer a script has.

The gradients are bucketed and allreduced in place while backward runs
(:mod:`hpcdl.optim.buckets`); ``step()`` waits for them and runs the optimizer's own step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..compression import Compression, Compressor
from ..errors import HpcdlError
from ..ops import Average, ReduceOp
from ..process_sets import ProcessSet, global_process_set
from .buckets import Reducer

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(  # noqa: N802 - Horovod's name: a factory that looks like a class
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    bucket_bytes: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` for data-parallel training (Horovod's arguments).

    Returns an instance of a subclass of the optimizer's class (``isinstance`` holds, its own
    ``step`` runs after the gradients are reduced) over the same parameter groups, keeping
    the optimizer's existing state.

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: ``model.named_parameters()``, so requests carry parameter names.
        compression: ``Compression.none``, ``fp16`` or ``bf16`` on the wire.
        backward_passes_per_step: communicate once every this many backward passes.
        op: ``Average`` (default) or ``Sum`` over ranks.
        gradient_predivide_factor: divide by this before the sum and by ``size / factor``
            after it (``Average`` only).
        groups: Horovod's explicit grouping; hpcdl buckets by size instead (must be None).
        process_set: the ranks that train together.
        bucket_bytes: the most gradient bytes in one bucket (default: the runtime's
            ``Config.bucket_bytes``, ``HPCDL_BUCKET_BYTES``).
    """
    if groups is not None:
        raise HpcdlError("DistributedOptimizer(groups=...) is not supported; gradients are bucketed by bucket_bytes")
    base = type(optimizer)
    cls = type(base.__name__, (Reducer, base), {"__module__": base.__module__})
    obj = cls(optimizer.param_groups)
    if optimizer.state:
        obj.load_state_dict(optimizer.state_dict())
    obj._hpcdl_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        process_set,
        bucket_bytes,
    )
    return obj
