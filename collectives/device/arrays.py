"""Device arrays: what counts as one, CuPy (imported only when a device array arrives), and
whether the MPI library takes device pointers.

A device array is anything with ``__cuda_array_interface__`` (CuPy arrays, CUDA torch
tensors, Numba arrays) or whose ``__dlpack_device__`` names a CUDA device. The collectives
work on it through a CuPy view of the same memory (no copy), so CuPy is needed only where
device arrays are used: ``pip install hpcdl[gpu]`` (or the ``cupy-cuda*`` wheel that
matches the CUDA runtime). Numpy-only installs never import it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, for dtypes read by name
import numpy as np

from ..errors import DeviceUnavailableError

__all__ = [
    "is_device",
    "describe",
    "cupy_module",
    "as_cupy",
    "stand_in",
    "cuda_aware_mpi",
    "mps_client",
    "bfloat16_ok",
    "CUDA_DLPACK_DEVICES",
    "BFLOAT16_CUPY",
]

CUDA_DLPACK_DEVICES = (2, 13)
"""DLPack device types of CUDA memory (kDLCUDA, kDLCUDAManaged); kDLCUDAHost (3) is
pinned host memory and is not a device array."""


def is_device(x: Any) -> bool:
    """True when ``x`` lives in CUDA device memory (see the module docstring)."""
    if type(x) is np.ndarray:
        return False
    try:
        if getattr(x, "__cuda_array_interface__", None) is not None:
            return True
    except (AttributeError, RuntimeError, TypeError):
        pass  # a CPU torch tensor's property raises, and so does a CUDA one's that requires grad
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return int(dev()[0]) in CUDA_DLPACK_DEVICES
    except (TypeError, ValueError, IndexError, RuntimeError):
        return False


def describe(x: Any) -> tuple[tuple[int, ...], np.dtype, bool]:
    """``x``'s shape, dtype and whether it is C-contiguous, read without CuPy.

    Raises:
        TypeError: the array's element type has no numpy equivalent.
    """
    cai = _interface(x)
    if cai is not None:
        shape = tuple(int(d) for d in cai["shape"])
        dtype = np.dtype(cai["typestr"])
        if dtype.kind == "V":  # a type the interface cannot spell (CuPy's bfloat16): the array says
            dtype = _own_dtype(x)
        strides = cai.get("strides")
        contiguous = strides is None or tuple(strides) == _c_strides(shape, dtype.itemsize)
        return shape, dtype, contiguous
    # DLPack only: the object is array-like enough to say its shape and dtype itself
    return tuple(int(d) for d in x.shape), _own_dtype(x), True


def _own_dtype(x: Any) -> np.dtype:
    """The numpy dtype named by ``x.dtype`` (a torch dtype without its prefix; bfloat16 is
    ml_dtypes')."""
    return np.dtype(str(x.dtype).removeprefix("torch."))


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def cupy_module() -> Any:
    """The ``cupy`` module, imported on first use (later calls find it in ``sys.modules``).

    Raises:
        DeviceUnavailableError: CuPy is not installed (the message says how to install it).
    """
    try:
        import cupy  # noqa: PLC0415 - optional, imported where a device array first arrives
    except ImportError as exc:
        raise DeviceUnavailableError(
            f"device arrays need CuPy, which cannot be imported here ({exc}); "
            "install it with `pip install hpcdl[gpu]` or the cupy-cuda* wheel matching your CUDA runtime"
        ) from exc
    return cupy


BFLOAT16_CUPY = 14
"""The first CuPy major version with a bfloat16 dtype (ml_dtypes') and its arithmetic."""


def bfloat16_ok(cp: Any) -> bool:
    """True when the CuPy module ``cp`` holds and reduces bfloat16 arrays."""
    try:
        return int(str(cp.__version__).split(".")[0]) >= BFLOAT16_CUPY
    except ValueError:
        return False


def as_cupy(x: Any) -> Any:
    """A CuPy array viewing ``x``'s memory (``x`` itself when it is one), of the dtype
    :func:`describe` reads: CuPy types a view by the interface's typestr, which spells
    bfloat16 (a CUDA torch tensor's, say) as the untyped ``<V2`` that no kernel takes."""
    cp = cupy_module()
    if isinstance(x, cp.ndarray):
        return x
    if getattr(x, "requires_grad", False):  # a tensor in autograd exports no interface: its data does
        x = x.detach()
    if _interface(x) is None:
        return cp.from_dlpack(x)
    a = cp.asarray(x)
    if a.dtype.kind == "V":
        a = a.view(describe(x)[1])
    return a


def _interface(x: Any) -> dict[str, Any] | None:
    """``x.__cuda_array_interface__``, or None where it has none or cannot give one (a CPU
    torch tensor's property raises, as does a CUDA tensor's of a dtype numpy lacks)."""
    try:
        return getattr(x, "__cuda_array_interface__", None)
    except (AttributeError, RuntimeError, TypeError):
        return None


def stand_in(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A host array of ``shape`` and ``dtype`` that takes no memory (every element is the
    same one), for argument agreement of a device array."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape), writeable=False)


MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"
"""Where NVIDIA's MPS control daemon listens when ``CUDA_MPS_PIPE_DIRECTORY`` is not set."""


def mps_client() -> bool:
    """True when this process's CUDA work goes through an MPS daemon: the daemon's control
    pipe exists where CUDA looks for it (``CUDA_MPS_PIPE_DIRECTORY``, else
    :data:`MPS_DEFAULT_PIPE`). Read without CUDA, from the file system alone."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE
    return os.path.exists(os.path.join(pipe, "control"))


def cuda_aware_mpi(setting: str = "auto") -> bool:
    """True when the MPI library takes CUDA device pointers.

    ``setting`` is the configuration's ``cuda_aware_mpi``: ``"1"`` or ``"0"`` say so outright
    (for an MPI that cannot be asked, such as MVAPICH2-GDR with ``MV2_USE_CUDA=1``); with
    ``"auto"`` the library is asked through ``MPIX_Query_cuda_support`` (Open MPI, MPICH 4),
    and one without it is taken as not CUDA-aware: hpcdl then never hands it a device pointer.
    """
    if setting in ("0", "1"):
        return setting == "1"
    return _asked()


@functools.cache
def _asked() -> bool:
    query = _mpix_query()
    return bool(query()) if query is not None else False


def _mpix_query() -> Any:
    """``MPIX_Query_cuda_support`` from the MPI library mpi4py loaded, or None."""
    from mpi4py import MPI  # noqa: F401, PLC0415 - the library must be loaded to be found

    for path in _loaded_mpi_libraries():
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = []
            return fn
    return None


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the shared libraries mapped into this process that look like an MPI's."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            for line in fh:
                path = line.split()[-1] if line.count("/") else ""
                name = os.path.basename(path)
                if name.startswith("libmpi") and ".so" in name and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths
