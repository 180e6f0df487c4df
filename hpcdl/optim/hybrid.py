"""``HybridOptimizer``: data parallelism through parameter servers, with bounded staleness.

The gradient buckets are those of :func:`DistributedOptimizer` (hooks fire as gradients
are ready, so pushes overlap backward). Each bucket's way through the servers:

- ``sync`` (BSP, BytePS's and Herring's scheme): inside a node the bucket is
  reduce-scattered over the node's workers (``node_reduce``); the owner of each shard
  pushes its partitions to the servers that hold them, the servers add the nodes'
  contributions, and the owner pulls the sums; an allgather inside the node completes the
  bucket. Every step sums every worker, and the wrapped optimizer steps on each worker as
  with ``DistributedOptimizer``. Without node reduction (or one worker per node) every
  worker pushes its whole gradient.
- ``ssp`` with staleness ``s`` (Ho et al.'s stale synchronous parallel): the servers hold
  the parameters and the wrapped optimizer's state (the update runs on the servers). Each
  worker pushes its whole gradient, which the servers step as it comes (divided by the
  number of workers), and pulls parameters that miss at most ``s`` clocks of any worker's
  updates; it waits only when it is more than ``s`` steps ahead of the slowest worker.
  ``s = 0`` is bulk synchronous (one averaged step per clock) and equals ``sync``.
- ``async``: no bound.

Partitions of about ``partition_bytes`` are spread over the servers by bytes
(:class:`hpcdl.ps.PartitionPlan`). The servers are the dedicated server ranks of
``hpcdl.init(ps_servers=k)``, or else a server thread on every node leader (co-located).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from collectives.context import node_groups
from collectives.cost import ps_times
from collectives.link import LinkComm, emulate_comm, located, waitall
from collectives.select import configured_node_path, configured_ps_own

from .. import state
from ..compression import Compression, Compressor
from ..errors import HpcdlArgumentError, HpcdlError
from ..functions import allgather_object, check_on_every_rank
from ..ops import Average, ReduceOp, Sum, allgather_into_async, barrier, poll, reducescatter_into_async, synchronize
from ..optim_state import copy_value, flatten_state, hyperparameters, is_per_element, numbered_groups, unflatten_state
from ..process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ..ps import Ask, Load, PartitionPlan, PSJob, Release, Server, Stats, TableSpec, Tags, as_bytes, wait_politely
from .buckets import Bucket, Reducer, is_elementwise

__all__ = ["HybridOptimizer", "MODES"]

MODES = ("sync", "ssp", "async")


def HybridOptimizer(  # noqa: N802 - a factory that looks like a class, as DistributedOptimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    mode: str = "sync",
    staleness: int = 4,
    servers: str | None = None,
    partition_bytes: int = 4 << 20,
    process_set: ProcessSet = global_process_set,
    *,
    node_reduce: bool | str = "auto",
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    compression: type[Compressor] = Compression.none,
    bucket_bytes: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` for data-parallel training through parameter servers.

    Returns an instance of a subclass of the optimizer's class over the same parameter
    groups (``isinstance`` holds). Collective over ``process_set``: every worker builds it
    with the same model and arguments, after the parameters were made equal (e.g. with
    :func:`hpcdl.broadcast_parameters`).

    Args:
        optimizer: the optimizer to wrap (an element-wise one for ``ssp`` and ``async``,
            whose update the servers run on their partitions: SGD, Adam, AdamW, ...).
        named_parameters: ``model.named_parameters()``, for names in messages.
        mode: ``"sync"``, ``"ssp"`` or ``"async"``.
        staleness: ``ssp``: how many clocks of the other workers' updates a worker's
            parameters may miss (0 equals ``sync``).
        servers: None: the job's dedicated server ranks when it has them, else
            ``"colocated"``: a server thread on every node leader.
        partition_bytes: the most bytes in one partition.
        process_set: the workers that train together.
        node_reduce: ``sync``: True: reduce-scatter inside a node before pushing (the
            hybrid); False: every worker pushes its whole gradient (a pure parameter server);
            ``"auto"``: whichever :func:`collectives.cost.ps_times` says is faster for the
            whole gradient, across the emulated link (``HPCDL_LINK``) where one is set,
            with the servers' own work and the hybrid's phases inside a node that the
            tuning table holds (``ps_own``, ``ps_phases``: the node report's
            ``tuning.json``); else
            the hybrid between machines, and between simulated nodes of one machine (whose
            bytes all share its memory) the pure parameter server.
        backward_passes_per_step, op, bucket_bytes: as for :func:`DistributedOptimizer`
            (``op`` is ``Average`` or ``Sum``; ``ssp`` and ``async`` average).
        compression: only ``Compression.none``.
    """
    base = type(optimizer)
    cls = type(base.__name__, (HybridReducer, base), {"__module__": base.__module__})
    obj = cls(optimizer.param_groups)
    if optimizer.state:
        obj.load_state_dict_local(optimizer.state_dict())
    problem = None
    try:  # checked here, then agreed: a rank alone with bad arguments must not leave the others waiting
        obj._hpcdl_setup(named_parameters, compression, backward_passes_per_step, op, 1.0, process_set, bucket_bytes)
        _check_arguments(obj, base, mode, staleness, servers, partition_bytes, node_reduce)
    except HpcdlArgumentError as exc:
        problem = str(exc)
    check_on_every_rank(problem, HpcdlArgumentError, process_set=process_set)
    obj._hybrid_setup(base, mode, staleness, servers, partition_bytes, node_reduce)
    return obj


def _check_arguments(
    opt: Any, base: type, mode: str, staleness: int, servers: str | None, partition_bytes: int, node_reduce: Any
) -> None:
    """Raise :class:`HpcdlArgumentError` for arguments :func:`HybridOptimizer` cannot use."""
    if node_reduce not in (True, False, "auto"):
        raise HpcdlArgumentError(f"HybridOptimizer: node_reduce={node_reduce!r} must be True, False or 'auto'")
    if mode not in MODES:
        raise HpcdlArgumentError(f"HybridOptimizer: mode={mode!r} must be one of {MODES}")
    if mode == "ssp" and (not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0):
        raise HpcdlArgumentError(f"HybridOptimizer: staleness={staleness!r} must be an integer >= 0")
    if not isinstance(partition_bytes, int) or partition_bytes <= 0:
        raise HpcdlArgumentError(f"HybridOptimizer: partition_bytes={partition_bytes!r} must be a positive integer")
    if servers not in (None, "colocated"):
        raise HpcdlArgumentError(f"HybridOptimizer: servers={servers!r} must be None or 'colocated'")
    if opt._compression is not Compression.none:
        raise HpcdlArgumentError("HybridOptimizer: only Compression.none is supported")
    if mode != "sync" and opt._op != Average:
        raise HpcdlArgumentError(f"HybridOptimizer(mode={mode!r}) averages the gradients: op must be Average")
    if mode != "sync" and not is_elementwise(base):
        raise HpcdlArgumentError(
            f"HybridOptimizer(mode={mode!r}) runs {base.__name__} on partitions of the parameters, but its "
            "update of an element depends on other elements; use an element-wise optimizer or mode='sync'"
        )
    dtypes = sorted({str(p.dtype) for b in opt._buckets for p in b.params})
    if len(dtypes) > 1:
        raise HpcdlArgumentError(f"HybridOptimizer: the parameters have several dtypes {dtypes}; use one")
    if not opt._buckets:
        raise HpcdlArgumentError("HybridOptimizer: no parameter requires a gradient")


class _BucketBuffers:
    """One bucket's buffers on its way through the servers, kept by the optimizer in
    ``_buffers[bucket.index]``: ``flat`` (its gradients laid end to end at ``offsets``,
    padded to whole shards), ``shard`` (this rank's block after the node's reduce-scatter;
    ``flat`` itself without one), ``full`` (the result: sums, or the parameters) and
    ``mine`` (this rank's block of ``full``, which the servers' replies fill); ``reqs`` are
    the pushes and pulls in flight, ``rs`` the node's reduce-scatter in flight."""

    __slots__ = ("offsets", "numels", "flat", "shard", "full", "mine", "reqs", "rs")

    def __init__(self, params: list[torch.nn.Parameter], padded: int, lo: int, hi: int, node_reduce: bool) -> None:
        self.offsets, self.numels, total = [], [p.numel() for p in params], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        dtype = params[0].dtype
        self.flat = torch.zeros(padded, dtype=dtype)
        self.shard = torch.zeros(hi - lo, dtype=dtype) if node_reduce else self.flat
        self.full = torch.zeros(padded, dtype=dtype)
        self.mine = self.full[lo:hi]
        self.reqs: list[Any] = []
        self.rs: int | None = None

    def gather(self, tensors: list[torch.Tensor | None]) -> None:
        """Copy ``tensors`` (shaped like the parameters) into ``flat``; None reads as zeros."""
        for o, p_numel, t in zip(self.offsets, self.numels, tensors, strict=True):
            seg = self.flat[o : o + p_numel]
            if t is None:
                seg.zero_()
            else:
                seg.copy_(t.reshape(-1))

    def pieces(self, params: list[torch.nn.Parameter], src: torch.Tensor) -> list[torch.Tensor]:
        """Views of the flat tensor ``src`` shaped like each parameter."""
        return [src[o : o + p.numel()].view_as(p) for p, o in zip(params, self.offsets, strict=True)]


def _members_comm_and_nodes(world: MPI.Comm, members: list[int]) -> tuple[MPI.Comm, list[list[int]]]:
    """The communicator of ``members`` (runtime ranks) cut from ``world`` (collective over
    the members; across an emulated link, a :class:`collectives.link.LinkComm`), and the
    members' nodes as runtime ranks: who reduces with whom before pushing."""
    grp_all = world.Get_group()
    grp = grp_all.Incl(members)
    sub = world.Create_group(grp)
    grp.Free()
    grp_all.Free()
    nodes = [[members[r] for r in g] for g in node_groups(sub)]
    return emulate_comm(sub), nodes


def _start_colocated_servers(sub: MPI.Comm, leaders: list[int], rt: state.Runtime) -> PSJob:
    """Start a server thread on every node leader (``leaders``: their ranks in ``sub``, the
    members' communicator), ended at the runtime's shutdown; collective over ``sub``."""
    hosts = sub.allgather((socket.gethostname(), os.getpid()))
    job = PSJob(sub, leaders, [hosts[r] for r in leaders], dedicated=False)
    if sub.rank in leaders:
        srv = Server(sub, leaders.index(sub.rank), list(range(sub.size)), rt.config.stall_check_time_seconds)
        t = threading.Thread(target=srv.serve, name="hpcdl-ps-server", daemon=True)
        t.start()
        job.threads.append(t)
        job.progress = srv.serve_once
    rt.at_shutdown.append(job.end)
    return job


def _hyper_keys(groups: list[dict]) -> list[tuple[int, str, int]]:
    """The numeric hyperparameters of every group, sent with each step (a scheduler may
    change them): (group, key, length); tuples of numbers (Adam's betas) count their length."""
    out = []
    for gi, g in enumerate(groups):
        for k in sorted(g):
            v = g[k]
            if k == "params" or isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                out.append((gi, k, 1))
            elif isinstance(v, tuple) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                out.append((gi, k, len(v)))
    return out


class HybridReducer(Reducer):
    """The worker side of :func:`HybridOptimizer` (put in front of the optimizer's class)."""

    _kind = "HybridOptimizer"

    def load_state_dict_local(self, sd: dict[str, Any]) -> None:
        torch.optim.Optimizer.load_state_dict(self, sd)  # type: ignore[arg-type]

    def _hybrid_setup(  # collective over the process set; the arguments were checked and agreed
        self,
        base: type,
        mode: str,
        staleness: int,
        servers: str | None,
        partition_bytes: int,
        node_reduce: bool,
    ) -> None:
        """Join the parameter servers: find the members' nodes, agree on the setup, start the
        co-located servers (or reach the dedicated ones), register the node sets, lay out the
        buckets and register this optimizer's table with every server."""
        rt = state.running()
        members = self._process_set.ranks
        self.mode, self.staleness = mode, (staleness if mode == "ssp" else None)
        self.partition_bytes = partition_bytes
        job: PSJob | None = rt.ps if servers is None else None
        sub, nodes = _members_comm_and_nodes(rt.comm, members)
        machines = len(set(sub.allgather(socket.gethostname())))
        mine = next(n for n in nodes if rt.rank in n)
        same = len({len(n) for n in nodes}) == 1
        # the node sets are registered by every rank of the runtime: only a set of all of them can
        whole = len(members) == rt.size
        self._agree_setup(base, node_reduce, "dedicated" if job is not None else "colocated")
        if job is None:  # co-located: a server thread on every node leader, over the members' communicator
            job = _start_colocated_servers(sub, [members.index(n[0]) for n in nodes], rt)
            self._own_job = True
            to_ps = members.index
        else:
            sub.Free()
            self._own_job = False
            to_ps = lambda r: r  # noqa: E731 - dedicated: a worker's rank there is its runtime rank
        self._job = job
        if node_reduce == "auto":
            node_reduce = self._node_reduce_pays(nodes, machines, partition_bytes)
        per_node = len(mine) if (mode == "sync" and node_reduce and same and whole) else 1
        self._workers_ps = [to_ps(r) for r in members]
        nodes_ps = [[to_ps(r) for r in n] for n in nodes] if per_node > 1 else [[w] for w in self._workers_ps]
        self._make_node_sets(nodes, mine, per_node)
        self._lay_out(per_node)
        self._register_table(base, nodes_ps)

    def _node_reduce_pays(self, nodes: list[list[int]], machines: int, partition_bytes: int) -> bool:
        """``node_reduce="auto"``: whether the hybrid's exchange of the whole gradient takes
        less time than every worker pushing its own, by :func:`collectives.cost.ps_times`
        across the emulated link. Without one: between machines, yes; between simulated
        nodes of one machine, no: there both move 2 S bytes a worker through the same
        memory, and the hybrid adds a reduce-scatter's and an allgather's steps. The same
        on every rank: every input is agreed."""
        where = located()
        link = where.link if where is not None else None
        if link is None:  # one machine's ranks move 2 n S bytes through its memory either way: no steps added
            return machines > 1
        job = self._job
        servers, per_server_node = (len(job.servers), 1) if job.dedicated else (0, 1)
        if job.dedicated and isinstance(job.comm, LinkComm):  # the servers' nodes, as located
            homes = [job.comm.nodes[s] for s in job.servers]
            per_server_node = max(homes.count(h) for h in homes)
        nbytes = sum(p.numel() * p.element_size() for b in self._buckets for p in b.params)
        workers, per_node = sum(len(n) for n in nodes), max(len(n) for n in nodes)
        intra = configured_node_path(per_node)  # measured by the tuner, or assumed
        # the servers' own work and the hybrid's calls inside a node, where the node report measured them
        own, phases = configured_ps_own(), configured_ps_own("ps_phases")
        times = ps_times(nbytes, workers, per_node, intra, link, servers, partition_bytes, per_server_node, own, phases)
        return times["hybrid"] < times["ps-sync"]

    def _agree_setup(self, base: type, node_reduce: bool | str, where: str) -> None:
        """Compare the setup every worker asks for (collective over the process set) and
        raise on every rank naming what differs: the tables only line up when it is one."""
        self._agree(
            {
                "mode": self.mode,
                "staleness": self.staleness,
                "partition_bytes": self.partition_bytes,
                "node_reduce": node_reduce if node_reduce == "auto" else bool(node_reduce),
                "servers": where,
                "optimizer": base.__name__,
                "buckets": [[(tuple(p.shape), str(p.dtype)) for p in b.params] for b in self._buckets],
            }
        )

    def _make_node_sets(self, nodes: list[list[int]], mine: list[int], per_node: int) -> None:
        """With node reduction (``per_node > 1``), register every node's process set (every
        worker registers all of them, in the same order), keep this worker's node set and
        its place there, which is its shard of every bucket; without, no set and shard 0."""
        rank = state.running().rank
        self._L = per_node
        self._shard = mine.index(rank) if per_node > 1 else 0
        self._node_set: ProcessSet | None = None
        if per_node > 1:
            made = [add_process_set(n) for n in nodes]
            self._node_set = next(ps for ps in made if rank in ps.ranks)
            self._made_sets = made

    def _lay_out(self, per_node: int) -> None:
        """Cut the buckets into shards and partitions over the servers
        (:class:`hpcdl.ps.PartitionPlan`), make each bucket's buffers and start the counters."""
        itemsize = self._buckets[0].params[0].element_size()
        numels = [sum(p.numel() for p in b.params) for b in self._buckets]
        lay = self._plan = PartitionPlan(numels, itemsize, per_node, len(self._job.servers), self.partition_bytes)
        self._holding = sorted({pc.server for pc in lay.pieces})  # servers with partitions
        self._n = len(self._process_set.ranks)
        self._clock = 0
        self.wait_seconds = 0.0
        """Seconds this worker has waited for the servers' replies (after pushing)."""
        self._hyper_sent = False
        self._hyper_reqs: list[Any] = []
        self._buffers: list[_BucketBuffers] = []  # by bucket index
        for b in self._buckets:
            m = lay.shard_numels[b.index]
            lo = self._shard * m
            self._buffers.append(_BucketBuffers(b.params, lay.padded(b.index), lo, lo + m, per_node > 1))

    def _register_table(self, base: type, nodes_ps: list[list[int]]) -> None:
        """Register this optimizer's table with every server (collective over the process
        set): its :class:`hpcdl.ps.TableSpec`, for ``ssp`` and ``async`` with the optimizer,
        its groups and, from the first worker, each server's starting partitions."""
        lay, job = self._plan, self._job
        spec = TableSpec(
            name=self._prefix,
            mode=self.mode,
            staleness=self.staleness,
            bucket_numels=lay.bucket_numels,
            itemsize=lay.itemsize,
            dtype=str(self._buckets[0].params[0].dtype).removeprefix("torch."),
            node_ranks=self._L,
            nodes=nodes_ps,
            partition_bytes=self.partition_bytes,
            servers=job.servers,
            workers=self._workers_ps,
        )
        if self.mode != "sync":
            groups = [hyperparameters(g) for g in self.param_groups]
            spec = dataclasses.replace(
                spec,
                optimizer=base,
                groups=groups,
                hyper_keys=_hyper_keys(groups),
                bucket_group=[b.group for b in self._buckets],
            )
            self._hyper_keys = spec.hyper_keys
        init = self._initial_pieces() if self.mode != "sync" and self._process_set.rank() == 0 else None
        specs = [  # each server gets the starting values of its own partitions only
            dataclasses.replace(
                spec, init=None if init is None else {i: t for i, t in init.items() if lay.pieces[i].server == s}
            )
            for s in range(len(job.servers))
        ]
        self._slots = job.register(specs)
        self._tags = [Tags(slot, len(lay.pieces)) for slot in self._slots]
        self._closed = False

    # -- what the servers start from (ssp, async) ------------------------------------------------
    def _flat_params(self, b: Bucket) -> torch.Tensor:
        f = torch.zeros(self._plan.padded(b.index), dtype=b.params[0].dtype)
        for p, o in zip(b.params, self._buffers[b.index].offsets, strict=True):
            f[o : o + p.numel()] = p.detach().reshape(-1).cpu()
        return f

    def _initial_pieces(self) -> dict[int, torch.Tensor]:
        """Every partition's starting parameters (tensors travel in any dtype, bfloat16 too)."""
        flats = {b.index: self._flat_params(b) for b in self._buckets}
        return {pc.index: flats[pc.bucket][pc.lo : pc.hi].clone() for pc in self._plan.pieces}

    # -- the step ------------------------------------------------------------------------------
    def _send_hyper(self) -> None:
        vec = []
        for gi, key, n in self._hyper_keys:
            v = self.param_groups[gi][key]
            vec.extend([float(x) for x in v] if n > 1 else [float(v)])
        buf = np.asarray(vec, np.float64)
        waitall(self._hyper_reqs)
        job = self._job
        self._hyper_buf = buf
        self._hyper_reqs = [job.comm.Isend(buf, job.servers[s], self._tags[s].hyper) for s in self._holding]

    def _submit(self, b: Bucket) -> None:
        if self._closed:
            raise HpcdlError(f"{self._kind} {self._prefix} was closed: build a new one to train on")
        if self.mode != "sync" and not self._hyper_sent:
            self._send_hyper()
            self._hyper_sent = True
        f = self._buffers[b.index]
        grads = []
        for p in b.params:
            g = p.grad
            if g is not None and g.is_sparse:
                g = g.to_dense()
            grads.append(g)
        f.gather([None if g is None else g.detach().cpu() for g in grads])
        b.handle = 0  # in flight outside the engine: _unpack waits for it
        if self._L > 1:
            f.rs = reducescatter_into_async(
                f.flat, f.shard, f"{self._prefix}.rs{b.index}", Sum, self._node_set, 1.0, 1.0
            )
        else:
            self._push(b)
        self._poll_node_reductions()

    def _poll_node_reductions(self) -> None:
        """Push the buckets whose reduce-scatter inside the node has finished."""
        for b in self._buckets:
            rs = self._buffers[b.index].rs
            if rs is not None and poll(rs):
                self._push_reduced(b)

    def _push_reduced(self, b: Bucket) -> None:
        """Wait for bucket ``b``'s reduce-scatter inside the node, then push its shard."""
        f = self._buffers[b.index]
        synchronize(f.rs)
        f.rs = None
        self._push(b)

    def _send_flags(self, missing: list[int]) -> int | None:
        """``sync`` checks missing gradients as DistributedOptimizer does; ``ssp`` and ``async``
        send nothing between workers, which would tie them together step by step."""
        return super()._send_flags(missing) if self.mode == "sync" else None

    def _push(self, b: Bucket) -> None:
        """Post the receives of the replies, then send this rank's partitions of ``b``."""
        f = self._buffers[b.index]
        job = self._job
        reqs = []
        for pc in self._plan.of_bucket(b.index, self._shard):
            dest, tags = job.servers[pc.server], self._tags[pc.server]
            reqs.append(job.comm.Irecv(as_bytes(f.mine[pc.lo : pc.hi]), dest, tags.reply(pc.index)))
            reqs.append(job.comm.Isend(as_bytes(f.shard[pc.lo : pc.hi]), dest, tags.push(pc.index)))
            nbytes = pc.numel * self._plan.itemsize
            job.counter.sent += nbytes
            job.counter.received += nbytes
        f.reqs = reqs

    def _stalled(self, seconds: float) -> None:
        """While a pull waits: a server that died ends the job naming it; a runtime shut down
        by another rank (which will push no more) is an error here too, not a wait for ever."""
        for s in range(len(self._job.servers)):
            self._job.check_alive(s)
        rt = state.peek()
        if rt is None or not rt.engine.running:
            raise HpcdlError(
                f"{self._kind}: the runtime was shut down (by this or another rank) while this rank waited for "
                "the parameter servers"
            )

    def _unpack(self, b: Bucket, result: Any) -> None:
        f = self._buffers[b.index]
        if f.rs is not None:
            self._push_reduced(b)
        t0 = time.perf_counter()
        wait_politely(f.reqs, self._stalled, nap=self._job.nap, progress=self._job.progress)
        self.wait_seconds += time.perf_counter() - t0
        f.reqs = []
        if self._L > 1:
            synchronize(allgather_into_async(f.mine, f.full, f"{self._prefix}.ag{b.index}", self._node_set))
        if self.mode == "sync":
            scale = 1.0 / self._n if self._op == Average else 1.0
            for p, v in zip(b.params, f.pieces(b.params, f.full), strict=True):
                if p.grad is None or p.grad.is_sparse:
                    p.grad = torch.zeros_like(p)
                if scale != 1.0 and p.grad.device == v.device and p.grad.dtype == v.dtype:
                    torch.mul(v, scale, out=p.grad)  # one pass, not a copy and a product
                    continue
                p.grad.copy_(v)
                if scale != 1.0:
                    p.grad.mul_(scale)
        else:
            with torch.no_grad():
                for p, v in zip(b.params, f.pieces(b.params, f.full), strict=True):
                    p.copy_(v)

    def synchronize(self) -> None:
        """Finish this step's pushes and pulls: ``sync`` leaves the summed gradients in
        ``p.grad``; ``ssp`` and ``async`` put the servers' parameters in the model."""
        if self.mode == "sync":
            super().synchronize()
            return
        for b in self._buckets:  # buckets whose hooks did not all fire go now, zeros for the missing
            if b.handle is None:
                self._submit(b)
        for b in self._buckets:
            self._finish(b)
        for p in self._passes:
            self._passes[p] = 0
        self._sent = 0
        self._flags = None
        self._synchronized = True

    def step(self, closure: Any = None) -> Any:
        """``sync``: reduce and run the wrapped optimizer's step. ``ssp``/``async``: push the
        gradients and pull the parameters the servers stepped."""
        if self.mode == "sync":
            return super().step(closure)
        loss = closure() if closure is not None else None
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        self._hyper_sent = False
        self._clock += 1
        return loss

    # -- statistics, state and the end ---------------------------------------------------------
    @property
    def node_set(self) -> ProcessSet | None:
        """The process set of this worker's node that buckets are reduce-scattered over
        before pushing (None without node reduction)."""
        return self._node_set

    @property
    def partition_plan(self) -> PartitionPlan:
        """The buckets' shards and partitions (:class:`hpcdl.ps.PartitionPlan`)."""
        return self._plan

    @property
    def job(self) -> PSJob:
        """The servers this optimizer talks to (its ``counter`` holds this worker's bytes)."""
        return self._job

    @property
    def clock(self) -> int:
        """Steps this worker has taken (its clock)."""
        return self._clock

    def ps_stats(self) -> list[dict[str, Any]]:
        """Every server's record of this optimizer: ``lags`` (worker -> the largest lag of
        parameters sent to it: its clock minus their version), ``lag_counts``, the server's
        ``bytes`` (sent, received) and ``cpu_s`` (its process's CPU time so far)."""
        return [self._job.ask(s, Stats(slot)) for s, slot in enumerate(self._slots)]

    def _updates_taken(self) -> int:
        """The updates every partition has taken once every worker's steps so far are in
        (collective over the process set): the common clock (bulk-synchronous ``ssp``,
        staleness 0), or the sum of the clocks (one update per worker step)."""
        clocks = allgather_object(self._clock, name=f"{self._prefix}.clocks", process_set=self._process_set)
        return max(clocks) if self.staleness == 0 else sum(clocks)

    def refresh(self) -> None:
        """``ssp``/``async``: put the servers' newest parameters into the model, once every
        worker's steps so far are in (collective over the process set; e.g. before an
        evaluation, whose parameters would otherwise be up to ``staleness`` clocks old).
        ``sync``: nothing to do."""
        if self.mode == "sync":
            return
        need = self._updates_taken()
        got: dict[int, torch.Tensor] = {}
        for s, slot in enumerate(self._slots):
            got.update(self._job.ask(s, Ask("params", slot, need)))
        with torch.no_grad():
            for b in self._buckets:
                flat = torch.cat([got[pc.index] for pc in self._plan.of_bucket(b.index, 0)])
                for p, v in zip(b.params, self._buffers[b.index].pieces(b.params, flat), strict=True):
                    p.copy_(v)
        barrier(process_set=self._process_set)  # no rank pushes its next step before every rank has these

    def ps_stats_summary(self) -> dict[str, Any]:
        """The largest lag every server sent each worker, and how often each lag was sent
        (``{"max_lag": {worker: lag}, "lag_counts": {lag: replies}}``)."""
        stats = self.ps_stats()
        workers = sorted({w for st in stats for w in st["lags"]})
        counts: dict[int, int] = {}
        for st in stats:
            for (_, lag), k in st["lag_counts"].items():
                counts[lag] = counts.get(lag, 0) + k
        return {
            "max_lag": {w: max(st["lags"].get(w, 0) for st in stats) for w in workers},
            "lag_counts": dict(sorted(counts.items())),
        }

    def state_dict(self) -> dict[str, Any]:
        """``sync``: the wrapped optimizer's own state. ``ssp``/``async``: the servers' state
        of every partition consolidated into the wrapped optimizer's format, as if one
        optimizer held it, with the servers' parameters (``ps_params``), their version
        (``ps_version``: updates taken) and the workers' clock (``ps_clock``). Collective
        over the process set: it waits until every worker's steps so far are in; every
        rank gets the whole state."""
        if self.mode == "sync":
            return super().state_dict()  # type: ignore[misc]
        need = self._updates_taken()
        got: dict[int, Any] = {}
        for s, slot in enumerate(self._slots):
            got.update(self._job.ask(s, Ask("state", slot, need)))
        params = [p for g in self.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(params)}
        st: dict[int, dict[str, Any]] = {}
        values: dict[int, torch.Tensor] = {}
        version = min(v for _, _, v in got.values())
        for b in self._buckets:
            f = self._buffers[b.index]
            pcs = self._plan.of_bucket(b.index, 0)
            flat = torch.cat([got[pc.index][0] for pc in pcs])
            states = [got[pc.index][1] for pc in pcs]
            whole = {  # the bucket's state in flat form: per-element entries joined over the partitions
                k: torch.cat([s[k] for s in states]) if is_per_element(k, v, (pcs[0].numel,)) else v
                for k, v in states[0].items()
            }
            for p, v in zip(b.params, f.pieces(b.params, flat), strict=True):
                values[index[p]] = v.clone()
            if whole:
                per_param = unflatten_state(whole, b.params, f.offsets, flat.numel())
                for p, pst in zip(b.params, per_param, strict=True):
                    st[index[p]] = pst
        groups = numbered_groups(self.param_groups)
        # no rank pushes its next step before every rank has its state of this one
        barrier(process_set=self._process_set)
        return {
            "state": st,
            "param_groups": groups,
            "ps_params": values,
            "ps_version": version,
            "ps_clock": self._clock,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s format (or, for ``sync``, the plain optimizer's).
        Collective over the process set for ``ssp``/``async``: the first worker sends each
        server its partitions, and every worker takes the servers' parameters."""
        if self.mode == "sync" or not hasattr(self, "_job"):
            plain = {k: v for k, v in state_dict.items() if not k.startswith("ps_")}
            torch.optim.Optimizer.load_state_dict(self, plain)  # type: ignore[arg-type]
            return
        params = [p for g in self.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(params)}
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for g, s in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update(hyperparameters(s))
        values = state_dict.get("ps_params", {})
        version = int(state_dict.get("ps_version", 0))
        clock = int(state_dict.get("ps_clock", version))
        with torch.no_grad():
            for p in params:
                v = values.get(ids[index[p]])
                if v is not None:
                    p.copy_(v)
        problem = None
        if self._process_set.rank() == 0:  # a failure here must reach every rank, not leave them waiting
            try:
                for srv, pieces in self._partitions_of(state_dict["state"], ids, index, version).items():
                    self._job.ask(srv, Load(self._slots[srv], pieces, clock))
            except (HpcdlError, KeyError, RuntimeError, TypeError, ValueError) as exc:
                problem = (
                    f"{self._kind}.load_state_dict: the servers did not take the state: {type(exc).__name__}: {exc}"
                )
        check_on_every_rank(problem, name=f"{self._prefix}.load", process_set=self._process_set)
        self._clock = clock

    def _partitions_of(
        self, saved: dict[int, dict[str, Any]], ids: list[int], index: dict[Any, int], version: int
    ) -> dict[int, dict[int, Any]]:
        """Cut the model's parameters and the saved per-parameter state into the servers'
        partitions: server -> partition -> (parameters, state, version). A parameter with
        no saved state (unused, say) gets zeros for the per-element entries the others have."""
        out: dict[int, dict[int, Any]] = {s: {} for s in range(len(self._job.servers))}
        for b in self._buckets:
            flat = self._flat_params(b)
            sts = [saved.get(ids[index[p]]) for p in b.params]
            flat_state = flatten_state(sts, b.params, self._buffers[b.index].offsets, flat.numel())
            for pc in self._plan.of_bucket(b.index, 0):
                st = {
                    k: v[pc.lo : pc.hi].clone() if is_per_element(k, v, flat.shape) else copy_value(v)
                    for k, v in flat_state.items()
                }
                out[pc.server][pc.index] = (flat[pc.lo : pc.hi].clone(), st, version)
        return out

    def close(self) -> None:
        """Release this optimizer's partitions on the servers (collective over the process
        set); co-located servers end with it."""
        job = getattr(self, "_job", None)
        if job is None or job.ended or self._closed:
            return
        self._closed = True
        barrier(process_set=self._process_set)
        if self._own_job:
            job.end()
            rt = state.peek()
            if rt is not None and job.end in rt.at_shutdown:
                rt.at_shutdown.remove(job.end)
        elif self._process_set.rank() == 0:
            for s, slot in enumerate(self._slots):
                job.ask(s, Release(slot))
        barrier(process_set=self._process_set)
        for ps in getattr(self, "_made_sets", []):
            remove_process_set(ps)
        self._made_sets = []
