"""Which launcher started this process, and the classic mistake of launching with one whose
tasks MPI does not see as one job.

hpcdl takes rank, local rank and node from MPI itself, so any launcher works. The
launcher's own variables (:mod:`collectives.launcher`) are read only to name it and to
catch ``srun`` without an MPI plugin, or ``mpiexec`` of another MPI than the one mpi4py
loads: every task then starts as its own one-rank job, and each would train, or measure,
alone. :func:`hpcdl.init` stops there (:func:`check_world`).
"""

from __future__ import annotations

from collections.abc import Mapping

from collectives.launcher import launcher, launcher_size

from .errors import HpcdlError

__all__ = ["launcher", "launcher_size", "check_world"]


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
