"""Test set-up shared by the single-process and the mpiexec runs: the runtime fixtures, a
directory every rank sees, and the helpers that launch a whole job under mpiexec.

A module picks its runtime fixture by name, e.g.
``pytestmark = pytest.mark.usefixtures("runtime")``. Test modules import the job helpers
(``from conftest import mpiexec_job``); torch and numpy helpers live in plain modules
(``tensors.py``, ``reference.py``), so no test module imports another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# one intra-op thread per rank: ranks already share two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: the repository root: the working directory of every job launched from a test
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the mpiexec installed next to this interpreter (the virtual environment's MPICH)
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


# -- every rank agrees on each test's outcome (mpiexec runs) -------------------------------------
_OUTCOMES = None
"""A communicator of its own for the outcome agreement, in mpiexec runs (``--with-mpi``)."""

#: seconds before pytest-timeout ends a hung test at which every rank prints its stacks
STACKS_BEFORE_TIMEOUT = 15


def pytest_configure(config):
    global _OUTCOMES
    if config.getoption("with_mpi", default=False):
        from mpi4py import MPI

        _OUTCOMES = MPI.COMM_WORLD.Dup()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each rank prints every thread's stack shortly before pytest-timeout ends a hung test
    (its timer on one rank ends the whole job, before the other ranks could print theirs);
    after a test that failed on any rank, the ranks start the next one with the
    collectives' state of the world communicator made anew (a stall stops it)."""
    import faulthandler

    timeout = item.config.getoption("timeout", default=None) or 0
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        timeout = marker.args[0]
    armed = _OUTCOMES is not None and timeout > STACKS_BEFORE_TIMEOUT
    if armed:
        # to the process's own stderr (the rank's log), not pytest's capture of it
        faulthandler.dump_traceback_later(timeout - STACKS_BEFORE_TIMEOUT, exit=False, file=sys.__stderr__)
    item.failed_on_some_rank = False
    yield
    if armed:
        faulthandler.cancel_dump_traceback_later()
    if item.failed_on_some_rank:
        import collectives

        collectives.reset()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In mpiexec runs, the ranks agree on each phase's outcome before going on: a test that
    failed on one rank fails on every rank, naming the ranks, and no rank starts the next
    test while another is still in this one. A rank still waiting in a collective for one
    that failed ends with the collectives' stall error (``HPCDL_STALL_TIMEOUT``)."""
    outcome = yield
    if _OUTCOMES is None:
        return
    report = outcome.get_result()
    failed = [r for r, bad in enumerate(_OUTCOMES.allgather(report.failed)) if bad]
    if failed:
        item.failed_on_some_rank = True
        if not report.failed:
            report.outcome = "failed"
            report.longrepr = f"{report.when} failed on rank(s) {failed} (their output: .pytest-rank<N>.log)"


# -- the hpcdl runtime ---------------------------------------------------------------------------
@pytest.fixture
def runtime():
    """The runtime initialised on every rank for the test, shut down after it."""
    import hpcdl as hvd

    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def clean_runtime():
    """No runtime when the test starts (it calls ``hvd.init`` itself) and none after it."""
    import hpcdl as hvd

    hvd.shutdown()
    yield
    hvd.shutdown()


@pytest.fixture
def shutdown_after():
    """The runtime the test started (or not) shut down after it."""
    import hpcdl as hvd

    yield
    hvd.shutdown()


# -- files every rank sees -----------------------------------------------------------------------
@pytest.fixture()
def run_dir():
    """A temporary directory named by rank 0, the same path on every rank (each rank's
    ``tmp_path`` differs), removed after the test."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkdtemp(prefix="hpcdl-train-") if world.rank == 0 else None)
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


# -- whole jobs under mpiexec --------------------------------------------------------------------
def _mpiexec(args: list[str], n: int, env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """The command line ``mpiexec -n N python ARGS`` and its environment: this process's, one
    intra-op thread per rank, then ``env``."""
    return [MPIEXEC, "-n", str(n), sys.executable, *args], {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}


def mpiexec_job(
    args: list[str], n: int = 2, timeout: float = 120, env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n N python ARGS`` from the repository root to its end and return it,
    with its output as text; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    cmd, environ = _mpiexec(args, n, env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=environ, **kw)


def mpiexec_start(args: list[str], n: int = 2, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """Start ``mpiexec -n N python ARGS`` from the repository root, its output piped, for a
    test that acts on the job while it runs (the test waits for it and ends it)."""
    cmd, environ = _mpiexec(args, n, env)
    return subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
