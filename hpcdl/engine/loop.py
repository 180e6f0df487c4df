"""The engine's loop: one thread per rank that does all of the runtime's communication.

User calls build a :class:`~.request.Submission` and submit it to the
:class:`~.queue.TensorQueue`; the engine thread then works in *cycles*, the same sequence
of cycles on every rank:

1. **Start.** A rank starts a cycle when it has new requests (after ``cycle_time`` since
   its last cycle, at once when its user thread is blocked on one, or when they fill a
   fusion buffer) and rings a doorbell (:mod:`.doorbell`) at every other rank; a rank
   that hears one joins the cycle. Idle ranks only wait for their doorbell.
2. **Negotiate** (:mod:`.controller`, :mod:`.response_cache`): every rank learns what
   every other submitted.
3. **Plan** (:mod:`.controller`): the ready requests, judged and grouped for fusion.
4. **Execute** (:mod:`.executors`), in the same order everywhere.
5. **Inspect** (:mod:`.stall_inspector`): requests some ranks submitted and others not.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from mpi4py import MPI

from collectives import unchecked

from ..config import Config
from ..errors import HpcdlError
from ..timeline import Timeline, write_trace
from .controller import F_JOIN, F_SHUTDOWN, Controller, Ready
from .doorbell import make_doorbell
from .executors import Executors
from .process_set_table import ProcessSetTable
from .queue import SHUT_DOWN, TensorQueue
from .request import CONTROL_KINDS, DATA_KINDS, Descriptor, Submission
from .stall_inspector import StallInspector

__all__ = ["Engine"]

log = logging.getLogger("hpcdl")

_POLL_MIN, _POLL_MAX, _HOT = 200e-6, 2e-3, 0.05  # MPI doorbells: how often an idle engine polls


class Engine:
    """The communication thread of one rank (see the module docstring)."""

    def __init__(self, comm: MPI.Comm, config: Config) -> None:
        self.cfg = config
        self.rank, self.size = comm.rank, comm.size
        self.ecomm = comm.Dup()  # negotiation and doorbells
        self.dcomm = comm.Dup()  # data: the global process set's collectives
        self.sets = ProcessSetTable(self.dcomm, self.rank)
        self.queue = TensorQueue(self.sets.__contains__)
        self.cycle_s = config.cycle_time / 1e3
        self.stall = StallInspector(config, self.rank)
        self.done = 0  # cycles run
        self.last_cycle = -math.inf
        self.mine: dict[tuple[int, str], Submission] = {}  # this rank's announced requests, by (set id, name)
        self.tl: Timeline | None = None
        if config.timeline:
            self.tl = Timeline(self.rank, config.timeline, time.perf_counter(), config.timeline_mark_cycles)
        self.bell = make_doorbell(self.ecomm, config.shm_doorbell)
        self.controller = Controller(self.ecomm, config, self.sets, self.bell.sleeps, self._be_polite)
        self.executors = Executors(config, self._span)
        self.thread = threading.Thread(target=self._main, name="hpcdl-engine", daemon=True)
        self.thread.start()

    # -- user side ---------------------------------------------------------------------------
    def submit_many(self, reqs: list[Submission]) -> None:
        """Queue ``reqs`` together for the next cycle (all or none: raises at once if the
        engine has stopped or a name is already in flight on this rank)."""
        self.queue.push(reqs)
        self.bell.poke()

    def wait(self, req: Submission) -> Any:
        """Block until ``req`` has finished; return its result or raise its error."""
        if not req.event.is_set():
            if self.queue.waiting(req):  # the user waits on it: no point in waiting for more
                self.bell.poke()
            try:
                while not req.event.wait(0.5):
                    if not self.thread.is_alive() and not req.event.is_set():  # stopped without reaching it
                        q = self.queue
                        err = q.error or q.stop_reason or HpcdlError("hpcdl's engine has stopped")
                        self._fail_all(err)
                        req.finish(exc=err)
            finally:
                self.queue.done_waiting()
        if req.exc is not None:
            raise req.exc
        return req.result

    def join(self, device: int = -1) -> int:
        """Mark this rank as joined and wait until every rank has; return the last to join.
        ``device``: the GPU its identity tensors are made on for allreduces of device
        memory meanwhile (-1: the GPU of its last device request)."""
        self.executors.join_device = int(device)
        req = self.queue.push_join()
        self.bell.poke()
        return self.wait(req)

    def stop(self, timeout: float = 60.0) -> None:
        """Ask every rank's engine to stop (after the next cycle) and wait for ours."""
        self.queue.request_stop()
        self.bell.poke()
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("hpcdl: the engine did not stop within %.0f s (another rank is not responding)", timeout)

    @property
    def running(self) -> bool:
        """False once the engine takes no more requests: a rank shut the runtime down, or
        the engine failed (set before any pending request fails, so a caller that saw
        such an error sees this False)."""
        return self.queue.running

    def record(self, row: str, phase: str, start: float, end: float, **args: Any) -> None:
        """Add a span of the caller's own work (``start``/``end``: ``time.perf_counter``
        seconds) to the timeline on row ``row``, when one is being written; nothing
        otherwise (the pipeline's forward and backward passes use it)."""
        tl = self.tl
        if tl is not None:
            tl.span(row, phase, start, end, **args)

    def thread_cpu_seconds(self) -> float:
        """CPU seconds the engine thread has used so far (its thread CPU clock; Linux)."""
        return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))

    # -- engine thread -----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while True:
                if self._wait_for_work():
                    self.bell.ring(self.done + 1)
                if self._cycle():
                    break
        except BaseException as exc:  # a bug or an MPI failure: nothing can be coordinated now
            err = HpcdlError(f"hpcdl engine failed on rank {self.rank}: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            log.error("%s", err, exc_info=exc)
            self._fail_all(err)
        finally:
            self._fail_all(HpcdlError(SHUT_DOWN), record=False)

    def _wait_for_work(self) -> bool:
        """Wait until this rank should start a cycle (True: ring the others) or another rank
        has started one (False)."""
        sleep = _POLL_MIN
        bell, q = self.bell, self.queue
        while True:
            seen = bell.arm()
            if bell.heard() > self.done:
                return False
            with q.cv:
                now = time.perf_counter()
                if q.stop_requested or (q.join_req is not None and not q.join_sent):
                    return True
                if q.pending:
                    due = self.last_cycle + self.cycle_s
                    full = 0 < self.cfg.fusion_threshold <= q.pending_bytes
                    if q.urgent or now >= due or full:
                        return True
                    deadline = due - now
                elif self.controller.table:
                    deadline = self.last_cycle + self.stall.period - now
                    if deadline <= 0:
                        return True
                else:
                    deadline = math.inf
                if not bell.sleeps:  # MPI doorbells: wait for the user thread, polling for bells
                    q.cv.wait(min(deadline, sleep))
            if bell.sleeps:  # rung, poked or due: nothing to poll meanwhile
                bell.sleep(seen, deadline)
            sleep = _POLL_MIN if now - self.last_cycle < _HOT else min(sleep * 2, _POLL_MAX)

    def _cycle(self) -> bool:
        """Run one cycle; True when the engine has stopped."""
        t_start = time.perf_counter()
        self.last_cycle = t_start
        new, stopping, joining = self.queue.take()
        for req in new:
            self.mine[(req.set_id, req.name)] = req
        if self.tl is not None:
            self.tl.cycle(self.done + 1, t_start)
        flags = (F_SHUTDOWN if stopping else 0) | (F_JOIN if joining else 0)
        stoppers, now_ref = self.controller.negotiate(new, flags, t_start)
        self.done += 1
        if stoppers:
            who = "this rank" if stoppers == [self.rank] else f"rank {stoppers[0]}"
            self.queue.stop_reason = HpcdlError(f"hpcdl was shut down by {who}; call hpcdl.init() to start again")
            self._teardown(self.queue.stop_reason)
            return True
        t_now = time.perf_counter()
        for group in self.controller.plan():
            self._execute(group, t_now)
        last = self.controller.all_joined()
        if last is not None:
            req = self.queue.end_join()
            if req is not None:
                req.finish(last)
        err = self.stall.check(self.controller.table, now_ref, self.controller.missing)
        if err is not None:
            self._teardown(err, error=True)
            return True
        return False

    def _execute(self, group: list[Ready], t_now: float) -> None:
        reqs = [self.mine.pop((item.first.set_id, item.name), None) for item in group]
        d0 = group[0].first
        kind, set_id = d0.kind, d0.set_id
        info = self.sets.get(set_id)
        member = info is not None and self.rank in info.ranks
        name, problem = group[0].name, group[0].problem
        if self.tl is not None:
            for req in reqs:
                if req is not None:
                    self.tl.span(req.name, "QUEUE", req.t_submit, req.t_announce)
                    self.tl.span(req.name, f"NEGOTIATE_{kind.upper()}", req.t_announce, t_now)
        if problem is not None:
            self._finish(reqs, exc=problem)
            return
        self.controller.remember(group)
        if info is None:  # removed while this was in flight (every rank alike)
            self._finish(reqs, exc=HpcdlError(f"{kind} '{name}': process set {set_id} was removed"))
            return
        if not member and kind not in CONTROL_KINDS:
            return
        try:
            if kind in DATA_KINDS:
                if info.comm.size > 1:
                    self._be_polite(info.comm)  # the collective below sets up its context anyway
                res = self.executors.run(kind, [item.entry for item in group], reqs, info, self.rank)
            else:
                res = getattr(self, "_run_" + kind)(d0, reqs[0])
            if kind == "allreduce":
                for req in reqs:
                    if req is not None:
                        req.result = req.out
            self._finish(reqs, res)
        except Exception as exc:
            err = HpcdlError(f"{kind} '{name}' failed on rank {self.rank}: {exc}")
            err.__cause__ = exc
            self._finish(reqs, exc=err)

    def _be_polite(self, comm: Any) -> None:
        """Make ``comm``'s node channel sleep soon when it waits for a peer while no user
        thread waits on the engine: the user thread is computing then, on the same cores."""
        unchecked.set_polite(comm, self._user_busy)

    def _user_busy(self) -> bool:
        return self.queue.user_waiting == 0

    def _finish(self, reqs: list[Submission | None], result: Any = None, exc: BaseException | None = None) -> None:
        self.queue.release(reqs)
        for req in reqs:
            if req is not None and not req.event.is_set():
                req.finish(req.result if result is None else result, exc)

    def _span(self, reqs: list[Submission | None], phase: str, t0: float, **args: Any) -> None:
        if self.tl is not None:
            t1 = time.perf_counter()
            for req in reqs:
                if req is not None:
                    self.tl.span(req.name, phase, t0, t1, **args)

    # -- control requests (every rank runs them) -------------------------------------------------
    def _run_barrier(self, d0: Descriptor, req: Submission | None) -> Any:
        return None  # every member submitted it: that is the barrier

    def _run_add_process_set(self, d0: Descriptor, req: Submission | None) -> Any:
        return self.sets.add(d0.sig.ranks)

    def _run_remove_process_set(self, d0: Descriptor, req: Submission | None) -> Any:
        sid = d0.sig.process_set
        return self.sets.remove(sid, self.controller.pending_on(sid))

    def _run_start_timeline(self, d0: Descriptor, req: Submission | None) -> Any:
        if self.tl is not None:
            raise HpcdlError(f"a timeline is already being written to {self.tl.path!r}; stop it first")
        path = d0.var
        self.tl = Timeline(self.rank, path, time.perf_counter(), d0.sig.mark_cycles)
        return path

    def _run_stop_timeline(self, d0: Descriptor, req: Submission | None) -> Any:
        return self._write_timeline()

    def _write_timeline(self) -> str | None:
        """Gather every rank's events on the lowest rank recording one, which writes the
        file (collective; ranks without a timeline contribute nothing)."""
        tl, self.tl = self.tl, None
        paths = self.ecomm.allgather(None if tl is None else tl.path)
        writer = next((r for r, p in enumerate(paths) if p is not None), None)
        if writer is None:
            return None
        per_rank = self.ecomm.gather([] if tl is None else tl.collect(), root=writer)
        if self.rank == writer:
            write_trace(paths[writer], per_rank)
        return paths[writer]

    # -- failure and the end ---------------------------------------------------------------------
    def _fail_all(self, err: HpcdlError, record: bool = True) -> None:
        """Fail every request of this rank; no more are accepted (``record``: later calls
        raise ``err`` too, not only "shut down")."""
        reqs = list(self.mine.values()) + self.queue.close(err if record else None)
        self.mine = {}
        for req in reqs:
            if not req.event.is_set():
                req.finish(exc=err)

    def _teardown(self, err: HpcdlError, error: bool = False) -> None:
        """Every rank, in the same cycle: fail what is pending, write the timeline, receive
        every doorbell still on its way, free the communicators."""
        self._fail_all(err, record=error)
        try:
            self._write_timeline()
        finally:
            self.bell.close()
            self.sets.free()
            self.dcomm.Free()
            self.ecomm.Free()
