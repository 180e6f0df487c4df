"""Process sets: collectives over a subset of the ranks, as in Horovod.

``ProcessSet(ranks)`` names ranks of the runtime's communicator; ``add_process_set``
registers it on every rank (every rank must call it, in the same order, with the same
ranks; otherwise every rank raises), after which any collective takes
``process_set=``. ``global_process_set`` (id 0) is every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpi4py import MPI

from . import state
from .engine import SetIdSig, SetSig
from .errors import HpcdlError
from .handles import control

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "registered_id"]


class ProcessSet:
    """A set of ranks that collectives can run on (``process_set_id`` once registered)."""

    def __init__(self, ranks: Sequence[int] | MPI.Comm) -> None:
        if isinstance(ranks, MPI.Comm):
            raise HpcdlError("ProcessSet takes a list of ranks; a communicator is not supported")
        try:
            self._ranks = sorted(int(r) for r in ranks)
        except (TypeError, ValueError):
            raise HpcdlError(f"ProcessSet takes a list of ranks, not {ranks!r}") from None
        self.process_set_id: int | None = None

    @property
    def ranks(self) -> list[int]:
        """The member ranks, in increasing order."""
        return list(self._ranks)

    def size(self) -> int:
        """Number of member ranks."""
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set, or None when it is not a member."""
        me = state.current().rank
        ranks = self.ranks
        return ranks.index(me) if me in ranks else None

    def included(self) -> bool:
        """True when this process is a member."""
        return self.rank() is not None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the runtime (id 0); its ranks follow the current ``init``."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        return list(range(state.current().size))

    def __repr__(self) -> str:
        # shown in signatures and help() before init: it must not raise there
        if state.peek() is None:
            return "ProcessSet(process_set_id=0, ranks=every rank, once initialized)"
        return super().__repr__()


global_process_set: ProcessSet = _GlobalProcessSet()
"""Every rank (process set id 0)."""


def registered_id(process_set: ProcessSet) -> int:
    """The registered id of ``process_set`` (what requests carry), checking that this rank
    is a member; raises ``TypeError`` for a non-ProcessSet and :class:`HpcdlError` for a set
    that is not registered or does not hold this rank."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    sid = process_set.process_set_id
    if sid is None:
        raise HpcdlError(f"{process_set!r} is not registered; call hpcdl.add_process_set() first")
    me = state.current().rank
    if sid and me not in process_set.ranks:
        raise HpcdlError(f"rank {me} is not a member of {process_set!r}")
    return sid


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (collective over all ranks) and return it.

    Raises:
        HpcdlError: on every rank, when ranks pass different lists or a bad one.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise HpcdlError(f"{ps!r} is already registered")
    rt = state.running()
    n = rt.size
    ranks = ps.ranks
    problem = None
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < n for r in ranks):
        problem = f"process set ranks {ranks} must be distinct ranks in [0, {n})"
    ps.process_set_id = control("add_process_set", SetSig(tuple(ranks)), error=problem)
    rt.process_sets.append(ps)  # shutdown unregisters it
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective); False if it was not registered."""
    sid = process_set.process_set_id
    if not sid:
        return False
    control("remove_process_set", SetIdSig(sid))
    process_set.process_set_id = None
    return True
