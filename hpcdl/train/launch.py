"""Which launcher started this process, and the rank layout MPI reports.

hpcdl takes rank, local rank and node from MPI itself (``MPI_COMM_TYPE_SHARED`` splits),
so any launcher works. The launcher's own variables are read only to name it and to catch
the classic mistake of ``srun`` without an MPI plugin (or ``mpirun`` of a different MPI
than the one mpi4py uses): every task then starts as its own one-rank job.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["launcher", "launcher_size", "check_world", "layout"]

# (launcher, variable holding the rank, variable holding the size)
_LAUNCHERS = (
    ("srun (Slurm)", "SLURM_PROCID", "SLURM_NTASKS"),
    ("mpiexec (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpiexec (MPICH hydra)", "PMI_RANK", "PMI_SIZE"),
    ("mpiexec (PMIx)", "PMIX_RANK", None),
)


def launcher(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    # mpiexec inside a Slurm allocation also sees SLURM_* (but not SLURM_STEP_ID's task vars
    # for its own ranks), so the MPI launchers' variables are looked at first
    for name, rank_var, _ in _LAUNCHERS[1:] + _LAUNCHERS[:1]:
        if rank_var in env:
            if name.startswith("srun") and "SLURM_STEP_ID" not in env:
                continue
            return name
    return "none (a single process)"


def launcher_size(environ: Mapping[str, str] | None = None) -> int | None:
    """The number of tasks the launcher says it started, when it says."""
    env = os.environ if environ is None else environ
    name = launcher(env)
    for n, _, size_var in _LAUNCHERS:
        if n == name and size_var and size_var in env:
            try:
                return int(env[size_var])
            except ValueError:
                return None
    return None


def check_world(size: int, environ: Mapping[str, str] | None = None) -> None:
    """Raise when the launcher started several tasks but MPI sees a world of ``size`` 1."""
    expected = launcher_size(environ)
    if expected is not None and expected > 1 and size == 1:
        hint = (
            "pass srun an MPI plugin that mpi4py's MPI speaks (srun --mpi=pmi2, or --mpi=pmix)"
            if launcher(environ).startswith("srun")
            else "launch with the mpiexec of the MPI library mpi4py was built against"
        )
        raise RuntimeError(
            f"{launcher(environ)} started {expected} tasks, but MPI sees each as a separate 1-rank job; {hint}"
        )


def layout(hvd: Any) -> list[dict[str, Any]]:
    """Every rank's rank, local rank, node index, host and pid (collective)."""
    me = {
        "rank": hvd.rank(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "node": hvd.cross_rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    return hvd.allgather_object(me)
