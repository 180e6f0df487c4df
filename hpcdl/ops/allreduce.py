"""Allreduce in Horovod's forms: ``allreduce`` (differentiable), ``allreduce_``,
``allreduce_async``, ``allreduce_async_`` and the grouped variants (one negotiation,
fused)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..compression import Compression, Compressor
from ..errors import HpcdlError
from ..handles import synchronize
from ..process_sets import ProcessSet, global_process_set
from .reduce_op import Adasum, Average, Product, ReduceOp, Sum, resolve_op
from .requests import (
    start_allgather,
    start_allreduce,
)

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
]


# -- allreduce -----------------------------------------------------------------------------
def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing ``tensor`` over the process set; return a handle whose
    :func:`synchronize` gives a new tensor with the result.

    Args:
        tensor: this rank's tensor (CPU or CUDA; any shape; the same shape and dtype on every rank).
        average: deprecated; ``op=Average`` (True) or ``op=Sum`` (False).
        name: a name unique among this rank's requests in flight, the same on every rank
            (unnamed calls are numbered in call order).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply the input by this before the reduction.
        postscale_factor: multiply the result by this after it.
        process_set: the ranks that take part (default: all).
    """
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, False)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """As :func:`allreduce_async`, writing the result into ``tensor``."""
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def _allreduce_async(tensor, average, name, op, pre, post, process_set, inplace):
    return start_allreduce([tensor], average, name, op, pre, post, process_set, inplace, single=True)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over the process set in place and return it (see :func:`allreduce_async`)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """y = post * op_r(pre * x_r); the gradient is the same reduction of the output
    gradients for Sum, Average and Adasum (Horovod's), and masked or product-of-others for
    Min/Max/Product (the analytic gradients, where Horovod reduces the gradients with the
    op again)."""

    @staticmethod
    def forward(ctx, tensor, op, pre, post, name, process_set):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        if op in (Sum, Average, Adasum) or isinstance(op, str):
            return synchronize(_allreduce_async(tensor, None, name, op, pre, post, process_set, False))
        # z = op_r(pre * x_r) unscaled, y = post * z: the backward needs z and pre * x exactly
        scaled = tensor * pre if pre != 1.0 else tensor
        z = synchronize(_allreduce_async(scaled, None, name, op, 1.0, 1.0, process_set, False))
        ctx.save_for_backward(scaled, z)
        return z * post if post != 1.0 else z

    @staticmethod
    def backward(ctx, grad):
        op, ps = ctx.op, ctx.process_set
        if op in (Sum, Average, Adasum):
            g = synchronize(_allreduce_async(grad, None, None, op, ctx.pre, ctx.post, ps, False))
        else:
            scaled, z = ctx.saved_tensors
            total = synchronize(_allreduce_async(grad, None, None, Sum, 1.0, 1.0, ps, False))
            if op == Product:
                everyone = synchronize(start_allgather([scaled.unsqueeze(0)], None, ps, True))
                me = ps.rank()
                others = torch.cat([everyone[:me], everyone[me + 1 :]])
                g = total * others.prod(dim=0)
            else:
                g = total * (scaled == z).to(grad.dtype)
            g = g * (ctx.pre * ctx.post)
        return g, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over the process set and return the result in a new tensor
    (differentiable; see :func:`allreduce_async` for the arguments).

    ``compression`` (``Compression.fp16``/``bf16``) sends floating-point tensors as 16-bit
    floats and returns the original dtype.
    """
    op = resolve_op(op, average)
    sent, cctx = compression.compress(tensor)
    out = _Allreduce.apply(sent, op, float(prescale_factor), float(postscale_factor), name, process_set)
    return compression.decompress(out, cctx)


# -- grouped allreduce ---------------------------------------------------------------------
def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing every tensor of ``tensors`` (submitted together, so they negotiate in
    one cycle and fuse); :func:`synchronize` gives the list of results."""
    return start_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """As :func:`grouped_allreduce_async`, in place."""
    return start_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce every tensor of ``tensors`` in place; return them."""
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, name, process_set, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        if op not in (Sum, Average):
            raise HpcdlError("grouped_allreduce is differentiable for Sum and Average only")
        return tuple(synchronize(start_allreduce(tensors, None, name, op, pre, post, process_set, False)))

    @staticmethod
    def backward(ctx, *grads):
        gs = synchronize(start_allreduce(grads, None, None, ctx.op, ctx.pre, ctx.post, ctx.process_set, False))
        return (None, None, None, None, None, *gs)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce every tensor of ``tensors`` (one negotiation, fused); return new tensors
    (differentiable for Sum and Average)."""
    op = resolve_op(op, average)
    packed = [compression.compress(t) for t in tensors]
    if op in (Sum, Average):
        outs = _GroupedAllreduce.apply(
            op, float(prescale_factor), float(postscale_factor), name, process_set, *[p[0] for p in packed]
        )
    else:
        outs = synchronize(
            start_allreduce(
                [p[0] for p in packed], None, name, op, prescale_factor, postscale_factor, process_set, False
            )
        )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed, strict=True)]
