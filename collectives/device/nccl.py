"""Collectives on device arrays through NCCL (algorithm ``nccl``), via CuPy's bindings.

One NCCL communicator per hpcdl communicator, created on its first ``nccl`` call: rank 0's
unique id travels over MPI. Whether NCCL can run is decided collectively, so that every
rank raises the same :class:`~collectives.errors.DeviceUnavailableError` when it cannot:
NCCL missing on some rank, or two ranks on one GPU (NCCL refuses a communicator with a
device twice). Calls are queued on the current CuPy stream.

``avg`` is reduced as ``sum`` and divided afterwards (as the host path does); blocks of
unequal size (reduce-scatter and allgather of counts that differ) go as grouped reduces
and broadcasts, since NCCL's own calls need equal blocks.
"""

from __future__ import annotations

import socket
from typing import Any, NamedTuple

import numpy as np

from ..errors import DeviceUnavailableError, UnsupportedDtypeError
from ..ops import finalize
from .arrays import cupy_module, mps_client

__all__ = ["Nccl", "plan", "survey", "Survey", "dtype_code", "available"]

_DTYPES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "int64": "NCCL_INT64",
    "float16": "NCCL_FLOAT16",
    "bfloat16": "NCCL_BFLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}
_OPS = {"sum": "NCCL_SUM", "avg": "NCCL_SUM", "prod": "NCCL_PROD", "min": "NCCL_MIN", "max": "NCCL_MAX"}


def _module() -> Any:
    cupy_module()
    from cupy.cuda import nccl  # noqa: PLC0415 - optional

    return nccl


def available() -> bool:
    """True when CuPy is installed and can load NCCL (no GPU is needed to ask)."""
    try:
        return bool(getattr(_module(), "available", False))
    except Exception:  # noqa: BLE001 - no CuPy, or a CuPy that cannot load
        return False


def dtype_code(dtype: np.dtype) -> int:
    """NCCL's code for ``dtype``.

    Raises:
        UnsupportedDtypeError: NCCL has no such type (int16).
    """
    name = _DTYPES.get(np.dtype(dtype).name)
    if name is None:
        raise UnsupportedDtypeError(
            f"nccl: NCCL has no {np.dtype(dtype)} type; use algorithm 'ipc' or 'staged', or another dtype"
        )
    return getattr(_module(), name)


def _local() -> tuple[str | None, str, str]:
    """(why NCCL cannot run on this rank, or None; host name; GPU's PCI bus id, or "" where
    CuPy cannot say)."""
    host = socket.gethostname()
    try:
        bus = cupy_module().cuda.Device().pci_bus_id
    except Exception as exc:  # noqa: BLE001 - reported collectively
        return f"{type(exc).__name__}: {exc}", host, ""
    try:
        if not getattr(_module(), "available", False):
            return "NCCL cannot be loaded (install the nvidia-nccl-cu* wheel matching CuPy's CUDA)", host, bus
    except Exception as exc:  # noqa: BLE001 - reported collectively
        return f"{type(exc).__name__}: {exc}", host, bus
    return None, host, bus


class Survey(NamedTuple):
    """Where the ranks' GPUs are, as every rank sees it (:func:`survey`)."""

    nccl: str | None
    """Why NCCL cannot run on these ranks (the same text on every rank), or None."""
    shared: bool
    """Some ranks use one GPU (the same PCI bus id on one host)."""
    mps: bool
    """Every rank's work goes through an MPS daemon (:func:`.arrays.mps_client`)."""


def survey(transport: Any) -> Survey:
    """Whether NCCL can run on ``transport``'s ranks, whether some of them share a GPU, and
    whether they run under MPS (collective: one exchange of each rank's host, GPU and MPS)."""
    everyone = transport.allgather_obj((*_local(), mps_client()))
    seen: dict[tuple[str, str], list[int]] = {}
    for q, (_, host, bus, _) in enumerate(everyone):
        if bus:
            seen.setdefault((host, bus), []).append(q)
    shared = [(key, qs) for key, qs in seen.items() if len(qs) > 1]
    missing = [(q, why) for q, (why, _, _, _) in enumerate(everyone) if why is not None]
    if missing:
        why = "; ".join(f"rank {q}: {why}" for q, why in missing)
    elif shared:
        (host, bus), qs = shared[0]
        why = (
            f"ranks {qs} share the GPU at {bus} on {host}, and NCCL refuses a communicator with a device "
            "twice; give each rank its own GPU, or use algorithm 'ipc' (ranks of one node) or 'staged'"
        )
    else:
        why = None
    return Survey(why, bool(shared), all(m for *_, m in everyone))


def plan(transport: Any) -> str | None:
    """Why NCCL cannot run on ``transport``'s ranks, the same text on every rank, or None
    (collective)."""
    return survey(transport).nccl


class Nccl:
    """An NCCL communicator over ``transport``'s ranks (collective to create).

    Raises:
        DeviceUnavailableError: on every rank, when NCCL cannot run (the reason from :func:`plan`).
    """

    def __init__(self, transport: Any) -> None:
        why = plan(transport)
        if why is not None:
            raise DeviceUnavailableError(f"nccl: {why}")
        nccl = _module()
        uid = nccl.get_unique_id() if transport.rank == 0 else None
        uid = transport.allgather_obj(uid)[0]
        self.nccl = nccl
        self.size, self.rank = transport.size, transport.rank
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)

    def free(self) -> None:
        self.comm.destroy()

    @staticmethod
    def _stream() -> int:
        return cupy_module().cuda.get_current_stream().ptr

    def allreduce(self, src: Any, out: Any, op: str) -> None:
        """``out`` = the reduction of every rank's ``src`` (flat device arrays)."""
        nc = self.nccl
        self.comm.allReduce(
            src.data.ptr, out.data.ptr, src.size, dtype_code(src.dtype), getattr(nc, _OPS[op]), self._stream()
        )
        finalize(out, op, self.size)

    def reduce(self, src: Any, out: Any | None, root: int, op: str) -> None:
        """The reduction of every rank's ``src`` into ``out`` on ``root`` (None elsewhere)."""
        nc = self.nccl
        dst = out.data.ptr if out is not None else src.data.ptr  # ignored off the root
        self.comm.reduce(
            src.data.ptr, dst, src.size, dtype_code(src.dtype), getattr(nc, _OPS[op]), root, self._stream()
        )
        if out is not None:
            finalize(out, op, self.size)

    def reduce_scatter(self, src: Any, counts: tuple[int, ...], out: Any, op: str) -> None:
        """Block ``rank`` (``counts``-sized blocks) of every rank's reduced ``src`` into ``out``."""
        nc, code, nop, stream = self.nccl, dtype_code(src.dtype), getattr(self.nccl, _OPS[op]), self._stream()
        if len(set(counts)) == 1:
            self.comm.reduceScatter(src.data.ptr, out.data.ptr, counts[0], code, nop, stream)
        else:
            nc.groupStart()
            start = 0
            for q, c in enumerate(counts):
                if c:
                    piece = src[start : start + c]
                    dst = out.data.ptr if q == self.rank else piece.data.ptr
                    self.comm.reduce(piece.data.ptr, dst, c, code, nop, q, stream)
                start += c
            nc.groupEnd()
        finalize(out, op, self.size)

    def allgather(self, src: Any, counts: tuple[int, ...], out: Any) -> None:
        """Every rank's ``src`` (``counts`` elements each) into ``out``, in rank order."""
        nc, code, stream = self.nccl, dtype_code(out.dtype), self._stream()
        if len(set(counts)) == 1:
            self.comm.allGather(src.data.ptr, out.data.ptr, counts[0], code, stream)
            return
        nc.groupStart()
        start = 0
        for q, c in enumerate(counts):
            if c:
                block = out[start : start + c]
                send = src.data.ptr if q == self.rank else block.data.ptr
                self.comm.broadcast(send, block.data.ptr, c, code, q, stream)
            start += c
        nc.groupEnd()

    def broadcast(self, buf: Any, root: int) -> None:
        """``root``'s ``buf`` into every rank's."""
        self.comm.bcast(buf.data.ptr, buf.size, dtype_code(buf.dtype), root, self._stream())
