"""The DP x TP x PP rank grid, computed once: every rank's coordinates, its groups as
process sets, and its pipeline neighbours, so that no other module does rank arithmetic.

Ranks are ordered with TP fastest, then DP, then PP (as in Megatron-LM): rank
``r = (pp * dp_size + dp) * tp_size + tp``, so a TP group is a run of consecutive ranks and
stays inside a node when ``tp`` divides the node's rank count.
"""

from __future__ import annotations

import dataclasses
import math

from .. import state
from ..basics import mpi_threads_supported
from ..errors import HpcdlArgumentError
from ..functions import allgather_object
from ..process_sets import ProcessSet, add_process_set, remove_process_set
from . import tp_comm

__all__ = ["Grid", "current_grid"]


@dataclasses.dataclass(eq=False)
class Grid:
    """A DP x TP x PP grid over the runtime's ranks; one size may be -1 (inferred).

    Building it is collective (it registers every group as a process set, in the same order
    on every rank). Attributes after construction:

    Attributes:
        dp, tp, pp: the sizes (the inferred one filled in).
        rank, world: this rank and the number of ranks.
        dp_rank, tp_rank, pp_rank: this rank's coordinates (``pp_rank`` is its stage).
        dp_group, tp_group, pp_group: the process sets of the ranks that share this rank's
            other two coordinates.
        prev_rank, next_rank: the ranks of the previous and next pipeline stage (None at the
            ends).
    """

    dp: int = -1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        rt = state.running()
        world = rt.size
        # every rank's arguments and node size first, so that any problem is every rank's
        said = allgather_object(
            (self.dp, self.tp, self.pp, rt.local_size, mpi_threads_supported()), name="parallel.grid"
        )
        if any(s[:3] != said[0][:3] for s in said):
            shown = "; ".join(f"rank {r}: dp={s[0]}, tp={s[1]}, pp={s[2]}" for r, s in enumerate(said))
            raise HpcdlArgumentError(f"Grid: ranks disagree on the sizes ({shown})")
        sizes = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v == 0 or v < -1}
        if bad:
            raise HpcdlArgumentError(f"Grid sizes must be positive integers or -1 (inferred), not {bad}")
        inferred = [k for k, v in sizes.items() if v == -1]
        if len(inferred) > 1:
            raise HpcdlArgumentError(f"Grid: at most one size may be -1 (inferred), not {inferred}")
        if inferred:
            known = math.prod(v for v in sizes.values() if v != -1)
            if world % known:
                raise HpcdlArgumentError(
                    f"Grid: {' x '.join(f'{k}={v}' for k, v in sizes.items() if v != -1)} = {known} "
                    f"does not divide the world size {world}, so {inferred[0]} cannot be inferred"
                )
            sizes[inferred[0]] = world // known
        if sizes["dp"] * sizes["tp"] * sizes["pp"] != world:
            raise HpcdlArgumentError(
                f"Grid: dp={sizes['dp']} x tp={sizes['tp']} x pp={sizes['pp']} = "
                f"{sizes['dp'] * sizes['tp'] * sizes['pp']} != world size {world}"
            )
        split = sorted({s[3] for s in said if s[3] % sizes["tp"]})
        if split:
            raise HpcdlArgumentError(
                f"Grid: tp={sizes['tp']} does not divide a node of {split[0]} ranks, so a tensor-parallel "
                "group would span nodes"
            )
        self.dp, self.tp, self.pp = sizes["dp"], sizes["tp"], sizes["pp"]
        self.rank, self.world = rt.rank, world
        self.tp_rank = self.rank % self.tp
        self.dp_rank = (self.rank // self.tp) % self.dp
        self.pp_rank = self.rank // (self.tp * self.dp)
        # every rank registers every group, in one order: process sets are collective
        self._sets: list[ProcessSet] = []
        self.tp_group = self._groups("tp")
        self.dp_group = self._groups("dp")
        self.pp_group = self._groups("pp")
        # the TP group's own communicator for the direct path (collective over the world);
        # only where every rank's MPI lets a second thread call it beside the engine's
        self._tp_comm = None
        if self.tp > 1 and all(s[4] for s in said):
            self._tp_comm = rt.comm.Split(self.pp_rank * self.dp + self.dp_rank, self.tp_rank)
            tp_comm.attach(self.tp_group, self._tp_comm)
            rt.at_shutdown.append(self._release_tp)
        stage = self.pp_rank
        self.prev_rank = self.rank_of(self.dp_rank, self.tp_rank, stage - 1) if stage > 0 else None
        self.next_rank = self.rank_of(self.dp_rank, self.tp_rank, stage + 1) if stage < self.pp - 1 else None
        rt.grid = self

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        """The rank at coordinates (dp, tp, pp)."""
        return (pp * self.dp + dp) * self.tp + tp

    def _groups(self, axis: str) -> ProcessSet:
        """Register the process set of each line of the grid along ``axis``; return this
        rank's."""
        mine = None
        for a in range(self.dp):
            for b in range(self.tp):
                for c in range(self.pp):
                    coords = {"dp": a, "tp": b, "pp": c}
                    if coords[axis] != 0:
                        continue  # one line per choice of the other two coordinates
                    line = []
                    for k in range({"dp": self.dp, "tp": self.tp, "pp": self.pp}[axis]):
                        coords[axis] = k
                        line.append(self.rank_of(coords["dp"], coords["tp"], coords["pp"]))
                    ps = add_process_set(line)
                    self._sets.append(ps)
                    if self.rank in line:
                        mine = ps
        assert mine is not None
        return mine

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def close(self) -> None:
        """Unregister the grid's process sets and free the TP group's communicator
        (collective); ``shutdown`` does it too."""
        self._release_tp()
        for ps in self._sets:
            if ps.process_set_id is not None:
                remove_process_set(ps)
        self._sets = []
        rt = state.peek()
        if rt is not None and getattr(rt, "grid", None) is self:
            rt.grid = None

    def _release_tp(self) -> None:
        """End the TP group's direct path and free its communicator (once)."""
        if self._tp_comm is not None:
            tp_comm.detach(self.tp_group)
            self._tp_comm.Free()
            self._tp_comm = None

    def __str__(self) -> str:
        return (
            f"DP({self.dp_rank}/{self.dp}) TP({self.tp_rank}/{self.tp}) PP({self.pp_rank}/{self.pp}) rank {self.rank}"
        )


def current_grid() -> Grid:
    """The most recently built :class:`Grid` of the running runtime."""
    grid = getattr(state.current(), "grid", None)
    if grid is None:
        raise HpcdlArgumentError("no hpcdl.parallel.Grid has been built; build one or pass grid=")
    return grid
