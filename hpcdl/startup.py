"""What the training job needs before anything heavy is imported.

``python -m hpcdl.train`` spends its first seconds importing torch and starting MPI, before
the trainer's own signal handling exists. Python's default Ctrl-C there would raise a
KeyboardInterrupt at a different point on each rank: a traceback per rank, and worse, a
rank that leaves before ``MPI_Init`` strands a peer that is already inside it (blocked in C,
where no Python handler runs) and the launcher waits for it forever.

So :func:`note_signals_while_starting`, called first thing by ``hpcdl/__init__.py``, makes a
Ctrl-C during start-up a note instead (:func:`signal_while_starting`): every rank finishes
starting, and the trainer, which takes the note over, stops the job after its first step
with one line and status 130. A second Ctrl-C stops at once; then Python's own ending
applies (death by SIGINT, which makes the launcher end the other ranks), with one line
instead of a traceback. A script that imports hpcdl keeps Python's behaviour.

The job's last second has the opposite problem. Once a rank's outcome is settled, Python's
own shutdown puts back the default action for the signals it handled, and the rank then
spends a while in C (freeing torch, ``MPI_Finalize`` waiting for its peers). A Ctrl-C there
would kill a rank of a job that has completed: status 2 from ``mpiexec`` and its cleanup
message. :func:`ignore_signals_while_ending` makes the ranks ignore SIGINT and SIGTERM from
that point; a shutdown that hangs still ends on a second signal to the launcher (a second
Ctrl-C makes ``mpiexec`` end every rank; Slurm follows SIGTERM with SIGKILL).

A dedicated parameter server's rank never stops by itself: the workers agree on the step to
stop after, write its checkpoint (which takes the servers' state) and then release the
servers. :func:`ignore_sigterm_while_serving` keeps a SIGTERM, which the launcher passes to
every rank, from killing a server before that (a Ctrl-C is noted there, as while starting).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = [
    "ignore_signals_while_ending",
    "ignore_sigterm_while_serving",
    "note_signals_while_starting",
    "running_the_training_job",
    "signal_while_starting",
]

#: where launchers put the rank before MPI is up (MPICH's and Intel's Hydra, Open MPI, PMIx, Slurm)
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK")

_noted: list[int] = []


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


def signal_while_starting() -> int | None:
    """The signal (SIGINT) noted while the training job was starting, or None."""
    return _noted[0] if _noted else None


def note_signals_while_starting() -> None:
    """In the training job: note a first SIGINT instead of raising KeyboardInterrupt, and
    make an uncaught KeyboardInterrupt (a second one) print one line, on the launch's rank 0
    only, instead of a traceback."""
    if not running_the_training_job() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def note(signum: int, frame) -> None:
        if _noted:  # asked twice: stop now
            raise KeyboardInterrupt
        _noted.append(signum)

    signal.signal(signal.SIGINT, note)
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        if issubclass(kind, KeyboardInterrupt):
            if _launch_rank() == 0:
                print("hpcdl.train: interrupted while starting, before the first step", file=sys.stderr, flush=True)
            return  # Python then ends the process by SIGINT, as the launcher expects of a Ctrl-C
        previous(kind, value, tb)

    sys.excepthook = hook


def ignore_signals_while_ending() -> None:
    """In the training job, once a rank's outcome is settled (its summary, error or stop
    said): ignore SIGINT and SIGTERM while it shuts down, instead of dying by them there.
    A script that imports hpcdl keeps Python's behaviour."""
    _ignore((signal.SIGINT, signal.SIGTERM))


def _ignore(signals: tuple[int, ...]) -> None:
    if not running_the_training_job() or threading.current_thread() is not threading.main_thread():
        return
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)


def ignore_sigterm_while_serving() -> None:
    """In the training job, on a dedicated parameter server's rank: ignore SIGTERM, which
    the workers answer for the job (stopping after a step they agree on, with its
    checkpoint) and which killed the server first. A script that imports hpcdl keeps
    Python's behaviour."""
    _ignore((signal.SIGTERM,))
