"""A parameter server: sums partitions (``sync``) or holds them and steps them (``ssp``,
``async``), over nonblocking MPI point-to-point messages.

One loop serves every table (one per :class:`~hpcdl.optim.HybridOptimizer`) and every
worker. A receive is posted for every (partition, contributor) straight into the buffer
it lands in, so a partition is summed or stepped as soon as its last contribution is in,
while the next ones are still arriving. The loop polls and, with nothing to do, sleeps in
short naps, so a server that shares cores with workers does not take one of them.

- ``sync``: the contributions of a partition (one per node, or per worker without
  node reduction) are added in contributor order, so the result does not depend on the
  order of arrival, and sent back to every contributor.
- ``ssp`` with staleness ``s`` (stale synchronous parallel, Ho et al., NIPS 2013): the
  server holds the partition's parameters and an instance of the workers' optimizer class.
  Each worker's gradient is stepped as it comes, with the learning rate divided by the
  number of workers ``W`` (for SGD the same as dividing the gradient; for Adam, whose step
  does not shrink with the gradient, the only way a clock's ``W`` steps add up to one).
  A worker that pushed clock ``t`` is sent the parameters, with every update applied so
  far, once every worker's updates of clocks up to ``t - s`` are in: it misses at most
  ``s`` clocks of any worker's updates, and waits only when it is more than ``s`` clocks
  ahead of the slowest worker.
- ``ssp`` with ``s = 0`` is bulk synchronous: the gradients of clock ``c`` from every worker
  are averaged (in worker order) and stepped once, so it equals ``sync`` (with the update
  on the server) for any optimizer, momentum and Adam too.
- ``async``: ``ssp`` without the bound; the parameters go back at once.

Every reply to a worker records its lag: the clocks by which it is ahead of the slowest
worker's applied updates (at most ``s`` under ``ssp``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from collectives.launcher import yield_core
from collectives.link import testall, testsome, waitall

from .partitions import PartitionPlan, Piece
from .wire import (
    CTRL,
    CTRL_REPLY,
    MAX_TABLES,
    NAP,
    POLL_WINDOW,
    Ask,
    Bye,
    Counter,
    Load,
    Register,
    Release,
    Reply,
    Stats,
    TableSpec,
    Tags,
    as_bytes,
)

__all__ = ["Server", "serve"]

log = logging.getLogger("hpcdl")


class _Table:
    """What a server holds of one optimizer: its partitions, receives, sums or parameters."""

    def __init__(self, spec: TableSpec, slot: int, index: int, comm: MPI.Comm, counter: Counter) -> None:
        self.bucket_group = spec.bucket_group
        self.slot = slot
        self.name = spec.name
        self.mode = spec.mode
        self.s = spec.staleness
        self.comm = comm
        self.counter = counter
        self.dtype = getattr(torch, spec.dtype)
        self.plan = PartitionPlan(
            spec.bucket_numels, spec.itemsize, spec.node_ranks, len(spec.servers), spec.partition_bytes
        )
        self.tags = Tags(slot, len(self.plan.pieces))
        self.pieces = self.plan.of_server(index)
        nodes = spec.nodes
        # a piece of shard l is pushed by local rank l of every node
        self.contrib = {p.index: [node[p.shard] for node in nodes] for p in self.pieces}
        self.bufs: dict[tuple[int, int], torch.Tensor] = {}
        self.reqs: dict[tuple[int, int], Any] = {}
        self.sends: dict[int, list[Any]] = {p.index: [] for p in self.pieces}
        self.arrived: dict[int, set[int]] = {p.index: set() for p in self.pieces}
        # sync: a partition's spare buffer; a sum is made in the first contributor's buffer and
        # sent from there, and that contributor's next push lands in the spare
        sync = self.mode == "sync"
        self.spare = {p.index: torch.empty(p.numel, dtype=self.dtype) for p in self.pieces} if sync else {}
        self.lags: dict[int, int] = {}  # worker -> largest lag sent
        self.lag_counts: dict[tuple[int, int], int] = {}  # (worker, lag) -> replies
        if self.mode != "sync":
            self._setup_update(spec)
        for p in self.pieces:
            for c in self.contrib[p.index]:
                self.bufs[p.index, c] = torch.empty(p.numel, dtype=self.dtype)
                self._arm(p, c)

    # -- ssp / async: the parameters and the optimizer live here -------------------------------
    def _setup_update(self, spec: TableSpec) -> None:
        cls = spec.optimizer
        self.groups = spec.groups
        self.hyper_keys = spec.hyper_keys
        self.params: dict[int, torch.nn.Parameter] = {}
        self.opts: dict[int, torch.optim.Optimizer] = {}
        for p in self.pieces:
            init = spec.init[p.index]
            self.params[p.index] = torch.nn.Parameter(init.clone().to(self.dtype), requires_grad=False)
            group = self.groups[spec.bucket_group[p.bucket]]
            self.opts[p.index] = cls([{**group, "params": [self.params[p.index]]}])
        self.version = {p.index: 0 for p in self.pieces}
        self.next_clock = {(p.index, c): 0 for p in self.pieces for c in self.contrib[p.index]}
        self.pending: dict[int, dict[int, dict[int, torch.Tensor]]] = {p.index: {} for p in self.pieces}
        self.owed: dict[int, list[tuple[int, int]]] = {p.index: [] for p in self.pieces}
        """Per partition, the (worker, clock) pushes whose reply has not been sent."""
        self.aggregate = self.mode == "ssp" and self.s == 0
        """Bulk synchronous: one averaged step per clock (else one step per gradient)."""
        self.to_apply: dict[int, list[tuple[int, int]]] = {p.index: [] for p in self.pieces}
        self.applied = {(p.index, c): 0 for p in self.pieces for c in self.contrib[p.index]}
        """(partition, worker) -> the worker's clocks applied there (one step per gradient)."""
        self.waiting_since: dict[int, float] = {}
        # replies are sent from a copy of the parameters taken once per version, so an update
        # never waits for a reply still on its way (to a worker that is computing, say, and
        # not progressing MPI): one slow worker would otherwise stall every partition
        self.snaps: dict[int, tuple[int, torch.Tensor, list[Any]]] = {}
        self.retiring: list[tuple[int, torch.Tensor, list[Any]]] = []
        self.workers = spec.workers
        self.hyper_len = sum(n for _, _, n in self.hyper_keys)
        self.hyper: dict[tuple[int, int], np.ndarray] = {}  # (worker, clock) -> the step's hyperparameters
        self.hyper_clock = {c: 0 for c in self.workers}
        self.hbufs = {c: np.empty(self.hyper_len, np.float64) for c in self.workers}
        # a server that holds no partition is sent no hyperparameters (nothing would forget them)
        self.hreqs = {c: self.comm.Irecv(self.hbufs[c], c, self.tags.hyper) for c in self.workers if self.pieces}

    def _hyper_arrived(self, c: int) -> None:
        self.hyper[c, self.hyper_clock[c]] = self.hbufs[c].copy()
        self.hyper_clock[c] += 1
        self.hreqs[c] = self.comm.Irecv(self.hbufs[c], c, self.tags.hyper)

    def _apply_hyper(self, piece: Piece, vec: np.ndarray) -> None:
        group = self.opts[piece.index].param_groups[0]
        gi = self.bucket_group[piece.bucket]
        at = 0
        for g, key, n in self.hyper_keys:
            if g == gi:
                vals = vec[at : at + n]
                group[key] = float(vals[0]) if n == 1 and not isinstance(group[key], tuple) else tuple(map(float, vals))
            at += n

    def _step(self, piece: Piece, grad: torch.Tensor, hyper: np.ndarray, share: float = 1.0) -> None:
        """One update of ``piece`` with the step's hyperparameters ``hyper``, its learning
        rate times ``share`` (one worker's part of a clock's update)."""
        i = piece.index
        self._apply_hyper(piece, hyper)
        group = self.opts[i].param_groups[0]
        lr = group["lr"]
        group["lr"] = lr * share
        param = self.params[i]
        param.grad = grad
        self.opts[i].step()
        param.grad = None
        group["lr"] = lr
        self.version[i] += 1

    def _reply(self, piece: Piece, c: int, data: torch.Tensor, lag: int | None = None) -> None:
        """Send ``data`` (a sum) to worker ``c``; with ``lag``, the partition's parameters
        instead, from this version's snapshot, recording the lag."""
        i = piece.index
        if lag is not None:
            snap = self.snaps.get(i)
            if snap is None or snap[0] != self.version[i]:
                if snap is not None and snap[2]:
                    self.retiring.append(snap)
                snap = self.snaps[i] = (self.version[i], self.params[i].detach().clone(), [])
            data = snap[1]
            snap[2].append(self.comm.Isend(as_bytes(data), c, self.tags.reply(i)))
        else:
            self.sends[i].append(self.comm.Isend(as_bytes(data), c, self.tags.reply(i)))
        self.counter.sent += data.numel() * data.element_size()
        if lag is not None:
            self.lags[c] = max(self.lags.get(c, 0), lag)
            self.lag_counts[c, lag] = self.lag_counts.get((c, lag), 0) + 1

    # -- arrivals ------------------------------------------------------------------------------
    def _arm(self, p: Piece, c: int) -> None:
        self.reqs[p.index, c] = self.comm.Irecv(as_bytes(self.bufs[p.index, c]), c, self.tags.push(p.index))

    def retire(self) -> None:
        """Free the snapshots whose replies have all been sent."""
        if self.mode != "sync":
            self.retiring = [s for s in self.retiring if not testall(s[2])]

    def requests(self) -> list[tuple[Any, tuple]]:
        out: list[tuple[Any, tuple]] = [(r, ("data", key)) for key, r in self.reqs.items() if r is not None]
        if self.mode != "sync":
            out += [(r, ("hyper", c)) for c, r in self.hreqs.items()]
        return out

    def arrived_from(self, what: tuple) -> None:
        kind, key = what
        if kind == "hyper":
            self._hyper_arrived(key)
            self.advance_all()
            return
        i, c = key
        piece = self.plan.pieces[i]
        self.reqs[i, c] = None
        self.counter.received += piece.numel * self.plan.itemsize
        if self.mode == "sync":
            self._sync_arrival(piece, c)
        else:
            t = self.next_clock[i, c]
            self.next_clock[i, c] = t + 1
            self.pending[i].setdefault(t, {})[c] = self.bufs[i, c].clone()
            if self.aggregate:
                self.owed[i].append((c, t))
            else:
                self.to_apply[i].append((c, t))
            self._arm(piece, c)
            self.advance(piece)

    def _sync_arrival(self, piece: Piece, c: int) -> None:
        i = piece.index
        self.arrived[i].add(c)
        who = self.contrib[i]
        if len(self.arrived[i]) < len(who):
            return
        waitall(self.sends[i])  # the last sum's replies, from the spare
        acc = self.bufs[i, who[0]]
        for w in who[1:]:  # summed in place, in contributor order: no pass to copy the first
            acc.add_(self.bufs[i, w])
        self.bufs[i, who[0]], self.spare[i] = self.spare[i], acc
        self.arrived[i].clear()
        self.sends[i] = []
        for w in who:
            self._arm(piece, w)
            self._reply(piece, w, acc)

    def advance_all(self) -> None:
        if self.mode != "sync":
            for p in self.pieces:
                self.advance(p)

    def advance(self, piece: Piece) -> None:
        """Step what can be stepped and send what is owed (ssp, async)."""
        if self.aggregate:
            self._advance_bulk(piece)
        else:
            self._advance_each(piece)
        self._forget_hyper()

    def _advance_bulk(self, piece: Piece) -> None:
        """ssp, s = 0: one averaged step once every worker's gradient of the clock is in."""
        i = piece.index
        pend, who = self.pending[i], self.contrib[i]
        while True:
            v = self.version[i]
            got = pend.get(v)
            hyper = next((self.hyper[c, v] for c in who if (c, v) in self.hyper), None)
            if got is None or len(got) < len(who) or hyper is None:
                break
            grad = got[who[0]].clone()
            for c in who[1:]:
                grad.add_(got[c])
            self._step(piece, grad.div_(len(who)), hyper)
            del pend[v]
        still = []
        for c, t in self.owed[i]:
            if self.version[i] >= t + 1:
                self._reply(piece, c, self.params[i].detach(), lag=0)
            else:
                still.append((c, t))
        self.owed[i] = still

    def _advance_each(self, piece: Piece) -> None:
        """ssp (s >= 1), async: step each gradient as it comes, in each worker's clock order
        (a step waits for its hyperparameters); reply within the staleness bound."""
        i = piece.index
        pend, who = self.pending[i], self.contrib[i]
        waiting, still = set(), []
        for c, t in self.to_apply[i]:
            hyper = self.hyper.get((c, t))
            if c in waiting or hyper is None:
                waiting.add(c)
                still.append((c, t))
                continue
            grad = pend[t].pop(c)
            if not pend[t]:
                del pend[t]
            # 1/W of a clock's update: the learning rate, not the gradient, is divided, since
            # Adam's step does not shrink with its gradient (W full-size steps a clock made
            # ssp and async W times as aggressive as sync, and collapsed runs at 4 workers)
            self._step(piece, grad, hyper, share=1.0 / len(who))
            self.applied[i, c] = t + 1
            self.owed[i].append((c, t))
        self.to_apply[i] = still
        low = min(self.applied[i, w] for w in who)
        still = []
        for c, t in self.owed[i]:
            if self.mode == "async" or low >= t + 1 - self.s:
                self._reply(piece, c, self.params[i].detach(), lag=t + 1 - low)
            else:
                still.append((c, t))
        self.owed[i] = still

    def _forget_hyper(self) -> None:
        """Drop the hyperparameters of steps every partition has taken."""
        if self.aggregate:
            low = min(self.version.values()) if self.version else 0
            stale = [k for k in self.hyper if k[1] < low]
        else:
            done = {c: min(self.applied[p.index, c] for p in self.pieces) for c in self.workers}
            stale = [k for k in self.hyper if k[1] < done[k[0]]]
        for k in stale:
            del self.hyper[k]

    def held_back(self, now: float, after: float) -> list[str]:
        """ssp: what the workers waiting longer than ``after`` seconds wait for."""
        if self.mode != "ssp":
            return []
        out = []
        for p in self.pieces:
            i = p.index
            if not self.owed[i]:
                self.waiting_since.pop(i, None)
                continue
            since = self.waiting_since.setdefault(i, now)
            if now - since < after:
                continue
            self.waiting_since[i] = now  # once per period
            waiting = sorted({c for c, _ in self.owed[i]})
            if self.aggregate:  # the clock being summed
                clock = self.version[i]
                have = self.pending[i].get(clock, {})
                slow = [c for c in self.contrib[i] if c not in have]
            else:  # the clock the longest-waiting push needs from everyone
                clock = min(t for _, t in self.owed[i]) - self.s
                slow = [c for c in self.contrib[i] if self.applied[i, c] <= clock]
            out.append(
                f"'{self.name}' partition {i}: workers {waiting} wait for every worker's clock {clock}, "
                f"held back by workers {slow} (not pushed yet)"
            )
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def reached(self, need: int) -> bool:
        """Whether every partition here has taken ``need`` updates (``sync``: always; a clock
        is one update in bulk-synchronous ``ssp``, one per worker otherwise)."""
        return self.mode == "sync" or all(v >= need for v in self.version.values())

    def params_now(self) -> dict[int, torch.Tensor]:
        """Every partition's parameters (``ssp``, ``async``)."""
        return {p.index: self.params[p.index].detach().clone() for p in self.pieces}

    def state(self) -> dict[int, Any]:
        if self.mode == "sync":
            return {}
        out = {}
        for p in self.pieces:
            i = p.index
            st = self.opts[i].state_dict()["state"].get(0, {})
            out[i] = (
                self.params[i].detach().clone(),
                {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()},
                self.version[i],
            )
        return out

    def load(self, pieces: dict[int, Any], clock: int) -> None:
        """Take the partitions' parameters and optimizer state from a checkpoint whose
        workers stood at ``clock`` (their next pushes are of that clock). The version is
        counted again for this table's mode and workers (one update a clock in bulk ssp,
        one a worker step otherwise), whatever mode or worker count wrote the checkpoint."""
        version = clock if self.aggregate else clock * len(self.workers)
        for p in self.pieces:
            i = p.index
            param, st, _ = pieces[i]
            with torch.no_grad():
                self.params[i].copy_(param)
            sd = self.opts[i].state_dict()
            self.opts[i].load_state_dict({"state": {0: st} if st else {}, "param_groups": sd["param_groups"]})
            self.version[i] = version
            snap = self.snaps.pop(i, None)  # a snapshot of this version number holds other values
            if snap is not None and snap[2]:
                self.retiring.append(snap)
            self.pending[i].clear()
            self.owed[i].clear()
            self.to_apply[i].clear()
            for c in self.contrib[i]:
                self.next_clock[i, c] = clock
                self.applied[i, c] = clock
        for c in self.workers:
            self.hyper_clock[c] = clock
        self.hyper.clear()

    def close(self) -> None:
        for r in list(self.reqs.values()) + (list(self.hreqs.values()) if self.mode != "sync" else []):
            if r is not None:
                r.Cancel()
                r.Wait()
        for sends in self.sends.values():
            waitall(sends)
        if self.mode != "sync":
            for snap in [*self.snaps.values(), *self.retiring]:
                waitall(snap[2])


class Server:
    """The server with index ``index`` among ``servers`` (ranks of ``comm``), serving the
    workers ``workers`` (ranks of ``comm``) until each of them has said goodbye."""

    def __init__(
        self, comm: MPI.Comm, index: int, workers: list[int], stall_seconds: float = 60.0, nap: float = NAP
    ) -> None:
        self.comm = comm
        self.index = index
        self.nap = nap
        """How an idle server waits (:func:`.wire.wait_nap`): with 0, it polls without
        sleeping for :data:`.wire.POLL_WINDOW` after its last message, then sleeps as with
        :data:`.wire.NAP`; else it sleeps at once, up to ``nap`` between polls."""
        self.workers = list(workers)
        self.left = set(workers)
        self.tables: dict[int, _Table] = {}
        """Tables by slot (this server's number for a table: it picks the data tags)."""
        self.registering: dict[str, dict[int, dict]] = {}
        """Registrations under way, by table name: worker -> its spec."""
        self.counter = Counter()
        self.stall_seconds = stall_seconds
        self._reqs: list[Any] | None = None
        self._what: list[tuple[_Table, tuple]] = []
        self.deferred: list[tuple[int, Ask]] = []  # (worker, what it asked), answered once the table reached it
        self.lock = threading.Lock()
        """Held while a thread looks at the messages: the server's own, or one that helps
        (:meth:`serve_once`)."""
        self.finished = False
        self._status = MPI.Status()

    def serve(self) -> None:
        """Serve until every worker said goodbye."""
        sleep = 0.0
        last_check = last_busy = time.monotonic()
        while self.left:
            with self.lock:
                busy = self._look(control=True)
            now = time.monotonic()
            if busy:
                sleep, last_busy = 0.0, now
                continue
            if now - last_check > 1.0:
                last_check = now
                with self.lock:  # a helping thread may be stepping the tables
                    stalls = [line for t in self.tables.values() for line in t.held_back(now, self.stall_seconds)]
                for line in stalls:
                    log.warning("hpcdl: parameter server %d: %s", self.index, line)
            if not self.nap and now - last_busy < POLL_WINDOW:  # a core of its own: between a step's messages
                yield_core()
                continue
            sleep = min(self.nap or NAP, max(sleep * 2, 20e-6))
            time.sleep(sleep)
        with self.lock:
            self.finished = True
            for t in self.tables.values():
                t.close()

    def serve_once(self) -> None:
        """One look at the partitions' messages, by another thread of this server's process
        (a worker waiting on this co-located server), unless the server's own thread is
        looking: the waiting thread sums and replies at once, where the server's thread
        sleeps between looks and must win the interpreter back from the waiting one.
        Control messages are left to the server's thread."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if not self.finished:
                self._look(control=False)
        finally:
            self.lock.release()

    def _look(self, control: bool) -> bool:
        """One look at the control messages (``control``) and the partitions' messages, and
        the work they bring; whether there was any. Under :attr:`lock`."""
        busy, status = False, self._status
        while control and self.comm.Iprobe(MPI.ANY_SOURCE, CTRL, status):
            src = status.Get_source()
            self._control(src, self.comm.recv(source=src, tag=CTRL))
            busy = True
        if self._reqs is None:
            self._collect()
        if self._reqs:
            done = testsome(self._reqs)
            if done:
                busy = True
                what = [self._what[k] for k in done]
                self._reqs = None
                for table, w in what:
                    table.arrived_from(w)
        if control and self.deferred:
            self._answer_deferred()
        for t in self.tables.values():  # every look, busy or not: snapshots pile up otherwise
            t.retire()
        return busy

    def _collect(self) -> None:
        self._reqs, self._what = [], []
        for t in self.tables.values():
            for r, w in t.requests():
                self._reqs.append(r)
                self._what.append((t, w))

    def _control(self, src: int, msg: tuple) -> None:
        """Answer one control message of worker ``src`` (a named tuple of :mod:`.wire`)."""
        if isinstance(msg, Bye):
            self.left.discard(src)
        elif isinstance(msg, Register):
            spec = msg.spec
            waiting = self.registering.setdefault(spec.name, {})
            waiting[src] = spec
            if set(waiting) >= set(spec.workers):
                del self.registering[spec.name]
                self._register(waiting)
        elif isinstance(msg, Release):
            t = self.tables.pop(msg.slot, None)
            if t is not None:
                t.close()
                self._reqs = None
            self.comm.send(Reply(True, None), dest=src, tag=CTRL_REPLY)
        elif not isinstance(msg, (Ask, Load, Stats)):
            self.comm.send(Reply(False, f"parameter server: unknown request {msg!r}"), dest=src, tag=CTRL_REPLY)
        elif msg.slot not in self.tables:
            what = f"parameter server {self.index}: no table {msg.slot} (the optimizer was closed?)"
            self.comm.send(Reply(False, what), dest=src, tag=CTRL_REPLY)
        elif isinstance(msg, Ask):  # once every partition has taken the updates asked for
            self.deferred.append((src, msg))
            self._answer_deferred()
        elif isinstance(msg, Load):
            self.tables[msg.slot].load(msg.pieces, msg.clock)
            self.comm.send(Reply(True, None), dest=src, tag=CTRL_REPLY)
        else:
            t = self.tables[msg.slot]
            stats = {"lags": dict(t.lags), "lag_counts": dict(t.lag_counts)}
            stats["bytes"] = (self.counter.sent, self.counter.received)
            stats["cpu_s"] = time.process_time()  # this process's CPU time so far
            self.comm.send(Reply(True, stats), dest=src, tag=CTRL_REPLY)

    def _answer_deferred(self) -> None:
        still = []
        for src, ask in self.deferred:
            t = self.tables.get(ask.slot)
            if t is None:
                gone = f"parameter server {self.index}: table {ask.slot} was released"
                self.comm.send(Reply(False, gone), src, CTRL_REPLY)
            elif t.reached(ask.need):
                self.comm.send(Reply(True, t.state() if ask.what == "state" else t.params_now()), src, CTRL_REPLY)
            else:
                still.append((src, ask))
        self.deferred = still

    def _register(self, specs: dict[int, TableSpec]) -> None:
        """Build the table every worker of ``specs`` registered, in the slot this server
        picks (a table of the same name is replaced), and tell each worker the slot."""
        first = specs[min(specs)]
        differ = sorted({f for s in specs.values() for f in first.differences(s)})
        problem, slot = None, None
        if differ:
            problem = f"parameter server {self.index}: workers registered '{first.name}' differently ({differ})"
        else:
            if first.mode != "sync":
                first = dataclasses.replace(first, init=next(s.init for s in specs.values() if s.init is not None))
            slot = next((k for k, t in self.tables.items() if t.name == first.name), None)
            if slot is not None:
                self.tables.pop(slot).close()
            else:
                slot = next((k for k in range(MAX_TABLES) if k not in self.tables), None)
            if slot is None:
                problem = f"parameter server {self.index}: {MAX_TABLES} tables are registered already; close one"
            else:
                try:
                    self.tables[slot] = _Table(first, slot, self.index, self.comm, self.counter)
                except Exception as exc:  # a table this server cannot build: every worker is told
                    problem = f"parameter server {self.index}: {type(exc).__name__}: {exc}"
            self._reqs = None
        for w in specs:
            self.comm.send(Reply(False, problem) if problem else Reply(True, slot), dest=w, tag=CTRL_REPLY)


def serve(comm: MPI.Comm, index: int, workers: list[int], stall_seconds: float = 60.0, nap: float = NAP) -> Counter:
    """Run server ``index`` over ``comm`` until every worker in ``workers`` said goodbye,
    sleeping at most ``nap`` seconds between polls while idle; return its byte counter."""
    srv = Server(comm, index, workers, stall_seconds, nap)
    srv.serve()
    return srv.counter
