"""Broadcast in Horovod's forms: ``broadcast`` (differentiable), ``broadcast_``,
``broadcast_async`` and ``broadcast_async_``."""

from __future__ import annotations

import torch

from .. import state
from ..handles import synchronize
from ..process_sets import ProcessSet, global_process_set
from .allreduce import allreduce_async
from .reduce_op import Average
from .requests import (
    start_broadcast,
)

__all__ = ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_"]


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start sending ``root_rank``'s ``tensor`` to every rank; :func:`synchronize` gives a
    new tensor with it (``root_rank`` is a rank of the job, as in Horovod, and must be a
    member of ``process_set``)."""
    return start_broadcast(tensor, root_rank, name, process_set, False)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """As :func:`broadcast_async`, writing into ``tensor``."""
    return start_broadcast(tensor, root_rank, name, process_set, True)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s on every rank; return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Every rank's output is the root's input; as in Horovod, the root's gradient is the
    average of the output gradients over the ranks (the analytic one is their sum), and
    the other ranks' is zero."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        summed = synchronize(allreduce_async(grad, op=Average, process_set=ctx.process_set))
        if state.current().rank != ctx.root:
            summed = torch.zeros_like(summed)
        return summed, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank, in a new tensor (differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)
