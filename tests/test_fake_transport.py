"""Property-based tests: every algorithm driven through the in-process thread transport."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import DTYPES, OPS, check_close, digest, expected, make_input

import collectives as C
from collectives.blocks import block_counts, offsets
from collectives.config import Config
from collectives.context import get_context
from collectives.fake import run_ranks

P2P = {c: [a for a in C.algorithms(c) if a != "native"] for c in ("allreduce", "reduce_scatter", "allgather")}

sizes = st.integers(min_value=1, max_value=5)
counts = st.integers(min_value=0, max_value=40)
dtypes = st.sampled_from(DTYPES)
ops = st.sampled_from(OPS)
node_sizes = st.integers(min_value=1, max_value=3)
segments = st.sampled_from([64, 128, 1 << 20])


def _ctx(t, node_size_unused=None, segment=1 << 20, shm=4096):
    # a context with small segments, windows and chunks, so pipelining and chunking are exercised
    return get_context(t, Config(segment_bytes=segment, shm_bytes=shm, shm_chunk_bytes=4096))


@settings(max_examples=60, deadline=None)
@given(n=sizes, count=counts, dtype=dtypes, op=ops, node=node_sizes, seg=segments, seed=st.integers(0, 9))
def test_allreduce_every_algorithm(n, count, dtype, op, node, seg, seed):
    inputs = [make_input(r, count, dtype, op, seed) for r in range(n)]
    want = expected(inputs, op)

    def body(t):
        _ctx(t, segment=seg)
        return {a: C.allreduce(inputs[t.rank], op=op, algorithm=a, comm=t) for a in P2P["allreduce"]}

    results = run_ranks(n, body, node_size=node)
    for alg in P2P["allreduce"]:
        check_close(results[0][alg], want, op, n, f"{alg} n={n} count={count} {np.dtype(dtype)} {op}")
        assert len({digest(res[alg]) for res in results}) == 1, f"{alg}: ranks differ bitwise"


@settings(max_examples=40, deadline=None)
@given(n=sizes, count=counts, dtype=dtypes, op=ops, seg=segments)
def test_reduce_scatter_every_algorithm(n, count, dtype, op, seg):
    inputs = [make_input(r, count, dtype, op) for r in range(n)]
    want = expected(inputs, op)
    off = offsets(block_counts(count, n))

    def body(t):
        _ctx(t, segment=seg)
        return {a: C.reduce_scatter(inputs[t.rank], op=op, algorithm=a, comm=t) for a in P2P["reduce_scatter"]}

    results = run_ranks(n, body)
    for r in range(n):
        for alg in P2P["reduce_scatter"]:
            check_close(results[r][alg], want[off[r] : off[r + 1]], op, n, f"{alg} rank {r} n={n} count={count}")


@settings(max_examples=40, deadline=None)
@given(n=sizes, rows=st.lists(st.integers(0, 6), min_size=5, max_size=5), dtype=dtypes, width=st.integers(1, 3))
def test_allgather_every_algorithm(n, rows, dtype, width):
    inputs = [make_input(r, rows[r] * width, dtype, "sum").reshape(rows[r], width) for r in range(n)]
    want = np.concatenate(inputs)

    def body(t):
        _ctx(t)
        return {a: C.allgather(inputs[t.rank], algorithm=a, comm=t) for a in P2P["allgather"]}

    for res in run_ranks(n, body):
        for alg in P2P["allgather"]:
            assert res[alg].shape == want.shape and digest(res[alg]) == digest(want), alg


@settings(max_examples=30, deadline=None)
@given(n=sizes, count=st.sampled_from([0, 1, 3, 40, 1500, 5001]), dtype=dtypes, op=ops, data=st.data())
def test_broadcast_and_reduce_tree_and_shm(n, count, dtype, op, data):
    root = data.draw(st.integers(0, n - 1))
    inputs = [make_input(r, count, dtype, op) for r in range(n)]
    want = expected(inputs, op)

    def body(t):
        _ctx(t)
        out = {}
        for alg in ("tree", "shm"):
            b = C.broadcast(inputs[t.rank], root, algorithm=alg, comm=t)
            red = C.reduce(inputs[t.rank], root, op=op, algorithm=alg, comm=t)
            out[alg] = b, red
        return out

    for r, res in enumerate(run_ranks(n, body)):
        for alg, (b, red) in res.items():
            assert digest(b) == digest(inputs[root]), alg
            if r == root:
                check_close(red, want, op, n, f"{alg} reduce root={root} count={count}")
            else:
                assert red is None


@settings(max_examples=20, deadline=None)
@given(n=sizes, per=st.integers(0, 3), dtype=dtypes)
def test_alltoall_pairwise(n, per, dtype):
    inputs = [make_input(r, n * per * 2, dtype, "sum").reshape(n * per, 2) for r in range(n)]

    def body(t):
        return C.alltoall(inputs[t.rank], comm=t)

    for r, got in enumerate(run_ranks(n, body)):
        want = np.concatenate([inputs[s][r * per : (r + 1) * per] for s in range(n)])
        assert digest(got) == digest(want)


def test_several_nonblocking_in_flight_complete_in_any_wait_order():
    n = 3
    xs = [[make_input(r, 50 + k, np.float64, "sum", seed=k) for r in range(n)] for k in range(4)]

    def body(t):
        reqs = [
            C.iallreduce(xs[k][t.rank], algorithm=alg, comm=t)
            for k, alg in enumerate(["ring", "recursive_doubling", "shm", "rabenseifner"])
        ]
        # each rank waits in a different order: progress must not depend on it
        order = list(range(4))[t.rank :] + list(range(4))[: t.rank]
        got = {}
        for k in order:
            got[k] = reqs[k].wait()
        return got

    for res in run_ranks(n, body, node_size=2):
        for k in range(4):
            check_close(res[k], expected(xs[k], "sum"), "sum", n, f"request {k}")


def test_mismatch_raises_on_every_thread_rank():
    def body(t):
        x = np.zeros(4 + t.rank, np.float32)
        with pytest.raises(C.CollectiveMismatchError, match="count"):
            C.allreduce(x, comm=t)
        return C.allreduce(np.ones(2, np.float32), comm=t)  # still usable

    for res in run_ranks(3, body):
        assert np.array_equal(res, np.full(2, 3, np.float32))
