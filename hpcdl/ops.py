"""Horovod's collectives on torch tensors, each in its forms: ``op`` (an autograd function),
``op_`` (in place), ``op_async`` and ``op_async_`` (return a handle for
:func:`synchronize`/:func:`poll`), plus the grouped variants.

Every call becomes a named request to the background engine (unnamed calls are numbered
per kind and process set, so ranks calling in the same order match). CPU tensors reach
the array layer without a copy when contiguous (bfloat16 and bool through a view of the
same memory). CUDA tensors are staged through host memory, as Horovod does over an MPI
that is not CUDA-aware: the request carries a host copy, reduced in place, and the result
is copied back to the tensor's device when the handle is synchronized. Problems with the
arguments (an unsupported dtype or op, a bad root) travel with the request, so they raise
on every rank, not only where they were made; passing something that is not a tensor
raises ``TypeError`` at once, before a name is taken.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

from collectives.layout import block_counts

from . import basics
from .basics import HpcdlError
from .compression import Compression, Compressor
from .engine import Request
from .process_sets import ProcessSet, _set_id, global_process_set

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "poll",
    "synchronize",
    "barrier",
    "join",
    "start_timeline",
    "stop_timeline",
]


class ReduceOp(enum.IntEnum):
    """Reduction ops (Horovod's constants ``hvd.Average``, ``hvd.Sum``, ...)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)
_OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_REDUCIBLE = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
)
_MOVABLE = (*_REDUCIBLE, torch.bool)


# -- tensors <-> numpy ---------------------------------------------------------------------
def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of the contiguous CPU tensor ``t`` (no copy)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def _torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over the numpy array ``a`` (no copy)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if dtype == torch.bool:
        return torch.from_numpy(a).view(torch.bool)
    return torch.from_numpy(a)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _source(t: Any, what: str) -> torch.Tensor:
    """``t`` detached and contiguous in host memory: ``t`` itself when it is a contiguous
    CPU tensor, else a private copy. A CUDA tensor's copy goes to pinned memory (torch's
    caching host allocator reuses freed blocks, so a training loop's staging buffers are
    not faulted in afresh each step); it waits for the kernels that write ``t``. A tensor
    on another device comes back as it is, for :func:`_check` to refuse."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, not {type(t).__name__}")
    t = t.detach()
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t)
    return t.contiguous()


def _private(src: torch.Tensor, t: torch.Tensor) -> bool:
    """True when :func:`_source` copied ``t`` (so the engine may write into ``src``)."""
    return src.device != t.device or src.data_ptr() != t.data_ptr()


def _home(out: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``out`` on ``device`` (the device of the tensor it answers)."""
    return out if out.device == device else out.to(device)


def _check(t: torch.Tensor, kind: str, allowed: tuple[torch.dtype, ...]) -> str | None:
    """The problem with ``t`` for ``kind`` (it travels to every rank), or None."""
    if t.device.type != "cpu":
        return f"tensor on {t.device}: hpcdl moves CPU and CUDA tensors only"
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        return f"{kind} does not support dtype {_dtype_name(t)}; use one of: {names}"
    return None


# -- the runtime's per-process state -------------------------------------------------------
def _rt() -> Any:
    st = basics._st()
    if st.engine is None:
        raise HpcdlError("hpcdl's engine is not running; call hpcdl.init()")
    return st


def _name(st: Any, kind: str, sid: int, name: str | None) -> str:
    if name is not None:
        return str(name)
    key = (kind, sid)
    k = st.counters.get(key, 0)
    st.counters[key] = k + 1
    return f"{kind}.noname.{sid}.{k}" if sid else f"{kind}.noname.{k}"


class _Handle:
    """What ``*_async`` returns: engine requests and how to turn their results into tensors."""

    __slots__ = ("reqs", "post", "value", "finished")

    def __init__(self, reqs: list[Request], post: Callable[[list[Any]], Any]) -> None:
        self.reqs, self.post = reqs, post
        self.value: Any = None
        self.finished = False


def _handle(st: Any, reqs: list[Request], post: Callable[[list[Any]], Any]) -> int:
    st.engine.submit_many(reqs)
    h = st.next_handle
    st.next_handle += 1
    st.handles[h] = _Handle(reqs, post)
    return h


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished (synchronize will not block)."""
    st = _rt()
    hd = st.handles.get(handle)
    if hd is None:
        raise HpcdlError(f"unknown handle {handle!r} (already synchronized?)")
    return all(r.event.is_set() for r in hd.reqs)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its output (tensor, or a list for
    grouped operations); raise :class:`HpcdlError` if it failed on this or another rank."""
    st = basics._st()
    hd = st.handles.pop(handle, None)
    if hd is None:
        raise HpcdlError(f"unknown handle {handle!r} (already synchronized?)")
    results = []
    for req in hd.reqs:
        results.append(st.engine.wait(req) if st.engine is not None else req.result)
    return hd.post(results)


def _op_of(op: Any, average: bool | None) -> Any:
    """The ReduceOp, or the text of what is wrong with it (sent with the request, so that
    every rank raises, not only this one)."""
    if isinstance(op, str):  # already a problem
        return op
    if average is not None:
        if op is not None:
            return "pass op= or the deprecated average=, not both"
        return Average if average else Sum
    op = Average if op is None else op
    try:
        op = ReduceOp(op)
    except ValueError:
        return f"op={op!r} is not one of hpcdl.Average, Sum, Min, Max, Product"
    if op == Adasum:
        return "op=Adasum is not supported by hpcdl; use Average or Sum"
    return op


def _tensors(tensors: Any, what: str) -> list[torch.Tensor]:
    """Check (before any name is taken) that ``tensors`` is a non-empty list of tensors."""
    ts = list(tensors)
    if not ts:
        raise ValueError(f"{what} needs at least one tensor")
    for t in ts:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} takes torch.Tensor arguments, not {type(t).__name__}")
    return ts


def _scales(t: torch.Tensor, pre: float, post: float) -> str | None:
    if (pre != 1.0 or post != 1.0) and not t.dtype.is_floating_point:
        return f"prescale_factor/postscale_factor need a floating-point tensor, not {_dtype_name(t)}"
    return None


# -- allreduce -----------------------------------------------------------------------------
def _allreduce_reqs(
    st: Any,
    tensors: Sequence[torch.Tensor],
    name: str | None,
    op: ReduceOp,
    pre: float,
    post: float,
    sid: int,
    inplace: bool,
    kind_name: str,
) -> tuple[list[Request], list[torch.Tensor], list[Callable[[], None]]]:
    reqs, outs, fixups = [], [], []
    tensors = _tensors(tensors, kind_name)
    base = _name(st, "allreduce", sid, name)
    bad_op = op if isinstance(op, str) else None
    for i, t in enumerate(tensors):
        src = _source(t, kind_name)
        problem = bad_op or _check(src, "allreduce", _REDUCIBLE) or _scales(src, pre, post)
        private = _private(src, t)
        # reduce in place where that writes nothing the caller sees: into t itself when
        # asked to, or into the private copy _source made (copied back into t when in place)
        out = src if inplace or private else torch.empty_like(src)
        if inplace and private:
            fixups.append(lambda t=t, out=out: t.copy_(out))
        x = _np(src) if problem is None else None
        req = Request(
            base if len(tensors) == 1 else f"{base}.{i}",
            "allreduce",
            sid,
            (_dtype_name(src), tuple(src.shape), _OP_NAMES.get(op, "invalid"), float(pre), float(post)),
            error=problem,
            x=x,
            out=_np(out) if problem is None else None,
        )
        reqs.append(req)
        outs.append(t if inplace else out)
    return reqs, outs, fixups


def _post_outs(
    outs: list[torch.Tensor], fixups: list[Callable[[], None]], single: bool, devices: list[torch.device]
) -> Callable[[list], Any]:
    """The handle's result: ``outs`` (after the copies back into in-place tensors), each on
    the device in ``devices`` of the tensor it answers."""

    def post(_: list) -> Any:
        for f in fixups:
            f()
        res = [_home(o, d) for o, d in zip(outs, devices, strict=True)]
        return res[0] if single else res

    return post


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
    return _grouped_allreduce_async([tensor], average, name, op, pre, post, process_set, inplace, single=True)


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
    gradients for Sum and Average, and masked or product-of-others for Min/Max/Product."""

    @staticmethod
    def forward(ctx, tensor, op, pre, post, name, process_set):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        if op in (Sum, Average):
            return synchronize(_allreduce_async(tensor, None, name, op, pre, post, process_set, False))
        # z = op_r(pre * x_r) unscaled, y = post * z: the backward needs z and pre * x exactly
        scaled = tensor * pre if pre != 1.0 else tensor
        z = synchronize(_allreduce_async(scaled, None, name, op, 1.0, 1.0, process_set, False))
        ctx.save_for_backward(scaled, z)
        return z * post if post != 1.0 else z

    @staticmethod
    def backward(ctx, grad):
        op, ps = ctx.op, ctx.process_set
        if op in (Sum, Average):
            g = synchronize(_allreduce_async(grad, None, None, op, ctx.pre, ctx.post, ps, False))
        else:
            scaled, z = ctx.saved_tensors
            total = synchronize(_allreduce_async(grad, None, None, Sum, 1.0, 1.0, ps, False))
            if op == Product:
                everyone = synchronize(allgather_async(scaled.unsqueeze(0), process_set=ps))
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
    op = _op_of(op, average)
    sent, cctx = compression.compress(tensor)
    out = _Allreduce.apply(sent, op, float(prescale_factor), float(postscale_factor), name, process_set)
    return compression.decompress(out, cctx)


# -- grouped allreduce ---------------------------------------------------------------------
def _grouped_allreduce_async(tensors, average, name, op, pre, post, process_set, inplace, single=False):
    st = _rt()
    op = _op_of(op, average)
    sid = _set_id(process_set)
    what = "allreduce" if single else "grouped_allreduce"
    tensors = list(tensors)
    reqs, outs, fixups = _allreduce_reqs(st, tensors, name, op, pre, post, sid, inplace, what)
    return _handle(st, reqs, _post_outs(outs, fixups, single, [t.device for t in tensors]))


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
    return _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False)


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
    return _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True)


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
        return tuple(synchronize(_grouped_allreduce_async(tensors, None, name, op, pre, post, process_set, False)))

    @staticmethod
    def backward(ctx, *grads):
        gs = synchronize(_grouped_allreduce_async(grads, None, None, ctx.op, ctx.pre, ctx.post, ctx.process_set, False))
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
    op = _op_of(op, average)
    packed = [compression.compress(t) for t in tensors]
    if op in (Sum, Average):
        outs = _GroupedAllreduce.apply(
            op, float(prescale_factor), float(postscale_factor), name, process_set, *[p[0] for p in packed]
        )
    else:
        outs = synchronize(
            _grouped_allreduce_async(
                [p[0] for p in packed], None, name, op, prescale_factor, postscale_factor, process_set, False
            )
        )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed, strict=True)]


# -- allgather -----------------------------------------------------------------------------
def _allgather_reqs(st, tensors, name, sid, what):
    reqs = []
    tensors = _tensors(tensors, what)
    base = _name(st, "allgather", sid, name)
    for i, t in enumerate(tensors):
        src = _source(t, what)
        problem = _check(src, "allgather", _MOVABLE)
        if problem is None and src.dim() == 0:
            problem = "allgather needs a tensor with at least one dimension"
        item = tuple(src.shape[1:]) if src.dim() else ()
        reqs.append(
            Request(
                base if len(tensors) == 1 else f"{base}.{i}",
                "allgather",
                sid,
                (_dtype_name(src), item),
                var=src.shape[0] if src.dim() else 0,
                error=problem,
                x=_np(src) if problem is None else None,
            )
        )
    kinds = [(t.dtype, t.device) for t in tensors]
    return reqs, lambda results: [_home(_torch(r, d), dev) for r, (d, dev) in zip(results, kinds, strict=True)]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (the first dimension
    may differ between ranks); :func:`synchronize` gives the result."""
    st = _rt()
    reqs, conv = _allgather_reqs(st, [tensor], name, _set_id(process_set), "allgather")
    return _handle(st, reqs, lambda res: conv(res)[0])


def _allgather_into_async(shard: torch.Tensor, out: torch.Tensor, name: str, process_set: ProcessSet) -> int:
    """Gather every rank's ``shard`` into the flat ``out`` in rank order, where ``shard`` is
    this rank's block of ``out`` already (hpcdl's own: ZeroOptimizer's flat parameters; every
    rank's block has the same size). On the CPU the engine gathers into ``out`` itself; a
    CUDA ``out`` gets the result copied back. A bad ``shard`` is an error on every rank."""
    st = _rt()
    n, me = len(process_set.ranks), process_set.rank()
    k = shard.numel()
    reqs, conv = _allgather_reqs(st, [shard], name, _set_id(process_set), "allgather")
    req = reqs[0]
    if (
        out.dim() != 1
        or not out.is_contiguous()
        or out.numel() != n * k
        or (shard.data_ptr() != out[me * k : (me + 1) * k].data_ptr())
    ):
        req.error = req.error or "the gathered shard must be this rank's block of the flat output"
    if req.error is None and out.device.type == "cpu":
        req.out = _np(out)
        return _handle(st, reqs, lambda _: out)
    return _handle(st, reqs, lambda res: out.copy_(conv(res)[0]))


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start allgathering every tensor of ``tensors``; :func:`synchronize` gives a list."""
    st = _rt()
    reqs, conv = _allgather_reqs(st, list(tensors), name, _set_id(process_set), "grouped_allgather")
    return _handle(st, reqs, conv)


def _slice_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's rows of the summed gradient of an allgather (allgather of dim 0 first)."""
    summed = synchronize(_allreduce_async(grad, None, None, Sum, 1.0, 1.0, process_set, False))
    dims = synchronize(allgather_async(torch.tensor([rows], dtype=torch.int64), process_set=process_set))
    me = process_set.rank()
    start = int(dims[:me].sum())
    return summed[start : start + rows]


class _Allgather(torch.autograd.Function):
    """Gradient of a concatenation: every rank's output gradients summed, then this rank's rows."""

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


# -- broadcast -----------------------------------------------------------------------------
def _broadcast_async(tensor, root_rank, name, process_set, inplace):
    st = _rt()
    sid = _set_id(process_set)
    _tensors([tensor], "broadcast")
    src = _source(tensor, "broadcast")
    problem = _check(src, "broadcast", _MOVABLE)
    members = process_set.ranks
    if problem is None and not (isinstance(root_rank, int) and root_rank in members):
        problem = f"root_rank={root_rank!r} is not a rank of the process set (ranks {members})"
    private = _private(src, tensor)
    out = src if inplace or private else torch.empty_like(src)
    fix = (lambda: tensor.copy_(out)) if inplace and private else None
    req = Request(
        _name(st, "broadcast", sid, name),
        "broadcast",
        sid,
        (_dtype_name(src), tuple(src.shape), root_rank if isinstance(root_rank, int) else -1),
        error=problem,
        x=_np(src) if problem is None else None,
        out=_np(out) if problem is None else None,
    )
    return _handle(st, [req], _post_outs([tensor if inplace else out], [fix] if fix else [], True, [tensor.device]))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start sending ``root_rank``'s ``tensor`` to every rank; :func:`synchronize` gives a
    new tensor with it (``root_rank`` is a rank of the job, as in Horovod, and must be a
    member of ``process_set``)."""
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """As :func:`broadcast_async`, writing into ``tensor``."""
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s on every rank; return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Every rank's output is the root's input: the root's gradient is the sum of the
    output gradients (a reduce to the root); the other ranks' is zero."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        summed = synchronize(_allreduce_async(grad, None, None, Sum, 1.0, 1.0, ctx.process_set, False))
        if basics.rank() != ctx.root:
            summed = torch.zeros_like(summed)
        return summed, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank, in a new tensor (differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall ------------------------------------------------------------------------------
def alltoall_async(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start sending rows of ``tensor`` to every rank (``splits[i]`` rows to rank i; by
    default an even split); :func:`synchronize` gives ``(received rows, received splits)``."""
    st = _rt()
    sid = _set_id(process_set)
    _tensors([tensor], "alltoall")
    src = _source(tensor, "alltoall")
    problem = _check(src, "alltoall", _MOVABLE)
    if problem is None and src.dim() == 0:
        problem = "alltoall needs a tensor with at least one dimension"
    sp = None
    if splits is not None:
        sp = [int(v) for v in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    req = Request(
        _name(st, "alltoall", sid, name),
        "alltoall",
        sid,
        (_dtype_name(src), tuple(src.shape[1:])),
        error=problem,
        x=_np(src) if problem is None else None,
        splits=sp,
    )
    dtype, device = src.dtype, tensor.device
    return _handle(
        st, [req], lambda res: (_home(_torch(res[0][0], dtype), device), torch.from_numpy(res[0][1]).to(torch.int32))
    )


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


# -- reducescatter -------------------------------------------------------------------------
def _reducescatter_reqs(st, tensors, name, op, pre, post, sid, n, me, what, given=None):
    reqs, outs = [], []
    tensors = _tensors(tensors, what)
    base = _name(st, "reducescatter", sid, name)
    bad_op = op if isinstance(op, str) else None
    for i, t in enumerate(tensors):
        src = _source(t, what)
        problem = bad_op or _check(src, "reducescatter", _REDUCIBLE) or _scales(src, pre, post)
        if problem is None and src.dim() == 0:
            problem = "reducescatter needs a tensor with at least one dimension"
        rows = block_counts(src.shape[0], n)[me] if src.dim() else 0
        out = torch.empty((rows, *src.shape[1:]), dtype=src.dtype) if given is None else given
        reqs.append(
            Request(
                base if len(tensors) == 1 else f"{base}.{i}",
                "reducescatter",
                sid,
                (_dtype_name(src), tuple(src.shape), _OP_NAMES.get(op, "invalid"), float(pre), float(post)),
                error=problem,
                x=_np(src) if problem is None else None,
                out=_np(out) if problem is None else None,
            )
        )
        outs.append(out)
    return reqs, outs


def _rs_async(tensors, name, op, pre, post, process_set, single, given=None):
    st = _rt()
    op = _op_of(op, None)
    sid = _set_id(process_set)
    n = len(process_set.ranks)
    me = process_set.rank()
    tensors = list(tensors)
    reqs, outs = _reducescatter_reqs(st, tensors, name, op, pre, post, sid, n, me, "reducescatter", given)
    return _handle(st, reqs, _post_outs(outs, [], single, [t.device for t in tensors]))


def _reducescatter_into_async(
    tensor: torch.Tensor,
    out: torch.Tensor,
    name: str,
    op: ReduceOp,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
) -> int:
    """:func:`reducescatter_async` of a 1-D ``tensor`` into ``out`` (hpcdl's own: the caller's
    persistent buffer for this rank's block) where the engine can write the result there:
    a CPU ``tensor`` and a contiguous CPU ``out`` of its dtype and this rank's block size.
    Otherwise (a CUDA or compressed ``tensor``) into a new tensor, as reducescatter_async."""
    n, me = len(process_set.ranks), process_set.rank()
    fits = (
        tensor.dim() == 1
        and tensor.device.type == out.device.type == "cpu"
        and out.dtype == tensor.dtype
        and out.is_contiguous()
        and out.shape == (block_counts(tensor.shape[0], n)[me],)
    )
    given = out if fits else None
    return _rs_async([tensor], name, op, prescale_factor, postscale_factor, process_set, True, given)


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
    return _rs_async([tensor], name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start :func:`reducescatter_async` of every tensor of ``tensors``; a list results."""
    return _rs_async(list(tensors), name, op, prescale_factor, postscale_factor, process_set, False)


class _Reducescatter(torch.autograd.Function):
    """Rank i's output is the reduction of every rank's block i, so every rank's input
    gradient is the allgather of the output gradients (scaled as the forward was)."""

    @staticmethod
    def forward(ctx, op, pre, post, name, process_set, *tensors):
        if op not in (Sum, Average):
            raise HpcdlError("reducescatter is differentiable for Sum and Average only")
        ctx.scale = pre * post / (len(process_set.ranks) if op == Average else 1)
        ctx.process_set = process_set
        return tuple(synchronize(_rs_async(tensors, name, op, pre, post, process_set, False)))

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
    op = _op_of(op, None)
    packed = [compression.compress(t) for t in tensors]
    sent = [p[0] for p in packed]
    if op in (Sum, Average):
        outs = _Reducescatter.apply(op, float(prescale_factor), float(postscale_factor), name, process_set, *sent)
    else:
        outs = synchronize(_rs_async(sent, name, op, prescale_factor, postscale_factor, process_set, False))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed, strict=True)]


# -- barrier, join, control requests -------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set has called barrier."""
    st = _rt()
    sid = _set_id(process_set)
    synchronize(_handle(st, [Request(_name(st, "barrier", sid, None), "barrier", sid, ())], lambda res: None))


def join(device: int = -1) -> int:
    """Declare that this rank has no more work: until every rank has joined, the others'
    allreduce, allgather and broadcast requests proceed with this rank contributing
    nothing (the op's identity for reductions, no rows for allgather). Returns the rank
    that joined last. ``device`` is accepted for Horovod compatibility."""
    return _rt().engine.join()


def _control(kind: str, sig: tuple, *, var: Any = None, error: str | None = None) -> Any:
    """Run a negotiated control request (process sets, timeline) and return its result."""
    st = _rt()
    req = Request(_name(st, kind, 0, None), kind, 0, sig, var=var, error=error)
    return synchronize(_handle(st, [req], lambda res: res[0]))


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording every rank's requests; rank 0's ``file_path`` receives the Chrome
    trace when :func:`stop_timeline` (or shutdown) is called. Collective over all ranks."""
    _control("start_timeline", (bool(mark_cycles),), var=str(file_path))


def stop_timeline() -> None:
    """Stop recording and write the timeline file (collective over all ranks)."""
    _control("stop_timeline", ())
