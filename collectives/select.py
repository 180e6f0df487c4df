"""The algorithm registry and ``auto`` selection from a tuning table.

A tuning table is JSON::

    {"machine": "...", "command": "...",
     "tables": [{"collective": "allreduce", "size": 2, "nodes": 1,
                 "rules": [[4096, "recursive_doubling"], [null, "ring"]]}, ...]}

Each rule is ``[max_bytes, algorithm]`` (``null``: no limit), applied in order to the
message size in bytes. For a communicator the table matching its collective, size and
number of nodes is used; failing that, the one with the same collective and node count
(one node, or several) and the nearest size; failing that, the defaults in this file.
A table may say ``"oversubscribed": true``: measured with more ranks than cores. On one
node whose ranks have a core each, such tables are passed over where another of the kind
exists (:func:`rules`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from typing import Any

from .algorithms import hierarchical as hier
from .algorithms import native, pairwise, rabenseifner, recursive_doubling, ring, shm, tree
from .config import load_config, read_tuning_file
from .cost import COLLECTIVE_TIMES, AlphaBeta
from .node import staged

__all__ = [
    "REGISTRY",
    "DEVICE",
    "NODE_PATH",
    "algorithms",
    "choose",
    "configured_node_path",
    "link_rules",
    "load_table",
    "node_path",
    "rules",
    "rules_for",
]

#: collective -> algorithm name -> schedule function. Order is the wire code order.
REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {
    "allreduce": {
        "native": native.allreduce,
        "ring": ring.allreduce,
        "tree": tree.allreduce,
        "recursive_doubling": recursive_doubling.allreduce,
        "rabenseifner": rabenseifner.allreduce,
        "hierarchical": hier.allreduce,
        "shm": shm.allreduce,
    },
    "reduce_scatter": {
        "native": native.reduce_scatter,
        "ring": ring.reduce_scatter,
        "recursive_halving": rabenseifner.reduce_scatter,
        "shm": staged.reduce_scatter,
    },
    "allgather": {
        "native": native.allgather,
        "ring": ring.allgather,
        "recursive_doubling": recursive_doubling.allgather,
        "shm": staged.allgather,
    },
    "broadcast": {"native": native.broadcast, "tree": tree.broadcast, "shm": staged.broadcast},
    "reduce": {"native": native.reduce, "tree": tree.reduce, "shm": staged.reduce},
    "alltoall": {"native": native.alltoall, "pairwise": pairwise.alltoall},
}

DEVICE: dict[str, tuple[str, ...]] = {
    "allreduce": ("ipc", "nccl", "staged"),
    "reduce_scatter": ("ipc", "nccl", "staged"),
    "allgather": ("ipc", "nccl", "staged"),
    "broadcast": ("ipc", "nccl", "staged"),
    "reduce": ("ipc", "nccl", "staged"),
    "alltoall": ("staged",),
}
"""The algorithms for device arrays (besides ``native`` and ``auto``), by collective:
``ipc`` (ranks of one node through CUDA IPC), ``nccl``, ``staged`` (through host memory).
Their code is in :mod:`.device.api`."""

#: Used when no tuning table covers a case, and on transports without an MPI library.
DEFAULT_RULES: dict[str, list[list[Any]]] = {
    "allreduce": [[16384, "recursive_doubling"], [None, "ring"]],
    "reduce_scatter": [[None, "ring"]],
    "allgather": [[16384, "recursive_doubling"], [None, "ring"]],
    "broadcast": [[None, "tree"]],
    "reduce": [[None, "tree"]],
    "alltoall": [[None, "pairwise"]],
}


def algorithms(collective: str, device: bool = False) -> list[str]:
    """Return the algorithm names registered for ``collective``, ``"auto"`` included: those
    for host (numpy) arrays, or with ``device`` those for device arrays."""
    if collective not in REGISTRY:
        raise ValueError(f"unknown collective {collective!r}; one of: {', '.join(REGISTRY)}")
    if device:
        return [*DEVICE[collective], "native", "auto"]
    return [*REGISTRY[collective], "auto"]


def load_table(path: str | None = None) -> dict[str, Any]:
    """Read a tuning table (the packaged one when ``path`` is empty)."""
    if path:
        return read_tuning_file(path)
    return json.loads(resources.files(__package__).joinpath("tuning/default.json").read_text("utf-8"))


def rules(
    table: dict[str, Any], collective: str, size: int, nodes: int, oversubscribed: bool | None = None
) -> list[list[Any]]:
    """The ``[max_bytes, algorithm]`` rules of ``table`` for ``collective`` on ``size`` ranks
    over ``nodes`` nodes: the exact table, else the nearest size of the same kind (one node
    or several; the larger on a tie), else the defaults.

    A row measured with more ranks than cores (``"oversubscribed": true``, as the tuner marks
    it) tells how the algorithms fare where ranks wait for a core to run on, which says
    little of a node with a core per rank: where ``oversubscribed`` is False, such rows are
    passed over for the nearest row measured with a core per rank (used only where the
    table has no such row of the kind). True or None (not known) takes every row."""
    same = [e for e in table.get("tables", []) if e["collective"] == collective]
    kin = [e for e in same if (e["nodes"] > 1) == (nodes > 1)]
    if oversubscribed is False and any(not e.get("oversubscribed") for e in kin):
        kin = [e for e in kin if not e.get("oversubscribed")]
    for e in kin:
        if e["size"] == size and e["nodes"] == nodes:
            return e["rules"]
    if kin:
        return min(kin, key=lambda e: (abs(e["size"] - size), -e["size"]))["rules"]
    return DEFAULT_RULES[collective]


def rules_for(ctx: Any, collective: str) -> list[list[Any]]:
    """The ``[max_bytes, algorithm]`` rules ``auto`` applies to ``collective`` on ``ctx``."""
    if getattr(ctx.transport, "comm", None) is None:
        return DEFAULT_RULES[collective]
    if ctx.tuning is None:
        ctx.tuning = load_table(ctx.config.tuning_file)
    over = ctx.chan.oversubscribed if ctx.chan is not None else None  # known on one node
    return rules(ctx.tuning, collective, ctx.transport.size, ctx.topology().nodes, over)


NODE_PATH = AlphaBeta(5e-6, 5e9)
"""What a message between two ranks of one node costs where nothing measured it (a few µs
and a few GB/s, negligible beside the links it is used with); a tuning table's
``node_paths`` (:func:`node_path`) takes its place."""


def node_path(table: dict[str, Any] | None, ranks: int) -> AlphaBeta:
    """What a message between two of ``ranks`` ranks of one node costs: the tuning table's
    measured ``node_paths`` entry (``python -m collectives.tune`` fits it to the ring
    allreduce on one node) for that many ranks, or the nearest count; :data:`NODE_PATH`
    without one."""
    paths = (table or {}).get("node_paths") or []
    if not paths or ranks < 2:
        return NODE_PATH
    e = min(paths, key=lambda e: (abs(e["size"] - ranks), e["size"]))
    return AlphaBeta(float(e["alpha"]), float(e["beta"]))


def configured_node_path(ranks: int) -> AlphaBeta:
    """:func:`node_path` of the tuning table the configuration names (``HPCDL_TUNING_FILE``,
    else the packaged one): what ``auto`` across emulated links takes a node's messages to
    cost, for the models that must cost them alike."""
    return node_path(load_table(load_config().tuning_file), ranks)


def ps_own(table: dict[str, Any] | None, key: str = "ps_own") -> AlphaBeta | None:
    """The parameter servers' own cost a contribution (:func:`.cost.ps_times`' ``own``) that
    the tuning table holds under ``ps_own`` (the node report fits it to exchanges timed
    without a link), or None; with ``key="ps_phases"``, the cost of each of the hybrid's
    calls inside a node (:func:`.cost.fit_ps_phases`: ``ps_times``' ``phases``)."""
    own = (table or {}).get(key)
    return AlphaBeta(float(own["alpha"]), float(own["beta"])) if own else None


def configured_ps_own(key: str = "ps_own") -> AlphaBeta | None:
    """:func:`ps_own` of the tuning table the configuration names (``HPCDL_TUNING_FILE``,
    else the packaged one): what ``HybridOptimizer(node_reduce="auto")`` takes the servers'
    own work (and with ``key="ps_phases"``, each of the hybrid's calls inside a node) to
    cost."""
    return ps_own(load_table(load_config().tuning_file), key)


def link_rules(
    ranks: int, per_node: int, link: AlphaBeta, collective: str = "allreduce", intra: AlphaBeta = NODE_PATH
) -> list[list[Any]]:
    """``auto``'s rules for ``collective`` (one of :data:`.cost.COLLECTIVE_TIMES`) across
    nodes joined by ``link`` (emulated), messages inside a node over ``intra``: at each
    power of two from 4 B to 16 GiB, the algorithm the cost model predicts fastest, as
    ``[max_bytes, algorithm]`` rules."""
    model = COLLECTIVE_TIMES[collective]
    out: list[list[Any]] = []
    for i in range(2, 35):
        times = model(1 << i, ranks, per_node, intra, link)
        best = min(times, key=times.__getitem__)
        if out and out[-1][1] == best:
            out[-1][0] = 1 << i
        else:
            out.append([1 << i, best])
    out[-1][0] = None
    return out


def choose(ctx: Any, collective: str, nbytes: int) -> str:
    """Pick the algorithm for ``collective`` of ``nbytes`` on ``ctx``'s communicator."""
    picks = ctx.picks.get(collective)
    if picks is None:  # the rules that apply here, once per communicator and collective
        mpi = getattr(ctx.transport, "comm", None) is not None
        multi = mpi and ctx.topology().nodes > 1
        # across emulated links only this package's algorithms pay the link's time: MPI's own would not
        link = getattr(ctx.transport, "link", None) if multi else None
        unusable = not mpi or link is not None
        found = rules_for(ctx, collective)
        lay = ctx.topology() if link is not None and collective in COLLECTIVE_TIMES else None
        if lay is not None and lay.homogeneous:  # the link's model, not a table measured without it
            intra = node_path(ctx.tuning, lay.node.size)  # rules_for loaded the table
            found = link_rules(ctx.transport.size, lay.node.size, link, collective, intra)
        picks = []
        for limit, name in found:
            if (name == "native" and unusable) or (name == "shm" and multi and collective != "allreduce"):
                name = DEFAULT_RULES[collective][-1][1]  # unusable here: the default's last instead
            picks.append((limit, name))
        ctx.picks[collective] = picks
    for limit, name in picks:
        if limit is None or nbytes <= limit:
            return name
    return DEFAULT_RULES[collective][-1][1]
