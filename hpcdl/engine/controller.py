"""Negotiation: which requests every rank has submitted, whether they agree, and the plan
of what runs (and what is fused) this cycle.

Each cycle every rank sends one fixed-size message, ``[flags, rank clock (us), cache
size, uncached count | cache bits]``: a bit per request whose descriptor is in the
:class:`~.response_cache.ResponseCache` (the steady state), and, only when some rank has
uncached requests, a second, pickled gather of their descriptors. From this every rank
keeps the same table of who submitted what, so every rank makes the same decisions.

A request is ready when every member of its process set submitted it (or has joined).
A name belongs to its process set, as in Horovod: disjoint sets (the data-parallel groups
of a grid) may use the same names at once. Ranks that disagree on its kind, dtype, shape,
op, root or scale factors make it fail on every rank with a message naming ranks and
values, and so do ranks that submit one name in two sets each waiting for the other's
ranks; the runtime stays usable.
Ready allreduces of one dtype, op, scale factors and process set are planned into
batches of at most ``fusion_threshold`` bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import collectives

from ..config import Config
from ..errors import HpcdlArgumentError, HpcdlError
from .process_set_table import ProcessSetTable
from .request import DTYPES, JOIN_OK, Descriptor, Submission, field_label
from .response_cache import ResponseCache

__all__ = ["Controller", "Entry", "Ready", "F_SHUTDOWN", "F_JOIN"]

_H = 4  # header words of a cycle message: flags, rank clock (us), cache size, uncached count
F_SHUTDOWN, F_JOIN = 1, 2
"""Cycle message flags: this rank shuts the runtime down; this rank has joined."""


@dataclasses.dataclass(slots=True)
class Entry:
    """A request (a name in a process set) some ranks submitted: their descriptors, by rank."""

    descs: dict[int, Descriptor]
    first: int  # rank 0's clock (us) in the cycle it was first announced


class Ready(NamedTuple):
    """A ready request: its name, its entry, and the error every rank raises (None: agreed)."""

    name: str
    entry: Entry
    problem: HpcdlError | None

    @property
    def first(self) -> Descriptor:
        """One rank's descriptor (every rank's agree where ``problem`` is None)."""
        return next(iter(self.entry.descs.values()))


class Controller:
    """The negotiation state of one rank's engine (identical on every rank)."""

    def __init__(
        self, ecomm: Any, config: Config, sets: ProcessSetTable, node_channel: bool, polite: Callable[[Any], None]
    ) -> None:
        self.ecomm = ecomm
        self.rank, self.size = ecomm.rank, ecomm.size
        self.cfg = config
        self.sets = sets
        self.node_channel = node_channel  # negotiate through the node channel (it sleeps while it waits)
        self.polite = polite
        self.cache = ResponseCache(config.cache_capacity)
        self.table: dict[tuple[int, str], Entry] = {}
        """The requests in negotiation, by (process set id, name)."""
        self.joined: set[int] = set()
        self.last_joined = -1

    def negotiate(self, new: list[Submission], flags: int, t_start: float) -> tuple[list[int], int]:
        """Announce ``new`` and this rank's ``flags``; learn every rank's. Return the ranks
        that asked to shut down and rank 0's clock (us)."""
        cache = self.cache
        msg = np.zeros(_H + cache.words(), np.int64)
        for req in new:
            req.t_announce = t_start
        uncached = cache.encode([req.desc for req in new], msg[_H:].view(np.uint64))
        msg[0], msg[1], msg[2], msg[3] = flags, int(t_start * 1e6), len(cache), len(uncached)
        table = np.empty((self.size, msg.size), np.int64)
        if self.node_channel:
            self.polite(self.ecomm)
            collectives.allgather(msg.reshape(1, -1), out=table, comm=self.ecomm)
        else:
            self.ecomm.Allgather(msg, table)
        lists = self.ecomm.allgather(uncached) if table[:, 3].any() else [[]] * self.size
        if (table[:, 2] != len(cache)).any():
            raise RuntimeError(f"response caches differ between ranks: sizes {table[:, 2].tolist()}")
        now_ref = int(table[0, 1])
        for r in range(self.size):
            for d in cache.decode(table[r, _H:]) + lists[r]:
                ent = self.table.get((d.set_id, d.name))
                if ent is None:
                    ent = self.table[(d.set_id, d.name)] = Entry({}, now_ref)
                ent.descs[r] = d
            if table[r, 0] & F_JOIN:
                self.joined.add(r)
                self.last_joined = r
        return [r for r in range(self.size) if table[r, 0] & F_SHUTDOWN], now_ref

    def all_joined(self) -> int | None:
        """When every rank has joined: forget the joins and return the last to join."""
        if self.joined and len(self.joined) == self.size:
            last, self.joined, self.last_joined = self.last_joined, set(), -1
            return last
        return None

    def members(self, ent: Entry) -> set[int]:
        """The ranks that must submit ``ent``: those that did, and every member of each
        process set their descriptors name (a set not registered has no members)."""
        members = set(ent.descs)
        for d in ent.descs.values():
            info = self.sets.get(d.set_id)
            if info is not None:
                members.update(info.ranks)
        return members

    def missing(self, ent: Entry) -> list[int]:
        """The ranks ``ent`` still waits for."""
        return sorted(self.members(ent) - set(ent.descs) - self.joined)

    def pending_on(self, sid: int) -> list[str]:
        """Names of the requests in the table that use process set ``sid``."""
        return sorted(name for (s, name) in self.table if s == sid)

    def plan(self) -> list[list[Ready]]:
        """Take the ready requests out of the table and return what runs this cycle, in
        order: groups of one request, or of fusable allreduces (one key, first-seen
        order). Removing a process set comes after the cycle's other requests, which may
        use it."""
        ready: list[Ready] = []
        done: list[tuple[int, str]] = []
        for key, ent in self.table.items():
            if all(r in ent.descs or r in self.joined for r in self.members(ent)):
                ready.append(Ready(key[1], ent, self.judge(key[1], ent)))
                done.append(key)
        for keys in self._crossed():
            both = Entry({r: d for k in keys for r, d in self.table[k].descs.items()}, self.table[keys[0]].first)
            problem = self.judge(keys[0][1], both)
            ready += [Ready(k[1], self.table[k], problem) for k in keys]
            done += keys
        if not ready:
            return []
        for key in done:
            del self.table[key]
        plan: list[list[Ready]] = []
        open_batch: dict[tuple, tuple[list, int]] = {}
        limit = self.cfg.fusion_threshold
        for item in ready:
            d = item.first
            s = d.sig
            if item.problem is None and d.kind == "allreduce" and limit and s.op != "adasum":  # adasum: per tensor
                nbytes = math.prod(s.shape) * DTYPES[s.dtype].itemsize
                if nbytes <= limit:
                    key = (d.set_id, s.dtype, s.op, s.prescale_factor, s.postscale_factor, s.memory)
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
        last = [g for g in plan if g[0].first.kind == "remove_process_set"]
        return [g for g in plan if g not in last] + last

    def _crossed(self) -> list[list[tuple[int, str]]]:
        """Pairs of waiting requests of one name in two process sets where each waits for a
        rank that submitted the other: ranks that disagree on the name's set, which would
        otherwise wait for ever (a rank has one request of a name in flight at a time).
        A pair is declared only once every member of both sets has submitted one of the
        two: a member still on its way would otherwise announce into an entry already
        failed, and wait alone for ever while the others move on."""
        by_name: dict[str, list[tuple[int, str]]] = {}
        for key in self.table:
            by_name.setdefault(key[1], []).append(key)
        out = []
        for keys in by_name.values():
            for i, a in enumerate(keys):
                for b in keys[i + 1 :]:
                    ea, eb = self.table[a], self.table[b]
                    if not (set(self.missing(ea)) & set(eb.descs) and set(self.missing(eb)) & set(ea.descs)):
                        continue
                    if self.members(ea) | self.members(eb) <= set(ea.descs) | set(eb.descs) | self.joined:
                        out.append([a, b])
        return out

    def remember(self, group: list[Ready]) -> None:
        """Cache every rank's descriptor of ``group`` (on every rank alike, members or not)."""
        for item in group:
            for r in sorted(item.entry.descs):
                self.cache.remember(item.entry.descs[r])

    def judge(self, name: str, ent: Entry) -> HpcdlError | None:
        """None when every rank's descriptor agrees (and can run now), else the error every
        rank raises: :class:`HpcdlArgumentError` for bad arguments, :class:`HpcdlError` for
        ranks that disagree or a request that cannot run while ranks have joined."""
        descs = ent.descs
        d0 = next(iter(descs.values()))
        if d0.error is None and not self.joined and all(d == d0 for d in descs.values()):
            return None  # the steady state: every rank sent the same (cached) descriptor
        errors = [f"rank {r}: {d.error}" for r, d in sorted(descs.items()) if d.error is not None]
        if errors:
            return HpcdlArgumentError(f"request '{name}' has bad arguments: " + "; ".join(errors))
        for label, field in (("operation", "kind"), ("process set", "set_id")):
            text = _differs(descs, lambda d, f=field: getattr(d, f), label)
            if text:
                return HpcdlError(f"ranks disagree on request '{name}': {text}")
        kind = d0.kind  # every rank's agrees from here on, and so does its signature's type
        for field in getattr(d0.sig, "_fields", ()):
            text = _differs(descs, lambda d, f=field: getattr(d.sig, f), field_label(field))
            if text:
                return HpcdlError(f"ranks disagree on {kind} '{name}': {text}")
        joined = sorted(self.joined & self.members(ent))
        if joined and kind not in JOIN_OK:
            return HpcdlError(f"{kind} '{name}' cannot run while ranks {joined} have joined (only allreduce can)")
        return None


def _differs(descs: dict[int, Descriptor], get: Any, field: str) -> str | None:
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
