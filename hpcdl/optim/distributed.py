"""``DistributedOptimizer``: data-parallel training by wrapping the optimizer a script has.

The gradients are bucketed and allreduced in place while backward runs
(:mod:`hpcdl.optim.buckets`); ``step()`` waits for them and runs the optimizer's own step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..compression import Compression, Compressor
from ..errors import HpcdlArgumentError
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
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    *,
    bucket_bytes: int | None = None,
    check_missing_gradients: bool | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` for data-parallel training (Horovod's arguments, in Horovod's order).

    Returns an instance of a subclass of the optimizer's class (``isinstance`` holds, its own
    ``step`` runs after the gradients are reduced) over the same parameter groups, keeping
    the optimizer's existing state.

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: ``model.named_parameters()``, so requests carry parameter names
            (None: names made up from the parameters' positions).
        compression: ``Compression.none``, ``fp16`` or ``bf16`` on the wire.
        backward_passes_per_step: communicate once every this many backward passes; the
            passes' gradients add up, as in Horovod (divide the loss by it to average).
        op: ``Average`` (default) or ``Sum`` over ranks.
        gradient_predivide_factor: divide by this before the sum and by ``size / factor``
            after it (``Average`` only).
        num_groups, groups: Horovod's grouping of tensors into fused requests; accepted,
            and changing no result: hpcdl groups gradients into buckets of ``bucket_bytes``.
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
            tensors instead of allgathering their indices and values.
        process_set: the ranks that train together (each rank passes a set it belongs to).
        bucket_bytes: the most gradient bytes in one bucket (default: the runtime's
            ``Config.bucket_bytes``, ``HPCDL_BUCKET_BYTES``).
        check_missing_gradients: make a gradient that is missing on some ranks but not on
            others an error on every rank, instead of reducing it with zeros where missing
            as Horovod does (default: ``Config.check_missing_gradients``).
    """
    if not isinstance(num_groups, int) or num_groups < 0:
        raise HpcdlArgumentError(f"num_groups={num_groups!r} must be a non-negative integer")
    listed = isinstance(groups, (list, tuple)) and all(
        isinstance(g, (list, tuple)) and all(isinstance(p, torch.Tensor) for p in g) for g in groups
    )
    if groups is not None and not listed and not (isinstance(groups, int) and groups >= 0):
        raise HpcdlArgumentError(
            f"groups={groups!r} must be a non-negative integer or a list of lists of parameters, as in Horovod"
        )
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
        sparse_as_dense,
        check_missing_gradients,
    )
    return obj
