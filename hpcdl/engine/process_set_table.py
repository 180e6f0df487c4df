"""The engine's registry of process sets: ids, ranks and, on members, communicators.

Every rank registers and removes sets in the same negotiated order, so ids agree across
ranks. Id 0 is the global set over the engine's data communicator.
"""

from __future__ import annotations

from typing import Any

from collectives.context import get_context

from ..errors import HpcdlError
from .request import ProcessSetInfo

__all__ = ["ProcessSetTable"]


class ProcessSetTable:
    """Registered process sets by id."""

    def __init__(self, dcomm: Any, rank: int) -> None:
        self.dcomm = dcomm
        self.rank = rank
        # a communicator's context (and its node window) is set up collectively here, where
        # every member meets, so the user thread can allocate from the window at any time
        self.sets: dict[int, ProcessSetInfo] = {
            0: ProcessSetInfo(tuple(range(dcomm.size)), dcomm, get_context(dcomm).arena)
        }
        self.next_id = 1

    def __contains__(self, sid: int) -> bool:
        return sid in self.sets

    def get(self, sid: int) -> ProcessSetInfo | None:
        """The set with id ``sid``, or None when it is not registered."""
        return self.sets.get(sid)

    def add(self, ranks: tuple[int, ...]) -> int:
        """Register a set of ``ranks`` (collective over the data communicator); return its id."""
        sid, self.next_id = self.next_id, self.next_id + 1
        comm = arena = None
        if self.rank in ranks:
            world = self.dcomm.Get_group()
            group = world.Incl(list(ranks))
            comm = self.dcomm.Create_group(group, tag=sid)
            group.Free()
            world.Free()
            arena = get_context(comm).arena
        self.sets[sid] = ProcessSetInfo(tuple(ranks), comm, arena)
        return sid

    def remove(self, sid: int, pending: list[str]) -> int:
        """Unregister set ``sid``; ``pending`` names the requests still waiting on it."""
        if sid == 0 or sid not in self.sets:
            raise HpcdlError(f"process set {sid} cannot be removed (global, or not registered)")
        if pending:
            raise HpcdlError(f"process set {sid} still has requests in flight: {pending}")
        removed = self.sets.pop(sid)
        if removed.comm is not None:
            removed.comm.Free()
        return sid

    def free(self) -> None:
        """Free every set's communicator (the engine's teardown; the data communicator is
        the engine's own)."""
        for sid, info in list(self.sets.items()):
            if sid and info.comm is not None:
                info.comm.Free()
        self.sets.clear()
