"""Which launcher started this process (:mod:`hpcdl.launcher`), and where MPI placed every
rank.

hpcdl takes rank, local rank and node from MPI itself (``MPI_COMM_TYPE_SHARED`` splits),
so any launcher works.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ..launcher import check_world, launcher, launcher_size

__all__ = ["launcher", "launcher_size", "check_world", "rank_placement", "pick_device", "servers", "output_is_terminal"]


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
