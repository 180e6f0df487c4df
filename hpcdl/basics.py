"""Horovod's basics: ``init``, ``shutdown`` and what a rank knows about the job.

``init`` takes an mpi4py communicator or a list of ranks of ``MPI.COMM_WORLD`` (default:
the whole world). Local and cross ranks come from the node split of :mod:`collectives`
(ranks sharing memory; ``HPCDL_RANKS_PER_NODE`` cuts nodes into smaller simulated ones):
``local_rank`` is the rank within the node, ``cross_rank`` the rank among the ranks with
the same local rank (the node's index when every node has the same number of ranks).
"""

from __future__ import annotations

import atexit
import dataclasses
from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from collectives import unchecked
from collectives.config import load_config as load_collectives_config
from collectives.cost import parse_link
from collectives.device.nccl import available as nccl_available
from collectives.errors import combined_problem
from collectives.link import locate

from . import ps as ps_roles
from . import state
from .config import AGREED, Config, load_config
from .engine import Engine
from .errors import HorovodInternalError, HpcdlError
from .launcher import check_world
from .process_sets import add_process_set
from .state import Runtime
from .timeline import path_problem

__all__ = [
    "HpcdlError",
    "HorovodInternalError",
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "is_homogeneous",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "nccl_built",
    "gloo_built",
    "gloo_enabled",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
]


def init(
    comm: MPI.Comm | Sequence[int] | None = None,
    process_sets: Sequence[Any] | None = None,
    *,
    config: Any = None,
    ps_servers: int | None = None,
) -> None:
    """Start the runtime on ``comm`` (an mpi4py communicator, a list of world ranks, or None
    for ``MPI.COMM_WORLD``) and its background engine. Collective over ``comm``'s ranks
    (over the world for a list); calling it again without :func:`shutdown` in between does
    nothing, as in Horovod.

    The ranks first exchange what they were given, so bad arguments on any rank raise
    :class:`HpcdlError` on every rank instead of leaving the others waiting. Where the
    launcher started several tasks and MPI sees each as a job of its own (``srun`` without
    an MPI plugin, the ``mpiexec`` of another MPI than mpi4py's), each raises
    :class:`HpcdlError` instead of running alone (:func:`hpcdl.launcher.check_world`).
    With a list of ranks every world rank must pass the same list; ranks outside it get an
    :class:`HpcdlError` (they are not part of the job).

    Args:
        comm: the communicator or world ranks to run on.
        process_sets: :class:`~hpcdl.ProcessSet` objects (or rank lists) to register now.
        config: a :class:`hpcdl.Config`; by default read from the ``HPCDL_*`` environment.
        ps_servers: make the last this many world ranks parameter servers (default:
            ``Config.ps_servers``, ``HPCDL_PS_SERVERS``). On them ``init`` serves until every
            worker has called :func:`shutdown` (or exited), then ends the process with exit
            status 0; on the workers the runtime counts the workers only. Needs ``comm=None``.
    """
    check_world(MPI.COMM_WORLD.Get_size(), library=MPI.Get_library_version().splitlines()[0].strip())
    with state.LOCK:
        old = state.peek()
        if old is not None:
            if old.engine.running:
                return
            _end(state.take())  # shut down by another rank (or failed): start afresh
        if state.servers_ended():
            raise HpcdlError(
                "init: this job's parameter servers ended with shutdown(), and their ranks are gone; "
                "hpcdl cannot start again in this job (call shutdown() only at the end)"
            )
        listed = comm is not None and not isinstance(comm, MPI.Comm)
        base = comm if isinstance(comm, MPI.Comm) else MPI.COMM_WORLD
        if base == MPI.COMM_NULL:
            raise HpcdlError("init(comm=MPI.COMM_NULL): this process is not part of the communicator")
        args = _InitArgs(comm if listed else None, process_sets, config, ps_servers)
        problem = args.check(base, comm is not None)
        said = base.allgather((problem, args.ranks, args.sets, args.agreed))
        _agree(said)
        state.install(_start(base, args))
    if process_sets:
        for ps in process_sets:
            add_process_set(ps)


@dataclasses.dataclass
class _InitArgs:
    """What one rank passed to :func:`init`, checked on this rank alone; what every rank
    must agree on is in ``ranks``, ``sets`` and ``agreed`` once :meth:`check` found no
    problem."""

    listed: Any
    process_sets: Sequence[Any] | None
    config: Any
    ps_servers: int | None
    servers: int = 0
    ranks: list[int] | None = None
    sets: list[list[int]] | None = None
    agreed: dict[str, Any] | None = None

    def check(self, base: MPI.Comm, comm_given: bool) -> str | None:
        """This rank's problem with its arguments (None: none), every check in order."""
        try:
            self._check_config(comm_given)
            if self.listed is not None:
                self.ranks = _rank_list(self.listed)
            timeline = self.config.timeline
            if timeline and base.rank == (self.ranks[0] if self.ranks else 0):  # its writer
                bad = path_problem(timeline)
                if bad is not None:
                    raise HpcdlError(f"HPCDL_TIMELINE={timeline!r}: {bad}")
            self.agreed = {f: getattr(self.config, f) for f in AGREED}
            self.agreed["ps_servers"] = self.servers
            try:  # the engine's collectives skip their own agreement: their configuration must match
                self.agreed["collectives"] = unchecked.fingerprint()
            except Exception as exc:  # a bad HPCDL_* value of the collectives layer
                raise HpcdlError(str(exc)) from exc
            if self.process_sets:
                try:
                    self.sets = [sorted(int(r) for r in getattr(ps, "ranks", ps)) for ps in self.process_sets]
                except (TypeError, ValueError):
                    raise HpcdlError(
                        f"init(process_sets=...) takes ProcessSet objects or rank lists, not {self.process_sets!r}"
                    ) from None
        except HpcdlError as exc:
            return str(exc)
        return None

    def _check_config(self, comm_given: bool) -> None:
        """The configuration, MPI's thread level and the number of parameter servers."""
        if self.config is None:
            self.config = load_config()
        elif not isinstance(self.config, Config):
            raise HpcdlError(f"init(config=...) takes an hpcdl.Config, not {type(self.config).__name__}")
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise HpcdlError(
                "MPI was initialized without thread support; hpcdl's engine thread needs at least "
                "MPI_THREAD_SERIALIZED (mpi4py's default is MPI_THREAD_MULTIPLE)"
            )
        servers = self.config.ps_servers if self.ps_servers is None else self.ps_servers
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 0:
            raise HpcdlError(f"init(ps_servers={servers!r}) must be an integer >= 0")
        if servers and comm_given:
            raise HpcdlError(f"init(ps_servers={servers}) takes the servers from MPI.COMM_WORLD: pass no comm")
        self.servers = servers


def _agree(said: list[tuple[Any, ...]]) -> None:
    """Raise on every rank unless every rank's ``(problem, ranks, sets, agreed)`` is fine
    and the same as rank 0's."""
    bad = combined_problem([p for p, _, _, _ in said])
    if bad is not None:
        raise HpcdlError(f"init failed: {bad}")
    differ = [r for r, (_, other, _, _) in enumerate(said) if other != said[0][1]]
    if differ:
        raise HpcdlError(f"init(comm=<ranks>): ranks {differ} passed a different list than rank 0")
    differ = [r for r, (_, _, other, _) in enumerate(said) if other != said[0][2]]
    if differ:
        raise HpcdlError(f"init(process_sets=...): ranks {differ} passed different process sets than rank 0")
    for f in AGREED:
        values = {r: a[f] for r, (_, _, _, a) in enumerate(said)}
        if len(set(values.values())) > 1:
            raise HpcdlError(
                f"init: every rank needs the same {f} (HPCDL_{f.upper()}); got "
                + ", ".join(f"{v!r} on rank {r}" for r, v in values.items())
            )
    differ = [r for r, (_, _, _, a) in enumerate(said) if a["collectives"] != said[0][3]["collectives"]]
    if differ:
        raise HpcdlError(
            f"init: ranks {differ} configure the collectives layer differently from rank 0 (HPCDL_* "
            "variables such as HPCDL_TUNING_FILE or HPCDL_SHM_SMALL_BYTES, or the tuning file itself)"
        )


def _start(base: MPI.Comm, args: _InitArgs) -> Runtime:
    """The runtime on the agreed ranks, its engine started: on a parameter server this
    serves, then ends the process."""
    ps_job = None
    cfg = load_collectives_config()  # the nodes, and the link between them, every rank of the job sees alike
    locate(base, cfg.ranks_per_node, parse_link(cfg.link) if cfg.link else None, cfg.shm_spin)
    if args.servers:
        base, ps_job = ps_roles.split_roles(base, args.servers, args.config.stall_check_time_seconds, cfg.shm_spin)
    comm, owned = base, ps_job is not None
    if args.ranks is not None:
        if base.rank not in args.ranks:
            raise HpcdlError(f"init(comm={args.ranks}): world rank {base.rank} is not in the list")
        whole = base.Get_group()
        group = whole.Incl(args.ranks)
        comm, owned = base.Create_group(group), True
        group.Free()
        whole.Free()
    rt = Runtime(comm, owned, args.config)
    rt.ps = ps_job
    rt.engine = Engine(comm, args.config)
    return rt


def _rank_list(ranks: Any) -> list[int]:
    try:
        out = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise HpcdlError(f"init(comm=...) takes an mpi4py communicator or a list of ranks, not {ranks!r}") from None
    n = MPI.COMM_WORLD.size
    if not out or len(set(out)) != len(out) or any(not 0 <= r < n for r in out):
        raise HpcdlError(f"init(comm={out}): need distinct world ranks in [0, {n})")
    return out


def shutdown() -> None:
    """Stop the runtime on every rank (init may be called again afterwards, on every rank).
    Requests still pending on any rank fail with :class:`HpcdlError`; a timeline being
    recorded is written."""
    with state.LOCK:
        st = state.take()
    if st is not None:
        _end(st)


def _end(rt: Runtime) -> None:
    """This rank's part of ending ``rt``: stop its engine (which tells the other ranks'),
    forget the process sets' ids, free what ``init`` created."""
    if MPI.Is_finalized():
        return
    for fn in rt.at_shutdown:  # co-located parameter servers: goodbye before the engine stops
        fn()
    if rt.ps is not None:
        rt.ps.end()
        state.mark_servers_ended()
    if rt.engine is not None:
        rt.engine.stop()
    for ps in rt.process_sets:  # their ids mean nothing to a later init
        ps.process_set_id = None
    if rt.owned:
        rt.comm.Free()


atexit.register(shutdown)


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`: False on every rank once any rank
    has shut the runtime down (or its engine failed), so that ``init`` starts it again."""
    rt = state.peek()
    return rt is not None and rt.engine.running


def size() -> int:
    """Number of ranks in the job."""
    return state.current().size


def rank() -> int:
    """This process's rank in the job, ``0 .. size() - 1``."""
    return state.current().rank


def local_size() -> int:
    """Number of ranks on this node."""
    return state.current().local_size


def local_rank() -> int:
    """This process's rank within its node."""
    return state.current().local_rank


def cross_size() -> int:
    """Number of ranks with this rank's local rank (the number of nodes, when homogeneous)."""
    return state.current().cross_size


def cross_rank() -> int:
    """This process's rank among the ranks with its local rank (its node's index, when homogeneous)."""
    return state.current().cross_rank


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return state.current().homogeneous


def mpi_threads_supported() -> bool:
    """True when MPI was initialized with ``MPI_THREAD_MULTIPLE``."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True: hpcdl always runs over MPI."""
    return True


def mpi_built() -> bool:
    """True: hpcdl is built on MPI (mpi4py)."""
    return True


def nccl_built() -> bool:
    """True when CuPy is installed and can load NCCL, which CUDA tensors' allreduces then
    use where every rank has its own GPU (:mod:`collectives.device.api`)."""
    return nccl_available()


def gloo_built() -> bool:
    """False: hpcdl does not use Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: hpcdl never runs over Gloo."""
    return False


def ddl_built() -> bool:
    """False: hpcdl has no IBM DDL support."""
    return False


def ccl_built() -> bool:
    """False: hpcdl has no oneCCL support."""
    return False


def rocm_built() -> bool:
    """False: hpcdl's device path is for CUDA only, whatever torch was built for."""
    return False


def cuda_built() -> bool:
    """True when the installed torch was built with CUDA."""
    import torch

    return torch.version.cuda is not None
