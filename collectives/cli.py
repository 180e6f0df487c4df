"""Helpers for launcher-facing entry points (scripts run under ``mpiexec``)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["run_main", "parse_size"]


def parse_size(text: str) -> int:
    """Parse a byte count for a command line: ``4``, ``64K``, ``16M``, ``1G``."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text and text[-1] in mult else int(text)


def run_main(main: Callable[[], Any]) -> Any:
    """Run ``main()``; on any uncaught exception print it and abort the whole MPI job.

    Without this, one rank dying leaves the others waiting forever inside a collective.
    """
    try:
        return main()
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        _abort(exc, int(exc.code) if isinstance(exc.code, int) else 1)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the job
        _abort(exc, 1)


def _abort(exc: BaseException, code: int) -> None:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
    sys.stdout.flush()
    print(f"[rank {rank}] aborting the job after an uncaught exception:", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(code)
