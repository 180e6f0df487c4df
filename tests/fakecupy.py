"""A stand-in for the part of CuPy the device collectives use, over host memory.

Its arrays are numpy arrays that say they are CUDA memory (``__cuda_array_interface__``),
with CuPy's ``data.ptr``, ``device.id``, ``set`` and ``get``; its streams finish work as
it is queued; NCCL is absent. Installed in ``sys.modules`` as ``cupy`` for a test, it
lets :mod:`collectives.gpu`'s logic (agreement, output checks, algorithm choice, the
staged and MPI paths, the ``ipc`` schedules on :class:`collectives.ipc.HostPeers`) run
on a machine without a GPU. It proves nothing about CUDA itself: ``test_gpu.py`` does.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

__version__ = "14.2.0"  # the CuPy whose API this stands in for (bfloat16 included)


class _Ptr:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Device:
    def __init__(self, i: int = 0) -> None:
        self.id = i
        self.pci_bus_id = "0000:00:00.0"

    def use(self) -> None:
        pass

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class ndarray(np.ndarray):  # noqa: N801 - CuPy's name
    """A host array posing as device memory."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.__array_interface__["data"][0], False),
            "strides": None if self.flags.c_contiguous else self.strides,
            "version": 3,
        }

    @property
    def data(self) -> _Ptr:  # type: ignore[override]
        return _Ptr(self.__array_interface__["data"][0])

    @property
    def device(self) -> _Device:  # type: ignore[override]
        return _Device(0)

    def set(self, a: np.ndarray) -> None:
        np.copyto(np.asarray(self), np.asarray(a).reshape(self.shape))

    def get(self) -> np.ndarray:
        return np.array(np.asarray(self))


def asarray(a: Any, dtype: Any = None) -> ndarray:
    """Like CuPy's: a host array is copied (to the "device"), a device array kept."""
    if isinstance(a, ndarray) and (dtype is None or a.dtype == dtype):
        return a
    return np.array(a, dtype).view(ndarray)


def array(a: Any, dtype: Any = None) -> ndarray:
    return np.array(a, dtype).view(ndarray)


def empty(shape: Any, dtype: Any = np.float32) -> ndarray:
    return np.empty(shape, dtype).view(ndarray)


def zeros(shape: Any, dtype: Any = np.float32) -> ndarray:
    return np.zeros(shape, dtype).view(ndarray)


def ones(shape: Any, dtype: Any = np.float32) -> ndarray:
    return np.ones(shape, dtype).view(ndarray)


def full(shape: Any, value: Any, dtype: Any = None) -> ndarray:
    return np.full(shape, value, dtype).view(ndarray)


def empty_like(a: Any) -> ndarray:
    return np.empty_like(np.asarray(a)).view(ndarray)


def ascontiguousarray(a: Any) -> ndarray:
    return np.ascontiguousarray(a).view(ndarray)


def asnumpy(a: Any, out: np.ndarray | None = None) -> np.ndarray:
    if out is None:
        return np.array(np.asarray(a))
    np.copyto(out, np.asarray(a))
    return out


def from_dlpack(a: Any) -> ndarray:
    return np.from_dlpack(a).view(ndarray)


uint8, int16, int32, int64, float16, float32, float64 = (
    np.uint8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
)

add, multiply, minimum, maximum, divide, floor_divide = (
    np.add,
    np.multiply,
    np.minimum,
    np.maximum,
    np.divide,
    np.floor_divide,
)


class _Stream:
    ptr = 0

    def synchronize(self) -> None:
        pass


def _current_stream() -> _Stream:
    return _Stream()


def _alloc_pinned_memory(nbytes: int) -> bytearray:
    """Host memory standing in for a pinned block (anything with the buffer protocol)."""
    return bytearray(nbytes)


cuda = types.ModuleType("cupy.cuda")
cuda.alloc_pinned_memory = _alloc_pinned_memory
cuda.get_current_stream = _current_stream
cuda.Device = _Device
cuda.nccl = types.SimpleNamespace(available=False)


def install(monkeypatch: Any) -> types.ModuleType:
    """Make ``import cupy`` give this module for the test (undone after it)."""
    import sys

    mod = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    return mod
