"""Reducescatter in Horovod's forms: ``reducescatter`` (differentiable),
``reducescatter_async`` and the grouped variants."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..compression import Compression, Compressor
from ..errors import HpcdlError
from ..handles import synchronize
from ..process_sets import ProcessSet, global_process_set
from .allgather import grouped_allgather_async
from .reduce_op import Average, ReduceOp, Sum, resolve_op
from .requests import (
    start_reducescatter,
)

__all__ = ["reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async"]


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` over the ranks and scattering dimension 0: rank i gets
    ``rows // n`` rows (one more on the first ``rows % n`` ranks) of the result."""
    return start_reducescatter([tensor], name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start :func:`reducescatter_async` of every tensor of ``tensors``; a list results."""
    return start_reducescatter(list(tensors), name, op, prescale_factor, postscale_factor, process_set, False)


class _Reducescatter(torch.autograd.Function):
    """Rank i's output is the reduction of every rank's block i, so every rank's input
    gradient is the allgather of the output gradients. As in Horovod, they are scaled by
    the set's size for Sum and by the pre- and postscale factors (for Average the analytic
    gradient would also divide by the size; Horovod's does not)."""

    @staticmethod
    def forward(ctx, op, pre, post, name, process_set, *tensors):
        if op not in (Sum, Average):
            raise HpcdlError("reducescatter is differentiable for Sum and Average only")
        ctx.scale = pre * post * (len(process_set.ranks) if op == Sum else 1)
        ctx.process_set = process_set
        return tuple(synchronize(start_reducescatter(tensors, name, op, pre, post, process_set, False)))

    @staticmethod
    def backward(ctx, *grads):
        gs = synchronize(grouped_allgather_async([g.contiguous() for g in grads], process_set=ctx.process_set))
        return (None, None, None, None, None, *[g * ctx.scale for g in gs])


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks and return this rank's rows of the result
    (differentiable for Sum and Average; see :func:`reducescatter_async`)."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """:func:`reducescatter` of every tensor of ``tensors`` in one negotiation."""
    op = resolve_op(op, None)
    packed = [compression.compress(t) for t in tensors]
    sent = [p[0] for p in packed]
    if op in (Sum, Average):
        outs = _Reducescatter.apply(op, float(prescale_factor), float(postscale_factor), name, process_set, *sent)
    else:
        outs = synchronize(start_reducescatter(sent, name, op, prescale_factor, postscale_factor, process_set, False))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed, strict=True)]
