"""Device arrays in the collectives, on any machine (no GPU needed).

What a device array is; the memory kind in the agreed signature (a host array on one rank
and a device array on another is a mismatch on every rank, whatever the size and the
collective); CuPy missing is an error on every rank; algorithm names checked against the
kind of array; CUDA-aware MPI detection; and the ``ipc`` schedules run on their host twin
(:class:`collectives.device.ipc.HostPeers`: numpy, a rank's work reaching its peers only through
the events, as on a GPU) at 1..4 ranks with a
window small enough to need many chunks, against rank-order numpy reductions, bitwise.
The same schedules on a GPU are tested in ``test_device_gpu.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from reference import OPS, check_close, digest, expected, make_input, rank_order

import collectives as C
from collectives.agreement import pack, unpack
from collectives.blocks import block_counts, offsets
from collectives.config import Config, load_config
from collectives.context import get_context
from collectives.device import ipc
from collectives.device.arrays import cuda_aware_mpi, describe, is_device, stand_in
from collectives.errors import (
    CollectiveMismatchError,
    ConfigError,
    DeviceUnavailableError,
    UnknownAlgorithmError,
)

WORLD = MPI.COMM_WORLD
N, ME = WORLD.size, WORLD.rank


class FakeDeviceArray:
    """Something that says it is CUDA memory, as a CuPy array or CUDA tensor does (its
    pointer is never dereferenced: the calls here fail before they would)."""

    def __init__(self, shape, dtype=np.float32, strides=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": np.dtype(dtype).str,
            "data": (0, False),
            "strides": strides,
            "version": 3,
        }


class FakeDLPack:
    def __init__(self, device_type):
        self.shape, self.dtype, self._t = (4,), "float32", device_type

    def __dlpack_device__(self):
        return (self._t, 0)


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401

        return True
    except ImportError:
        return False


no_cupy = pytest.mark.skipif(_has_cupy(), reason="CuPy is installed here: its absence cannot be tested")


# -- single process ------------------------------------------------------------------------------
def test_what_counts_as_a_device_array():
    torch = pytest.importorskip("torch")
    assert not is_device(np.zeros(3))
    assert not is_device(torch.zeros(3))  # a CPU tensor's interface property raises
    assert not is_device([1.0, 2.0])
    assert is_device(FakeDeviceArray((2, 3)))
    assert is_device(FakeDLPack(2)) and is_device(FakeDLPack(13))
    assert not is_device(FakeDLPack(1)) and not is_device(FakeDLPack(3))  # CPU, pinned host


def test_describe_reads_shape_dtype_and_layout():
    assert describe(FakeDeviceArray((2, 3), np.int16)) == ((2, 3), np.dtype(np.int16), True)
    assert describe(FakeDeviceArray((2, 3), np.float64, strides=(24, 8)))[2]
    assert not describe(FakeDeviceArray((2, 3), np.float64, strides=(8, 16)))[2]
    s = stand_in((3, 5), np.dtype(np.float16))
    assert s.shape == (3, 5) and s.dtype == np.float16 and s.strides == (0, 0) and s.nbytes == 30


def test_signature_carries_the_memory_kind():
    for mem in (0, 1):
        for err in (0, 1):
            sig = [5, 7, 6, 4, 8, 123456789, 3000, 99, err, mem]
            assert unpack(pack(sig)) == sig
    assert pack([5, 7, 6, 4, 8, 1, -2, 0, 0, 1])[0] != pack([5, 7, 6, 4, 8, 1, -2, 0, 0, 0])[0]
    assert pack([5, 7, 6, 4, 8, 1, 2**31 - 3, 0, 1, 1])[0] < 2**63


def test_device_algorithm_names():
    assert C.algorithms("allreduce", device=True) == ["ipc", "nccl", "staged", "native", "auto"]
    assert C.algorithms("alltoall", device=True) == ["staged", "native", "auto"]
    assert "ipc" not in C.algorithms("allreduce")


def test_cuda_aware_mpi_setting_and_query():
    assert cuda_aware_mpi("1") and not cuda_aware_mpi("0")
    # the virtualenv's MPICH answers MPIX_Query_cuda_support: it is not built with CUDA
    if "MPICH" in MPI.Get_library_version():
        assert cuda_aware_mpi("auto") is False
    assert load_config({"HPCDL_CUDA_AWARE_MPI": "1"}).cuda_aware_mpi == "1"
    with pytest.raises(ConfigError, match="cuda_aware_mpi"):
        Config(cuda_aware_mpi="yes")
    with pytest.raises(ConfigError, match="device_window_bytes"):
        Config(device_window_bytes=100)
    assert load_config({"HPCDL_DEVICE_STAGED_BYTES": "65536"}).device_staged_bytes == 65536
    with pytest.raises(ConfigError, match="device_staged_bytes=-2 must be >= 0"):
        Config(device_staged_bytes=-2)


# -- argument checks at any size ----------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("alg", ["ipc", "nccl", "staged"])
def test_a_device_algorithm_on_host_arrays_says_so(alg):
    with pytest.raises(UnknownAlgorithmError, match="takes device arrays"):
        C.allreduce(np.ones(4, np.float32), algorithm=alg)
    assert C.allreduce(np.ones(4, np.float32))[0] == N  # still usable


@pytest.mark.mpi(min_size=1)
@no_cupy
def test_device_arrays_without_cupy_fail_on_every_rank():
    with pytest.raises(DeviceUnavailableError, match="pip install hpcdl\\[gpu\\]"):
        C.allreduce(FakeDeviceArray((8,)))
    with pytest.raises(DeviceUnavailableError):
        C.allgather(FakeDeviceArray((2, 3)))
    with pytest.raises(UnknownAlgorithmError, match="takes host"):
        C.allreduce(FakeDeviceArray((8,)), algorithm="ring")
    assert C.allreduce(np.ones(4, np.float32))[0] == N


@pytest.mark.mpi(min_size=2)
@no_cupy
def test_cupy_missing_on_one_rank_is_an_error_on_every_rank():
    # rank 1 passes a device array it cannot use, the others host arrays of that shape and
    # dtype: the memory kinds differ, so every rank hears of that before anything else
    x = FakeDeviceArray((8,)) if ME == 1 else np.ones(8, np.float32)
    with pytest.raises(CollectiveMismatchError, match="'memory'"):
        C.broadcast(x, root=0)
    # every rank passes one, rank 1 with a host algorithm: each raises its own error or the
    # algorithms' difference, and nothing hangs
    x = FakeDeviceArray((8,))
    with pytest.raises(C.CollectiveError):
        C.broadcast(x, root=0, algorithm="tree" if ME == 1 else "auto")
    with pytest.raises(DeviceUnavailableError):
        C.broadcast(x, root=0)
    assert C.allreduce(np.ones(4, np.float32))[0] == N


CALLS = {
    "allreduce": lambda x: C.allreduce(x),
    "reduce_scatter": lambda x: C.reduce_scatter(x),
    "allgather": lambda x: C.allgather(x),
    "broadcast": lambda x: C.broadcast(x, root=0),
    "reduce": lambda x: C.reduce(x, root=N - 1),
    "iallreduce": lambda x: C.iallreduce(x).wait(),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", list(CALLS))
@pytest.mark.parametrize("count", [4, 100_000])  # one step through the slots, and the general path
def test_host_and_device_arrays_mixed_are_a_mismatch_on_every_rank(collective, count):
    x = np.ones(count, np.float32) if ME == 0 else FakeDeviceArray((count,))
    with pytest.raises(CollectiveMismatchError, match="'memory'") as info:
        CALLS[collective](x)
    assert info.value.field == "memory"
    assert info.value.values == {"a host array": [0], "a device array": list(range(1, N))}
    got = C.allreduce(np.full(3, ME + 1, np.float32))  # the communicator is still usable
    assert got[0] == N * (N + 1) / 2


@pytest.mark.mpi(min_size=2)
def test_mixed_memory_across_nodes_too():
    comm = WORLD.Dup()
    get_context(comm, config=Config(ranks_per_node=1))  # every rank a node: agreement by allgather
    try:
        x = np.ones(10, np.float32) if ME == N - 1 else FakeDeviceArray((10,))
        with pytest.raises(CollectiveMismatchError, match="'memory'"):
            C.allreduce(x, comm=comm)
    finally:
        comm.Free()


# -- the ipc schedules on host memory -----------------------------------------------------------
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]
WINDOW = 4096  # bytes per rank: 1001 float64 take two chunks, 1001 × N a few more


@pytest.fixture(scope="module")
def twin():
    comm = WORLD.Dup()
    ctx = get_context(comm)
    peers = ipc.HostPeers(ctx.topology().node, WINDOW) if N > 1 else None
    yield ctx, peers
    comm.Free()


def _everyone(count, dtype, op, seed):
    return [make_input(r, count, dtype, op, seed) for r in range(N)]


def _same_everywhere(a):
    ds = WORLD.allgather(digest(a))
    assert len(set(ds)) == 1, f"results differ between ranks: {ds}"


needs_twin = pytest.mark.mpi(min_size=2)


@needs_twin
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("count", [1, 3, 1001, 3000])
def test_ipc_allreduce_twin(twin, dtype, op, count):
    ctx, peers = twin
    xs = _everyone(count, dtype, op, seed=11)
    out = np.empty(count, dtype)
    ctx.run(ipc.allreduce(ctx.channel(), peers, xs[ME].copy(), out, op))
    want = rank_order(xs, op)
    assert out.tobytes() == want.tobytes(), f"{op} {np.dtype(dtype)} x{count}"
    check_close(out, expected(xs, op), op, N, "ipc allreduce")
    _same_everywhere(out)


@needs_twin
@pytest.mark.parametrize("count", [5, 2000])
def test_ipc_allreduce_twin_in_place(twin, count):
    ctx, peers = twin
    xs = _everyone(count, np.float32, "sum", seed=12)
    buf = xs[ME].copy()
    ctx.run(ipc.allreduce(ctx.channel(), peers, buf, buf, "sum"))
    assert buf.tobytes() == rank_order(xs, "sum").tobytes()


@needs_twin
@pytest.mark.parametrize(
    "dtype", [np.float16, ml_dtypes.bfloat16, np.float64, np.int32], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("count", [1, 7, 3001])
def test_ipc_reduce_scatter_and_reduce_twin(twin, dtype, op, count):
    ctx, peers = twin
    xs = _everyone(count, dtype, op, seed=13)
    want = rank_order(xs, op)
    counts = block_counts(count, N)
    off = offsets(counts)
    block = np.empty(counts[ME], dtype)
    ctx.run(ipc.reduce_scatter(ctx.channel(), peers, xs[ME], counts, block, op))
    assert block.tobytes() == want[off[ME] : off[ME + 1]].tobytes()
    root = count % N
    out = np.empty(count, dtype) if ME == root else None
    ctx.run(ipc.reduce(ctx.channel(), peers, xs[ME], out, root, op))
    if ME == root:
        assert out.tobytes() == want.tobytes()


@needs_twin
@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_ipc_allgather_and_broadcast_twin(twin, dtype):
    ctx, peers = twin
    counts = tuple(3 + 700 * r for r in range(N))  # uneven, some over a window
    xs = [make_input(r, counts[r], dtype, "sum", 14) for r in range(N)]
    out = np.empty(sum(counts), dtype)
    ctx.run(ipc.allgather(ctx.channel(), peers, xs[ME], counts, out))
    assert out.tobytes() == np.concatenate(xs).tobytes()
    for root in range(N):
        buf = xs[root].copy() if ME == root else np.zeros(counts[root], dtype)
        ctx.run(ipc.broadcast(ctx.channel(), peers, buf, root))
        assert buf.tobytes() == xs[root].tobytes()


@needs_twin
def test_ipc_twin_shows_a_peers_work_only_after_its_event_and_a_wait(twin):
    """Models CUDA across processes: a rank's queued work reaches a peer only once the rank
    recorded an event after it and the peer waited for that event, so a schedule that skips
    either reads stale bytes here, as it would race on a GPU."""
    ctx, peers = twin
    sync = WORLD.Dup()
    mine = peers.views[ME]

    def published_everywhere() -> None:
        peers.record(ipc.STAGED)
        sync.Barrier()
        peers.wait(ipc.STAGED)
        sync.Barrier()

    mine[:8] = 0  # every mirror starts from zeros, whatever earlier tests left there
    published_everywhere()
    mine[:8] = ME + 1  # "queued" on this rank's stream
    sync.Barrier()
    seen = [peers.views[q][:8].copy() for q in range(N)]
    peers.wait(ipc.STAGED)  # no event recorded after the write: still not visible
    stale = [peers.views[q][:8].copy() for q in range(N)]
    sync.Barrier()
    peers.record(ipc.STAGED)
    sync.Barrier()
    before_wait = [peers.views[q][:8].copy() for q in range(N)]
    peers.wait(ipc.STAGED)
    after = [peers.views[q][:8].copy() for q in range(N)]
    sync.Barrier()  # every rank has read before any publishes again (the READ event's role)
    mine[:8] = 0
    published_everywhere()
    sync.Free()
    for q in range(N):  # checked once every rank is past the barriers
        if q != ME:
            assert not seen[q].any() and not stale[q].any() and not before_wait[q].any()
            assert (after[q] == q + 1).all()


@needs_twin
def test_ipc_twin_leaves_the_communicator_usable(twin):
    ctx, peers = twin
    x = np.arange(5000, dtype=np.float64) * (ME + 1)
    out = np.empty_like(x)
    ctx.run(ipc.allreduce(ctx.channel(), peers, x, out, "avg"))
    host = C.allreduce(x, op="avg", comm=ctx.transport.comm)
    np.testing.assert_allclose(out, host, rtol=1e-15)


# -- the device entry points on the CuPy stand-in ---------------------------------------------
FAKE_ALGS = ["ipc", "staged", "native", "native-direct", "auto"]


@pytest.fixture()
def fake(monkeypatch):
    """The CuPy stand-in installed, and a communicator whose ``ipc`` windows are host ones."""
    import fakecupy

    cp = fakecupy.install(monkeypatch)
    plain, direct = WORLD.Dup(), WORLD.Dup()
    for c, aware in ((plain, "0"), (direct, "1")):
        ctx = get_context(c, config=Config(cuda_aware_mpi=aware))
        if N > 1:
            ctx.device["ipc"] = ipc.HostPeers(ctx.topology().node, WINDOW)
    yield cp, plain, direct
    plain.Free()
    direct.Free()


def _run(fake, alg):
    """(algorithm name, communicator) for a FAKE_ALGS entry."""
    _, plain, direct = fake
    return ("native", direct) if alg == "native-direct" else (alg, plain)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("alg", FAKE_ALGS)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.int64], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_device_allreduce_logic(fake, alg, dtype, op):
    cp = fake[0]
    name, comm = _run(fake, alg)
    count = 2500
    xs = _everyone(count, dtype, op, seed=31)
    want = rank_order(xs, op)
    got = C.allreduce(cp.asarray(xs[ME]), op=op, algorithm=name, comm=comm)
    assert isinstance(got, cp.ndarray) and got.shape == (count,)
    check_close(cp.asnumpy(got), expected(xs, op), op, N, f"{alg}")
    if name != "native":  # MPI's own reduction order is its own
        assert cp.asnumpy(got).tobytes() == want.tobytes()
    _same_everywhere(cp.asnumpy(got))
    y = cp.asarray(xs[ME].reshape(50, 50))
    assert C.allreduce(y, op=op, algorithm=name, out=y, comm=comm) is y  # in place, the caller's object
    assert cp.asnumpy(y).reshape(-1).tobytes() == cp.asnumpy(got).tobytes()
    req = C.iallreduce(cp.asarray(xs[ME]), op=op, algorithm=name, comm=comm)
    assert cp.asnumpy(req.wait()).tobytes() == cp.asnumpy(got).tobytes()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("alg", FAKE_ALGS)
def test_device_reduce_scatter_reduce_allgather_broadcast_logic(fake, alg):
    cp = fake[0]
    name, comm = _run(fake, alg)
    count = 3001
    xs = _everyone(count, np.float64, "sum", seed=32)
    want = rank_order(xs, "sum")
    counts = block_counts(count, N)
    off = offsets(counts)
    block = C.reduce_scatter(cp.asarray(xs[ME]), algorithm=name, comm=comm)
    np.testing.assert_allclose(cp.asnumpy(block), want[off[ME] : off[ME + 1]], rtol=1e-12)
    for root in range(N):
        got = C.reduce(cp.asarray(xs[ME]), root, algorithm=name, comm=comm)
        if ME == root:
            np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-12)
        else:
            assert got is None
        b = cp.asarray(xs[ME].copy())
        assert C.broadcast(b, root, algorithm=name, out=b, comm=comm) is b
        assert cp.asnumpy(b).tobytes() == xs[root].tobytes()
    rows = [1 + 300 * r for r in range(N)]
    parts = [make_input(r, rows[r] * 3, np.float32, "sum", 33).reshape(rows[r], 3) for r in range(N)]
    got = C.allgather(cp.asarray(parts[ME]), algorithm=name, comm=comm)
    assert cp.asnumpy(got).tobytes() == np.concatenate(parts).tobytes()
    out = cp.empty((sum(rows), 3), np.float32)
    assert C.iallgather(cp.asarray(parts[ME]), algorithm=name, out=out, comm=comm).wait() is out
    assert cp.asnumpy(out).tobytes() == np.concatenate(parts).tobytes()


@pytest.mark.mpi(min_size=1)
def test_device_alltoall_logic(fake):
    cp, comm, _ = fake
    x = cp.asarray(np.arange(4 * N, dtype=np.float32) + 100 * ME)
    got = C.alltoall(x, comm=comm)
    want = np.concatenate([np.arange(4 * N, dtype=np.float32)[4 * ME : 4 * ME + 4] + 100 * r for r in range(N)])
    assert isinstance(got, cp.ndarray) and np.array_equal(cp.asnumpy(got), want)


@pytest.mark.mpi(min_size=1)
def test_device_out_checks_fail_on_every_rank(fake):
    cp, comm, _ = fake
    from collectives.errors import OutputMismatchError

    x = cp.ones(10, np.float32)
    bad = cp.empty(11, np.float32) if ME == 0 else cp.empty(10, np.float32)
    with pytest.raises((OutputMismatchError, C.PeerInputError)) as info:
        C.allreduce(x, out=bad, comm=comm)
    assert isinstance(info.value, OutputMismatchError) == (ME == 0)
    host_out = np.empty(10, np.float32) if ME == 0 else cp.empty(10, np.float32)
    with pytest.raises((OutputMismatchError, C.PeerInputError)):
        C.allreduce(x, out=host_out, comm=comm)
    with pytest.raises(OutputMismatchError, match="rows"):
        C.allgather(cp.ones((2, 3), np.float32), out=cp.empty((2 * N + 1, 3), np.float32), comm=comm)
    if N > 1:  # every rank a node of its own
        multi = WORLD.Dup()
        try:
            get_context(multi, config=Config(ranks_per_node=1))
            with pytest.raises(C.InvalidArgumentError, match="one node"):
                C.allreduce(x, algorithm="ipc", comm=multi)
            got = C.allreduce(x, comm=multi)  # auto: staged, across nodes without CUDA-aware MPI
            assert cp.asnumpy(got)[0] == N
        finally:
            multi.Free()
    assert cp.asnumpy(C.allreduce(x, comm=comm))[0] == N


@pytest.mark.mpi(min_size=1)
def test_bfloat16_before_cupy_14_is_an_error_on_every_rank(fake, monkeypatch):
    cp, comm, _ = fake
    x = cp.asarray(np.ones(10, ml_dtypes.bfloat16))
    assert describe(x)[1] == np.dtype(ml_dtypes.bfloat16)  # the interface says "<V2"; the array says more
    if ME == 0:
        monkeypatch.setattr(cp, "__version__", "13.6.0")
    with pytest.raises((C.UnsupportedDtypeError, C.PeerInputError)) as info:
        C.allreduce(x, comm=comm)
    assert isinstance(info.value, C.UnsupportedDtypeError) == (ME == 0)
    if ME == 0:
        assert "bfloat16 device arrays need CuPy 14 or later (this is 13.6.0)" in str(info.value)
        monkeypatch.setattr(cp, "__version__", "14.2.0")
    assert cp.asnumpy(C.allreduce(x, comm=comm))[0] == N


@pytest.mark.mpi(min_size=1)
def test_nccl_missing_is_an_error_on_every_rank_and_auto_goes_on(fake):
    cp, comm, _ = fake
    with pytest.raises(DeviceUnavailableError, match="NCCL cannot be loaded"):
        C.allreduce(cp.ones(4, np.float32), algorithm="nccl", comm=comm)
    with pytest.raises(C.UnsupportedDtypeError, match="NCCL has no int16"):
        C.allreduce(cp.ones(4, np.int16), algorithm="nccl", comm=comm)
    assert cp.asnumpy(C.allreduce(cp.ones(4, np.int16), comm=comm))[0] == N


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", ["ipc", "staged"])
def test_torch_bfloat16_through_the_array_interface(fake, alg):
    """A CUDA torch tensor reaches CuPy through its interface, whose typestr spells bfloat16
    as ``<V2`` (models the GPU failure: ``Wrong type (V2, V2) for cupy_add`` in ipc's
    combine): the stand-in types the view as CuPy does and refuses V2 arithmetic as CuPy's
    kernels do, so the collectives must type the view themselves, for x and for out."""
    torch = pytest.importorskip("torch")
    import fakecupy

    cp, comm, _ = fake
    t = torch.full((1000,), ME + 0.5, dtype=torch.bfloat16)
    x = fakecupy.CudaTensor(t)
    assert x.__cuda_array_interface__["typestr"] == "<V2" and cp.asarray(x).dtype.kind == "V"
    with pytest.raises(TypeError, match="Wrong type"):
        cp.add(cp.asarray(x), cp.asarray(x))
    want = rank_order([np.full(1000, r + 0.5, ml_dtypes.bfloat16) for r in range(N)], "sum")
    got = C.allreduce(x, algorithm=alg, comm=comm)
    assert got.dtype == np.dtype(ml_dtypes.bfloat16) and cp.asnumpy(got).tobytes() == want.tobytes()
    C.allreduce(x, out=x, algorithm=alg, comm=comm)  # into the tensor's own memory
    assert t.view(torch.int16).numpy().tobytes() == want.view(np.int16).tobytes()


@pytest.mark.mpi(min_size=2)
def test_a_cuda_tensor_that_requires_grad_is_a_device_array(fake):
    """Models torch on a GPU: a CUDA tensor that requires grad raises from its array interface
    (it has a DLPack device all the same), so it must not be taken for host memory."""
    torch = pytest.importorskip("torch")
    import fakecupy

    cp, comm, _ = fake
    t = torch.full((5,), float(ME + 1), dtype=torch.float64, requires_grad=True)
    x = fakecupy.CudaTensor(t)
    with pytest.raises(RuntimeError, match="requires grad"):
        x.__cuda_array_interface__  # noqa: B018
    assert is_device(x) and describe(x) == ((5,), np.dtype(np.float64), True)
    got = C.allreduce(x, comm=comm)
    assert cp.asnumpy(got).tolist() == [N * (N + 1) / 2] * 5


def _waits(cp, run, times=5):
    """(stream synchronizations, copies to the host) per call of ``run()``, on this rank."""
    before = dict(cp.WAITS)
    for _ in range(times):
        run()
    return tuple((cp.WAITS[k] - before[k]) / times for k in ("synchronize", "to_host"))


@pytest.mark.mpi(min_size=2)
def test_the_host_waits_for_the_device_only_where_host_memory_needs_it(fake):
    """Calls on CuPy arrays are ordered on the stream, as NCCL's are: ``ipc`` never makes
    the host wait for the device (on a GPU its kernels of one call then overlap the host
    side of the next); ``staged`` waits once, for its copy to the host; ``native`` over a
    CUDA-aware MPI once, before MPI reads the device memory; a CUDA tensor of another
    library once more, at the end, since hpcdl does not know that library's streams."""
    torch = pytest.importorskip("torch")
    import fakecupy

    cp, plain, direct = fake
    x = cp.asarray(np.arange(3000, dtype=np.float32) + ME)
    t = fakecupy.CudaTensor(torch.arange(3000, dtype=torch.float32) + ME)
    calls = {
        "allreduce": lambda a, alg, c: C.allreduce(a, algorithm=alg, comm=c),
        "reduce_scatter": lambda a, alg, c: C.reduce_scatter(a, algorithm=alg, comm=c),
        "allgather": lambda a, alg, c: C.allgather(a, algorithm=alg, comm=c),
        "broadcast": lambda a, alg, c: C.broadcast(a, 0, algorithm=alg, comm=c),
        "reduce": lambda a, alg, c: C.reduce(a, 0, algorithm=alg, comm=c),
    }
    want = {"ipc": (0, 0), "staged": (0, 1), "native-direct": (1, 0)}
    for name, call in calls.items():
        for alg, per_call in want.items():
            algorithm, comm = _run(fake, alg)
            assert _waits(cp, lambda: call(x, algorithm, comm)) == per_call, f"{name} {alg}"
        assert _waits(cp, lambda: call(t, "ipc", plain)) == (1, 0), f"{name} of a CUDA tensor"
    got = C.allreduce(x, algorithm="ipc", comm=plain)
    assert cp.asnumpy(got).tobytes() == sum(np.arange(3000, dtype=np.float32) + r for r in range(N)).tobytes()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("per_rank", [True, False], ids=["gpu-per-rank", "shared-gpu"])
def test_auto_stages_small_calls_where_ranks_share_a_gpu(fake, monkeypatch, per_rank):
    """``auto`` without NCCL on one node: ``ipc`` where each rank has its own GPU; where
    ranks share one, ``staged`` up to ``device_staged_bytes`` per rank and ``ipc`` above
    (seen by the copies to the host: one per staged call). Every rank decides alike, also
    for an allgather whose ranks pass different sizes on each side of the crossover."""
    import fakecupy

    cp = fake[0]
    monkeypatch.setattr(fakecupy, "GPU_PER_RANK", per_rank)
    comm = WORLD.Dup()
    ctx = get_context(comm, config=Config(device_staged_bytes=4096))
    ctx.device["ipc"] = ipc.HostPeers(ctx.topology().node, WINDOW)
    try:
        for count in (1, 1024, 1025, 5000):
            x = cp.asarray(np.full(count, ME + 1, np.float32))
            staged = not per_rank and count * 4 <= 4096
            got = []
            assert _waits(cp, lambda: got.append(C.allreduce(x, comm=comm)), 1) == (0, int(staged)), count
            assert cp.asnumpy(got[0]).tolist() == [N * (N + 1) / 2] * count
        rows = 1000 + 50 * ME  # 4000 + 200 r bytes per rank: some ranks below 4096, some above
        got = C.allgather(cp.asarray(np.full((rows, 1), ME, np.float32)), comm=comm)
        want = np.concatenate([np.full((1000 + 50 * q, 1), q, np.float32) for q in range(N)])
        assert cp.asnumpy(got).tobytes() == want.tobytes()
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mps", [False, True], ids=["without-mps", "under-mps"])
def test_auto_takes_the_measured_crossover_with_or_without_mps(fake, monkeypatch, tmp_path, mps):
    """By default the crossover is the one measured on an H100 shared by 2 ranks: 1 MiB
    without MPS, 128 KiB when every rank finds the MPS daemon's control pipe."""
    import fakecupy

    from collectives.device.api import STAGED_BYTES

    cp = fake[0]
    monkeypatch.setattr(fakecupy, "GPU_PER_RANK", False)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    if mps:
        (tmp_path / "control").write_text("")
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    comm = WORLD.Dup()
    ctx = get_context(comm)
    ctx.device["ipc"] = ipc.HostPeers(ctx.topology().node, WINDOW)
    try:
        cut = STAGED_BYTES[mps]
        assert cut == (128 << 10 if mps else 1 << 20)
        for count in (cut // 4, cut // 4 + 1):
            x = cp.asarray(np.ones(count, np.float32))
            staged = count * 4 <= cut
            assert _waits(cp, lambda: C.allreduce(x, comm=comm), 1) == (0, int(staged)), count
    finally:
        comm.Free()
