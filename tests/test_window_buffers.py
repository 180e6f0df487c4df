"""Window-resident buffers: the arena's allocator in one process; under mpiexec -n 2, 3, 4
every collective on arrays from ``collectives.empty`` against a numpy reference, read in
place (no staging copy: the byte counters say so), bitwise equal across ranks, mixed with
ordinary buffers and nonblocking calls; ``hpcdl.empty`` and ZeroOptimizer's buffers."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from reference import check_close, digest, expected, make_input

import collectives as C
from collectives.blocks import block_counts
from collectives.context import get_context
from collectives.node.arena import ALIGN, Arena

WORLD = MPI.COMM_WORLD
N, ME = WORLD.size, WORLD.rank


# -- the allocator, in one process -----------------------------------------------------------
def test_arena_allocates_aligned_blocks_frees_them_on_collection_and_merges_neighbours():
    seg = np.zeros(64 * ALIGN, np.uint8)
    arena = Arena([seg], 0)
    a = arena.empty((3, 5), np.float32)
    b = arena.empty(100, np.float64)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags.c_contiguous
    assert arena.where(a) == 1 and arena.where(b) == ALIGN + 1  # 60 bytes take one line, then b
    assert arena.where(a[:, ::2]) == 0  # not contiguous
    assert arena.where(np.empty(4, np.float32)) == 0  # not in the segment
    a[...] = 7
    assert np.array_equal(arena.peer(0, arena.where(a), np.dtype(np.float32), 15), np.full(15, 7, np.float32))
    view = a[1:]  # a view keeps the block alive
    del a
    gc.collect()
    assert arena.in_use == ALIGN + 13 * ALIGN
    c = arena.empty(16, np.float32)  # 64 bytes: fits only after the first block
    assert arena.where(c) == 14 * ALIGN + 1
    del view, c
    gc.collect()
    assert arena.in_use == 13 * ALIGN
    del b
    gc.collect()
    assert arena.in_use == 0
    whole = arena.empty(64 * ALIGN, np.uint8)  # every block merged back into one
    assert whole is not None and arena.where(whole) == 1
    assert arena.empty(1, np.uint8) is None  # full
    del whole
    gc.collect()
    assert arena.empty(64 * ALIGN + 1, np.uint8) is None  # larger than the segment


def test_empty_without_a_node_window_gives_ordinary_memory():
    # one rank: no node window; the array works all the same
    comm = MPI.COMM_SELF
    a = C.empty((4, 3), np.int32, comm=comm)
    assert a.shape == (4, 3) and a.dtype == np.int32 and not C.is_shared(a, comm=comm)
    assert C.copied_bytes(comm) == {"staged": 0, "reduced": 0, "copied_out": 0}


# -- every collective on window buffers, under mpiexec ------------------------------------------
def _window(a: np.ndarray, comm=WORLD) -> np.ndarray:
    w = C.empty(a.shape, a.dtype, comm=comm)
    w[...] = a
    return w


def _inputs(count: int, dtype, op: str, seed: int = 0) -> list[np.ndarray]:
    return [make_input(r, count, dtype, op, seed) for r in range(N)]


DTYPES = [np.float32, np.float64, np.int32, ml_dtypes.bfloat16]
NBYTES = [280_004, 1_200_000]  # above a slot (the one-step sizes), below and above one chunk per rank


def _needs_window():
    if get_context(WORLD).arena is None:
        pytest.skip("needs a node window (two or more ranks on one node)")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nbytes", NBYTES)
def test_allreduce_reads_every_rank_in_place_and_copies_only_its_results(dtype, nbytes):
    _needs_window()
    count = nbytes // np.dtype(dtype).itemsize
    for op in ("sum", "avg", "max", "prod"):
        xs = _inputs(count, dtype, op)
        want = expected(xs, op)
        x = _window(xs[ME])
        out = C.empty(count, dtype)
        before = C.copied_bytes()
        got = C.allreduce(x, op=op, out=out)
        after = C.copied_bytes()
        assert got is out
        check_close(out, want, op, N, f"allreduce {op} {np.dtype(dtype)}")
        assert len(set(WORLD.allgather(digest(out)))) == 1
        assert np.array_equal(x, xs[ME])  # the input is left as it was
        item = np.dtype(dtype).itemsize
        mine = block_counts(count, N)[ME]  # the slice this rank reduces
        assert after["staged"] - before["staged"] == 0
        assert after["reduced"] - before["reduced"] == mine * item
        assert after["copied_out"] - before["copied_out"] == (count - mine) * item
        # in place (out is x), as the engine's fusion buffer is reduced
        C.allreduce(x, op=op, out=x)
        assert digest(x) == digest(out)


@pytest.mark.mpi(min_size=2)
def test_ordinary_buffers_are_staged_as_before():
    _needs_window()
    x = make_input(ME, 300_000, np.float32, "sum")
    before = C.copied_bytes()
    C.allreduce(x, algorithm="shm")
    after = C.copied_bytes()
    assert after["staged"] > before["staged"]
    assert after["copied_out"] - before["copied_out"] == x.nbytes


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_allgather_broadcast_and_reduce_read_window_buffers(dtype):
    _needs_window()
    count = 300_001
    xs = _inputs(count, dtype, "sum", seed=1)
    want = expected(xs, "sum")
    blocks = np.array_split(np.arange(count), N)
    x = _window(xs[ME])
    before = C.copied_bytes()
    block = C.reduce_scatter(x)
    assert C.copied_bytes()["staged"] == before["staged"]
    check_close(block, want[blocks[ME]], "sum", N, "reduce_scatter")
    # allgather: every rank's out in the window, its own block in place already (ZeRO's
    # layout); blocks just above the one-step size (which copies through the slots)
    rows = get_context().chan.copy_small // np.dtype(dtype).itemsize + 1
    out = C.empty(rows * N, dtype)
    out[ME * rows : (ME + 1) * rows] = xs[ME][:rows]
    before = C.copied_bytes()
    got = C.allgather(out[ME * rows : (ME + 1) * rows], out=out)
    assert got is out and np.array_equal(out, np.concatenate([v[:rows] for v in xs]))
    assert C.copied_bytes()["copied_out"] - before["copied_out"] == (N - 1) * rows * np.dtype(dtype).itemsize
    assert C.copied_bytes()["staged"] == before["staged"]
    for root in range(N):
        res = C.broadcast(x, root)
        assert np.array_equal(res, xs[root])
        red = C.reduce(x, root, op="max")
        if ME == root:
            check_close(red, expected(xs, "max"), "max", N, "reduce")
        else:
            assert red is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_a_mid_size_broadcast_streams_through_the_roots_slot_from_any_buffer(dtype):
    # between the reductions' one-step size and the copies': the root copies its data, in
    # the window or not, into its slot piece by piece while the others copy it out (nothing
    # staged or read in place, so the byte counters stay as they were)
    from collectives.node.channel import STREAM_SHIFT

    _needs_window()
    ch = get_context().chan
    count = (ch.small + ch.copy_small) // 2 // np.dtype(dtype).itemsize
    xs = _inputs(count, dtype, "sum", seed=5)
    for root in range(N):
        x = _window(xs[ME])
        plain = xs[ME].copy()
        mixed = x if ME == root else plain  # the root's buffer in the window, the others' ordinary
        for buf in (x, plain, mixed):
            before = C.copied_bytes()
            out = np.empty_like(plain)
            assert C.broadcast(buf, root, out=out) is out and np.array_equal(out, xs[root])
            assert C.copied_bytes() == before
            assert ch.streams[root][0] >> STREAM_SHIFT == ch.seq  # this call's pieces went through root's slot


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_ordinary_buffers_sends_every_rank_down_the_staged_path():
    _needs_window()
    count = 200_000
    xs = _inputs(count, np.float64, "sum", seed=2)
    want = expected(xs, "sum")
    x = xs[ME].copy() if ME == N - 1 else _window(xs[ME])
    before = C.copied_bytes()
    got = C.allreduce(x, algorithm="shm")
    check_close(got, want, "sum", N, "mixed allreduce")
    assert C.copied_bytes()["staged"] > before["staged"]  # every rank staged: no one read in place
    out = C.empty(block_counts(count, N)[ME], np.float64)
    got = C.reduce_scatter(x, out=out)
    check_close(got, want[np.array_split(np.arange(count), N)[ME]], "sum", N, "mixed reduce_scatter")


@pytest.mark.mpi(min_size=2)
def test_nonblocking_window_calls_interleave_with_staged_ones():
    _needs_window()
    count = 150_000
    xs = _inputs(count, np.float32, "sum", seed=3)
    want = expected(xs, "sum")
    win = [_window(xs[ME]) for _ in range(3)]
    plain = [xs[ME].copy() for _ in range(2)]
    reqs = [
        C.iallreduce(win[0], out=win[0]),
        C.iallreduce(plain[0]),
        C.iallreduce(win[1], out=win[1]),
        C.ireduce_scatter(win[2]),
        C.iallreduce(plain[1], out=plain[1]),
    ]
    results = [r.wait() for r in reversed(reqs)][::-1]
    for res in (results[0], results[1], results[2], results[4]):
        check_close(res, want, "sum", N, "nonblocking allreduce")
    check_close(results[3], want[np.array_split(np.arange(count), N)[ME]], "sum", N, "nonblocking reduce_scatter")


@pytest.mark.mpi(min_size=2)
def test_a_count_mismatch_on_window_buffers_raises_on_every_rank():
    _needs_window()
    x = C.empty(100_000 + (ME == 0), np.float32)
    x[...] = 1
    with pytest.raises(C.CollectiveMismatchError, match="count"):
        C.allreduce(x, out=x)
    x = C.empty(100_000, np.float32)
    x[...] = 1
    assert np.array_equal(C.allreduce(x, out=x), np.full(100_000, N, np.float32))  # still usable


@pytest.mark.mpi(min_size=2)
def test_arrays_outlive_their_communicator():
    comm = WORLD.Dup()
    if get_context(comm).arena is None:
        comm.Free()
        pytest.skip("needs a node window")
    kept = C.empty(100_000, np.float64, comm=comm)
    kept[...] = ME
    C.allreduce(kept, out=kept, comm=comm)
    comm.Free()  # the window stays: this array still views it
    assert np.array_equal(kept, np.full(100_000, N * (N - 1) / 2))
    kept[...] = 1  # and may still be written
    other = WORLD.Dup()
    gone = C.empty(10, np.float32, comm=other)
    del gone
    gc.collect()
    other.Free()  # nothing left in this one: freed with it
    assert kept.sum() == 100_000


# -- the torch layer ---------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.usefixtures("runtime")
def test_hpcdl_empty_tensors_are_reduced_in_place_by_the_engine():
    import torch

    import hpcdl as hvd
    from hpcdl import state

    t = hvd.empty(300_000, dtype=torch.float32)
    assert t.shape == (300_000,) and t.dtype == torch.float32
    info = state.current().engine.sets.get(0)
    if info.arena is None:
        pytest.skip("needs a node window")
    assert info.arena.where(t.numpy()) > 0
    t.fill_(ME + 1)
    got = hvd.allreduce_(t, op=hvd.Sum, name="window.tensor")
    assert got.data_ptr() == t.data_ptr()
    assert torch.equal(t, torch.full((300_000,), N * (N + 1) / 2))
    b = hvd.empty((3, 4), dtype=torch.bfloat16)
    assert b.shape == (3, 4) and b.dtype == torch.bfloat16


@pytest.mark.mpi(min_size=2)
@pytest.mark.usefixtures("runtime")
def test_zero_optimizer_keeps_its_flat_buffers_in_the_window():
    import torch

    import hpcdl as hvd
    from hpcdl import state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = hvd.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    info = state.current().engine.sets.get(0)
    if info.arena is None:
        pytest.skip("needs a node window")
    for b in opt.buckets:
        assert info.arena.where(b.zero.flat.numpy()) > 0
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(ME))
    model(x).sum().backward()
    opt.step()
    for b in opt.buckets:
        if b.zero.staging is not None:
            assert info.arena.where(b.zero.staging.numpy()) > 0
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert len(set(WORLD.allgather(digest(flat)))) == 1
    hvd.shutdown()  # the parameters live in the window; they stay readable after the runtime ends
    assert digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()) == digest(flat)
