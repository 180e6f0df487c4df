"""Run pytest on every rank of an mpiexec job, with only rank 0 talking to the terminal.

Usage: ``mpiexec -n N python tests/mpi_pytest.py [pytest args]``. Other ranks write to
``.pytest-rank<N>.log`` (printed by ``jobs/test.sh`` when the run fails). The redirection
happens here, before pytest captures the standard streams.
"""

from __future__ import annotations

import os
import sys

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
if rank > 0:
    log = open(f".pytest-rank{rank}.log", "w")  # noqa: SIM115 - kept for the process lifetime
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)

# a collective (or an engine request) left waiting by a rank whose test failed ends in an error
# within a minute, so the run goes on to the next test instead of looking hung (jobs/test.sh
# sets the same; a caller's own values win)
os.environ.setdefault("HPCDL_STALL_TIMEOUT", "60")
os.environ.setdefault("HPCDL_STALL_SHUTDOWN_TIME_SECONDS", "60")

import pytest  # noqa: E402 - after the redirection on purpose

# the torch runtime's HPCDL_* names (jobs/test.sh sets its stall shutdown) are valid in every
# test file's environment, also where only the collectives are imported
import hpcdl  # noqa: E402, F401

sys.exit(pytest.main(["--with-mpi", *sys.argv[1:]]))
