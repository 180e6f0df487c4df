"""Measure every algorithm of every collective here and write a tuning table for ``auto``.

Run under the launcher, on the nodes and rank count the table is for::

    mpiexec -n 4 python -m collectives.tune --out my_table.json [--merge old.json] [--max 64M]

then point ``auto`` at it with ``HPCDL_TUNING_FILE=my_table.json``. For each collective
and message size (powers of four from ``--min`` to ``--max``) every registered algorithm
runs in interleaved rounds (each round: calls timed one at a time with an untimed barrier
after each, as OSU times them, so an algorithm that lets its root run ahead of the others
gains nothing; a round's time is the ranks' average), the median round decides, and runs
of sizes won by the same algorithm become one rule. With ``--sweeps K`` every size is
measured K times and each goes to the algorithm that won the most sweeps. The table is
keyed by collective, rank count and node count, so tables from several runs (2 ranks,
4 ranks, 2 nodes, ...) are merged into one file with ``--merge``. A row measured on one
node says whether its ranks outnumbered the cores they could run on (``oversubscribed``):
``auto`` on a node with a core per rank passes such rows over. On one node it also
records, under ``node_paths``, the α-β of one message between two of its ranks that the
ring allreduce's times imply: the cost model (:mod:`.cost`) takes a node's messages at
that, where ``auto`` chooses across emulated links and where the planner costs a node.
"""

from __future__ import annotations

import collections
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from . import api
from .blocks import block_counts
from .cli import ArgumentParser, dump_json, output_file, parse_size, run_main
from .config import read_tuning_file
from .context import get_context
from .cost import AlphaBeta, fit, link_from_allreduce
from .errors import ConfigError
from .select import REGISTRY

__all__ = ["measure", "vote", "rules_from", "merge", "main"]


def _caller(collective: str, x: np.ndarray, comm: MPI.Comm) -> Callable[[str], Any]:
    """``call(algorithm)``: one ``collective`` of ``x`` into an output allocated once (as a
    training loop reuses its buffers and OSU its receive buffer; a fresh output per call
    would time the allocator's page faults too). Broadcast is in place, as ``MPI_Bcast``."""
    n, r = comm.size, comm.rank
    if collective == "allreduce":
        out = np.empty_like(x)
        return lambda alg: api.allreduce(x, algorithm=alg, out=out, comm=comm)
    if collective == "reduce_scatter":
        block = np.empty(block_counts(x.size, n)[r], x.dtype)
        return lambda alg: api.reduce_scatter(x, algorithm=alg, out=block, comm=comm)
    if collective == "allgather":
        whole = np.empty(x.size * n, x.dtype)
        return lambda alg: api.allgather(x, algorithm=alg, out=whole, comm=comm)
    if collective == "broadcast":
        return lambda alg: api.broadcast(x, 0, algorithm=alg, out=x, comm=comm)
    return lambda alg: api.reduce(x, 0, algorithm=alg, comm=comm)


COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


def candidates(collective: str, comm: MPI.Comm) -> list[str]:
    """The algorithms worth timing for ``collective`` on ``comm``."""
    names = list(REGISTRY[collective])
    if collective != "allreduce" and get_context(comm).topology().nodes > 1:
        names.remove("shm")
    return names


def measure(
    comm: MPI.Comm, collective: str, nbytes: int, names: list[str], rounds: int, dtype=np.float32, iterations: int = 0
) -> dict[str, float]:
    """Median seconds per call of each algorithm for a message of ``nbytes`` (``auto``'s measure:
    the whole vector, or for allgather everything gathered), each timed over ``iterations``
    calls a round (0: by size, from 200 for small messages down to 3)."""
    item = np.dtype(dtype).itemsize
    n = comm.size
    count = max(nbytes // item // (n if collective == "allgather" else 1), 1)
    x = np.random.default_rng(comm.rank).standard_normal(count).astype(dtype)
    iters = iterations or max(3, min(200, (32 << 20) // max(nbytes, 1)))
    call = _caller(collective, x, comm)
    for name in names:  # first calls set up windows and scratch: not timed
        call(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    wtime = MPI.Wtime
    for k in range(rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            comm.Barrier()
            spent = 0.0
            for _ in range(iters):  # as OSU times a call: alone, an untimed barrier after it
                t0 = wtime()
                call(name)
                spent += wtime() - t0
                comm.Barrier()
            times[name].append(comm.allreduce(spent / iters, op=MPI.SUM) / comm.size)
    return {name: statistics.median(v) for name, v in times.items()}


def vote(sweeps: list[dict[str, float]]) -> str:
    """The algorithm that was fastest in the most sweeps (each a name -> median seconds
    dict); a tie goes to the lowest median over the sweeps."""
    wins = collections.Counter(min(m, key=m.get) for m in sweeps)
    top = max(wins.values())
    tied = [name for name, w in wins.items() if w == top]
    return min(tied, key=lambda name: statistics.median(m[name] for m in sweeps))


def measured_node_path(meds: dict[int, list[dict[str, float]]], ranks: int) -> AlphaBeta:
    """The per-message cost inside a node that the ring allreduce's median times (by size,
    one dict per sweep) imply on ``ranks`` ranks: :func:`.cost.fit` to them, turned back into
    one message's α-β by :func:`.cost.link_from_allreduce`."""
    points = [(nbytes, statistics.median(m["ring"] for m in sweeps)) for nbytes, sweeps in meds.items()]
    return link_from_allreduce(fit(points), ranks)


def rules_from(winners: list[tuple[int, str]]) -> list[list[Any]]:
    """Turn (size, best algorithm) pairs, by increasing size, into ``[max_bytes, name]`` rules;
    a boundary falls halfway (geometrically) between the last size one algorithm won and the
    next size another did, and the last rule has no limit."""
    rules: list[list[Any]] = []
    for size, name in winners:
        if rules and rules[-1][1] == name:
            rules[-1][0] = size
        else:
            if rules:
                prev = rules[-1][0]
                rules[-1][0] = int((prev * size) ** 0.5)
            rules.append([size, name])
    if rules:
        rules[-1][0] = None
    return rules


def merge(table: dict[str, Any], new: dict[str, Any], machine: str | None = None) -> dict[str, Any]:
    """``table`` with ``new``'s rows in place of its rows of the same collective, rank count
    and node count (its other rows kept), ``new``'s ``node_paths`` in place of those of the
    same rank count, ``new``'s ``ps_own`` and ``ps_phases`` in place of its own, and
    ``new``'s ``runs`` after its own; each row taken from ``new`` is labelled with
    ``machine`` where given. Neither argument is changed."""
    rows = [{**e, "machine": machine} if machine else dict(e) for e in new.get("tables", [])]
    keys = {(e["collective"], e["size"], e["nodes"]) for e in rows}
    kept = [e for e in table.get("tables", []) if (e["collective"], e["size"], e["nodes"]) not in keys]
    out = {**table, "tables": sorted(kept + rows, key=lambda e: (e["collective"], e["nodes"], e["size"]))}
    if new.get("node_paths"):
        sizes = {e["size"] for e in new["node_paths"]}
        paths = [e for e in table.get("node_paths", []) if e["size"] not in sizes] + list(new["node_paths"])
        out["node_paths"] = sorted(paths, key=lambda e: e["size"])
    for key in ("ps_own", "ps_phases"):
        if new.get(key):
            out[key] = dict(new[key])
    out["runs"] = [*table.get("runs", []), *new.get("runs", [])]
    return out


def _merge_base(p: ArgumentParser, path: str | None, comm: MPI.Comm) -> dict[str, Any] | None:
    """The table ``--merge`` names, read by rank 0 before anything is measured; a usage
    error on every rank where it is not a tuning table."""
    table, why = None, None
    if path and comm.rank == 0:
        try:
            table = read_tuning_file(path)
        except ConfigError as exc:
            why = str(exc)
    why = comm.bcast(why, root=0)
    if why:
        p.error(f"--merge: {why}")
    return table


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python -m collectives.tune", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=output_file, required=True, help="tuning table to write (rank 0)")
    p.add_argument("--merge", help="existing table whose other entries are kept")
    p.add_argument("--min", type=parse_size, default="4", help="smallest message in bytes (K/M suffixes)")
    p.add_argument("--max", type=parse_size, default="64M", help="largest message in bytes")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    p.add_argument(
        "--iterations", type=int, default=0, help="timed calls per algorithm, size and round (0: by size, 200 to 3)"
    )
    p.add_argument(
        "--sweeps",
        type=int,
        default=1,
        help="measure every size this many times, one sweep after another; a size goes to the "
        "algorithm that wins the most sweeps (ties: the lowest median), so a slow spell of a "
        "shared machine during one sweep does not decide it",
    )
    p.add_argument("--collectives", default=",".join(COLLECTIVES), help="comma-separated subset")
    p.add_argument("--machine", default="", help="a line describing the machine, for the record")
    args = p.parse_args(argv)
    p.require_at_least(("--rounds", args.rounds, 1), ("--sweeps", args.sweeps, 1), ("--iterations", args.iterations, 0))
    if not 0 < args.min <= args.max:
        p.error(f"--min {args.min} --max {args.max}: need 0 < min <= max")
    if unknown := [c for c in args.collectives.split(",") if c not in COLLECTIVES]:
        p.error(f"--collectives: unknown {', '.join(unknown)}; the collectives are {', '.join(COLLECTIVES)}")
    comm = MPI.COMM_WORLD
    merged = _merge_base(p, args.merge, comm)
    ctx = get_context(comm)
    nodes = ctx.topology().nodes
    lo, hi = args.min, args.max
    sizes, s = [], lo
    while s < hi:
        sizes.append(s)
        s *= 4
    sizes.append(hi)
    entries = []
    path = None
    for coll in args.collectives.split(","):
        names = candidates(coll, comm)
        meds: dict[int, list[dict[str, float]]] = {nbytes: [] for nbytes in sizes}
        for sweep in range(max(args.sweeps, 1)):
            for nbytes in sizes:
                med = measure(comm, coll, nbytes, names, args.rounds, iterations=args.iterations)
                meds[nbytes].append(med)
                if comm.rank == 0:
                    cells = "  ".join(f"{k}={v * 1e6:.1f}" for k, v in med.items())
                    best = min(med, key=med.get)
                    print(f"{coll:>15} {nbytes:>10} sweep {sweep} best={best:<20} us: {cells}", flush=True)
        winners = [(nbytes, vote(meds[nbytes])) for nbytes in sizes]
        row = {"collective": coll, "size": comm.size, "nodes": nodes, "rules": rules_from(winners)}
        if ctx.chan is not None:  # one node: whether its ranks outnumbered their cores
            row["oversubscribed"] = ctx.chan.oversubscribed
        entries.append(row)
        if coll == "allreduce" and nodes == 1 and comm.size > 1 and "ring" in names and len(sizes) > 1:
            path = measured_node_path(meds, comm.size)
    if comm.rank == 0:
        words = sys.argv[1:] if argv is None else argv
        new: dict[str, Any] = {
            "tables": entries,
            "runs": [f"mpiexec -n {comm.size} python -m collectives.tune " + " ".join(words)],
        }
        if path is not None and path.alpha > 0 and math.isfinite(path.beta):  # else the sizes told too little
            # what auto across emulated links, and the planner, take a node's messages to cost
            new["node_paths"] = [{"size": comm.size, "alpha": path.alpha, "beta": path.beta}]
        table = merge(merged or {"machine": args.machine, "tables": []}, new)
        if args.machine:
            table["machine"] = args.machine
        with open(args.out, "w", encoding="utf-8") as fh:
            dump_json(table, fh, indent=1)
        print(f"wrote {args.out}: {len(entries)} tables for {comm.size} ranks on {nodes} node(s)", flush=True)


if __name__ == "__main__":
    run_main(main)
