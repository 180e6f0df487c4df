"""Every collective and algorithm against a numpy reference, under mpiexec -n 2, 3, 4; one
rank's calls in one process; the block counts, fold and average the algorithms share."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from reference import COUNTS, DTYPES, OPS, check_close, digest, expected, make_input

import collectives as C
from collectives.blocks import Fold, block_counts, offsets
from collectives.config import Config
from collectives.context import get_context
from collectives.ops import finalize

WORLD = MPI.COMM_WORLD


def same_on_every_rank(comm, a) -> bool:
    return len(set(comm.allgather(digest(a)))) == 1


def fresh(**cfg) -> MPI.Comm:
    """A duplicate of the world with its own configuration."""
    comm = WORLD.Dup()
    get_context(comm, Config(**cfg))
    return comm


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_rank_calls_return_their_input(dtype):
    x = make_input(0, 11, dtype, "sum").reshape(11, 1)
    for op in OPS:
        for alg in C.algorithms("allreduce"):
            assert digest(C.allreduce(x, op=op, algorithm=alg)) == digest(x)
    assert digest(C.reduce_scatter(x)) == digest(x.reshape(-1))
    assert digest(C.allgather(x)) == digest(x)
    assert digest(C.broadcast(x)) == digest(x)
    assert digest(C.reduce(x)) == digest(x)
    assert digest(C.alltoall(x)) == digest(x)
    assert digest(C.iallreduce(x).wait()) == digest(x)
    assert C.iallgather(x).test()


def test_integer_average_truncates_toward_zero():
    buf = np.array([7, -7, 6, -6, 0], np.int32)
    finalize(buf, "avg", 4)
    assert buf.tolist() == [1, -1, 1, -1, 0]


def test_block_counts_follow_mpich():
    assert block_counts(10, 4) == (3, 3, 2, 2)
    assert block_counts(2, 3) == (1, 1, 0)
    assert block_counts(0, 2) == (0, 0)


@pytest.mark.parametrize("n", range(1, 12))
def test_fold_maps_every_rank_once(n):
    folds = [Fold(r, n) for r in range(n)]
    news = sorted(f.new for f in folds if f.new >= 0)
    assert news == list(range(folds[0].p))
    for f in folds:
        if f.new >= 0:
            assert f.actual(f.new) == f.rank
    assert [folds[0].first(k) for k in range(folds[0].p + 1)][-1] == n


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", C.algorithms("allreduce"))
def test_allreduce_every_op_dtype_count(alg):
    n, r = WORLD.size, WORLD.rank
    for op in OPS:
        for dtype in DTYPES:
            for count in COUNTS:
                inputs = [make_input(q, count, dtype, op) for q in range(n)]
                got = C.allreduce(inputs[r], op=op, algorithm=alg)
                what = f"{alg} {op} {np.dtype(dtype)} count={count}"
                check_close(got, expected(inputs, op), op, n, what)
                assert same_on_every_rank(WORLD, got), what


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", C.algorithms("reduce_scatter"))
def test_reduce_scatter_every_op_dtype_count(alg):
    n, r = WORLD.size, WORLD.rank
    for op in OPS:
        for dtype in DTYPES:
            for count in COUNTS:
                inputs = [make_input(q, count, dtype, op) for q in range(n)]
                got = C.reduce_scatter(inputs[r], op=op, algorithm=alg)
                off = offsets(block_counts(count, n))
                want = expected(inputs, op)[off[r] : off[r + 1]]
                check_close(got, want, op, n, f"{alg} {op} {dtype} {count}")
                out = np.full(off[r + 1] - off[r], 7, dtype)
                assert C.reduce_scatter(inputs[r], op=op, algorithm=alg, out=out) is out
                assert digest(out) == digest(got), f"out= {alg} {op} {dtype} {count}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", C.algorithms("allgather"))
def test_allgather_uneven_first_dimension(alg):
    n, r = WORLD.size, WORLD.rank
    for dtype in DTYPES:
        for rows in ([0] * n, [(q * 3) % 4 for q in range(n)], [q + 1 for q in range(n)], [1000 + q for q in range(n)]):
            inputs = [make_input(q, rows[q] * 3, dtype, "sum").reshape(rows[q], 3) for q in range(n)]
            got = C.allgather(inputs[r], algorithm=alg)
            assert digest(got) == digest(np.concatenate(inputs)) and got.shape == (sum(rows), 3), (alg, dtype, rows)
            out = np.full((sum(rows), 3), 7, dtype)
            assert C.allgather(inputs[r], algorithm=alg, out=out) is out
            assert digest(out) == digest(got), ("out=", alg, dtype, rows)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", C.algorithms("allgather"))
def test_allgather_of_a_block_of_out_itself(alg):
    """``x`` may already be this rank's block of ``out`` (ZeroOptimizer's flat parameters):
    the block is not copied onto itself and the result is the same."""
    n, r = WORLD.size, WORLD.rank
    for dtype in DTYPES:
        for count in (1, 37, 70_000):  # one step through the slots, and chunked
            inputs = [make_input(q, count, dtype, "sum") for q in range(n)]
            out = np.full(n * count, 7, dtype)
            mine = out[r * count : (r + 1) * count]
            mine[...] = inputs[r]
            assert C.allgather(mine, algorithm=alg, out=out) is out
            assert digest(out) == digest(np.concatenate(inputs)), (alg, dtype, count)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", C.algorithms("broadcast"))
def test_broadcast_from_every_root(alg):
    n, r = WORLD.size, WORLD.rank
    for dtype in DTYPES:
        for count in COUNTS:
            for root in range(n):
                x = make_input(r, count, dtype, "sum").reshape(count, 1)
                got = C.broadcast(x, root, algorithm=alg)
                assert digest(got) == digest(make_input(root, count, dtype, "sum").reshape(count, 1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", C.algorithms("reduce"))
def test_reduce_onto_every_root(alg):
    n, r = WORLD.size, WORLD.rank
    for op in OPS:
        for dtype in DTYPES:
            for root in range(n):
                inputs = [make_input(q, 17, dtype, op) for q in range(n)]
                got = C.reduce(inputs[r], root, op=op, algorithm=alg)
                if r == root:
                    check_close(got, expected(inputs, op), op, n, f"{alg} {op} {dtype} root={root}")
                else:
                    assert got is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", C.algorithms("alltoall"))
def test_alltoall_with_and_without_splits(alg):
    n, r = WORLD.size, WORLD.rank
    for dtype in DTYPES:
        x = make_input(r, n * 2 * 4, dtype, "sum").reshape(n * 2, 4)
        got = C.alltoall(x, algorithm=alg)
        want = np.concatenate(
            [make_input(q, n * 8, dtype, "sum").reshape(n * 2, 4)[2 * r : 2 * r + 2] for q in range(n)]
        )
        assert digest(got) == digest(want)
    # uneven splits: rank q sends (q + j) % 3 rows to rank j
    splits = [(r + j) % 3 for j in range(n)]
    x = np.arange(sum(splits) * 2, dtype=np.int32).reshape(-1, 2) + 1000 * r
    got = C.alltoall(x, splits, algorithm=alg)
    parts = []
    for q in range(n):
        sq = [(q + j) % 3 for j in range(n)]
        xq = np.arange(sum(sq) * 2, dtype=np.int32).reshape(-1, 2) + 1000 * q
        start = sum(sq[:r])
        parts.append(xq[start : start + sq[r]])
    assert np.array_equal(got, np.concatenate(parts))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("alg", [a for a in C.algorithms("allreduce") if a != "auto"])
def test_large_allreduce_segmented_and_chunked(alg):
    # small segments and a small window make the pipelining and chunking paths run
    comm = fresh(segment_bytes=4096, shm_bytes=8192)
    n, r = comm.size, comm.rank
    for count in (5000, 1 << 18):
        inputs = [make_input(q, count, np.float32, "sum") for q in range(n)]
        got = C.allreduce(inputs[r], algorithm=alg, comm=comm)
        check_close(got, expected(inputs, "sum"), "sum", n, f"{alg} {count}")
        assert same_on_every_rank(comm, got)
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_shm_one_step_and_chunked_paths_of_every_collective():
    # tiny slots and chunks: counts below run in one step through the slots (broadcast and
    # allgather up to 1 KiB, the reductions up to 256 B), the rest in one chunk or many;
    # every dtype, several ops, and inputs that are 2-D or strided
    comm = fresh(shm_small_bytes=256, shm_copy_small_bytes=1024, shm_chunk_bytes=4096)
    n, r = comm.size, comm.rank
    assert get_context(comm).chan is not None
    for dtype in DTYPES:
        for count in (0, 1, 40, 64, 333, 1024, 5003):
            for op in ("sum", "avg", "min") if count < 1000 else ("sum",):
                what = f"{np.dtype(dtype)} {op} count={count}"
                inputs = [make_input(q, count, dtype, op) for q in range(n)]
                want = expected(inputs, op)
                got = C.allreduce(inputs[r], op=op, algorithm="shm", comm=comm)
                check_close(got, want, op, n, "allreduce " + what)
                assert same_on_every_rank(comm, got), what
                off = offsets(block_counts(count, n))
                rs = C.reduce_scatter(inputs[r], op=op, algorithm="shm", comm=comm)
                check_close(rs, want[off[r] : off[r + 1]], op, n, "reduce_scatter " + what)
                red = C.reduce(inputs[r], n - 1, op=op, algorithm="shm", comm=comm)
                if r == n - 1:
                    check_close(red, want, op, n, "reduce " + what)
                bc = C.broadcast(inputs[r], root=n - 1, algorithm="shm", comm=comm)
                assert digest(bc) == digest(inputs[n - 1]), "broadcast " + what
            rows = [count // (q + 1) for q in range(n)]
            parts = [make_input(q, rows[q] * 2, dtype, "sum").reshape(rows[q], 2) for q in range(n)]
            ag = C.allgather(parts[r], algorithm="shm", comm=comm)
            assert digest(ag) == digest(np.concatenate(parts)), f"allgather {np.dtype(dtype)} rows={rows}"
    # an input straddling blocks of out: read whole before its own block or the peers' land
    rows = 700
    parts = [make_input(q, rows * 2, np.float64, "sum").reshape(rows, 2) for q in range(n)]
    out = np.empty((n * rows, 2))
    src = out[rows - 50 : 2 * rows - 50] if r == 0 else out[50 : rows + 50]
    src[...] = parts[r]
    assert C.allgather(src, out=out, algorithm="shm", comm=comm) is out
    assert digest(out) == digest(np.concatenate(parts))
    # 2-D, strided and in-place inputs
    base = [np.arange(600, dtype=np.float64).reshape(20, 30) * (q + 1) for q in range(n)]
    want = sum(base)
    assert np.array_equal(C.allreduce(base[r].T, algorithm="shm", comm=comm), want.T)
    assert np.array_equal(C.allreduce(base[r][:2, :3].T, algorithm="shm", comm=comm), want[:2, :3].T)
    x = base[r].copy()
    assert C.allreduce(x, out=x, algorithm="shm", comm=comm) is x and np.array_equal(x, want)
    comm.Free()


def _forms(r: int) -> str:
    """How rank ``r`` makes a call: the one-step fast path, or one of the general path's entries."""
    return ("fast", "nonblocking", "subclass", "out")[r % 4]


class Sub(np.ndarray):
    """An ndarray subclass: the API takes it, but only through the general path."""


# each collective: (blocking, nonblocking or None, numpy reference from every rank's input)
ONE_STEP = {
    "allreduce": (lambda x, **k: C.allreduce(x, **k), C.iallreduce, lambda xs, r: sum(xs)),
    "reduce_scatter": (
        lambda x, **k: C.reduce_scatter(x, **k),
        C.ireduce_scatter,
        lambda xs, r: sum(xs).reshape(-1)[offsets(block_counts(xs[0].size, len(xs)))[r] :][
            : block_counts(xs[0].size, len(xs))[r]
        ],
    ),
    "allgather": (lambda x, **k: C.allgather(x, **k), C.iallgather, lambda xs, r: np.concatenate(xs)),
    "broadcast": (lambda x, **k: C.broadcast(x, 1, **k), lambda x, **k: C.ibroadcast(x, 1, **k), lambda xs, r: xs[1]),
    "reduce": (
        lambda x, **k: C.reduce(x, 0, **k),
        None,
        lambda xs, r: sum(xs) if r == 0 else None,
    ),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("coll", list(ONE_STEP))
def test_fast_path_meets_general_path_and_nonblocking_peers(coll):
    # rank 0 takes the one-step fast path; the others reach the same call through the
    # nonblocking form, with an ndarray subclass, or with out=/non-contiguous input: all must match
    comm = fresh()
    n, r = comm.size, comm.rank
    blocking, nonblocking, reference = ONE_STEP[coll]
    xs = [np.arange(12, dtype=np.float32).reshape(3, 4) * (q + 1) + q for q in range(n)]
    want = reference(xs, r)
    x = xs[r]
    for _ in range(3):
        form = _forms(r)
        if form == "nonblocking" and nonblocking is not None:
            got = nonblocking(x, comm=comm).wait()
        elif form == "subclass" or (form == "nonblocking" and nonblocking is None):
            got = blocking(x.view(Sub), comm=comm)
        elif form == "out" and coll in ("allreduce", "broadcast"):
            got = np.empty_like(x)
            blocking(x, out=got, comm=comm)
        else:
            got = blocking(np.asfortranarray(x) if form == "out" else x, comm=comm)
        if want is None:
            assert got is None
        else:
            assert digest(got) == digest(want.astype(np.float32)), (coll, form)
    # a mismatch seen from the fast path raises on every rank and leaves the comm usable
    y = np.ones((3 + (r == n - 1), 2), np.float32)
    field = "item shape" if coll == "allgather" else "count"
    y = y.T.copy() if coll == "allgather" else y
    with pytest.raises(C.CollectiveMismatchError, match=field):
        if r == 1 and nonblocking is not None:
            nonblocking(y, comm=comm).wait()
        else:
            blocking(y, comm=comm)
    assert np.array_equal(C.allreduce(np.ones(2, np.float32), comm=comm), np.full(2, n, np.float32))
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_fast_allgather_with_uneven_rows_finishes_on_the_general_path():
    # every rank small, row counts differ: the one-step attempt hands over after agreement
    comm = fresh()
    n, r = comm.size, comm.rank
    parts = [np.full((q + 1, 3), q, np.int16) for q in range(n)]
    out = np.empty((n, 3), np.int16)
    for k in range(3):
        assert np.array_equal(C.allgather(parts[r], comm=comm), np.concatenate(parts))
        assert np.array_equal(C.allgather(parts[0], comm=comm), np.concatenate([parts[0]] * n))
        # the same out again and again, with new data each time
        assert C.allgather(parts[0] + r + k, out=out, comm=comm) is out
        assert np.array_equal(out, np.concatenate([parts[0] + q + k for q in range(n)]))
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("per_node", [1, 2, 3])
@pytest.mark.parametrize("alg", ["hierarchical", "shm"])
def test_simulated_nodes(per_node, alg):
    comm = fresh(ranks_per_node=per_node, shm_bytes=4096)
    n, r = comm.size, comm.rank
    lay = get_context(comm).topology()
    assert lay.nodes == -(-n // per_node)
    assert lay.node.size == min(per_node, n - (r // per_node) * per_node)
    assert lay.homogeneous == (n % per_node == 0 or n < per_node)
    for op in ("sum", "avg", "max"):
        for count in (0, 1, 7, 3001):
            inputs = [make_input(q, count, np.float64, op) for q in range(n)]
            got = C.allreduce(inputs[r], op=op, algorithm=alg, comm=comm)
            check_close(got, expected(inputs, op), op, n, f"{alg} {op} per_node={per_node} count={count}")
            assert same_on_every_rank(comm, got)
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_nonblocking_several_in_flight_waited_in_any_order():
    n, r = WORLD.size, WORLD.rank
    algs = ["ring", "native", "shm", "recursive_doubling", "rabenseifner", "hierarchical", "tree"]
    inputs = {a: [make_input(q, 1000 + i, np.float32, "sum", seed=i) for q in range(n)] for i, a in enumerate(algs)}
    reqs = {a: C.iallreduce(inputs[a][r], algorithm=a) for a in algs}
    rs = C.ireduce_scatter(inputs["ring"][r])
    ag = C.iallgather(inputs["tree"][r][: r + 1])
    bc = C.ibroadcast(inputs["shm"][r], root=n - 1)
    order = algs[r % len(algs) :] + algs[: r % len(algs)]
    for a in order:
        check_close(reqs[a].wait(), expected(inputs[a], "sum"), "sum", n, a)
    off = offsets(block_counts(1000, n))
    check_close(rs.wait(), expected(inputs["ring"], "sum")[off[r] : off[r + 1]], "sum", n, "ireduce_scatter")
    assert digest(ag.wait()) == digest(np.concatenate([inputs["tree"][q][: q + 1] for q in range(n)]))
    assert digest(bc.wait()) == digest(inputs["shm"][n - 1])
    assert bc.test()


@pytest.mark.mpi(min_size=2)
def test_out_in_place_and_non_contiguous_input():
    n, r = WORLD.size, WORLD.rank
    base = [np.arange(60, dtype=np.float64).reshape(6, 10) * (q + 1) for q in range(n)]
    want = sum(base)
    x = base[r].copy()
    y = C.allreduce(x, out=x)
    assert y is x and np.array_equal(x, want)
    for alg in ("ring", "native"):
        strided = base[r].T  # not C-contiguous
        got = C.allreduce(strided, algorithm=alg)
        assert np.array_equal(got, want.T) and got.shape == (10, 6)
        out = np.empty((10, 6))
        assert C.allreduce(strided, algorithm=alg, out=out) is out and np.array_equal(out, want.T)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("coll", ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"])
def test_a_layout_on_one_rank_only_keeps_every_rank_on_the_same_tags(coll):
    """Each rank's input layout is its own business: one rank's column slice, another's
    reversed view, an ``out`` on a third must not make that rank draw a point-to-point tag
    the others do not (a shm allreduce of a non-contiguous input on one rank once did, and
    the next tree or ring collective waited forever on mismatched tags). Checked directly,
    every rank's next tag the same after each algorithm, then by a tree and a ring call."""
    n, r = WORLD.size, WORLD.rank
    comm = fresh(shm_small_bytes=256, shm_copy_small_bytes=1024, shm_chunk_bytes=4096, segment_bytes=512)
    ctx = get_context(comm)
    inputs = [np.arange(189.0).reshape(63, 3) * (q + 1) for q in range(n)]
    flat = np.concatenate([a.reshape(-1) for a in inputs])
    for alg in C.algorithms(coll):
        kind = r % 3  # contiguous, a column block of a wider array, reversed rows
        x = inputs[r].copy()
        if kind == 1:
            x = np.zeros((63, 5))[:, 1:4]
            x[...] = inputs[r]
        elif kind == 2:
            x = np.zeros((63, 3))[::-1]
            x[...] = inputs[r]
        out = None if r % 2 else "given"
        if coll == "allreduce":
            got = C.allreduce(x, algorithm=alg, comm=comm, out=np.empty((63, 3)) if out else None)
            assert np.array_equal(got, sum(inputs)), alg
        elif coll == "reduce_scatter":
            got = C.reduce_scatter(x, algorithm=alg, comm=comm)
            off = offsets(block_counts(x.size, n))
            assert np.array_equal(got, sum(inputs).reshape(-1)[off[r] : off[r + 1]]), alg
        elif coll == "allgather":
            assert np.array_equal(C.allgather(x, algorithm=alg, comm=comm), flat.reshape(-1, 3)), alg
        elif coll == "broadcast":
            got = C.broadcast(x, n - 1, algorithm=alg, comm=comm)
            assert np.array_equal(got, inputs[n - 1]), alg
        else:
            got = C.reduce(x, n - 1, algorithm=alg, comm=comm)
            assert got is None if r != n - 1 else np.array_equal(got, sum(inputs)), alg
        assert len(set(comm.allgather(ctx.next_tag()))) == 1, f"{coll} {alg}: the ranks' tags went apart"
        for follow in ("tree", "ring"):
            assert np.array_equal(C.allreduce(inputs[r], algorithm=follow, comm=comm), sum(inputs))
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_freed_communicators_context_is_never_reused():
    # get_context remembers the last communicator object; freeing it must forget it
    a = WORLD.Dup()
    ctx = get_context(a)
    assert get_context(a) is ctx
    assert np.array_equal(C.allreduce(np.ones(2), comm=a), np.full(2, float(a.size)))
    a.Free()
    b = WORLD.Dup()
    assert get_context(b) is not ctx
    assert np.array_equal(C.allreduce(np.ones(2), comm=b), np.full(2, float(b.size)))
    b.Free()
