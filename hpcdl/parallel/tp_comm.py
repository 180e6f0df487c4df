"""The communication of tensor parallelism: Megatron-LM's conjugate functions (Shoeybi et
al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", 2019), as autograd functions over a grid's TP process set.

``copy_to_tp`` (identity forward, sum of the gradients backward) enters a tensor-parallel
region, ``reduce_from_tp`` (sum forward, identity backward) leaves one; ``gather_from_tp``
and ``scatter_to_tp`` concatenate and split along the last dimension. Each returns at once
when the group has one rank.
"""

from __future__ import annotations

import torch

from ..ops import Max, Sum, allgather_async, allreduce_async, synchronize
from ..process_sets import ProcessSet

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "tp_sum", "tp_max"]


def tp_sum(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The sum of ``t`` over ``group`` (no autograd)."""
    return synchronize(allreduce_async(t.contiguous(), op=Sum, process_set=group))


def tp_max(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The elementwise maximum of ``t`` over ``group`` (no autograd)."""
    return synchronize(allreduce_async(t.contiguous(), op=Max, process_set=group))


def _gather_last(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Every rank's ``t`` concatenated along the last dimension, in the group's rank order."""
    front = synchronize(allgather_async(t.movedim(-1, 0).contiguous(), process_set=group))
    return front.movedim(0, -1).contiguous()


def _my_chunk(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """This rank's equal chunk of ``t``'s last dimension."""
    n, r = group.size(), group.rank()
    k = t.shape[-1] // n
    return t[..., r * k : (r + 1) * k].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the gradients of every TP rank summed backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return tp_sum(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Sum over the TP ranks forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        return tp_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate the TP ranks' last dimensions forward; this rank's chunk backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_chunk(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    """This rank's chunk of the last dimension forward; the chunks concatenated backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_chunk(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Enter a tensor-parallel region (identity; sums the gradients over ``group``)."""
    return x if group.size() == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Leave a tensor-parallel region: the sum of the ranks' partial results."""
    return x if group.size() == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Concatenate the ranks' slices of the last dimension."""
    return x if group.size() == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """This rank's slice of the last dimension (which ``group.size()`` must divide)."""
    return x if group.size() == 1 else _ScatterToTP.apply(x, group)
