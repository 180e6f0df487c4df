"""Alltoall in Horovod's forms: ``alltoall`` (differentiable) and ``alltoall_async``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..handles import synchronize
from ..process_sets import ProcessSet, global_process_set
from .requests import (
    start_alltoall,
)

__all__ = ["alltoall", "alltoall_async"]


def alltoall_async(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start sending rows of ``tensor`` to every rank (``splits[i]`` rows to rank i; by
    default an even split); :func:`synchronize` gives ``(received rows, received splits)``."""
    return start_alltoall(tensor, splits, name, process_set)


class _Alltoall(torch.autograd.Function):
    """The gradient of an alltoall is the alltoall of the gradient with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        g, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return g, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank i and return the rows received, in rank
    order (differentiable); with ``splits`` given, return ``(rows, received_splits)``."""
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)
