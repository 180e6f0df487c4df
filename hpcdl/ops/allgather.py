"""Allgather in Horovod's forms: ``allgather`` (differentiable), ``allgather_async`` and
the grouped variants."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..handles import synchronize
from ..process_sets import ProcessSet, global_process_set
from .allreduce import allreduce_async
from .reduce_op import Average
from .requests import (
    start_allgather,
)

__all__ = ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async"]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (the first dimension
    may differ between ranks); :func:`synchronize` gives the result."""
    return start_allgather([tensor], name, process_set, True)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start allgathering every tensor of ``tensors``; :func:`synchronize` gives a list."""
    return start_allgather(list(tensors), name, process_set, False)


def _slice_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's rows of the output gradients averaged over the ranks, as Horovod's
    allgather gradient is (the analytic one is their sum)."""
    summed = synchronize(allreduce_async(grad, op=Average, process_set=process_set))
    dims = synchronize(allgather_async(torch.tensor([rows], dtype=torch.int64), process_set=process_set))
    me = process_set.rank()
    start = int(dims[:me].sum())
    return summed[start : start + rows]


class _Allgather(torch.autograd.Function):
    """Gradient, as Horovod's: every rank's output gradients averaged, then this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0] if tensor.dim() else 0, process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _slice_rows(grad, ctx.rows, ctx.process_set), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order (differentiable)."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *[_slice_rows(g, r, ctx.process_set) for g, r in zip(grads, ctx.rows, strict=True)])


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    """Allgather every tensor of ``tensors`` (differentiable); return a list."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))
