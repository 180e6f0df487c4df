"""Sleeping until a word of shared memory changes: Linux futexes, through ``ctypes``.

A rank waiting for a peer's counter in a shared window can spin (fast, but it takes a
core away from whatever else runs there: a training step's compute, or the peer itself)
or sleep. ``FUTEX_WAIT`` sleeps in the kernel until another process calls ``FUTEX_WAKE``
on the same word, and returns at once if the word no longer holds the value the waiter
last saw, so a change made between the waiter's last look and its sleep is never missed.
The operations used here are the shared (not ``_PRIVATE``) ones, which work between
processes mapping the same memory.

Counters in the windows are 64-bit; a futex watches 32 bits. On a little-endian machine
the low half of a counter lies at its address, and a counter that moved has a different
low half (it would have to move by a multiple of 2**32 not to), so the waiter passes the
low half of the value it saw.

Callers always wait with a timeout and look again, so a wake-up that is lost (a peer
that changed the word without waking) costs at most that timeout, never a hang.

Without futexes (not Linux, an unknown architecture, or ``ctypes`` failing) :data:`OK`
is False and :func:`wait` sleeps for a short while instead.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time

__all__ = ["OK", "wait", "wake"]

# the futex system call's number per architecture (asm-generic where not listed)
_NR = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "riscv64": 98, "s390x": 238}
_WAIT, _WAKE = 0, 1
_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> tuple[object, int] | None:
    if not sys.platform.startswith("linux") or sys.byteorder != "little":
        return None
    nr = _NR.get(platform.machine().lower())
    if nr is None or os.environ.get("COLLECTIVES_NO_FUTEX"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall  # releases the GIL while it sleeps
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn, nr


_SYS = _load()
OK = _SYS is not None
"""True when :func:`wait` really sleeps on the word (Linux, little-endian, known syscall)."""


def wait(addr: int, seen: int, timeout: float) -> None:
    """Sleep until the 32-bit word at ``addr`` is woken by :func:`wake`, no longer holds the low
    32 bits of ``seen``, or ``timeout`` seconds pass (or a signal arrives): check again after."""
    if _SYS is None:
        time.sleep(min(timeout, 50e-6))
        return
    fn, nr = _SYS
    sec = int(timeout)
    ts = _Timespec(sec, int((timeout - sec) * 1e9))
    fn(nr, ctypes.c_void_p(addr), _WAIT, ctypes.c_uint32(seen & 0xFFFFFFFF), ctypes.byref(ts), None, 0)


def wake(addr: int) -> None:
    """Wake every process or thread sleeping in :func:`wait` on the word at ``addr``."""
    if _SYS is not None:
        fn, nr = _SYS
        fn(nr, ctypes.c_void_p(addr), _WAKE, _ALL, None, None, 0)
