"""A test file run only as a job by ``test_harness.py`` (its name keeps pytest from collecting
it in the suite): its first test fails on rank 0 alone, while the other ranks go on calling
collectives that rank 0 never reaches; the tests after it must run and pass on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import collectives as C

WORLD = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_fails_on_rank_0_while_the_others_go_on():
    assert np.array_equal(C.allreduce(np.ones(2)), np.full(2, float(WORLD.size)))
    assert WORLD.rank != 0, "rank 0 fails here on purpose"
    for _ in range(3):  # rank 0 never makes these calls
        C.allreduce(np.ones(2))


@pytest.mark.mpi(min_size=2)
def test_the_next_test_runs_on_a_fresh_start():
    for k in range(3):
        got = C.allreduce(np.full(3, k + WORLD.rank, np.int64))
        assert np.array_equal(got, np.full(3, WORLD.size * k + WORLD.size * (WORLD.size - 1) // 2))
