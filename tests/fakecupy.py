"""A stand-in for the part of CuPy the device collectives use, over host memory.

Its arrays are numpy arrays that say they are CUDA memory (``__cuda_array_interface__``),
with CuPy's ``data.ptr``, ``device.id``, ``set`` and ``get``; its streams finish work as
it is queued, and count each time the host waits for them (:data:`WAITS`); NCCL is absent;
each rank has a GPU of its own unless :data:`GPU_PER_RANK` is False. Where real CuPy differs from numpy in a way that has hidden
bugs, it does as CuPy does: ``asarray`` of another library's device array (a CUDA tensor:
:class:`CudaTensor` here) types the view by the interface's typestr, so bfloat16 arrives as
the untyped ``V2``, and arithmetic refuses such dtypes as CuPy's kernels do. Installed in ``sys.modules`` as ``cupy`` for a test, it
lets :mod:`collectives.device.api`'s logic (agreement, output checks, algorithm choice, the
staged and MPI paths, the ``ipc`` schedules on :class:`collectives.device.ipc.HostPeers`) run
on a machine without a GPU. It proves nothing about CUDA itself: ``test_device_gpu.py`` does.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

__version__ = "14.2.0"  # the CuPy whose API this stands in for (bfloat16 included)


class _Ptr:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


GPU_PER_RANK = True
"""Each rank's stand-in GPU has a PCI bus id of its own (False: every rank of the machine
shares one GPU, as several ranks on one H100 do)."""

WAITS = {"synchronize": 0, "to_host": 0}
"""How often the host has waited for the device: stream synchronizations, and copies to
the host (``asnumpy``, ``get``), which wait for the stream as CuPy's do."""


class _Device:
    def __init__(self, i: int = 0) -> None:
        self.id = i

    @property
    def pci_bus_id(self) -> str:
        from mpi4py import MPI

        return f"0000:{MPI.COMM_WORLD.rank % 256:02x}:00.0" if GPU_PER_RANK else "0000:00:00.0"

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

    def __array_ufunc__(self, uf: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """numpy's ufunc, refusing the dtypes CuPy has no kernel for, with CuPy's message."""
        args = [*inputs, *kwargs.get("out", ())]
        types = tuple(a.dtype for a in args if isinstance(a, np.ndarray))
        if any(t.type is np.void for t in types):  # untyped bytes (ml_dtypes' bfloat16 is typed)
            raise TypeError(f"Wrong type ({types}) of arguments for cupy_{uf.__name__}")
        plain = [np.asarray(a) if isinstance(a, ndarray) else a for a in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, ndarray) else o for o in kwargs["out"])
        res = getattr(uf, method)(*plain, **kwargs)
        if "out" in kwargs and len(kwargs["out"]) == 1:
            return args[-1]
        return res.view(ndarray) if isinstance(res, np.ndarray) else res

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
        WAITS["to_host"] += 1
        return np.array(np.asarray(self))


class _HostView:
    """Another library's device memory seen through numpy: its CUDA interface as numpy's."""

    def __init__(self, cai: dict[str, Any]) -> None:
        self.__array_interface__ = {k: cai.get(k) for k in ("shape", "typestr", "data", "strides")} | {"version": 3}


def _foreign_interface(a: Any) -> dict[str, Any] | None:
    if isinstance(a, np.ndarray):
        return None
    try:
        return getattr(a, "__cuda_array_interface__", None)
    except (AttributeError, RuntimeError, TypeError):  # a CPU torch tensor's property raises
        return None


def asarray(a: Any, dtype: Any = None) -> ndarray:
    """Like CuPy's: a host array is copied (to the "device"), a device array kept, and
    another library's device array viewed with the dtype its interface's typestr spells
    (``V2`` for bfloat16), as CuPy does."""
    if isinstance(a, ndarray) and (dtype is None or a.dtype == dtype):
        return a
    cai = _foreign_interface(a)
    if cai is not None:
        view = np.asarray(_HostView(cai)).view(ndarray)
        return view if dtype is None else view.astype(dtype)
    return np.array(a, dtype).view(ndarray)


TORCH_TYPESTR = {"bfloat16": "<V2", "bool": "|b1"}
"""Typestrs a CUDA torch tensor's interface gives where numpy's name would differ (numpy
has no bfloat16: torch spells it as two untyped bytes)."""


class CudaTensor:
    """A stand-in for a CUDA torch tensor over a CPU tensor's memory, as other libraries see
    one: ``__cuda_array_interface__`` with torch's typestrs (raising, as torch's does, while
    the tensor requires grad), ``__dlpack_device__`` (CUDA, device 0), ``shape``, ``dtype``,
    ``requires_grad`` and ``detach``."""

    def __init__(self, t: Any) -> None:
        self.t = t
        self.shape = tuple(t.shape)
        self.dtype = t.dtype

    @property
    def requires_grad(self) -> bool:
        return bool(self.t.requires_grad)

    def detach(self) -> CudaTensor:
        return CudaTensor(self.t.detach())

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.t.requires_grad:
            raise RuntimeError(
                "Can't get __cuda_array_interface__ on Variable that requires grad. Use var.detach().__cuda_array_interface__ instead."
            )
        name = str(self.t.dtype).removeprefix("torch.")
        isz = self.t.element_size()
        return {
            "shape": self.shape,
            "typestr": TORCH_TYPESTR.get(name) or np.dtype(name).str,
            "data": (self.t.data_ptr(), False),
            "strides": None if self.t.is_contiguous() else tuple(s * isz for s in self.t.stride()),
            "version": 2,
        }


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
    WAITS["to_host"] += 1
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
        WAITS["synchronize"] += 1


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
