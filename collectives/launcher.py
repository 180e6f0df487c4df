"""Which launcher started this process, from the variables it sets: MPICH's Hydra, Open
MPI, Slurm's ``srun``, or another PMI or PMIx launcher. Only the environment is read (MPI
is not initialized), so a tool that starts MPI jobs of its own can ask first whether it was
itself started as one of several tasks.

A Slurm batch script is not a task: ``sbatch`` sets ``SLURM_NTASKS`` for the allocation but
no ``SLURM_STEP_ID``, which only an ``srun`` step has.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

__all__ = ["launcher", "launcher_size", "process_cpus", "node_cores", "waits_poll", "yield_core"]

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


def process_cpus() -> list[int]:
    """The CPUs the launcher (or a binding inside the job) let this process run on; empty
    where the system does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return []


def node_cores(cpus: list[list[int]]) -> int:
    """The cores a node's ranks may run on together: the union of each rank's CPUs
    (:func:`process_cpus`, gathered), or the machine's count where a rank's are unknown."""
    if not cpus or any(not c for c in cpus):
        return os.cpu_count() or 1
    return len(set().union(*cpus))


def waits_poll(cpus: list[list[int]], spin: int = -1) -> bool:
    """Whether ranks of one machine that may run on ``cpus`` (each rank's, gathered) poll
    while they wait, yielding the core between looks, rather than sleep: where they are no
    more than the cores they may run on together (:func:`node_cores`). ``spin``
    (``HPCDL_SHM_SPIN``) decides instead where it is not -1: 0 sleeps, more polls."""
    return spin > 0 if spin >= 0 else len(cpus) <= node_cores(cpus)


def yield_core() -> None:
    """Let other threads and processes run, and come back at once if none wants to: a
    poll's pause where a rank has a core of its own (:func:`waits_poll`). Not
    ``time.sleep(0)``, which is a timer sleep on Linux and took 77 µs on a 2-vCPU virtual
    machine (``sched_yield``: 0.5 µs), so that a poll answered a message only every 77 µs."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()  # releases the GIL, as a sleep does
    else:  # pragma: no cover - not Linux
        time.sleep(0)
