"""Collectives on device (GPU) memory, all in one place.

- :mod:`.api`: the entry point: the public collectives take device arrays (CuPy arrays,
  CUDA torch tensors, anything with ``__cuda_array_interface__`` or a CUDA DLPack device)
  and run them by ``ipc``, ``nccl``, a CUDA-aware MPI, or staged through host memory.
- :mod:`.arrays`: what counts as a device array, CuPy (imported only when one arrives), and
  whether the MPI library takes device pointers.
- :mod:`.ipc`: single-node collectives through peers' buffers over CUDA IPC.
- :mod:`.nccl`: collectives through NCCL, via CuPy's bindings.

The torch side (CUDA tensors staged through pinned host memory, streams and events) is
:mod:`hpcdl.staging`. Their tests are ``tests/test_device_*.py``; ``tests/fakecupy.py`` is
the CPU stand-in for CuPy that lets them run without a GPU.
"""
