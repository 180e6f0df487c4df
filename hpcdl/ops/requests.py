"""The primitives under the collectives' four forms: build each collective's engine
requests from tensors and submit them, returning a handle.

Problems with the arguments (an unsupported dtype or op, a bad root) travel with the
request, so they raise on every rank, not only where they were made; passing something
that is not a tensor raises ``TypeError`` at once, before a name is taken. The public
forms (``allreduce``, ``allreduce_``, ``allreduce_async``, ...) in the sibling modules
are thin wrappers over these.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from collectives.blocks import block_counts

from .. import state
from ..engine import BroadcastSig, GatherSig, ReduceSig, Submission
from ..handles import request_name, submit, tensor_results
from ..process_sets import ProcessSet, registered_id
from ..staging import (
    MOVABLE,
    REDUCIBLE,
    check_tensor,
    device_source,
    dtype_name,
    host_source,
    inplace_problem,
    is_private,
    memory,
    ready_event,
    result_tensor,
    tensor_list,
    to_cupy,
    to_numpy,
)
from .reduce_op import OP_NAMES, Adasum, ReduceOp, resolve_op

__all__ = [
    "start_allreduce",
    "start_allgather",
    "allgather_into_async",
    "start_broadcast",
    "start_alltoall",
    "start_reducescatter",
    "reducescatter_into_async",
]


def adasum_problem(op: Any, t: torch.Tensor, process_set: ProcessSet) -> str | None:
    """What keeps ``op`` from being Adasum on ``t`` over ``process_set``, or None: Adasum
    combines floating-point tensors over a power-of-two number of ranks (as in Horovod)."""
    if op != Adasum:
        return None
    n = len(process_set.ranks)
    if n & (n - 1):
        return f"op=Adasum needs a power-of-two number of ranks; the process set has {n}"
    if not t.dtype.is_floating_point:
        return f"op=Adasum combines floating-point tensors, not {dtype_name(t)}"
    return None


def _group_name(base: str, i: int, count: int) -> str:
    return base if count == 1 else f"{base}.{i}"


def _source(rt: state.Runtime, t: Any, what: str, device_ok: bool = True) -> tuple[torch.Tensor, bool]:
    """``(src, on_device)``: the tensor the engine reads for ``t``, on its GPU where the
    device path takes it (:func:`~hpcdl.staging.device_source`), else in host memory."""
    src = device_source(t, rt.config.device_path and device_ok)
    if src is not None:
        return src, True
    return host_source(t, what), False


def _reduce_sig(src: torch.Tensor, op: Any, pre: float, post: float, on_device: bool) -> ReduceSig:
    """The signature of an allreduce or reducescatter of ``src`` (an unknown op reads "invalid")."""
    name = OP_NAMES.get(op, "invalid")
    return ReduceSig(dtype_name(src), tuple(src.shape), name, float(pre), float(post), memory(on_device))


def _buffers(on_device: bool, problem: str | None, x: torch.Tensor, out: torch.Tensor | None = None) -> dict[str, Any]:
    """A request's buffers (``x``, ``out``: numpy or CuPy views; none after a problem) and,
    on the device, the event the engine awaits before reading them."""
    if problem is not None:
        return {}
    view = to_cupy if on_device else to_numpy
    bufs = {"x": view(x), "out": None if out is None else view(out)}
    if on_device:
        bufs["ready"] = ready_event(x)
    return bufs


# -- allreduce -----------------------------------------------------------------------------
def start_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None,
    name: str | None,
    op: Any,
    pre: float,
    post: float,
    process_set: ProcessSet,
    inplace: bool,
    single: bool = False,
) -> int:
    """Submit an allreduce of every tensor of ``tensors`` (one request each, negotiated
    together); the handle gives a tensor when ``single``, else a list."""
    rt = state.running()
    op = resolve_op(op, average)
    sid = registered_id(process_set)
    what = "allreduce" if single else "grouped_allreduce"
    tensors = tensor_list(tensors, what)
    reqs, outs, fixups = [], [], []
    base = request_name(rt, "allreduce", sid, name)
    bad_op = op if isinstance(op, str) else None
    for i, t in enumerate(tensors):
        # a CUDA tensor stays on its GPU where CuPy can take it; else it is staged on the host
        src, dev = _source(rt, t, what, device_ok=op != Adasum)
        problem = bad_op or check_tensor(src, "allreduce", REDUCIBLE) or adasum_problem(op, src, process_set)
        problem = problem or (inplace_problem(t, what + "_") if inplace else None)
        private = is_private(src, t)
        # reduce in place where that writes nothing the caller sees: into t itself when
        # asked to, or into the private copy made above (copied back into t when in place)
        out = src if inplace or private else torch.empty_like(src)
        if inplace and private:
            fixups.append(lambda t=t, out=out: t.copy_(out))
        reqs.append(
            Submission(
                _group_name(base, i, len(tensors)),
                "allreduce",
                sid,
                _reduce_sig(src, op, pre, post, dev),
                error=problem,
                **_buffers(dev, problem, src, out),
            )
        )
        outs.append(t if inplace else out)
    return submit(rt, reqs, tensor_results(outs, fixups, single, [t.device for t in tensors]))


# -- allgather -----------------------------------------------------------------------------
def _allgather_reqs(
    rt: state.Runtime, tensors: Any, name: str | None, sid: int, what: str
) -> tuple[list[Submission], Callable[[list], list[torch.Tensor]]]:
    reqs = []
    tensors = tensor_list(tensors, what)
    base = request_name(rt, "allgather", sid, name)
    for i, t in enumerate(tensors):
        src, dev = _source(rt, t, what)
        problem = check_tensor(src, "allgather", MOVABLE)
        if problem is None and src.dim() == 0:
            problem = "allgather needs a tensor with at least one dimension"
        item = tuple(src.shape[1:]) if src.dim() else ()
        reqs.append(
            Submission(
                _group_name(base, i, len(tensors)),
                "allgather",
                sid,
                GatherSig(dtype_name(src), item, memory(dev)),
                var=src.shape[0] if src.dim() else 0,  # every rank's rows: the engine gathers without asking
                error=problem,
                **_buffers(dev, problem, src),
            )
        )
    kinds = [(t.dtype, t.device) for t in tensors]
    return reqs, lambda results: [result_tensor(r, d, dev) for r, (d, dev) in zip(results, kinds, strict=True)]


def start_allgather(tensors: Sequence[torch.Tensor], name: str | None, process_set: ProcessSet, single: bool) -> int:
    """Submit an allgather of every tensor of ``tensors``; the handle gives a tensor when
    ``single``, else a list."""
    rt = state.running()
    what = "allgather" if single else "grouped_allgather"
    reqs, conv = _allgather_reqs(rt, list(tensors), name, registered_id(process_set), what)
    return submit(rt, reqs, (lambda res: conv(res)[0]) if single else conv)


def allgather_into_async(shard: torch.Tensor, out: torch.Tensor, name: str, process_set: ProcessSet) -> int:
    """Gather every rank's ``shard`` into the flat ``out`` in rank order, where ``shard`` is
    this rank's block of ``out`` already (the optimizers' flat parameters; every rank's
    block has the same size). The engine gathers into ``out`` itself where it reads
    ``shard`` in place (a CPU tensor, or a CUDA one on the device path); a CUDA ``out``
    staged through the host gets the result copied back. A bad ``shard`` is an error on
    every rank."""
    rt = state.running()
    n, me = len(process_set.ranks), process_set.rank()
    k = shard.numel()
    reqs, conv = _allgather_reqs(rt, [shard], name, registered_id(process_set), "allgather")
    req = reqs[0]
    if (
        out.dim() != 1
        or not out.is_contiguous()
        or out.numel() != n * k
        or (shard.data_ptr() != out[me * k : (me + 1) * k].data_ptr())
    ):
        req.error = req.error or "the gathered shard must be this rank's block of the flat output"
    on_device = req.on_device
    if req.error is None and (out.device.type == "cpu" or on_device):
        req.out = to_cupy(out) if on_device else to_numpy(out)
        return submit(rt, reqs, lambda _: out)
    return submit(rt, reqs, lambda res: out.copy_(conv(res)[0]))


# -- broadcast -----------------------------------------------------------------------------
def start_broadcast(
    tensor: torch.Tensor, root_rank: Any, name: str | None, process_set: ProcessSet, inplace: bool
) -> int:
    """Submit a broadcast of ``root_rank``'s ``tensor`` (into ``tensor`` when ``inplace``)."""
    rt = state.running()
    sid = registered_id(process_set)
    tensor_list([tensor], "broadcast")
    src, dev = _source(rt, tensor, "broadcast")
    problem = check_tensor(src, "broadcast", MOVABLE) or (inplace_problem(tensor, "broadcast_") if inplace else None)
    members = process_set.ranks
    root = int(root_rank) if isinstance(root_rank, numbers.Integral) and not isinstance(root_rank, bool) else None
    if problem is None and root not in members:
        shown = root if root is not None else repr(root_rank)
        problem = f"root_rank={shown} is not a rank of the process set (ranks {members})"
    private = is_private(src, tensor)
    out = src if inplace or private else torch.empty_like(src)
    fix = (lambda: tensor.copy_(out)) if inplace and private else None
    req = Submission(
        request_name(rt, "broadcast", sid, name),
        "broadcast",
        sid,
        BroadcastSig(dtype_name(src), tuple(src.shape), -1 if root is None else root, memory(dev)),
        error=problem,
        **_buffers(dev, problem, src, out),
    )
    return submit(rt, [req], tensor_results([tensor if inplace else out], [fix] if fix else [], True, [tensor.device]))


# -- alltoall ------------------------------------------------------------------------------
def start_alltoall(tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> int:
    """Submit an alltoall of ``tensor``'s rows; the handle gives ``(rows, received splits)``."""
    rt = state.running()
    sid = registered_id(process_set)
    tensor_list([tensor], "alltoall")
    src, dev = _source(rt, tensor, "alltoall")
    problem = check_tensor(src, "alltoall", MOVABLE)
    if problem is None and src.dim() == 0:
        problem = "alltoall needs a tensor with at least one dimension"
    sp, n = None, len(process_set.ranks)
    rows = src.shape[0] if src.dim() else 0
    if splits is not None:
        values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            problem = problem or f"alltoall splits={values!r} must be integers (rows for each rank)"
        else:
            sp = [int(v) for v in values]
            if len(sp) != n or any(v < 0 for v in sp) or sum(sp) != rows:
                problem = problem or (
                    f"alltoall splits={sp} must be {n} non-negative row counts, one per rank of the process set, "
                    f"adding up to the tensor's {rows} rows"
                )
    elif problem is None and rows % n:
        problem = f"alltoall of {rows} rows without splits: they do not divide evenly over {n} ranks; pass splits"
    req = Submission(
        request_name(rt, "alltoall", sid, name),
        "alltoall",
        sid,
        GatherSig(dtype_name(src), tuple(src.shape[1:]), memory(dev)),
        error=problem,
        splits=sp,
        **_buffers(dev, problem, src),
    )
    dtype, device = src.dtype, tensor.device
    return submit(
        rt,
        [req],
        lambda res: (result_tensor(res[0][0], dtype, device), torch.from_numpy(res[0][1]).to(torch.int32)),
    )


# -- reducescatter -------------------------------------------------------------------------
def start_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None,
    op: Any,
    pre: float,
    post: float,
    process_set: ProcessSet,
    single: bool,
    given: torch.Tensor | None = None,
) -> int:
    """Submit a reducescatter of every tensor of ``tensors`` (into ``given``, a buffer of
    this rank's block, for a single tensor that fits it); a tensor results when
    ``single``, else a list."""
    rt = state.running()
    op = resolve_op(op, None)
    sid = registered_id(process_set)
    n, me = len(process_set.ranks), process_set.rank()
    what = "reducescatter"
    tensors = tensor_list(list(tensors), what)
    reqs, outs = [], []
    base = request_name(rt, "reducescatter", sid, name)
    bad_op = op if isinstance(op, str) else None
    for i, t in enumerate(tensors):
        src, dev = _source(rt, t, what)
        problem = bad_op or check_tensor(src, "reducescatter", REDUCIBLE)
        if problem is None and src.dim() == 0:
            problem = "reducescatter needs a tensor with at least one dimension"
        rows = block_counts(src.shape[0], n)[me] if src.dim() else 0
        # the given buffer where the engine writes in its memory (a staged CUDA tensor's is on the host)
        fits = given is not None and given.device == src.device
        out = given if fits else torch.empty((rows, *src.shape[1:]), dtype=src.dtype, device=src.device)
        reqs.append(
            Submission(
                _group_name(base, i, len(tensors)),
                "reducescatter",
                sid,
                _reduce_sig(src, op, pre, post, dev),
                error=problem,
                **_buffers(dev, problem, src, out),
            )
        )
        outs.append(out)
    return submit(rt, reqs, tensor_results(outs, [], single, [t.device for t in tensors]))


def reducescatter_into_async(
    tensor: torch.Tensor,
    out: torch.Tensor,
    name: str,
    op: ReduceOp,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
) -> int:
    """Reducescatter a 1-D ``tensor`` into ``out`` (the caller's persistent buffer for
    this rank's block) where the engine can write the result there: a contiguous ``out``
    of ``tensor``'s dtype, device and this rank's block size, in the memory the engine
    works in (host memory, or the GPU on the device path). Otherwise (a staged CUDA or a
    compressed ``tensor``) into a new tensor, as ``reducescatter_async``."""
    n, me = len(process_set.ranks), process_set.rank()
    fits = (
        tensor.dim() == 1
        and tensor.device == out.device
        and out.dtype == tensor.dtype
        and out.is_contiguous()
        and out.shape == (block_counts(tensor.shape[0], n)[me],)
    )
    given = out if fits else None
    return start_reducescatter([tensor], name, op, prescale_factor, postscale_factor, process_set, True, given)
