"""The communication of tensor parallelism: Megatron-LM's conjugate functions (Shoeybi et
al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", 2019), as autograd functions over a grid's TP process set.

``copy_to_tp`` (identity forward, sum of the gradients backward) enters a tensor-parallel
region, ``reduce_from_tp`` (sum forward, identity backward) leaves one; ``gather_from_tp``
and ``scatter_to_tp`` concatenate and split along the last dimension.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022) splits the activations outside the tensor-parallel regions
(LayerNorm, residual, dropout) along the sequence, dimension 1 of (batch, sequence,
features): ``gather_seq_from_tp`` enters a tensor-parallel region from this rank's sequence
chunk (allgather forward, reduce-scatter backward), ``reduce_scatter_seq_to_tp`` leaves one
(reduce-scatter forward, allgather backward) in place of ``reduce_from_tp``, and
``scatter_seq_to_tp`` cuts a whole input into the chunks. The parameters used on the
chunks get partial gradients: :func:`mark_sequence_parallel` marks them and
:func:`allreduce_sequence_parallel_grads` sums their gradients over the group.

Each function returns at once when the group has one rank. Every collective they run is
counted in :data:`traffic` (calls, bytes and the seconds this rank waited in them, by
kind), so a step's tensor-parallel communication can be set against what a cost model of
the node predicts (``benchmarks.parallel_gpt``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import HpcdlArgumentError
from ..ops import (
    Max,
    Sum,
    allgather_async,
    allreduce_async,
    grouped_allgather_async,
    grouped_allreduce_async_,
    reducescatter_async,
    synchronize,
)
from ..process_sets import ProcessSet

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "scatter_seq_to_tp",
    "gather_seq_from_tp",
    "reduce_scatter_seq_to_tp",
    "mark_sequence_parallel",
    "allreduce_sequence_parallel_grads",
    "tp_sum",
    "tp_max",
    "Traffic",
    "traffic",
]


class Traffic:
    """The tensor-parallel collectives run on this process since :meth:`reset`, by kind
    (``allreduce``, ``allgather``, ``reducescatter``): calls, bytes (each call's input on
    this rank, the size a cost model takes) and seconds (from starting the call to its
    result, on this rank)."""

    KINDS = ("allreduce", "allgather", "reducescatter")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting afresh."""
        self.counts = {k: {"calls": 0, "bytes": 0, "seconds": 0.0} for k in self.KINDS}

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        """Count one call of ``kind``."""
        c = self.counts[kind]
        c["calls"] += 1
        c["bytes"] += nbytes
        c["seconds"] += seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A copy of the counts, by kind."""
        return {k: dict(v) for k, v in self.counts.items()}


traffic = Traffic()
"""What this process's tensor-parallel functions have sent through their groups."""


def _counted(kind: str, nbytes: int, start: Callable[[], Any]) -> Any:
    """``synchronize(start())``, counted in :data:`traffic`."""
    t0 = time.perf_counter()
    out = synchronize(start())
    traffic.add(kind, nbytes, time.perf_counter() - t0)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tp_sum(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The sum of ``t`` over ``group`` (no autograd)."""
    t = t.contiguous()
    return _counted("allreduce", _nbytes(t), lambda: allreduce_async(t, op=Sum, process_set=group))


def tp_max(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The elementwise maximum of ``t`` over ``group`` (no autograd)."""
    t = t.contiguous()
    return _counted("allreduce", _nbytes(t), lambda: allreduce_async(t, op=Max, process_set=group))


def _gather_last(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Every rank's ``t`` concatenated along the last dimension, in the group's rank order."""
    t = t.movedim(-1, 0).contiguous()
    front = _counted("allgather", _nbytes(t), lambda: allgather_async(t, process_set=group))
    return front.movedim(0, -1).contiguous()


def _chunk(t: torch.Tensor, group: ProcessSet, dim: int) -> torch.Tensor:
    """This rank's equal chunk of ``t``'s dimension ``dim``."""
    k = t.shape[dim] // group.size()
    return t.narrow(dim, group.rank() * k, k).contiguous()


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
        return _chunk(grad, ctx.group, -1), None


class _ScatterToTP(torch.autograd.Function):
    """This rank's chunk of the last dimension forward; the chunks concatenated backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk(x, group, -1)

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


# -- sequence parallelism: chunks of dimension 1 -------------------------------------------------
def _check_seq(t: torch.Tensor, group: ProcessSet, what: str) -> None:
    """``t`` is (batch, sequence, ...) with a sequence length that ``group``'s size divides."""
    if t.dim() < 2:
        raise HpcdlArgumentError(f"{what} takes (batch, sequence, ...) tensors, not shape {tuple(t.shape)}")
    if t.shape[1] % group.size():
        raise HpcdlArgumentError(
            f"{what}: the sequence length (dimension 1) {t.shape[1]} must divide by the tensor-parallel "
            f"size {group.size()}"
        )


def _gather_seq(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dimension 1, in the group's rank order; the
    ranks' lengths travel with it, so unequal chunks raise on every rank."""
    length = torch.tensor([t.shape[1]], dtype=torch.int64)
    x = t.movedim(1, 0).contiguous()
    front, lengths = _counted(
        "allgather", _nbytes(x) + 8, lambda: grouped_allgather_async([x, length], process_set=group)
    )
    if any(int(k) != t.shape[1] for k in lengths):
        raise HpcdlArgumentError(
            "gather_seq_from_tp: every rank's sequence chunk must have the same length, not "
            f"{[int(k) for k in lengths]} (in the group's rank order)"
        )
    return front.movedim(0, 1).contiguous()


def _reduce_scatter_seq(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The sum of every rank's ``t`` over ``group``, this rank's chunk of dimension 1."""
    t = t.movedim(1, 0).contiguous()
    front = _counted("reducescatter", _nbytes(t), lambda: reducescatter_async(t, op=Sum, process_set=group))
    return front.movedim(0, 1).contiguous()


class _ScatterSeqToTP(torch.autograd.Function):
    """This rank's chunk of the sequence forward; the chunks' gradients concatenated backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _GatherSeqFromTP(torch.autograd.Function):
    """The ranks' sequence chunks concatenated forward; backward, the ranks' gradients of
    the whole sequence (each partial) summed, and this rank's chunk of the sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSeqToTP(torch.autograd.Function):
    """The ranks' partial results summed, this rank's sequence chunk of the sum, forward;
    the chunks' gradients concatenated backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def scatter_seq_to_tp(x: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """This rank's equal chunk of the sequence (dimension 1) of ``x``, which is whole and the
    same on every rank of ``group``; backward, the chunks' gradients are concatenated.

    Raises:
        HpcdlArgumentError: ``x`` has fewer than two dimensions, or ``group.size()`` does
            not divide its sequence length.
    """
    if group.size() == 1:
        return x
    _check_seq(x, group, "scatter_seq_to_tp")
    return _ScatterSeqToTP.apply(x, group)


def gather_seq_from_tp(x: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Enter a tensor-parallel region from a sequence-parallel one: every rank's sequence
    chunk ``x`` concatenated along dimension 1, in the group's rank order. Backward, the
    gradient of the whole sequence, partial on each rank, is summed over ``group`` and this
    rank's chunk of the sum returned (a reduce-scatter).

    Raises:
        HpcdlArgumentError: ``x`` has fewer than two dimensions, or the ranks' chunks differ
            in length (on every rank).
    """
    if group.size() == 1:
        return x
    if x.dim() < 2:
        raise HpcdlArgumentError(f"gather_seq_from_tp takes (batch, sequence, ...) tensors, not shape {tuple(x.shape)}")
    return _GatherSeqFromTP.apply(x, group)


def reduce_scatter_seq_to_tp(x: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Leave a tensor-parallel region into a sequence-parallel one, in place of
    :func:`reduce_from_tp`: the sum over ``group`` of the ranks' partial results ``x``
    (whole sequences), this rank's equal chunk of dimension 1 of the sum. Backward, the
    chunks' gradients are concatenated (an allgather).

    Raises:
        HpcdlArgumentError: ``x`` has fewer than two dimensions, or ``group.size()`` does
            not divide its sequence length.
    """
    if group.size() == 1:
        return x
    _check_seq(x, group, "reduce_scatter_seq_to_tp")
    return _ReduceScatterSeqToTP.apply(x, group)


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    """Mark every parameter of ``module`` as used in the sequence-parallel region (set its
    attribute ``sequence_parallel`` to True), e.g. a LayerNorm applied to sequence chunks,
    whose gradient is then a partial sum over the tensor-parallel group's chunks; return
    ``module``. :func:`allreduce_sequence_parallel_grads` completes these gradients."""
    for p in module.parameters():
        p.sequence_parallel = True
    return module


def allreduce_sequence_parallel_grads(module: nn.Module, group: ProcessSet) -> None:
    """Sum over ``group`` (the tensor-parallel group), in place, the ``.grad`` of every
    parameter of ``module`` marked ``sequence_parallel`` (by :func:`mark_sequence_parallel`,
    or a :class:`~hpcdl.parallel.RowParallelLinear` with ``sequence_parallel=True``, which
    marks its bias), whose gradients each rank computed from its sequence chunk only.

    Call it after the backward pass and before the optimizer step (and before any average
    over the data-parallel group). Parameters without a gradient are skipped; every rank of
    ``group`` must have the same marked parameters with gradients.
    """
    if group.size() == 1:
        return
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads:
        nbytes = sum(_nbytes(g) for g in grads)
        _counted("allreduce", nbytes, lambda: grouped_allreduce_async_(grads, op=Sum, process_set=group))
