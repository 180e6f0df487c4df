"""The collectives on device arrays, under mpiexec -n 1..4 ranks sharing the GPUs there are
(local rank % GPUs); skipped where CuPy or a GPU is missing.

Every collective × dtype × algorithm on CuPy arrays against a host reference: the
reductions of ``ipc`` bitwise equal to rank-order numpy, those of ``staged`` bitwise equal
to the host collective it goes through (whose algorithm, a tree say, may sum in another
order from 3 ranks), those of ``nccl``, ``native`` and ``auto`` within tolerance (integers,
min and max exactly), and all bitwise equal across ranks;
CUDA torch tensors taken as they are; a host array on one rank and a device array on
another an error on every rank; a result never read before the kernels that produce it
(a long kernel queued before the call); IPC windows released when the communicator is
freed (no growth over 1,000 create/free cycles); NCCL at one rank, and its refusal of two
ranks on one GPU.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from reference import OPS, check_close, digest, make_input, rank_order

import collectives as C
from collectives.blocks import block_counts, offsets
from collectives.config import Config
from collectives.context import get_context
from collectives.device.api import NCCL_DTYPES
from collectives.device.arrays import bfloat16_ok
from collectives.device.nccl import plan as nccl_plan
from collectives.errors import CollectiveMismatchError, DeviceUnavailableError, UnsupportedDtypeError

WORLD = MPI.COMM_WORLD
N, ME = WORLD.size, WORLD.rank


def _gpus() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return 0


GPUS = _gpus()
pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(GPUS == 0, reason="no CuPy or no CUDA device here"),
]

if GPUS:
    import cupy as cp

    cp.cuda.Device(ME % GPUS).use()

BF16 = [ml_dtypes.bfloat16] if GPUS and bfloat16_ok(cp) else []  # CuPy 14 holds bfloat16
DTYPES = [np.float16, *BF16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]
COUNTS = [1, 3, 1001, 300_000]


def everyone(count, dtype, op, seed):
    return [make_input(r, count, dtype, op, seed) for r in range(N)]


def same_everywhere(a):
    ds = WORLD.allgather(digest(a))
    assert len(set(ds)) == 1, f"results differ between ranks: {ds}"


def algorithms(dtype=None):
    """The device algorithms that run here (``nccl`` where NCCL can, and has ``dtype``)."""
    algs = ["ipc", "staged", "native", "auto"]
    if nccl_plan(get_context().transport) is None and (dtype is None or np.dtype(dtype).name in NCCL_DTYPES):
        algs.append("nccl")
    return algs


@pytest.fixture(scope="module")
def comm():
    c = WORLD.Dup()
    get_context(c, config=Config(device_window_bytes=1 << 20))  # large calls take several chunks
    yield c
    c.Free()


def _check(got, want, op, dtype, alg, what, host):
    """``want``: the rank-order reduction; ``host``: the host collective's result on the same
    inputs, which ``staged`` must give bit for bit."""
    if alg == "staged":
        assert got.tobytes() == host.tobytes(), what
    elif alg == "ipc" or np.dtype(dtype).kind in "iu" or op in ("min", "max"):
        assert got.tobytes() == want.tobytes(), what
    else:
        check_close(got, want, op, N, what)  # NCCL, MPI and the host's trees sum in their own order


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("count", COUNTS)
def test_allreduce_on_device(comm, dtype, op, count):
    xs = everyone(count, dtype, op, 21)
    want = rank_order(xs, op)
    host = C.allreduce(xs[ME], op=op, comm=comm)
    for alg in algorithms():
        if alg == "nccl" and np.dtype(dtype) == np.int16:
            with pytest.raises(UnsupportedDtypeError):
                C.allreduce(cp.asarray(xs[ME]), op=op, algorithm=alg, comm=comm)
            continue
        x = cp.asarray(xs[ME])
        got = C.allreduce(x, op=op, algorithm=alg, comm=comm)
        assert isinstance(got, cp.ndarray) and got.device.id == x.device.id
        res = cp.asnumpy(got)
        _check(res, want, op, dtype, alg, f"allreduce {alg} {op} {np.dtype(dtype)} x{count}", host)
        same_everywhere(res)
        y = cp.asarray(xs[ME])
        C.allreduce(y, op=op, algorithm=alg, out=y, comm=comm)  # in place
        assert cp.asnumpy(y).tobytes() == res.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("count", [1, 1001, 300_001])
def test_reduce_scatter_and_reduce_on_device(comm, dtype, op, count):
    xs = everyone(count, dtype, op, 22)
    want = rank_order(xs, op)
    counts = block_counts(count, N)
    off = offsets(counts)
    root = count % N
    host_block = C.reduce_scatter(xs[ME], op=op, comm=comm)
    host_reduced = C.reduce(xs[ME], root, op=op, comm=comm)
    for alg in algorithms(dtype):
        block = cp.asnumpy(C.reduce_scatter(cp.asarray(xs[ME]), op=op, algorithm=alg, comm=comm))
        _check(block, want[off[ME] : off[ME + 1]], op, dtype, alg, f"reduce_scatter {alg}", host_block)
        got = C.reduce(cp.asarray(xs[ME]), root, op=op, algorithm=alg, comm=comm)
        if ME == root:
            _check(cp.asnumpy(got), want, op, dtype, alg, f"reduce {alg}", host_reduced)
        else:
            assert got is None


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_allgather_broadcast_alltoall_on_device(comm, dtype):
    rows = [3 + 50_000 * r for r in range(N)]
    xs = [make_input(r, rows[r] * 2, dtype, "sum", 23).reshape(rows[r], 2) for r in range(N)]
    for alg in algorithms(dtype):
        got = cp.asnumpy(C.allgather(cp.asarray(xs[ME]), algorithm=alg, comm=comm))
        assert got.tobytes() == np.concatenate(xs).tobytes(), f"allgather {alg}"
        for root in range(N):
            b = cp.asarray(xs[root] if ME == root else np.zeros_like(xs[root]))
            got = C.broadcast(b, root, algorithm=alg, out=b, comm=comm)
            assert cp.asnumpy(got).tobytes() == xs[root].tobytes(), f"broadcast {alg} root {root}"
    x = cp.asarray(np.arange(4 * N, dtype=np.float32) + 100 * ME)
    got = cp.asnumpy(C.alltoall(x, comm=comm))
    want = np.concatenate([np.arange(4 * N, dtype=np.float32)[4 * ME : 4 * ME + 4] + 100 * r for r in range(N)])
    assert np.array_equal(got, want)


def test_torch_bfloat16_tensors_reduce_or_need_cupy_14_on_every_rank(comm):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    t = torch.full((1000,), ME + 0.5, dtype=torch.bfloat16, device=f"cuda:{ME % GPUS}")
    if not BF16:
        with pytest.raises(UnsupportedDtypeError, match="bfloat16 device arrays need CuPy 14"):
            C.allreduce(t, comm=comm)
        return
    assert C.allreduce(t, out=t, comm=comm) is t
    want = rank_order([np.full(1000, r + 0.5, ml_dtypes.bfloat16) for r in range(N)], "sum")
    assert t.view(torch.int16).cpu().numpy().tobytes() == want.view(np.int16).tobytes()


def test_torch_cuda_tensors_go_through_as_they_are(comm):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    xs = everyone(10_000, np.float32, "sum", 24)
    t = torch.from_numpy(xs[ME]).to(f"cuda:{ME % GPUS}")
    got = C.allreduce(t, out=t, comm=comm)  # the result in the tensor's own memory
    assert got is t
    assert t.cpu().numpy().tobytes() == rank_order(xs, "sum").tobytes()
    got = C.allreduce(t, comm=comm)  # a new CuPy array on the tensor's device
    assert isinstance(got, cp.ndarray) and got.device.id == t.device.index


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [4, 100_000])
def test_host_on_one_rank_device_on_another_fails_everywhere(comm, count):
    x = np.ones(count, np.float32) if ME == 0 else cp.ones(count, cp.float32)
    with pytest.raises(CollectiveMismatchError, match="'memory'"):
        C.allreduce(x, comm=comm)
    assert C.allreduce(cp.ones(3, cp.float32), comm=comm)[0] == N


_SPIN = r"""
extern "C" __global__ void spin_then_write(float* x, int n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 1.0f;
}
"""


@pytest.mark.parametrize("alg", ["ipc", "staged", "native"])
def test_a_result_never_reads_before_the_kernels_that_write_the_input(comm, alg):
    spin = cp.RawKernel(_SPIN, "spin_then_write")
    n = 1 << 20
    x = cp.zeros(n, cp.float32)
    spin(((n + 255) // 256,), (256,), (x, np.int32(n), np.int64(200_000_000)))  # ~0.1 s, then ones
    got = C.allreduce(x, algorithm=alg, comm=comm)  # queued after the kernel on the same stream
    assert float(got.min()) == N and float(got.max()) == N


def test_ipc_windows_are_released_with_the_communicator():
    free_before = cp.cuda.runtime.memGetInfo()[0]
    x = cp.ones(1000, cp.float32)
    for i in range(1000):
        c = WORLD.Dup()
        get_context(c, config=Config(device_window_bytes=1 << 20))
        C.allreduce(x, algorithm="ipc", comm=c)
        c.Free()
        if i == 10:
            after_ten = cp.cuda.runtime.memGetInfo()[0]
    cp.cuda.Device().synchronize()
    free_after = cp.cuda.runtime.memGetInfo()[0]
    # 1,000 windows of 1 MiB not released would be a GiB; allow the driver's own slack
    assert free_before - free_after < 64 << 20, (free_before, after_ten, free_after)


def test_nccl_at_one_rank_or_its_reason():
    why = nccl_plan(get_context().transport)
    x = cp.arange(1000, dtype=cp.float32)
    if why is None:
        got = C.allreduce(x, algorithm="nccl")
        assert cp.asnumpy(got).tobytes() == (np.arange(1000, dtype=np.float32) * N).tobytes()
        return
    with pytest.raises(DeviceUnavailableError, match="nccl") as info:
        C.allreduce(x, algorithm="nccl")
    if N > GPUS:  # two ranks on one GPU: the reason names it
        assert "share the GPU" in str(info.value)
