"""Where a small call's time goes on the node channel's one-step path, beside MPI's.

Run: ``mpiexec -n N python -m benchmarks.small_calls [--sizes 4,1K,16K] [--calls 2000]
[--rounds 5] [--json F]``.

For allreduce, broadcast and allgather of float32 at each size, the median over
interleaved rounds of each part's time per call (µs, averaged over ranks):

- ``total``: the public call, ``collectives.allreduce(x, out=out)``;
- ``python``: the same call with its one-step function swapped for one that returns at
  once: the public function and its front door (the remembered call, or the cache lookup);
- ``step``: the cached one-step function called directly: post, wait for every peer,
  compare their signatures, reduce or copy (in the compiled loop where it is built);
- ``copy``: the bytes the call reads and writes on this rank (every rank's data once, the
  result once) at this rank's copy rate for data in cache (a 256 KiB numpy copy);
- ``wait``: ``step - copy``: posting, waiting for the peers and the wake-ups;
- ``barrier``: ``MPI_Barrier``, the MPI library's floor for "every rank has arrived";
- ``mpi``: the MPI library's own call.

Before and after the rows, a cache line's round trip from rank 0 to each other rank
(:func:`benchmarks.osu.line_trips`): half of it is the least a call that waits for a peer
can wait, and where it differs from pair to pair (sockets, caches some pairs do not
share) or from before to after (a virtual machine's CPUs moved), so do the waits.

And, per ``step`` call, from the compiled loop's counters (``core.waits``; None without
it): ``waited``, the waits for a peer's counter that found it behind; ``polls``, the
polls they made; ``sleeps``, how often they slept (a futex wait each); ``wakes``, the
futex wake-ups this rank sent to peers asleep. A node whose ranks have a core each
should poll and never sleep; sleeps and wake-ups there cost several µs a call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives as C
from benchmarks.osu import line_trips, trips_text
from collectives.cli import ArgumentParser, dump_json, output_file, parse_size, run_main
from collectives.context import get_context
from collectives.node.channel import forget_calls

__all__ = ["measure", "main"]

PARTS = ("total", "python", "step", "copy", "wait", "barrier", "mpi")
WAITS = ("waited", "polls", "sleeps", "wakes")


def _contenders(comm: MPI.Comm, coll: str, size: int) -> tuple[dict[str, Callable[[], Any]], Any, tuple]:
    """Each part's call for ``coll`` of ``size`` bytes, the communicator's context, and the
    call's one-step key."""
    n = comm.size
    x = np.ones(max(1, size // 4), np.float32)
    ctx = get_context(comm)
    if coll == "allreduce":
        out = np.empty_like(x)
        public = lambda: C.allreduce(x, out=out, comm=comm)  # noqa: E731
        key = ("allreduce", x.dtype, x.shape, "sum", "auto")
        mpi = lambda: comm.Allreduce(x, out)  # noqa: E731
    elif coll == "broadcast":
        out = x
        public = lambda: C.broadcast(x, 0, out=x, comm=comm)  # noqa: E731
        key = ("broadcast", x.dtype, x.shape, 0, "auto")
        mpi = lambda: comm.Bcast(x, root=0)  # noqa: E731
    else:
        out = np.empty(x.size * n, np.float32)
        public = lambda: C.allgather(x, out=out, comm=comm)  # noqa: E731
        key = ("allgather", x.dtype, x.shape, None, "auto")
        mpi = lambda: comm.Allgather(x, out)  # noqa: E731
    public()  # builds and caches the one-step function (False: the call takes the general path)
    fn = ctx.fast.get(key)
    if fn:
        step = (lambda: fn(x, out)) if coll != "broadcast" else (lambda: fn(x, x))
    else:
        step = public

    calls = {"total": public, "python": public, "step": step, "barrier": comm.Barrier, "mpi": mpi}
    return calls, ctx, key


def copy_rate() -> float:
    """This rank's copy rate for data in cache, bytes per µs (a 256 KiB numpy copy, the best
    of 50): small calls' data is in cache."""
    a, b = np.ones(64 << 10, np.float32), np.empty(64 << 10, np.float32)
    best = min(_once(lambda: np.copyto(b, a)) for _ in range(50))
    return a.nbytes / best


def _once(f: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1e6


def _time(comm: MPI.Comm, f: Callable[[], Any], calls: int) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    mine = (time.perf_counter() - t0) / calls * 1e6
    return comm.allreduce(mine) / comm.size


def measure(comm: MPI.Comm, coll: str, size: int, calls: int, rounds: int, rate: float) -> dict[str, Any]:
    """One row: each part's median time per call (µs) and the loop's counters per call
    (``rate``: this rank's copy rate, bytes per µs)."""
    parts, ctx, key = _contenders(comm, coll, size)
    core = getattr(ctx.chan, "core", None)
    noop = lambda x, out=None: out  # noqa: E731
    times: dict[str, list[float]] = {k: [] for k in parts}
    waits: dict[str, list[float]] = {k: [] for k in WAITS}
    for k in range(rounds):
        names = list(parts)
        names = names[k % len(names) :] + names[: k % len(names)]
        for name in names:
            if name == "python":  # the one step answers at once: what is left is Python's
                held, ctx.fast[key] = ctx.fast.get(key), noop
                forget_calls()  # the front door looks the swapped function up
            before = core.waits if core is not None and name == "step" else None
            times[name].append(_time(comm, parts[name], calls))
            if before is not None:  # this rank's counts per call, averaged over the ranks
                for w, now, then in zip(WAITS, core.waits, before, strict=True):
                    waits[w].append(comm.allreduce((now - then) / calls) / comm.size)
            if name == "python":
                ctx.fast[key] = held
                forget_calls()
    row: dict[str, Any] = {"collective": coll, "size": size, "ranks": comm.size}
    for name, ts in times.items():
        row[name] = statistics.median(ts)
    for name, counts in waits.items():
        row[name] = statistics.median(counts) if counts else None
    n = comm.size
    moved = {"allreduce": size * (n + 1), "broadcast": 2 * size, "allgather": 2 * size * n}[coll]
    row["copy"] = moved / rate
    row["wait"] = max(0.0, row["step"] - row["copy"])
    row["compiled"] = getattr(ctx.chan, "core", None) is not None
    row["one_step"] = parts["step"] is not parts["total"]
    return row


def report(rows: list[dict[str, Any]]) -> str:
    head = f"{'collective':<10} {'bytes':>7} " + " ".join(f"{p:>8}" for p in (*PARTS, *WAITS))
    lines = ["# µs per call, then the step's waits, polls, sleeps and wake-ups per call (median over rounds,", head]
    lines[0] += " mean over ranks)"
    for r in rows:
        counts = " ".join("       -" if r[w] is None else f"{r[w]:8.3g}" for w in WAITS)
        lines.append(f"{r['collective']:<10} {r['size']:>7} " + " ".join(f"{r[p]:8.2f}" for p in PARTS) + " " + counts)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="small_calls", description="where a small call's time goes")
    p.add_argument("--sizes", default="4,1K,16K", help="comma-separated sizes in bytes (K suffix)")
    p.add_argument("--collectives", default="allreduce,broadcast,allgather")
    p.add_argument("--calls", type=int, default=2000, help="calls per timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    p.require_at_least(("--calls", args.calls, 1), ("--rounds", args.rounds, 1))
    comm = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    colls = args.collectives.split(",")
    bad = [c for c in colls if c not in ("allreduce", "broadcast", "allgather")]
    if bad:
        p.error(f"--collectives takes allreduce, broadcast and allgather, not {bad}")
    rate = comm.allreduce(copy_rate()) / comm.size
    before = line_trips(comm)
    rows = [measure(comm, c, s, args.calls, args.rounds, rate) for c in colls for s in sizes]
    after = line_trips(comm)
    if comm.rank == 0:
        print(report(rows) + f"\n# {trips_text(before, after)}", flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                dump_json({"rows": rows, "line_round_trip_s": {"before": before, "after": after}}, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
