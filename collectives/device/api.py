"""The public collectives on device arrays (CuPy arrays, CUDA torch tensors, anything with
``__cuda_array_interface__`` or a CUDA DLPack device).

:mod:`.api` sends a device array here. Arguments are agreed as for host arrays, with the
kind of memory in the signature: a rank passing a host array where another passes a
device array is a :class:`~collectives.CollectiveMismatchError` (field ``memory``) on
every rank, and CuPy missing on a rank is an error on every rank.

Algorithms (``algorithms(collective, device=True)``):

- ``ipc``: ranks of one node read each other's device windows (:mod:`.ipc`);
- ``nccl``: NCCL through CuPy (:mod:`.nccl`), where each rank has its own GPU;
- ``native``: the MPI library's own call on the device pointers where it is CUDA-aware
  (:func:`.device.cuda_aware_mpi`), else on host copies: a device pointer is never handed
  to an MPI that is not;
- ``staged``: copied to host memory, reduced by the host algorithms (``auto``), copied back;
- ``auto``: ``nccl`` where it can run (every rank its own GPU) and has the dtype; else on
  one node ``ipc``, or ``staged`` for calls up to ``device_staged_bytes`` where ranks share
  a GPU (:data:`STAGED_BYTES` by default, with or without MPS); else ``native`` over a
  CUDA-aware MPI, else ``staged``.

Streams: as NCCL's, a call is ordered on the current CuPy stream. Its device work runs
after the work queued there before the call, and the host does not wait for it: work
queued on that stream afterwards sees the result, and so does a copy to the host
(``cupy.asnumpy``, a torch tensor's ``.cpu()`` on the same stream), which waits for it.
Only the paths through host memory wait for the stream, before they read the input
(``staged``; ``native``, since MPI does not know streams). ``ipc`` orders the ranks' work
with CUDA IPC events: one call's kernels on the GPU may overlap the next call's host side.
Another library's array (a CUDA torch tensor) is the exception: the call returns once the
stream has finished it, since that library's later work may be queued on streams hpcdl
does not know (the ``hpcdl`` runtime orders its own: one wait per fused group). The
nonblocking forms queue the call before returning their request.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ..agreement import ROWS, Call, check_out_layout
from ..algorithms.native import mpi_op
from ..blocks import block_counts, offsets
from ..context import Context, get_context
from ..errors import CollectiveError, InvalidArgumentError, OutputMismatchError, UnsupportedDtypeError
from ..ops import finalize
from . import ipc
from .arrays import BFLOAT16_CUPY, as_cupy, bfloat16_ok, cuda_aware_mpi, cupy_module, describe, is_device, stand_in
from .nccl import Nccl, survey

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "NCCL_DTYPES", "STAGED_BYTES"]

NCCL_DTYPES = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
"""The dtypes NCCL reduces and moves."""

_MPI_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "float32", "float64")
"""The dtypes handed to a CUDA-aware MPI as they are (float16 goes through host copies)."""

Host = Callable[..., Any]
"""The host collective of the same name (from :mod:`.api`), for ``staged`` and ``native``."""


# -- per-communicator state (freed with the context) ---------------------------------------
def _peers(ctx: Context) -> ipc.CudaPeers:
    st = ctx.device
    if "ipc" not in st:
        st["ipc"] = ipc.CudaPeers(ctx.topology().node, ctx.config.device_window_bytes)
    return st["ipc"]


def _nccl(ctx: Context) -> Nccl:
    st = ctx.device
    if "nccl" not in st:
        st["nccl"] = Nccl(ctx.transport)
    return st["nccl"]


# -- arguments -----------------------------------------------------------------------------
def _call(ctx: Context, collective: str, x: Any, algorithm: str, op: str | None = None, root: Any = None):
    """The checked :class:`.agreement.Call` of a device array and its flat CuPy view (None
    after a local error)."""
    problem = None
    try:
        shape, dtype, _ = describe(x)
    except (AttributeError, TypeError, ValueError) as exc:
        shape, dtype = (0,), np.dtype(np.uint8)
        problem = UnsupportedDtypeError(f"{collective}: the device array's element type is not supported ({exc})")
    call = Call(ctx, collective, stand_in(shape, dtype), algorithm, op, root=root, device=True)
    if problem is not None:
        call.fail(problem)
    lay = ctx.topology()
    if algorithm == "ipc" and lay.nodes > 1:
        call.fail(InvalidArgumentError(f"{collective}: algorithm 'ipc' needs every rank on one node"))
    if algorithm == "nccl" and dtype.name not in NCCL_DTYPES:
        call.fail(UnsupportedDtypeError(f"{collective}: NCCL has no {dtype} type; use algorithm 'ipc' or 'staged'"))
    xa = None
    if call.error is None:
        try:
            if dtype.name == "bfloat16" and not bfloat16_ok(cupy_module()):
                raise UnsupportedDtypeError(
                    f"{collective}: bfloat16 device arrays need CuPy {BFLOAT16_CUPY} or later "
                    f"(this is {cupy_module().__version__})"
                )
            xa = as_cupy(x)
        except Exception as exc:  # noqa: BLE001 - CuPy missing, or an array it cannot view
            call.fail(exc if isinstance(exc, CollectiveError) else InvalidArgumentError(f"{collective}: {exc}"))
    return call, xa


def _check_out(call: Call, out: Any, shape: tuple[int, ...], xa: Any) -> Any:
    """``out`` as a CuPy array, after checking it like the host path does (None: none given,
    or a local error kept in ``call``)."""
    if out is None or call.error is not None:
        return None
    if not is_device(out):  # CuPy would copy a host array to the device, and write there
        call.fail(OutputMismatchError(f"{call.collective}: out must be a device array, like x"))
        return None
    try:
        o = as_cupy(out)
    except Exception:  # noqa: BLE001 - anything that is not a device array
        call.fail(OutputMismatchError(f"{call.collective}: out must be a device array, like x"))
        return None
    if check_out_layout(call, o, shape, xa.dtype) and o.device.id != xa.device.id:
        call.fail(OutputMismatchError(f"{call.collective}: out is on GPU {o.device.id}, x on GPU {xa.device.id}"))
    return o


def _resolve(ctx: Context, call: Call, nbytes: int) -> str:
    """The algorithm a device call of ``nbytes`` per rank (agreed: the same on every rank)
    runs; the first time, collectively, where the ranks' GPUs are."""
    if call.algorithm != "auto":
        return call.algorithm
    st = ctx.device
    if "survey" not in st:
        st["survey"] = survey(ctx.transport)
    where = st["survey"]
    if getattr(ctx.transport, "link", None) is not None and ctx.topology().nodes > 1:
        return "staged"  # across emulated links: NCCL's and MPI's own messages would not pay the link
    if where.nccl is None and call.x.dtype.name in NCCL_DTYPES and call.collective != "alltoall":
        return "nccl"
    if ctx.topology().nodes == 1 and call.collective != "alltoall":
        return "staged" if where.shared and nbytes <= _staged_bytes(ctx.config, where.mps) else "ipc"
    if _mpi_direct(ctx, call.x.dtype):
        return "native"
    return "staged"


STAGED_BYTES = {False: 1 << 20, True: 128 << 10}
"""The staged/ipc crossover of 2 ranks sharing an H100, without MPS and under it (the
default of ``device_staged_bytes``)."""


def _staged_bytes(config: Any, mps: bool) -> int:
    return STAGED_BYTES[mps] if config.device_staged_bytes < 0 else config.device_staged_bytes


def _mpi_direct(ctx: Context, dtype: np.dtype) -> bool:
    """True when ``native`` hands the device pointers to MPI itself."""
    return cuda_aware_mpi(ctx.config.cuda_aware_mpi) and dtype.name in _MPI_DTYPES


def _finish(result: Any, out: Any = None) -> Any:
    """``out`` when the caller gave one (its own object: a CUDA tensor stays a tensor), else
    ``result``. The call's device work stays queued on the current stream: the host does
    not wait for it."""
    return result if out is None else out


def _pinned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An empty host array in page-locked memory from CuPy's pinned pool (which reuses its
    blocks), so that copies between it and the device run at the bus's speed, as the torch
    layer's staging does."""
    count = math.prod(shape)
    mem = cupy_module().cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(mem, dtype, count).reshape(shape)


def _host(a: Any) -> np.ndarray:
    """A copy of the device array ``a`` in pinned host memory (once the stream's work on it is done)."""
    return cupy_module().asnumpy(a, out=_pinned(a.shape, a.dtype))


# -- the collectives -----------------------------------------------------------------------
def _on_its_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn(x, ...)`` with ``x``'s GPU current (any thread may call; CuPy launches on the
    current device). Without CuPy, ``fn`` runs as it is and reports that on every rank.
    Another library's array (a CUDA torch tensor) is returned once the current stream has
    finished the call: hpcdl does not know that library's streams, so its later work could
    not be ordered after the call's."""

    @functools.wraps(fn)
    def run(x: Any, *args: Any) -> Any:
        try:
            cp = cupy_module()
            dev = as_cupy(x).device.id
        except Exception:  # noqa: BLE001 - CuPy missing or x not viewable: fn reports it
            return fn(x, *args)
        with cp.cuda.Device(dev):
            res = fn(x, *args)
            if not isinstance(x, cp.ndarray):
                cp.cuda.get_current_stream().synchronize()
            return res

    return run


@_on_its_device
def allreduce(x: Any, op: str, algorithm: str, out: Any, comm: Any, host: Host) -> Any:
    """:func:`collectives.allreduce` of a device array (the result on its device)."""
    ctx = get_context(comm)
    call, xa = _call(ctx, "allreduce", x, algorithm, op)
    o = _check_out(call, out, call.x.shape, xa)
    call.agree(call.x.size)
    cp = cupy_module()
    if o is None:
        o = cp.empty(xa.shape, xa.dtype)
    src = cp.ascontiguousarray(xa).reshape(-1)
    flat = o.reshape(-1)
    n = ctx.transport.size
    if (n == 1 and algorithm != "nccl") or xa.size == 0:
        if flat.data.ptr != src.data.ptr:
            flat[...] = src
        return _finish(o, out)
    alg = _resolve(ctx, call, xa.nbytes)
    if alg == "ipc":
        if flat.data.ptr != src.data.ptr and _overlaps(flat, src):
            src = src.copy()
        ctx.run(ipc.allreduce(ctx.channel(), _peers(ctx), src, flat, op))
    elif alg == "nccl":
        _nccl(ctx).allreduce(src, flat, op)
    elif alg == "native" and _mpi_direct(ctx, xa.dtype):
        cp.cuda.get_current_stream().synchronize()  # MPI does not know streams
        ctx.transport.comm.Allreduce(src if flat.data.ptr != src.data.ptr else MPI.IN_PLACE, flat, mpi_op(op))
        finalize(flat, op, n)
    else:
        h = _host(src)
        flat.set(host(h, op=op, algorithm="native" if alg == "native" else "auto", out=h, comm=comm))
    return _finish(o, out)


@_on_its_device
def reduce_scatter(x: Any, op: str, algorithm: str, out: Any, comm: Any, host: Host) -> Any:
    """:func:`collectives.reduce_scatter` of a device array."""
    ctx = get_context(comm)
    call, xa = _call(ctx, "reduce_scatter", x, algorithm, op)
    n, r = ctx.transport.size, ctx.transport.rank
    counts = block_counts(call.x.size, n)
    o = _check_out(call, out, (counts[r],), xa)
    call.agree(call.x.size)
    cp = cupy_module()
    if o is None:
        o = cp.empty(counts[r], xa.dtype)
    src = cp.ascontiguousarray(xa).reshape(-1)
    if (n == 1 and algorithm != "nccl") or xa.size == 0:
        o[...] = src[: counts[r]]
        return _finish(o, out)
    alg = _resolve(ctx, call, xa.nbytes)
    if alg == "ipc":
        ctx.run(ipc.reduce_scatter(ctx.channel(), _peers(ctx), src, counts, o, op))
    elif alg == "nccl":
        _nccl(ctx).reduce_scatter(src, counts, o, op)
    elif alg == "native" and _mpi_direct(ctx, xa.dtype):
        cp.cuda.get_current_stream().synchronize()
        ctx.transport.comm.Reduce_scatter(src, o, list(counts), mpi_op(op))
        finalize(o, op, n)
    else:
        res = _pinned(o.shape, o.dtype)
        o.set(host(_host(src), op=op, algorithm="native" if alg == "native" else "auto", out=res, comm=comm))
    return _finish(o, out)


@_on_its_device
def allgather(x: Any, algorithm: str, out: Any, comm: Any, host: Host) -> Any:
    """:func:`collectives.allgather` of a device array (rows may differ between ranks)."""
    ctx = get_context(comm)
    call, xa = _call(ctx, "allgather", x, algorithm)
    shape = call.x.shape
    if call.error is None and len(shape) == 0:
        call.fail(InvalidArgumentError("allgather: x must have at least one dimension to concatenate along"))
    rows = shape[0] if shape else 1
    item = tuple(shape[1:])
    o = None
    out_rows = -1
    if out is not None and call.error is None:
        try:
            out_shape = describe(out)[0]
        except (AttributeError, TypeError, ValueError):
            out_shape = ()
        o = _check_out(call, out, (out_shape[0] if out_shape else -1, *item), xa)
        out_rows = out_shape[0] if call.error is None else -1
    if call.error is None and rows >= ROWS:
        call.fail(InvalidArgumentError(f"allgather: {rows} rows; at most {ROWS - 1}"))
    call.agree((rows % ROWS) + (min(out_rows, ROWS - 2) + 1) * ROWS, item)
    words = call.counts()
    all_rows = [w % ROWS for w in words]
    total = sum(all_rows)
    bad = {q: w // ROWS - 1 for q, w in enumerate(words) if w >= ROWS and w // ROWS - 1 != total}
    if bad:
        raise OutputMismatchError(
            f"allgather: out must have {total} rows (the sum over ranks); "
            + "; ".join(f"rank {q} passed {v}" for q, v in bad.items())
        )
    cp = cupy_module()
    if o is None:
        o = cp.empty((total, *item), xa.dtype)
    per_row = math.prod(item)
    counts = tuple(rw * per_row for rw in all_rows)
    src = cp.ascontiguousarray(xa).reshape(-1)
    flat = o.reshape(-1)
    n = ctx.transport.size
    if (n == 1 and algorithm != "nccl") or flat.size == 0:
        flat[...] = src
        return _finish(o, out)
    alg = _resolve(ctx, call, flat.nbytes // n)
    if _overlaps(flat, src):  # x inside out (ZeroOptimizer's shard): no algorithm reads and writes one buffer
        src = src.copy()
    if alg == "ipc":
        ctx.run(ipc.allgather(ctx.channel(), _peers(ctx), src, counts, flat))
    elif alg == "nccl":
        _nccl(ctx).allgather(src, counts, flat)
    elif alg == "native" and _mpi_direct(ctx, xa.dtype):
        cp.cuda.get_current_stream().synchronize()
        ctx.transport.comm.Allgatherv(src, [flat, (list(counts), list(offsets(counts)[:-1]))])
    else:
        res = _pinned(o.shape, o.dtype)
        how = "native" if alg == "native" else "auto"
        o.set(host(_host(src).reshape(xa.shape), algorithm=how, out=res, comm=comm))
    return _finish(o, out)


@_on_its_device
def broadcast(x: Any, root: int, algorithm: str, out: Any, comm: Any, host: Host) -> Any:
    """:func:`collectives.broadcast` of a device array."""
    ctx = get_context(comm)
    call, xa = _call(ctx, "broadcast", x, algorithm, root=root)
    o = _check_out(call, out, call.x.shape, xa)
    call.agree(call.x.size)
    cp = cupy_module()
    is_root = ctx.transport.rank == root
    if o is None:
        o = cp.empty(xa.shape, xa.dtype)
    flat = o.reshape(-1)
    if is_root and flat.data.ptr != xa.data.ptr:
        flat[...] = cp.ascontiguousarray(xa).reshape(-1)
    if (ctx.transport.size == 1 and algorithm != "nccl") or xa.size == 0:
        return _finish(o, out)
    alg = _resolve(ctx, call, xa.nbytes)
    if alg == "ipc":
        ctx.run(ipc.broadcast(ctx.channel(), _peers(ctx), flat, root))
    elif alg == "nccl":
        _nccl(ctx).broadcast(flat, root)
    elif alg == "native" and _mpi_direct(ctx, xa.dtype):
        cp.cuda.get_current_stream().synchronize()
        ctx.transport.comm.Bcast(flat, root)
    else:
        h = _host(flat)
        res = host(h, root, algorithm="native" if alg == "native" else "auto", out=h, comm=comm)
        if not is_root:
            flat.set(res)
    return _finish(o, out)


@_on_its_device
def reduce(x: Any, root: int, op: str, algorithm: str, comm: Any, host: Host) -> Any:
    """:func:`collectives.reduce` of a device array: the result on ``root``, None elsewhere."""
    ctx = get_context(comm)
    call, xa = _call(ctx, "reduce", x, algorithm, op, root=root)
    call.agree(call.x.size)
    cp = cupy_module()
    t = ctx.transport
    is_root = t.rank == root
    o = cp.empty(xa.shape, xa.dtype) if is_root else None
    src = cp.ascontiguousarray(xa).reshape(-1)
    flat = o.reshape(-1) if is_root else None
    if (t.size == 1 and algorithm != "nccl") or xa.size == 0:
        if is_root:
            flat[...] = src
        return _finish(o)
    alg = _resolve(ctx, call, xa.nbytes)
    if alg == "ipc":
        ctx.run(ipc.reduce(ctx.channel(), _peers(ctx), src, flat, root, op))
    elif alg == "nccl":
        _nccl(ctx).reduce(src, flat, root, op)
    elif alg == "native" and _mpi_direct(ctx, xa.dtype):
        cp.cuda.get_current_stream().synchronize()
        t.comm.Reduce(src, flat, mpi_op(op), root)
        if is_root:
            finalize(flat, op, t.size)
    else:
        res = host(_host(src), root, op=op, algorithm="native" if alg == "native" else "auto", comm=comm)
        if is_root:
            flat.set(res.reshape(-1))
    return _finish(o)


@_on_its_device
def alltoall(x: Any, splits: Any, algorithm: str, comm: Any, host: Host) -> Any:
    """:func:`collectives.alltoall` of a device array, through host copies."""
    ctx = get_context(comm)
    call, xa = _call(ctx, "alltoall", x, algorithm)
    shape = call.x.shape
    call.agree(shape[0] if shape else 0, tuple(shape[1:]))
    cp = cupy_module()
    res = host(_host(xa), splits, algorithm="auto", comm=comm)
    return _finish(cp.asarray(res))


# -- helpers -------------------------------------------------------------------------------
def _overlaps(a: Any, b: Any) -> bool:
    lo_a, lo_b = a.data.ptr, b.data.ptr
    return lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes
