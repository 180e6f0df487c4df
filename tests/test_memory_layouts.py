"""Every collective takes any memory layout on any subset of ranks: contiguous, strided,
reversed, Fortran-ordered 2-D and column slices, zero-size, for sizes on both sides of
each path's threshold (the one-step call through the node channel, the chunked window,
the ring's segments), checked against numpy on every rank.

Hypothesis draws the same examples on every rank (``derandomize``), and every rank
learns whether any rank failed before the test judges, so all ranks fail together and
nothing waits for a rank that has stopped.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from reference import check_close, expected, make_input

import collectives as C
from collectives.blocks import block_counts, offsets
from collectives.config import Config
from collectives.context import get_context

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, ME = WORLD.size, WORLD.rank
LAYOUTS = ("contiguous", "strided", "reversed", "fortran", "column")
DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int8]
# float32 elements around the small comm's thresholds: one step up to 256 B (64 elements;
# broadcast and allgather up to 1 KiB), chunks of 4 KiB through the window, ring segments of 512 B
COUNTS = [0, 1, 3, 63, 64, 65, 200, 700, 2500]
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


@pytest.fixture(scope="module")
def comms():
    small = WORLD.Dup()
    get_context(small, Config(shm_small_bytes=256, shm_copy_small_bytes=1024, shm_chunk_bytes=4096, segment_bytes=512))
    default = WORLD.Dup()
    get_context(default)
    yield {"small": small, "default": default}
    small.Free()
    default.Free()


def laid_out(a: np.ndarray, layout: str) -> np.ndarray:
    """``a``'s values in an array of the same shape laid out as ``layout``: a view into a
    larger or reordered buffer, not ``a``'s own memory."""
    if layout == "contiguous":
        v = np.zeros(a.shape, a.dtype)
    elif layout == "strided":  # every other element of the last axis
        v = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)[..., ::2]
    elif layout == "reversed":  # negative strides along the first axis
        v = np.zeros(a.shape, a.dtype)[::-1]
    elif layout == "fortran":
        v = np.zeros(a.shape, a.dtype, order="F")
    elif a.ndim == 1:  # a column of a 2-D array
        v = np.zeros((a.shape[0], 2), a.dtype)[:, 1]
    else:  # a block of columns of a wider 2-D array
        v = np.zeros((a.shape[0], a.shape[1] + 2), a.dtype)[:, 1:-1]
    v[...] = a
    return v


def everyone_agrees(ok: bool) -> bool:
    return WORLD.allreduce(ok, op=MPI.LAND)


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)
@given(
    coll=st.sampled_from(COLLECTIVES),
    count=st.sampled_from(COUNTS),
    width=st.sampled_from([0, 3]),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(["sum", "max", "avg"]),
    layouts=st.lists(st.sampled_from(LAYOUTS), min_size=N, max_size=N),  # one per rank
    algorithm=st.sampled_from(["auto", "shm", "ring", "native", "tree", "recursive_doubling"]),
    which=st.sampled_from(["small", "default"]),
    root=st.integers(0, 3),
    seed=st.integers(0, 3),
)
def test_any_layout_on_any_ranks_gives_numpys_result(
    comms, coll, count, width, dtype, op, layouts, algorithm, which, root, seed
):
    if algorithm not in C.algorithms(coll):
        algorithm = "auto"
    root %= N
    shape = (count, width) if width else (count,)
    comm = comms[which]
    problem = None
    try:  # everything that can raise, so that no rank leaves the others waiting
        flat = [make_input(r, count * max(width, 1), dtype, op, seed) for r in range(N)]
        inputs = [f.reshape(shape) for f in flat]
        x = laid_out(inputs[ME], layouts[ME])
        if coll == "allreduce":
            got = C.allreduce(x, op=op, algorithm=algorithm, comm=comm)
            check_close(got, expected(inputs, op).astype(got.dtype), op, N, "allreduce")
        elif coll == "reduce_scatter":
            got = C.reduce_scatter(x, op=op, algorithm=algorithm, comm=comm)
            off = offsets(block_counts(x.size, N))
            want = expected(flat, op).reshape(-1)[off[ME] : off[ME + 1]]
            check_close(got, want.astype(got.dtype), op, N, "reduce_scatter")
        elif coll == "allgather":
            got = C.allgather(x, algorithm=algorithm, comm=comm) if x.ndim else None
            if got is not None:
                assert np.array_equal(got, np.concatenate(inputs)), "allgather"
        elif coll == "broadcast":
            mine = x if ME == root else laid_out(np.zeros(shape, dtype), layouts[ME])
            got = C.broadcast(mine, root, algorithm=algorithm, comm=comm)
            assert np.array_equal(got, inputs[root]), "broadcast"
        else:
            got = C.reduce(x, root, op=op, algorithm=algorithm, comm=comm)
            if ME == root:
                check_close(got, expected(inputs, op).astype(got.dtype), op, N, "reduce")
            else:
                assert got is None
    except Exception as exc:  # noqa: BLE001 - reported after every rank has had its say
        problem = f"rank {ME}: {type(exc).__name__}: {exc}"
    problems = [p for p in WORLD.allgather(problem) if p is not None]
    assert everyone_agrees(not problems), f"{coll} {algorithm} {shape} {np.dtype(dtype)} {layouts}: {problems}"
