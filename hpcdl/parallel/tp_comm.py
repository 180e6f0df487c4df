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

Each function returns at once when the group has one rank. On CPU tensors of a group that
a :class:`~hpcdl.parallel.Grid` built (with ``MPI_THREAD_MULTIPLE``), the collectives run
directly through :mod:`collectives` on the group's own communicator, from the calling
thread, as Megatron-LM calls ``torch.distributed``: a tensor-parallel call sits on the
critical path of every layer, and a round trip through the engine's negotiation costs far
more than the call itself (:func:`attach`). Other tensors (CUDA ones) go through the
engine's requests. Every collective they run is counted in :data:`traffic` (calls, bytes
and the seconds this rank waited in them, by kind), so a step's tensor-parallel
communication can be set against what a cost model of the node predicts
(``benchmarks.parallel_gpt``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import collectives

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
from ..staging import REDUCIBLE, to_numpy, to_torch

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
    "attach",
    "detach",
]


class Traffic:
    """The tensor-parallel collectives run on this process since :meth:`reset`, by kind
    (``allreduce``, ``allgather``, ``reducescatter``): calls, bytes (each call's input on
    this rank, the size a cost model takes) and seconds (from starting the call to its
    result, on this rank).

    Attributes:
        counts: by kind, the calls, bytes and seconds so far.
        calls: with ``reset(keep_calls=True)``, each call's seconds in the order they ran
            (else None). A group's ranks make the same calls in the same order, so the
            least of its ranks' seconds for one call is that call's own cost, paid once
            every rank had reached it, and what a rank waited beyond that was for a later
            peer (``benchmarks.parallel_gpt`` splits a step's waiting so).
    """

    KINDS = ("allreduce", "allgather", "reducescatter")

    def __init__(self) -> None:
        self.reset()

    def reset(self, keep_calls: bool = False) -> None:
        """Start counting afresh; with ``keep_calls``, also list each call's seconds (a
        float a call, for as long as it counts: for measurements, not a training run)."""
        self.counts = {k: {"calls": 0, "bytes": 0, "seconds": 0.0} for k in self.KINDS}
        self.calls: list[float] | None = [] if keep_calls else None

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        """Count one call of ``kind``."""
        c = self.counts[kind]
        c["calls"] += 1
        c["bytes"] += nbytes
        c["seconds"] += seconds
        if self.calls is not None:
            self.calls.append(seconds)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A copy of the counts, by kind."""
        return {k: dict(v) for k, v in self.counts.items()}


traffic = Traffic()
"""What this process's tensor-parallel functions have sent through their groups."""


_direct: dict[int, tuple[ProcessSet, Any]] = {}
"""id(process set) -> the process set (held, so its id stays its own) and the MPI
communicator of its ranks, for the direct path."""


def attach(group: ProcessSet, comm: Any) -> None:
    """Run the tensor-parallel collectives of ``group`` on CPU tensors directly, through
    :mod:`collectives` on ``comm`` (a communicator of the group's ranks in its order, used
    for nothing else), from the calling thread. Every rank of the group must attach it, or
    none: :class:`~hpcdl.parallel.Grid` does, after agreeing that MPI runs with
    ``MPI_THREAD_MULTIPLE`` everywhere (the engine's thread keeps using its own
    communicators meanwhile)."""
    _direct[id(group)] = (group, comm)


def detach(group: ProcessSet) -> Any:
    """Stop the direct path of ``group`` (every rank of it); gives its communicator back
    (None if it had none), for the caller to free."""
    entry = _direct.pop(id(group), None)
    return None if entry is None else entry[1]


def _direct_comm(group: ProcessSet, tensors: list[torch.Tensor]) -> Any:
    entry = _direct.get(id(group))
    comm = None if entry is None else entry[1]
    if comm is None or any(t.device.type != "cpu" or t.dtype not in REDUCIBLE for t in tensors):
        return None
    return comm


def _counted(
    kind: str, nbytes: int, start: Callable[[], Any], group: ProcessSet, direct: Callable[[Any], Any] | None, *ts: Any
) -> Any:
    """``direct(comm)`` where ``group`` has the direct path and takes ``ts``, else (or with
    ``direct`` None) ``synchronize(start())`` through the engine; counted in :data:`traffic`."""
    comm = None if direct is None else _direct_comm(group, list(ts))
    t0 = time.perf_counter()
    out = synchronize(start()) if comm is None else direct(comm)
    traffic.add(kind, nbytes, time.perf_counter() - t0)
    return out


def _allreduce(t: torch.Tensor, op: str, comm: Any) -> torch.Tensor:
    return to_torch(collectives.allreduce(to_numpy(t.detach()), op=op, comm=comm), t.dtype)


def _allgather(t: torch.Tensor, comm: Any) -> torch.Tensor:
    return to_torch(collectives.allgather(to_numpy(t.detach()), comm=comm), t.dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tp_sum(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The sum of ``t`` over ``group`` (no autograd)."""
    t = t.contiguous()
    start = lambda: allreduce_async(t, op=Sum, process_set=group)  # noqa: E731
    return _counted("allreduce", _nbytes(t), start, group, lambda c: _allreduce(t, "sum", c), t)


def tp_max(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The elementwise maximum of ``t`` over ``group`` (no autograd)."""
    t = t.contiguous()
    start = lambda: allreduce_async(t, op=Max, process_set=group)  # noqa: E731
    return _counted("allreduce", _nbytes(t), start, group, lambda c: _allreduce(t, "max", c), t)


def _gather_last(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """Every rank's ``t`` concatenated along the last dimension, in the group's rank order."""
    t = t.movedim(-1, 0).contiguous()
    start = lambda: allgather_async(t, process_set=group)  # noqa: E731
    front = _counted("allgather", _nbytes(t), start, group, lambda c: _allgather(t, c), t)
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
    start = lambda: grouped_allgather_async([x, length], process_set=group)  # noqa: E731

    def direct(c: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = _allgather(length, c)  # first, so that unequal chunks fail alike everywhere
        return (_allgather(x, c) if bool((lengths == length).all()) else x), lengths

    front, lengths = _counted("allgather", _nbytes(x) + 8, start, group, direct, x)
    if any(int(k) != t.shape[1] for k in lengths):
        raise HpcdlArgumentError(
            "gather_seq_from_tp: every rank's sequence chunk must have the same length, not "
            f"{[int(k) for k in lengths]} (in the group's rank order)"
        )
    return front.movedim(0, 1).contiguous()


def _reduce_scatter_seq(t: torch.Tensor, group: ProcessSet) -> torch.Tensor:
    """The sum of every rank's ``t`` over ``group``, this rank's chunk of dimension 1."""
    t = t.movedim(1, 0).contiguous()
    start = lambda: reducescatter_async(t, op=Sum, process_set=group)  # noqa: E731

    def direct(c: Any) -> torch.Tensor:  # the rows divide by the group's size: equal blocks of rows
        mine = collectives.reduce_scatter(to_numpy(t.detach()).reshape(-1), op="sum", comm=c)
        return to_torch(mine, t.dtype).view(t.shape[0] // group.size(), *t.shape[1:])

    front = _counted("reducescatter", _nbytes(t), start, group, direct, t)
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
        start = lambda: grouped_allreduce_async_(grads, op=Sum, process_set=group)  # noqa: E731

        def direct(c: Any) -> None:  # one call over the gradients laid end to end
            flat = torch.cat([g.reshape(-1) for g in grads])
            total = _allreduce(flat, "sum", c)
            for g, part in zip(grads, total.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))

        one_dtype = len({g.dtype for g in grads}) == 1
        _counted("allreduce", nbytes, start, group, direct if one_dtype else None, *grads)
