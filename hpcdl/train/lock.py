"""The run directory's lock: one job at a time writes into a run directory.

Rank 0 holds an exclusive ``flock`` on ``<run_dir>/.lock`` for the life of the job, and
writes its host, pid and start time into the file. A second job into the same directory
finds the lock taken and stops at once, naming the holder. The kernel drops the lock of
a job that dies, however it dies; the file it leaves behind still names it, so the next
job takes the lock over with a warning that says whose it was. Where the file system
does not support ``flock``, the file's content decides: a holder on this host whose
process is gone is taken over; one on another host is refused, naming the file to delete.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket

__all__ = ["RunLock", "LockHeld", "LOCK_NAME"]

LOCK_NAME = ".lock"


class LockHeld(RuntimeError):
    """Another job holds the run directory."""


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('started')}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        return True
    return True


class RunLock:
    """The lock on run directory ``directory`` (which must exist). :meth:`acquire` takes it
    or raises :class:`LockHeld`; :meth:`release` gives it back and removes the file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when it takes over the lock of a job that ended
        without giving it back (None otherwise)."""
        started = f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}"
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = self._flock(fd)
                left = self._read(fd)
                if not locked:  # no flock here: judge by what the file says
                    if left and left.get("pid") != me["pid"] and self._holder_alive(left):
                        raise LockHeld(
                            f"run directory {self.directory} is in use by the job of {_describe(left)} (this file "
                            f"system has no flock: delete {self.path} if that job is gone)"
                        )
                # a holder that released between our open and our flock removed the file: retry
                if os.fstat(fd).st_ino != getattr(self._stat(), "st_ino", None):
                    os.close(fd)
                    continue
            except BaseException:
                os.close(fd)
                raise
            break
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        if left:
            return f"taking over the lock of a job that ended without giving it back ({_describe(left)})"
        return None

    def release(self) -> None:
        """Remove the lock file and give the lock back (a no-op when not held)."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == getattr(self._stat(), "st_ino", None):
                os.unlink(self.path)
        finally:
            os.close(self._fd)
            self._fd = None

    def _stat(self) -> os.stat_result | None:
        try:
            return os.stat(self.path)
        except FileNotFoundError:
            return None

    def _flock(self, fd: int) -> bool:
        """True when the flock is taken; False where the file system has none; LockHeld
        when another job holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = self._read(fd)
            who = _describe(left) if left else "a job that is still starting"
            raise LockHeld(
                f"run directory {self.directory} is in use by the job of {who}; wait for it to end or choose another "
                "--run-dir"
            ) from None
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise

    @staticmethod
    def _read(fd: int) -> dict | None:
        raw = os.pread(fd, 4096, 0)
        try:
            left = json.loads(raw) if raw.strip() else None
        except ValueError:
            return {"host": "?", "pid": "?", "started": "?"}
        return left if isinstance(left, dict) else None

    @staticmethod
    def _holder_alive(holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return True  # cannot tell from here
        pid = holder.get("pid")
        return isinstance(pid, int) and _alive(pid)
