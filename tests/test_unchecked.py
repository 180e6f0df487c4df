"""collectives.unchecked: the entry points for callers that agreed the arguments already
(hpcdl's engine) give the public collectives' results, post no signature unless the call
finishes in one step, and the runtime refuses ranks whose configurations differ."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import collectives as C
import hpcdl as hvd
from collectives import unchecked
from collectives.context import get_context

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
N, ME = COMM.size, COMM.rank
# one element, a small message (one step through the node channel) and a chunked one
COUNTS = [1, 1000, 100_000]


def inputs(count: int, seed: int = 0) -> list[np.ndarray]:
    return [np.random.default_rng([seed, r, count]).uniform(-1, 1, count).astype(np.float32) for r in range(N)]


@pytest.mark.parametrize("count", COUNTS)
def test_agreed_calls_give_the_public_results(count):
    xs = inputs(count)
    want = np.sum(np.stack(xs).astype(np.float64), axis=0)
    got = unchecked.allreduce(xs[ME], op="sum", comm=COMM)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * N)
    assert np.array_equal(got, C.allreduce(xs[ME], op="sum", comm=COMM))  # bitwise the public path's
    out = np.empty(count, np.float32)
    assert unchecked.allreduce(xs[ME], op="max", out=out, comm=COMM) is out
    assert np.array_equal(out, np.max(np.stack(xs), axis=0))
    for root in range(N):
        x = xs[ME] if ME == root else np.zeros(count, np.float32)
        assert np.array_equal(unchecked.broadcast(x, root, comm=COMM), xs[root])
    block = unchecked.reduce_scatter(xs[ME], op="sum", comm=COMM)
    assert np.array_equal(block, C.reduce_scatter(xs[ME], op="sum", comm=COMM))


@pytest.mark.parametrize("count", COUNTS)
def test_agreed_allgather_takes_every_ranks_rows(count):
    rows = [count + r % 2 for r in range(N)]  # uneven when N > 1
    xs = [np.full((rows[r], 2), r, np.int32) for r in range(N)]
    got = unchecked.allgather(xs[ME], rows, comm=COMM)
    assert np.array_equal(got, np.concatenate(xs))
    out = np.empty((sum(rows), 2), np.int32)
    assert unchecked.allgather(xs[ME], rows, out=out, comm=COMM) is out
    assert np.array_equal(out, np.concatenate(xs))


def test_agreed_calls_on_one_node_post_where_their_buffers_lie():
    ctx = get_context(COMM)
    ch = ctx.chan
    if ch is None:
        pytest.skip("needs a node channel (two or more ranks on one node)")
    big = np.ones(100_000, np.float32)  # above the one-step size: chunked
    seq = ch.seq
    unchecked.allreduce(big, comm=COMM)
    assert ch.seq == seq + 1  # its signature and arena words, no more
    assert ch.wheres(ch.seq)[ch.me] == (0, 0)  # ordinary memory
    shared = C.empty(100_000, np.float32, comm=COMM)
    shared[...] = 1
    unchecked.allreduce(shared, out=shared, comm=COMM)
    assert ch.wheres(ch.seq)[ch.me] == (ctx.arena.where(shared),) * 2
    assert np.array_equal(shared, np.full(100_000, N, np.float32))
    unchecked.allreduce(np.ones(4, np.float32), comm=COMM)
    assert ch.seq == seq + 3  # a one-step call posts, since its data travels with it


def test_init_refuses_ranks_that_configure_the_collectives_differently(monkeypatch):
    if N < 2:
        pytest.skip("needs two ranks")
    hvd.shutdown()
    if ME == 1:
        monkeypatch.setenv("HPCDL_SHM_SMALL_BYTES", "4096")
    with pytest.raises(hvd.HpcdlError, match=r"ranks \[1\] configure the collectives layer differently"):
        hvd.init()
    assert not hvd.is_initialized()


def test_init_refuses_ranks_whose_fusion_settings_differ():
    if N < 2:
        pytest.skip("needs two ranks")
    hvd.shutdown()
    for field in ("fusion_alone_bytes", "bucket_bytes", "first_bucket_bytes"):
        cfg = hvd.Config(**{field: 1000 + ME})
        with pytest.raises(hvd.HpcdlError, match=rf"every rank needs the same {field} \(HPCDL_{field.upper()}\)"):
            hvd.init(config=cfg)
        assert not hvd.is_initialized()
    hvd.init(config=hvd.Config(bucket_bytes=1000))
    try:
        assert hvd.state.current().config.bucket_bytes == 1000
    finally:
        hvd.shutdown()
