"""Which launcher started this process, and where MPI placed every rank.

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

__all__ = ["launcher", "launcher_size", "check_world", "rank_placement", "pick_device", "servers", "output_is_terminal"]

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


def pick_device(choice: str, local_rank: int) -> Any:
    """The torch device a rank trains on: for ``cuda`` (or ``auto`` where torch sees a GPU),
    GPU ``local_rank % GPUs`` of the node (made the current device), else the CPU."""
    import torch

    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def rank_placement(hvd: Any, device: Any = None) -> list[dict[str, Any]]:
    """Every rank's rank, local rank, node index, host, pid and device (collective)."""
    me = {
        "rank": hvd.rank(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "node": hvd.cross_rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device) if device is not None else "cpu",
    }
    return hvd.allgather_object(me)


def servers(hvd: Any) -> dict[str, Any]:
    """The job's dedicated parameter servers (their rank, host and pid), when it has them."""
    job = hvd.state.current().ps
    if job is None:
        return {}
    return {"servers": [{"rank": r, "host": h, "pid": p} for r, (h, p) in zip(job.servers, job.where, strict=True)]}


def output_is_terminal(fd: int = 1, pid: int | None = None, hops: int = 6) -> bool:
    """Whether what this process writes to ``fd`` reaches a terminal. A launcher hands its
    ranks pipes (mpiexec's proxies forward them), so where ``fd`` is a pipe or a socket the
    answer is that of the process at the pipe's other end, found by walking up the parent
    processes (Linux ``/proc``); a file (a Slurm ``.out``, a redirect), ``/dev/null`` or
    anything that cannot be read is not a terminal."""
    if pid is None and os.isatty(fd):
        return True
    pid = os.getpid() if pid is None else pid
    try:
        for _ in range(hops):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith(("pipe:", "socket:")):
                return target.startswith(("/dev/pts/", "/dev/tty"))
            with open(f"/proc/{pid}/stat") as fh:  # the parent's pid follows the ")" ending the name
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
            if pid <= 1:
                return False
    except (OSError, ValueError, IndexError):
        return False
    return False
