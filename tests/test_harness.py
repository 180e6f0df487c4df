"""The mpiexec test harness itself: a test that fails on one rank while the others go on into
collectives fails on every rank within the stall timeout, and the tests after it still run."""

from __future__ import annotations

import os

import pytest
from conftest import ROOT, mpiexec_job


@pytest.mark.timeout(120)
def test_a_test_failing_on_one_rank_leaves_the_next_tests_running():
    job = mpiexec_job(
        ["tests/mpi_pytest.py", "-q", "-p", "no:cacheprovider", "--timeout=60", "-m", "mpi", "tests/out_of_step_job.py"],
        n=3,
        timeout=100,
        env={"HPCDL_STALL_TIMEOUT": "3"},
    )
    out = job.stdout + job.stderr
    assert job.returncode == 1, out
    assert "rank 0 fails here on purpose" in out
    assert "1 failed, 1 passed" in out, out
    for r in (1, 2):  # the others failed too, in a stall error, and ran the next test
        with open(os.path.join(ROOT, f".pytest-rank{r}.log")) as f:
            log = f.read()
        assert "StallError" in log and "1 failed, 1 passed" in log, log
