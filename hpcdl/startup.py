"""What the training job needs before anything heavy is imported.

``python -m hpcdl.train`` spends its first seconds importing torch and MPI, before the job's
own Ctrl-C handling (:func:`collectives.cli.run_main`, then the trainer's) exists. A Ctrl-C
then would print a traceback on every rank. :func:`quiet_interrupt_while_starting`, called
first thing by ``hpcdl/__init__.py``, makes it one line instead, when this process is the
training job; a script that imports hpcdl keeps Python's own behaviour.
"""

from __future__ import annotations

import os
import sys

__all__ = ["quiet_interrupt_while_starting", "running_the_training_job"]

#: where launchers put the rank before MPI is up (MPICH's and Intel's Hydra, Open MPI, PMIx, Slurm)
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK")


def running_the_training_job() -> bool:
    """Whether this process was started as ``python -m hpcdl.train`` or ``hpcdl-train``."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] in ("hpcdl.train", "hpcdl.train.__main__"):
        return True
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "hpcdl-train"


def _launch_rank() -> int:
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def quiet_interrupt_while_starting() -> None:
    """In the training job, an uncaught KeyboardInterrupt (Ctrl-C while modules are still
    being imported) prints one line, on the launch's rank 0 only, and the process still ends
    as Python ends one on SIGINT (status 130). Other exceptions keep the hook they had."""
    if not running_the_training_job():
        return
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        if issubclass(kind, KeyboardInterrupt):
            if _launch_rank() == 0:
                print("hpcdl.train: interrupted while starting, before the first step", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(130)  # the status a shell gives Ctrl-C; a death by SIGINT would make mpiexec print a banner
        previous(kind, value, tb)

    sys.excepthook = hook
