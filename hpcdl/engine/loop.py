"""The background engine: one thread per rank does all of the runtime's communication.

User calls build a :class:`Request` (numpy views of the tensors, a name, a signature) and
:meth:`Engine.submit` it; the engine thread then works in *cycles*, the same sequence of
cycles on every rank:

1. **Start.** A rank starts a cycle when it has new requests (after ``cycle_time`` since
   its last cycle, at once when its user thread is blocked on one, or when they fill a
   fusion buffer) and rings a doorbell (a small message) at every other rank; a rank
   that hears a doorbell joins the cycle. Idle ranks only poll their doorbell.
2. **Negotiate.** Every rank sends what it submitted since the last cycle: a bit per
   request whose signature is in the *response cache* (steady state: one fixed-size
   ``Allgather``), and the full descriptor of the others (one more, pickled, gather).
   From this every rank keeps the same table of who submitted what.
3. **Respond.** A request is ready when every member of its process set submitted it (or
   has joined). Ranks that disagree on its kind, dtype, shape, op, root, scale factors or
   process set get :class:`~hpcdl.HpcdlError` on every rank, naming ranks and values; the
   runtime stays usable.
4. **Execute.** Ready requests run in the same order everywhere; small allreduces of the
   same dtype, op, scale factors and process set are packed into one persistent fusion
   buffer (up to ``fusion_threshold`` bytes) and reduced with one ``collectives`` call; a
   tensor of 1 MiB or more is reduced alone where it lies (fusion would only copy it).

The stall inspector looks at the same table: a request some ranks submitted and others
not for ``stall_check_time_seconds`` is logged (rank 0) with the missing ranks; after
``stall_shutdown_time_seconds`` it is an error on every rank and the engine stops. Time
is rank 0's clock, sent in every cycle, so every rank decides alike.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np
from mpi4py import MPI

import collectives
from collectives.context import get_context
from collectives.layout import block_counts, offsets
from collectives.select import choose

from .basics import HpcdlError
from .config import Config
from .doorbell import make_doorbell
from .timeline import Timeline, write_trace

__all__ = ["Engine", "Request", "ProcessSetInfo", "SIG_FIELDS"]

log = logging.getLogger("hpcdl")

_H = 4  # header words of a cycle message: flags, rank clock (us), cache size, uncached count
_F_SHUTDOWN, _F_JOIN = 1, 2
_UNFUSED_BYTES = 1 << 20  # tensors this large are reduced alone, in place
_POLL_MIN, _POLL_MAX, _HOT = 200e-6, 2e-3, 0.05  # MPI doorbells: how often an idle engine polls

#: the compared fields of each kind's signature, for error messages
SIG_FIELDS: dict[str, tuple[str, ...]] = {
    "allreduce": ("dtype", "shape", "op", "prescale_factor", "postscale_factor"),
    "reducescatter": ("dtype", "shape", "op", "prescale_factor", "postscale_factor"),
    "allgather": ("dtype", "shape after the first dimension"),
    "broadcast": ("dtype", "shape", "root_rank"),
    "alltoall": ("dtype", "shape after the first dimension"),
    "barrier": (),
    "add_process_set": ("ranks",),
    "remove_process_set": ("process set",),
    "start_timeline": ("mark_cycles",),
    "stop_timeline": (),
}
_DATA_KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")  # call collectives
_JOIN_OK = ("allreduce", "allgather", "broadcast", "barrier")
#: torch dtype names (the signature's) to the numpy dtype that carries them
_DTYPES = {str(d): d for d in collectives.DTYPES} | {"bool": np.dtype(np.uint8)}


def _identity(op: str, dtype: np.dtype) -> Any:
    """The value a joined rank contributes to a reduction with ``op``."""
    if op in ("sum", "avg"):
        return 0
    if op == "prod":
        return 1
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if op == "min" else info.min
    inf = float(ml_dtypes.finfo(dtype).max) if dtype == np.dtype(ml_dtypes.bfloat16) else np.inf
    return inf if op == "min" else -inf


class Request:
    """One submitted operation: its descriptor, its numpy buffers, and its completion."""

    __slots__ = (
        "name",
        "kind",
        "set_id",
        "sig",
        "var",
        "error",
        "x",
        "out",
        "args",
        "nbytes",
        "result",
        "exc",
        "event",
        "t_submit",
        "t_announce",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        set_id: int,
        sig: tuple,
        *,
        var: Any = None,
        error: str | None = None,
        x: np.ndarray | None = None,
        out: np.ndarray | None = None,
        **args: Any,
    ) -> None:
        self.name, self.kind, self.set_id, self.sig, self.var, self.error = name, kind, set_id, sig, var, error
        self.x, self.out, self.args = x, out, args
        self.nbytes = 0 if x is None else x.nbytes
        self.result: Any = None
        self.exc: BaseException | None = None
        self.event = threading.Event()
        self.t_submit = time.perf_counter()
        self.t_announce = 0.0

    @property
    def desc(self) -> tuple:
        """What the other ranks learn about this request (hashable; the cache key)."""
        return (self.name, self.kind, self.set_id, self.sig, self.var, self.error)

    def finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        self.result, self.exc = result, exc
        self.event.set()


@dataclasses.dataclass(slots=True)
class ProcessSetInfo:
    """A registered process set: its ranks (of the runtime's communicator) and, on its
    members, its communicator."""

    ranks: tuple[int, ...]
    comm: Any  # MPI.Comm on members, None elsewhere


@dataclasses.dataclass(slots=True)
class _Entry:
    """A request name some ranks submitted: their descriptors, by rank."""

    descs: dict[int, tuple]
    first: int  # rank 0's clock (us) in the cycle it was first announced


class Engine:
    """The communication thread of one rank (see the module docstring)."""

    def __init__(self, comm: MPI.Comm, config: Config) -> None:
        self.cfg = config
        self.rank, self.size = comm.rank, comm.size
        self.ecomm = comm.Dup()  # negotiation and doorbells
        self.dcomm = comm.Dup()  # data: the global process set's collectives
        self.sets: dict[int, ProcessSetInfo] = {0: ProcessSetInfo(tuple(range(self.size)), self.dcomm)}
        self.next_set_id = 1
        self.cycle_s = config.cycle_time / 1e3
        self.stall_period = math.inf
        if not config.stall_check_disable or config.stall_shutdown_time_seconds > 0:
            limit = config.stall_check_time_seconds
            if config.stall_shutdown_time_seconds > 0:
                limit = min(limit, config.stall_shutdown_time_seconds)
            self.stall_period = min(max(limit / 10, 0.01), 1.0)
        # user side (under cv)
        self.cv = threading.Condition()
        self.queue: list[Request] = []
        self.queued_bytes = 0
        self.names: set[str] = set()  # names submitted and not finished on this rank
        self.urgent = False
        self.user_waiting = 0  # user threads blocked in wait(): then the engine may spin
        self.stop_requested = False
        self.join_req: Request | None = None
        self.join_sent = False
        self.error: HpcdlError | None = None
        self.stop_reason: HpcdlError | None = None  # who shut the runtime down, for later calls
        self.running = True
        # engine side (identical on every rank, except ``mine``)
        self.done = 0
        self.last_cycle = -math.inf
        self.table: dict[str, _Entry] = {}
        self.mine: dict[str, Request] = {}
        self.cache: list[tuple] = []
        self.cache_ids: dict[tuple, int] = {}
        self.joined: set[int] = set()
        self.last_joined = -1
        self.last_warn = -math.inf
        self.fusion = np.empty(0, np.uint8)
        self.algs: dict[tuple, str] = {}
        self.tl: Timeline | None = None
        if config.timeline:
            self.tl = Timeline(self.rank, config.timeline, time.perf_counter(), config.timeline_mark_cycles)
        self.bell = make_doorbell(self.ecomm, config.shm_doorbell)
        self.thread = threading.Thread(target=self._main, name="hpcdl-engine", daemon=True)
        self.thread.start()

    # -- user side ---------------------------------------------------------------------------
    def submit_many(self, reqs: list[Request]) -> None:
        """Queue ``reqs`` together for the next cycle (all or none: raises at once if the
        engine has stopped or a name is already in flight on this rank)."""
        with self.cv:
            self._check_alive()
            names = set()
            for req in reqs:
                if req.set_id not in self.sets:
                    raise HpcdlError(f"{req.kind} '{req.name}': process set {req.set_id} is not registered")
                if req.name in self.names or req.name in names:
                    raise HpcdlError(
                        f"{req.kind} '{req.name}': a request with this name is already in flight on this rank; "
                        "use a different name or synchronize the first one"
                    )
                names.add(req.name)
            self.names |= names
            self.queue.extend(reqs)
            self.queued_bytes += sum(r.nbytes for r in reqs)
            self.cv.notify()
        self.bell.poke()

    def wait(self, req: Request) -> Any:
        """Block until ``req`` has finished; return its result or raise its error."""
        if not req.event.is_set():
            with self.cv:
                urgent = req in self.queue  # the user waits on it: no point in waiting for more
                if urgent:
                    self.urgent = True
                    self.cv.notify()
                self.user_waiting += 1
            if urgent:
                self.bell.poke()
            try:
                while not req.event.wait(0.5):
                    if not self.thread.is_alive() and not req.event.is_set():  # stopped without reaching it
                        err = self.error or self.stop_reason or HpcdlError("hpcdl's engine has stopped")
                        self._fail_all(err)
                        req.finish(exc=err)
            finally:
                with self.cv:
                    self.user_waiting -= 1
        if req.exc is not None:
            raise req.exc
        return req.result

    def join(self) -> int:
        """Mark this rank as joined and wait until every rank has; return the last to join."""
        with self.cv:
            self._check_alive()
            if self.join_req is not None:
                raise HpcdlError("join() is already in progress on this rank")
            req = self.join_req = Request("join", "join", 0, ())
            self.join_sent = False
            self.cv.notify()
        self.bell.poke()
        return self.wait(req)

    def stop(self, timeout: float = 60.0) -> None:
        """Ask every rank's engine to stop (after the next cycle) and wait for ours."""
        with self.cv:
            self.stop_requested = True
            self.cv.notify()
        self.bell.poke()
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("hpcdl: the engine did not stop within %.0f s (another rank is not responding)", timeout)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error
        if not self.running or self.stop_requested:
            raise self.stop_reason or HpcdlError("hpcdl has been shut down; call hpcdl.init() to start again")

    # -- engine thread -----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while True:
                if self._wait_for_work():
                    self._ring()
                if self._cycle():
                    break
        except BaseException as exc:  # a bug or an MPI failure: nothing can be coordinated now
            err = HpcdlError(f"hpcdl engine failed on rank {self.rank}: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            log.error("%s", err, exc_info=exc)
            self._fail_all(err)
        finally:
            self._fail_all(HpcdlError("hpcdl has been shut down; call hpcdl.init() to start again"), record=False)

    def _bells(self) -> bool:
        """True when some rank has started the next cycle."""
        return self.bell.heard() > self.done

    def _wait_for_work(self) -> bool:
        """Wait until this rank should start a cycle (True: ring the others) or another rank
        has started one (False)."""
        sleep = _POLL_MIN
        bell = self.bell
        while True:
            seen = bell.arm()
            if self._bells():
                return False
            with self.cv:
                now = time.perf_counter()
                if self.stop_requested or (self.join_req is not None and not self.join_sent):
                    return True
                if self.queue:
                    due = self.last_cycle + self.cycle_s
                    full = 0 < self.cfg.fusion_threshold <= self.queued_bytes
                    if self.urgent or now >= due or full:
                        return True
                    deadline = due - now
                elif self.table:
                    deadline = self.last_cycle + self.stall_period - now
                    if deadline <= 0:
                        return True
                else:
                    deadline = math.inf
                if not bell.sleeps:  # MPI doorbells: wait for the user thread, polling for bells
                    self.cv.wait(min(deadline, sleep))
            if bell.sleeps:  # rung, poked or due: nothing to poll meanwhile
                bell.sleep(seen, deadline)
            sleep = _POLL_MIN if now - self.last_cycle < _HOT else min(sleep * 2, _POLL_MAX)

    def _ring(self) -> None:
        self.bell.ring(self.done + 1)

    def _cycle(self) -> bool:
        """Run one cycle; True when the engine has stopped."""
        t_start = time.perf_counter()
        self.last_cycle = t_start
        with self.cv:
            new, self.queue = self.queue, []
            self.queued_bytes = 0
            self.urgent = False
            flags = _F_SHUTDOWN if self.stop_requested else 0
            if self.join_req is not None and not self.join_sent:
                flags |= _F_JOIN
                self.join_sent = True
            for req in new:
                self.mine[req.name] = req
        if self.tl is not None:
            self.tl.cycle(self.done + 1, t_start)
        # negotiate: cached requests as bits, the rest as descriptors
        words = (len(self.cache) + 63) // 64
        msg = np.zeros(_H + words, np.int64)
        bits = msg[_H:].view(np.uint64)
        uncached = []
        for req in new:
            req.t_announce = t_start
            cid = self.cache_ids.get(req.desc)
            if cid is None:
                uncached.append(req.desc)
            else:
                bits[cid >> 6] |= np.uint64(1) << np.uint64(cid & 63)
        msg[0], msg[1], msg[2], msg[3] = flags, int(t_start * 1e6), len(self.cache), len(uncached)
        table = np.empty((self.size, _H + words), np.int64)
        if self.bell.sleeps:  # one node: through the node channel, which sleeps while it waits
            self._be_polite(self.ecomm)
            collectives.allgather(msg.reshape(1, -1), out=table, comm=self.ecomm)
        else:
            self.ecomm.Allgather(msg, table)
        lists = self.ecomm.allgather(uncached) if table[:, 3].any() else [[]] * self.size
        self.done += 1
        if (table[:, 2] != len(self.cache)).any():
            raise RuntimeError(f"response caches differ between ranks: sizes {table[:, 2].tolist()}")
        now_ref = int(table[0, 1])
        for r in range(self.size):
            ids = np.flatnonzero(np.unpackbits(table[r, _H:].view(np.uint8), bitorder="little"))
            for d in [self.cache[i] for i in ids] + lists[r]:
                ent = self.table.get(d[0])
                if ent is None:
                    ent = self.table[d[0]] = _Entry({}, now_ref)
                ent.descs[r] = d
            if table[r, 0] & _F_JOIN:
                self.joined.add(r)
                self.last_joined = r
        stoppers = [r for r in range(self.size) if table[r, 0] & _F_SHUTDOWN]
        if stoppers:
            who = "this rank" if stoppers == [self.rank] else f"rank {stoppers[0]}"
            self.stop_reason = HpcdlError(f"hpcdl was shut down by {who}; call hpcdl.init() to start again")
            self._teardown(self.stop_reason)
            return True
        self._respond(time.perf_counter())
        if self.joined and len(self.joined) == self.size:
            last, self.joined, self.last_joined = self.last_joined, set(), -1
            with self.cv:
                req, self.join_req = self.join_req, None
            if req is not None:
                req.finish(last)
        return self._stall_check(now_ref)

    # -- responses ---------------------------------------------------------------------------
    def _members(self, ent: _Entry) -> set[int]:
        """The ranks that must submit ``ent``: those that did, and every member of each process
        set their descriptors name (a set not registered has no members)."""
        members = set(ent.descs)
        for d in ent.descs.values():
            info = self.sets.get(d[2])
            if info is not None:
                members.update(info.ranks)
        return members

    def _respond(self, t_now: float) -> None:
        ready: list[tuple[str, _Entry, str | None]] = []
        for name, ent in self.table.items():
            if all(r in ent.descs or r in self.joined for r in self._members(ent)):
                ready.append((name, ent, self._judge(name, ent)))
        if not ready:
            return
        for name, _, _ in ready:
            del self.table[name]
        # the plan: fusable allreduces go into batches of one key, in first-seen order
        plan: list[list[tuple[str, _Entry, str | None]]] = []
        open_batch: dict[tuple, tuple[list, int]] = {}
        limit = self.cfg.fusion_threshold
        for item in ready:
            name, ent, problem = item
            d = next(iter(ent.descs.values()))
            if problem is None and d[1] == "allreduce" and limit:
                dtype = _DTYPES[d[3][0]]
                nbytes = math.prod(d[3][1]) * dtype.itemsize
                if nbytes <= limit:
                    key = (d[2], d[3][0], d[3][2], d[3][3], d[3][4])
                    batch = open_batch.get(key)
                    if batch is not None and batch[1] + nbytes <= limit:
                        batch[0].append(item)
                        open_batch[key] = (batch[0], batch[1] + nbytes)
                        continue
                    group = [item]
                    plan.append(group)
                    open_batch[key] = (group, nbytes)
                    continue
            plan.append([item])
        # a process set is removed only after this cycle's other requests, which may use it
        last = [g for g in plan if next(iter(g[0][1].descs.values()))[1] == "remove_process_set"]
        for group in [g for g in plan if g not in last] + last:
            self._execute(group, t_now)

    def _judge(self, name: str, ent: _Entry) -> str | None:
        """None when every rank's descriptor agrees (and can run now), else the error text."""
        descs = ent.descs
        d0 = next(iter(descs.values()))
        if d0[5] is None and not self.joined and all(d == d0 for d in descs.values()):
            return None  # the steady state: every rank sent the same (cached) descriptor
        errors = [f"rank {r}: {d[5]}" for r, d in sorted(descs.items()) if d[5] is not None]
        if errors:
            return f"request '{name}' has bad arguments: " + "; ".join(errors)
        for field, idx in (("operation", 1), ("process set", 2)):
            text = _differs(descs, lambda d, i=idx: d[i], field)
            if text:
                return f"ranks disagree on request '{name}': {text}"
        kind = d0[1]  # every rank's agrees from here on
        for i, field in enumerate(SIG_FIELDS.get(kind, ())):
            text = _differs(descs, lambda d, i=i: d[3][i], field)
            if text:
                return f"ranks disagree on {kind} '{name}': {text}"
        joined = sorted(self.joined & self._members(ent))
        if joined:
            if kind not in _JOIN_OK:
                return f"{kind} '{name}' cannot run while ranks {joined} have joined"
            if kind == "broadcast" and d0[3][2] in joined:
                return f"broadcast '{name}': root rank {d0[3][2]} has joined"
        return None

    def _execute(self, group: list[tuple[str, _Entry, str | None]], t_now: float) -> None:
        reqs: list[Request | None] = []
        with self.cv:
            for name, _, _ in group:
                reqs.append(self.mine.pop(name, None))
        d0 = next(iter(group[0][1].descs.values()))
        kind, set_id = d0[1], d0[2]
        info = self.sets.get(set_id)
        member = info is not None and self.rank in info.ranks
        problem = group[0][2]
        for req in reqs:
            if req is not None and self.tl is not None:
                self.tl.span(req.name, "QUEUE", req.t_submit, req.t_announce)
                self.tl.span(req.name, f"NEGOTIATE_{kind.upper()}", req.t_announce, t_now)
        if problem is not None:
            self._finish(reqs, exc=HpcdlError(problem))
            return
        # agreed: remember every rank's descriptor (on every rank alike, members or not)
        for _, ent, _ in group:
            for r in sorted(ent.descs):
                d = ent.descs[r]
                if d not in self.cache_ids and len(self.cache) < self.cfg.cache_capacity:
                    self.cache_ids[d] = len(self.cache)
                    self.cache.append(d)
        if info is None:  # removed while this was in flight (every rank alike)
            self._finish(reqs, exc=HpcdlError(f"{kind} '{group[0][0]}': process set {set_id} was removed"))
            return
        if not member and kind not in ("add_process_set", "remove_process_set", "start_timeline", "stop_timeline"):
            return
        try:
            if kind in _DATA_KINDS and info.comm.size > 1:
                self._be_polite(info.comm)  # the collective below sets up its context anyway
            if kind == "allreduce":
                self._allreduce(group, reqs, info)
                for req in reqs:
                    if req is not None:
                        req.result = req.out
                self._finish(reqs)
            else:
                res = getattr(self, "_run_" + kind)(group[0][1], reqs[0], info)
                self._finish(reqs, res)
        except Exception as exc:
            err = HpcdlError(f"{kind} '{group[0][0]}' failed on rank {self.rank}: {exc}")
            err.__cause__ = exc
            self._finish(reqs, exc=err)

    def _be_polite(self, comm: Any) -> None:
        """Make ``comm``'s node channel sleep soon when it waits for a peer while no user
        thread waits on the engine: the user thread is computing then, on the same cores."""
        ch = get_context(comm).chan
        if ch is not None and ch.polite is None:
            ch.polite = self._user_busy

    def _user_busy(self) -> bool:
        return self.user_waiting == 0

    def _finish(self, reqs: list[Request | None], result: Any = None, exc: BaseException | None = None) -> None:
        with self.cv:
            for req in reqs:
                if req is not None:
                    self.names.discard(req.name)
        for req in reqs:
            if req is not None and not req.event.is_set():
                req.finish(req.result if result is None else result, exc)

    def _alg(self, comm: Any, coll: str, nbytes: int) -> str:
        key = (id(comm), coll, nbytes)
        alg = self.algs.get(key)
        if alg is None:
            alg = "local" if comm.size == 1 else choose(get_context(comm), coll, nbytes)
            if len(self.algs) > 4096:
                self.algs.clear()
            self.algs[key] = alg
        return alg

    def _span(self, reqs: list[Request | None], phase: str, t0: float, **args: Any) -> None:
        if self.tl is not None:
            t1 = time.perf_counter()
            for req in reqs:
                if req is not None:
                    self.tl.span(req.name, phase, t0, t1, **args)

    # -- the collectives -----------------------------------------------------------------------
    def _allreduce(self, group: list, reqs: list[Request | None], info: ProcessSetInfo) -> None:
        d0 = next(iter(group[0][1].descs.values()))
        dtype_name, _, op, pre, post = d0[3]
        dtype = _DTYPES[dtype_name]
        comm = info.comm
        xs = []
        for (_, ent, _), req in zip(group, reqs, strict=True):
            if req is not None:
                xs.append((req.x, req.out, req))
            else:  # joined: the op's identity, result discarded
                shape = next(iter(ent.descs.values()))[3][1]
                xs.append((np.full(shape, _identity(op, dtype), dtype), np.empty(shape, dtype), None))
        # fusion amortises the per-call cost over small tensors; a large tensor gains nothing
        # from it, so it is reduced where it lies, without the copies into and out of the buffer
        small = [e for e in xs if e[0].nbytes < _UNFUSED_BYTES]
        alone = [e for e in xs if e[0].nbytes >= _UNFUSED_BYTES]
        if len(small) == 1:
            alone, small = alone + small, []
        for x, out, req in alone:
            t0 = time.perf_counter()
            src = x
            if pre != 1.0:
                np.multiply(x, pre, out=out)
                src = out
            collectives.allreduce(src, op=op, out=out, comm=comm)
            if post != 1.0:
                np.multiply(out, post, out=out)
            alg = self._alg(comm, "allreduce", out.nbytes)
            self._span([req], "ALLREDUCE", t0, algorithm=alg, bytes=int(out.nbytes))
        if not small:
            return
        reqs = [req for _, _, req in small]
        total = sum(x.size for x, _, _ in small)
        nbytes = total * dtype.itemsize
        alg = self._alg(comm, "allreduce", nbytes)
        if self.fusion.nbytes < nbytes:
            self.fusion = np.empty(max(nbytes, min(2 * self.fusion.nbytes, self.cfg.fusion_threshold)), np.uint8)
        buf = self.fusion[:nbytes].view(dtype)
        t0 = time.perf_counter()
        off = 0
        for x, _, _ in small:
            seg = buf[off : off + x.size]
            if pre != 1.0:
                np.multiply(x.reshape(-1), pre, out=seg)
            else:
                seg[...] = x.reshape(-1)
            off += x.size
        t1 = time.perf_counter()
        self._span(reqs, "MEMCPY_IN_FUSION_BUFFER", t0)
        collectives.allreduce(buf, op=op, out=buf, comm=comm)
        self._span(reqs, "ALLREDUCE", t1, algorithm=alg, bytes=int(nbytes), fused=len(small))
        t2 = time.perf_counter()
        off = 0
        for _, out, _ in small:
            seg = buf[off : off + out.size]
            if post != 1.0:
                np.multiply(seg, post, out=out.reshape(-1))
            else:
                out.reshape(-1)[...] = seg
            off += out.size
        self._span(reqs, "MEMCPY_OUT_FUSION_BUFFER", t2)

    def _run_allgather(self, ent: _Entry, req: Request | None, info: ProcessSetInfo) -> Any:
        d0 = next(iter(ent.descs.values()))
        dtype = _DTYPES[d0[3][0]]
        x = req.x if req is not None else np.empty((0, *d0[3][1]), dtype)
        t0 = time.perf_counter()
        # an ``out`` (ZeroOptimizer's flat parameters) holds this rank's block already
        res = collectives.allgather(x, comm=info.comm, out=None if req is None else req.out)
        alg = self._alg(info.comm, "allgather", res.nbytes)
        self._span([req], "ALLGATHER", t0, algorithm=alg, bytes=int(res.nbytes))
        return res

    def _run_broadcast(self, ent: _Entry, req: Request | None, info: ProcessSetInfo) -> Any:
        d0 = next(iter(ent.descs.values()))
        dtype, shape, root = _DTYPES[d0[3][0]], d0[3][1], d0[3][2]
        out = req.out if req is not None else np.empty(shape, dtype)
        src = req.x if req is not None and self.rank == root else out
        t0 = time.perf_counter()
        collectives.broadcast(src, info.ranks.index(root), out=out, comm=info.comm)
        alg = self._alg(info.comm, "broadcast", out.nbytes)
        self._span([req], "BROADCAST", t0, algorithm=alg, bytes=int(out.nbytes))
        return out

    def _run_alltoall(self, ent: _Entry, req: Request, info: ProcessSetInfo) -> Any:
        n = len(info.ranks)
        splits = req.args.get("splits")
        rows = req.x.shape[0]
        send = np.asarray(splits if splits is not None else [rows // n] * n, np.int64)
        t0 = time.perf_counter()
        out = collectives.alltoall(req.x, None if splits is None else send, comm=info.comm)
        received = collectives.alltoall(send, comm=info.comm)
        self._span([req], "ALLTOALL", t0, algorithm="pairwise", bytes=int(out.nbytes))
        return out, received

    def _run_reducescatter(self, ent: _Entry, req: Request, info: ProcessSetInfo) -> Any:
        _, shape, op, pre, post = req.sig
        n, me = len(info.ranks), info.ranks.index(self.rank)
        x, out = req.x, req.out
        t0 = time.perf_counter()
        src = x * np.asarray(pre, x.dtype) if pre != 1.0 else x
        rows = shape[0] if shape else 0
        if rows % n == 0 and x.size:
            collectives.reduce_scatter(src, op=op, out=out.reshape(-1), comm=info.comm)
            alg = self._alg(info.comm, "reduce_scatter", x.nbytes)
        else:  # uneven rows: reduce everything, keep this rank's rows
            full = collectives.allreduce(src, op=op, comm=info.comm)
            off = offsets(block_counts(rows, n))
            out[...] = full[off[me] : off[me + 1]]
            alg = "allreduce+slice"
        if post != 1.0:
            np.multiply(out, post, out=out)
        self._span([req], "REDUCESCATTER", t0, algorithm=alg, bytes=int(x.nbytes))
        return out

    def _run_barrier(self, ent: _Entry, req: Request | None, info: ProcessSetInfo) -> Any:
        return None  # every member submitted it: that is the barrier

    def _run_add_process_set(self, ent: _Entry, req: Request | None, info: ProcessSetInfo) -> Any:
        ranks = next(iter(ent.descs.values()))[3][0]
        sid, self.next_set_id = self.next_set_id, self.next_set_id + 1
        comm = None
        if self.rank in ranks:
            world = self.dcomm.Get_group()
            group = world.Incl(list(ranks))
            comm = self.dcomm.Create_group(group, tag=sid)
            group.Free()
            world.Free()
        self.sets[sid] = ProcessSetInfo(tuple(ranks), comm)
        return sid

    def _run_remove_process_set(self, ent: _Entry, req: Request | None, info: ProcessSetInfo) -> Any:
        sid = next(iter(ent.descs.values()))[3][0]
        pending = sorted(name for name, e in self.table.items() if any(d[2] == sid for d in e.descs.values()))
        if sid == 0 or sid not in self.sets:
            raise HpcdlError(f"process set {sid} cannot be removed (global, or not registered)")
        if pending:
            raise HpcdlError(f"process set {sid} still has requests in flight: {pending}")
        removed = self.sets.pop(sid)
        if removed.comm is not None:
            removed.comm.Free()
        return sid

    def _run_start_timeline(self, ent: _Entry, req: Request | None, info: ProcessSetInfo) -> Any:
        if self.tl is not None:
            raise HpcdlError(f"a timeline is already being written to {self.tl.path!r}; stop it first")
        path = ent.descs[0][4]
        self.tl = Timeline(self.rank, path, time.perf_counter(), bool(ent.descs[0][3][0]))
        return path

    def _run_stop_timeline(self, ent: _Entry, req: Request | None, info: ProcessSetInfo) -> Any:
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

    # -- stalls, failure and the end -----------------------------------------------------------
    def _stall_check(self, now_ref: int) -> bool:
        cfg = self.cfg
        if not self.table or (cfg.stall_check_disable and cfg.stall_shutdown_time_seconds <= 0):
            return False
        stalled = []
        for name, ent in self.table.items():
            age = (now_ref - ent.first) / 1e6
            if age >= min(cfg.stall_check_time_seconds, cfg.stall_shutdown_time_seconds or math.inf):
                missing = sorted(self._members(ent) - set(ent.descs) - self.joined)
                stalled.append((age, f"'{name}' submitted by ranks {sorted(ent.descs)}, missing on ranks {missing}"))
        if not stalled:
            return False
        text = "; ".join(s for _, s in stalled)
        worst = max(a for a, _ in stalled)
        if cfg.stall_shutdown_time_seconds > 0 and worst >= cfg.stall_shutdown_time_seconds:
            err = HpcdlError(
                f"stalled for more than {cfg.stall_shutdown_time_seconds:g} s "
                f"(HPCDL_STALL_SHUTDOWN_TIME_SECONDS), shutting down: {text}"
            )
            if self.rank == 0:
                log.error("hpcdl: %s", err)
            self._teardown(err, error=True)
            return True
        warn_due = now_ref / 1e6 - self.last_warn >= cfg.stall_check_time_seconds
        if not cfg.stall_check_disable and self.rank == 0 and warn_due:
            self.last_warn = now_ref / 1e6
            log.warning(
                "hpcdl: requests waited more than %g s for other ranks (a rank skipped a call or named it "
                "differently): %s",
                cfg.stall_check_time_seconds,
                text,
            )
        return False

    def _fail_all(self, err: HpcdlError, record: bool = True) -> None:
        """Fail every request of this rank; no more are accepted (``record``: later calls
        raise ``err`` too, not only "shut down")."""
        with self.cv:
            self.running = False
            if record:
                self.error = self.error or err
            reqs = list(self.mine.values()) + self.queue + ([self.join_req] if self.join_req else [])
            self.mine, self.queue, self.join_req = {}, [], None
            self.names.clear()
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
            for sid, info in list(self.sets.items()):
                if sid and info.comm is not None:
                    info.comm.Free()
            self.sets.clear()
            self.dcomm.Free()
            self.ecomm.Free()


def _differs(descs: dict[int, tuple], get: Any, field: str) -> str | None:
    """``field`` values by rank when they are not all equal, else None."""
    by_value: dict[Any, list[int]] = {}
    for r, d in sorted(descs.items()):
        by_value.setdefault(get(d), []).append(r)
    if len(by_value) < 2:
        return None
    return f"{field} differs: " + "; ".join(f"{_show(v)} on ranks {rs}" for v, rs in by_value.items())


def _show(v: Any) -> str:
    if isinstance(v, tuple) and all(isinstance(i, int) for i in v):
        return "(" + ", ".join(map(str, v)) + ("," if len(v) == 1 else "") + ")"
    return repr(v) if isinstance(v, str) else str(v)
