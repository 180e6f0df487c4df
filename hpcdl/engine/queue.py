"""The tensor queue: where user threads leave requests for the engine, and the state the
two sides share under one condition variable.

User threads :meth:`TensorQueue.push` requests (all of a group or none) and block in the
engine's ``wait``; the engine thread :meth:`TensorQueue.take` s what arrived at the start
of each cycle. Names in flight are unique per rank, since the negotiation matches
requests across ranks by name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import HpcdlArgumentError, HpcdlError
from .request import Submission

__all__ = ["TensorQueue", "SHUT_DOWN"]

SHUT_DOWN = "hpcdl has been shut down; call hpcdl.init() to start again"


class TensorQueue:
    """Requests submitted and not yet announced, and the flags both sides read.

    Attributes (under :attr:`cv`):
        pending: submitted requests not yet taken by a cycle.
        pending_bytes: their bytes (a full fusion buffer starts a cycle early).
        names: names submitted and not finished on this rank.
        urgent: a user thread waits on a pending request: start a cycle now.
        user_waiting: user threads blocked waiting on the engine (then it may spin).
        stop_requested: ``shutdown`` was called on this rank.
        join_req, join_sent: this rank's join and whether a cycle announced it.
        error: the error that stopped the engine (later calls raise it).
        stop_reason: who shut the runtime down (later calls raise it).
        running: False once the engine no longer takes requests.
    """

    def __init__(self, known_set: Callable[[int], bool]) -> None:
        self.known_set = known_set
        self.cv = threading.Condition()
        self.pending: list[Submission] = []
        self.pending_bytes = 0
        self.names: set[str] = set()
        self.urgent = False
        self.user_waiting = 0
        self.stop_requested = False
        self.join_req: Submission | None = None
        self.join_sent = False
        self.error: HpcdlError | None = None
        self.stop_reason: HpcdlError | None = None
        self.running = True

    def check_alive(self) -> None:
        """Raise why the engine takes no more requests, if it does not (under :attr:`cv`)."""
        if self.error is not None:
            raise self.error
        if not self.running or self.stop_requested:
            raise self.stop_reason or HpcdlError(SHUT_DOWN)

    def push(self, reqs: list[Submission]) -> None:
        """Queue ``reqs`` together for the next cycle (all or none: raises at once if the
        engine has stopped, a process set is unknown or a name is already in flight)."""
        with self.cv:
            self.check_alive()
            names = set()
            for req in reqs:
                if not self.known_set(req.set_id):
                    raise HpcdlError(f"{req.kind} '{req.name}': process set {req.set_id} is not registered")
                if req.name in self.names or req.name in names:
                    raise HpcdlArgumentError(
                        f"{req.kind} '{req.name}': a request with this name is already in flight on this rank; "
                        "use a different name or synchronize the first one"
                    )
                names.add(req.name)
            self.names |= names
            self.pending.extend(reqs)
            self.pending_bytes += sum(r.nbytes for r in reqs)
            self.cv.notify()

    def push_join(self) -> Submission:
        """Queue this rank's join; return the request that finishes when every rank joined."""
        with self.cv:
            self.check_alive()
            if self.join_req is not None:
                raise HpcdlError("join() is already in progress on this rank")
            req = self.join_req = Submission("join", "join", 0, ())
            self.join_sent = False
            self.cv.notify()
        return req

    def request_stop(self) -> None:
        with self.cv:
            self.stop_requested = True
            self.cv.notify()

    def waiting(self, req: Submission) -> bool:
        """A user thread starts waiting on ``req``: True when it is still pending (then the
        next cycle starts at once)."""
        with self.cv:
            urgent = req in self.pending
            if urgent:
                self.urgent = True
                self.cv.notify()
            self.user_waiting += 1
        return urgent

    def done_waiting(self) -> None:
        with self.cv:
            self.user_waiting -= 1

    def take(self) -> tuple[list[Submission], bool, bool]:
        """For a cycle: the pending requests, whether a stop was requested, and whether the
        cycle announces this rank's join."""
        with self.cv:
            new, self.pending = self.pending, []
            self.pending_bytes = 0
            self.urgent = False
            join = self.join_req is not None and not self.join_sent
            if join:
                self.join_sent = True
            return new, self.stop_requested, join

    def end_join(self) -> Submission | None:
        """Every rank joined: this rank's join request, no longer pending."""
        with self.cv:
            req, self.join_req = self.join_req, None
        return req

    def release(self, reqs: list[Submission | None]) -> None:
        """The names of ``reqs`` (finished) may be used again."""
        with self.cv:
            for req in reqs:
                if req is not None:
                    self.names.discard(req.name)

    def close(self, err: HpcdlError | None) -> list[Submission]:
        """Take no more requests (``err``: later calls raise it); return every request the
        user side still holds, the join included, for the engine to fail."""
        with self.cv:
            self.running = False
            if err is not None:
                self.error = self.error or err
            reqs = self.pending + ([self.join_req] if self.join_req else [])
            self.pending, self.join_req = [], None
            self.names.clear()
        return reqs
