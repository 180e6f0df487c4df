"""Tensor staging: torch tensors as numpy views for the engine, and results back as tensors.

CPU tensors reach the array layer without a copy when contiguous (bfloat16 and bool
through a view of the same memory). CUDA tensors stay on their GPU where CuPy is
installed and the device path is on (:func:`device_source`): the request carries a CuPy
view of the tensor (:func:`to_cupy`), and results the engine allocates come back as CUDA
tensors over the same memory (:func:`from_cupy`). Otherwise CUDA tensors are staged
through pinned host memory, as Horovod does over an MPI that is not CUDA-aware: the
request carries a host copy, and the result is copied back to the tensor's device when
the handle is synchronized.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

from collectives.device.arrays import as_cupy, bfloat16_ok, cupy_module
from collectives.errors import DeviceUnavailableError

__all__ = [
    "REDUCIBLE",
    "MOVABLE",
    "to_numpy",
    "to_torch",
    "dtype_name",
    "host_source",
    "is_private",
    "home",
    "check_tensor",
    "inplace_problem",
    "tensor_list",
    "device_source",
    "ready_event",
    "to_cupy",
    "from_cupy",
    "result_tensor",
    "memory",
]

REDUCIBLE = (
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
"""Dtypes the reductions take."""

MOVABLE = (*REDUCIBLE, torch.bool)
"""Dtypes the collectives that only move data take."""


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of the contiguous CPU tensor ``t`` (no copy)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over the numpy array ``a`` (no copy)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if dtype == torch.bool:
        return torch.from_numpy(a).view(torch.bool)
    return torch.from_numpy(a)


def dtype_name(t: torch.Tensor) -> str:
    """The torch dtype's name without ``torch.`` (what signatures carry)."""
    return str(t.dtype).removeprefix("torch.")


def host_source(t: Any, what: str) -> torch.Tensor:
    """``t`` detached and contiguous in host memory: ``t`` itself when it is a contiguous
    CPU tensor, else a private copy. A CUDA tensor's copy goes to pinned memory (torch's
    caching host allocator reuses freed blocks, so a training loop's staging buffers are
    not faulted in afresh each step); it waits for the kernels that write ``t``. A tensor
    on another device comes back as it is, for :func:`check_tensor` to refuse."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, not {type(t).__name__}")
    t = t.detach()
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t)
    return t.contiguous()


def device_source(t: torch.Tensor, enabled: bool) -> torch.Tensor | None:
    """``t`` detached and contiguous on its GPU (``t`` itself when it already is, else a
    private copy), for a collective that keeps it on the device: where ``enabled``, ``t`` is
    a CUDA tensor of a dtype hpcdl moves, and CuPy can be imported and holds that dtype
    (bfloat16 needs CuPy 14). None otherwise: the caller stages ``t`` through host memory."""
    if not enabled or not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.dtype not in MOVABLE:
        return None
    try:
        cp = cupy_module()
    except DeviceUnavailableError:
        return None
    if t.dtype == torch.bfloat16 and not bfloat16_ok(cp):
        return None
    return t.detach().contiguous()


def to_cupy(t: torch.Tensor) -> Any:
    """A CuPy view of the contiguous CUDA tensor ``t`` (no copy): bfloat16 as ml_dtypes'
    bfloat16, bool as uint8, as :func:`to_numpy` views CPU tensors."""
    if t.dtype == torch.bfloat16:
        return as_cupy(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    if t.dtype == torch.bool:
        return as_cupy(t.view(torch.uint8))
    return as_cupy(t)


def from_cupy(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """A CUDA tensor of ``dtype`` over the CuPy array ``a`` (no copy)."""
    if dtype == torch.bfloat16:
        return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    if dtype == torch.bool:
        return torch.from_dlpack(a).view(torch.bool)
    return torch.from_dlpack(a)


def result_tensor(a: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The engine's result ``a`` as a tensor of ``dtype`` on ``device``, the device of the
    tensor it answers: a host array is wrapped (and copied to a CUDA ``device``), a device
    array wrapped where it lies."""
    if isinstance(a, np.ndarray):
        return home(to_torch(a, dtype), device)
    return from_cupy(a, dtype)


def memory(on_device: bool) -> str:
    """The memory a request's buffers are in, as its signature says: every rank's must agree."""
    return "device" if on_device else "host"


def ready_event(t: torch.Tensor) -> Any:
    """An event recorded on ``t``'s device's current stream: the engine waits for it before
    reading ``t``, so a tensor written on any stream is read after it is written."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def is_private(src: torch.Tensor, t: torch.Tensor) -> bool:
    """True when :func:`host_source` copied ``t`` (so the engine may write into ``src``)."""
    return src.device != t.device or src.data_ptr() != t.data_ptr()


def home(out: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``out`` on ``device`` (the device of the tensor it answers)."""
    return out if out.device == device else out.to(device)


def check_tensor(t: torch.Tensor, kind: str, allowed: tuple[torch.dtype, ...]) -> str | None:
    """The problem with ``t`` for ``kind`` (it travels to every rank), or None."""
    if t.device.type not in ("cpu", "cuda"):  # a CUDA tensor here stays on the device
        return f"tensor on {t.device}: hpcdl moves CPU and CUDA tensors only"
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        return f"{kind} does not support dtype {dtype_name(t)}; use one of: {names}"
    return None


def tensor_list(tensors: Any, what: str) -> list[torch.Tensor]:
    """Check (before any name is taken) that ``tensors`` is a non-empty list of tensors."""
    ts = list(tensors)
    if not ts:
        raise ValueError(f"{what} needs at least one tensor")
    for t in ts:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} takes torch.Tensor arguments, not {type(t).__name__}")
    return ts


def inplace_problem(t: torch.Tensor, what: str) -> str | None:
    """The problem with writing ``t`` in place, as torch sees it: a leaf that requires grad,
    while grad mode is on (torch refuses in-place ops on such leaves), or None."""
    if torch.is_grad_enabled() and t.requires_grad and t.is_leaf:
        return (
            f"{what} would write in place into a leaf tensor that requires grad, which torch refuses; "
            "call it under torch.no_grad() or pass tensor.detach()"
        )
    return None
