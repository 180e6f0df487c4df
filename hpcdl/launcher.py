"""Which launcher started this process, and the classic mistake of launching with one whose
tasks MPI does not see as one job.

hpcdl takes rank, local rank and node from MPI itself, so any launcher works. The
launcher's own variables are read only to name it and to catch ``srun`` without an MPI
plugin, or ``mpiexec`` of another MPI than the one mpi4py loads: every task then starts as
its own one-rank job, and each would train, or measure, alone. :func:`hpcdl.init` stops
there (:func:`check_world`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import HpcdlError

__all__ = ["launcher", "launcher_size", "check_world"]

# (launcher, a variable only it sets, the variable holding the task count), looked at in
# this order: hydra's and Open MPI's ranks inside a Slurm allocation still see SLURM_*, and
# srun's PMI-2 plugin sets PMI_RANK as hydra does
_LAUNCHERS = (
    ("mpiexec (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpiexec (MPICH hydra)", "HYDI_CONTROL_FD", "PMI_SIZE"),
    ("srun (Slurm)", "SLURM_STEP_ID", "SLURM_NTASKS"),
    ("a PMI launcher", "PMI_RANK", "PMI_SIZE"),
    ("a PMIx launcher", "PMIX_RANK", None),
)


def _detect(env: Mapping[str, str]) -> tuple[str, str | None]:
    for name, marker, size_var in _LAUNCHERS:
        if marker in env:
            return name, size_var
    return "none (a single process)", None


def launcher(environ: Mapping[str, str] | None = None) -> str:
    """The name of the launcher that started this process, from its environment."""
    return _detect(os.environ if environ is None else environ)[0]


def launcher_size(environ: Mapping[str, str] | None = None) -> int | None:
    """The number of tasks the launcher says it started, when it says."""
    env = os.environ if environ is None else environ
    size_var = _detect(env)[1]
    if size_var and size_var in env:
        try:
            return int(env[size_var])
        except ValueError:
            return None
    return None


def check_world(size: int, environ: Mapping[str, str] | None = None, library: str | None = None) -> None:
    """Raise :class:`~hpcdl.HpcdlError` when the launcher started several tasks but MPI sees
    a world of ``size`` 1; ``library`` names the MPI that mpi4py loads, for the message."""
    expected = launcher_size(environ)
    if expected is not None and expected > 1 and size == 1:
        mpi = f" ({library})" if library else ""
        hint = (
            f"pass srun an MPI plugin that mpi4py's MPI{mpi} speaks (srun --mpi=pmi2, or --mpi=pmix)"
            if launcher(environ).startswith("srun")
            else f"launch with the mpiexec of the MPI library mpi4py loads{mpi}"
        )
        raise HpcdlError(
            f"{launcher(environ)} started {expected} tasks, but MPI sees each as a separate 1-rank job; {hint}"
        )
