"""Helpers for launcher-facing entry points (scripts run under ``mpiexec``)."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = [
    "ArgumentParser",
    "run_main",
    "parse_size",
    "parse_sizes",
    "output_file",
    "output_dir",
    "dump_json",
    "replace_file",
]

_DRAIN_S = 0.5
"""How long a failing rank waits between printing why and ``MPI_Abort``: the abort tears
the job down at once, and output that the launcher has not forwarded yet, this rank's or a
peer's failing alike, would be lost (MPICH's hydra cut a usage message short in 2 of 40
tries without the wait)."""

_MULT = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def world_rank() -> int:
    """This process's rank in ``MPI.COMM_WORLD`` (0 outside an MPI job or after finalize)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else 0


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for a script every rank of an ``mpiexec`` job runs: help
    and usage errors are printed by world rank 0 only, instead of once per rank; every
    rank still parses alike and exits with the same status."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if world_rank() == 0:
            super()._print_message(message, file)

    def require_at_least(self, *checks: tuple[str, int, int]) -> None:
        """A usage error (status 2) naming the first ``(flag, value, least)`` whose value is
        below ``least``: ``--rounds 0: must be at least 1``."""
        for flag, value, least in checks:
            if value < least:
                self.error(f"{flag} {value}: must be at least {least}")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dump_json(obj: Any, fh: Any, **kw: Any) -> None:
    """``json.dump`` that writes valid JSON only: a non-finite float (a ratio of a zero
    time, say) becomes ``null`` instead of the ``NaN``/``Infinity`` JSON has no word for."""
    json.dump(_finite(obj), fh, allow_nan=False, **kw)


def replace_file(path: str, write: Callable[[Any], None], binary: bool = False, durable: bool = False) -> None:
    """Give ``path`` new content whole: ``write(fh)`` fills a file beside it (text, UTF-8, or
    ``binary``), which then replaces ``path``, so that a reader finds the old file or the
    complete new one, never part of one, however the writer ends. If ``write`` raises, the
    partial file is removed and ``path`` is left as it was. ``durable`` also flushes the
    file and its directory to disk before returning (a checkpoint), so a crash of the
    machine after it keeps the new file. The partial file is ``path.tmp-PID``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as fh:
            write(fh)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if durable:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def parse_size(text: str) -> int:
    """Parse a byte count for a command line: ``4``, ``64K``, ``16M``, ``1G``.

    Raises ``argparse.ArgumentTypeError`` naming the text otherwise, so it serves as an
    argparse ``type=`` (the parser then reports it as a usage error)."""
    t = text.strip().upper()
    digits, mult = (t[:-1], _MULT[t[-1]]) if t and t[-1] in _MULT else (t, 1)
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"bad size {text!r}: give a byte count such as 4, 64K, 16M or 1G")
    return int(digits) * mult


def parse_sizes(text: str) -> list[int]:
    """Parse a comma-separated list of byte counts (``4,1K,1M``): an argparse ``type=``."""
    return [parse_size(s) for s in text.split(",")]


def output_file(text: str) -> str:
    """An argparse ``type=`` for a file a script writes when it ends (world rank 0 writes
    it): where that could not succeed (no such directory, a file where a directory should
    be, a directory by that name, no permission), a usage error before anything is measured
    instead of a traceback after. World rank 0 checks, on its own filesystem and without
    making anything; the others take the text as it is."""
    if world_rank() != 0:
        return text
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        why = errno.EISDIR
    elif not os.path.isdir(parent):
        why = errno.ENOTDIR if os.path.exists(parent) else errno.ENOENT
    elif not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        why = errno.EACCES
    else:
        return text
    raise argparse.ArgumentTypeError(f"cannot write {text}: {os.strerror(why)}")


def output_dir(text: str) -> str:
    """As :func:`output_file`, for a directory a script writes its files into: world rank 0
    makes it (with its parents) where missing, as the script would, and checks that it may
    write there."""
    if world_rank() != 0:
        return text
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write in {text}: {exc.strerror or exc}") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {text}: {os.strerror(errno.EACCES)}")
    return text


def run_main(main: Callable[[], Any]) -> Any:
    """Run ``main()``; on any uncaught exception print it and abort the whole MPI job (on
    Ctrl-C, one line per rank and status 130).

    Without this, one rank dying leaves the others waiting forever inside a collective
    (MPICH's ``mpiexec`` does not end the job when one rank merely exits non-zero). A
    non-zero ``SystemExit`` (argparse's usage error, exit status 2) has already said why,
    so it ends the job with its status and no traceback.
    """
    try:
        return main()
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        if not isinstance(exc.code, int):  # sys.exit("message"): the message, status 1
            print(exc.code, file=sys.stderr)
        _abort(None, exc.code if isinstance(exc.code, int) else 1)
    except KeyboardInterrupt:  # Ctrl-C, which mpiexec passes to every rank: a line each, no traceback
        _abort(None, 130, "interrupted")
    except BaseException as exc:  # noqa: BLE001 - every failure must end the job
        _abort(exc, 1)


def _abort(exc: BaseException | None, code: int, why: str = "") -> None:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
    sys.stdout.flush()
    if exc is None:
        print(f"[rank {rank}] {why or f'exited with status {code}'}: ending the job", file=sys.stderr)
    else:
        print(f"[rank {rank}] aborting the job after an uncaught exception:", file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    time.sleep(_DRAIN_S)
    MPI.COMM_WORLD.Abort(code)
