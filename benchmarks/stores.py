"""Plain against non-temporal stores into the node's shared buffers, side by side in one run.

Run: ``mpiexec -n 2 python -m benchmarks.stores [--min 1K] [--max 16M] [--rounds 5]``.

The compiled loop copies into the node's shared slots and chunk buffers with non-temporal
stores from ``HPCDL_SHM_NONTEMPORAL_BYTES`` up (by default 4 KiB for a broadcast's root,
and for every copy where the node's ranks span more than one last-level cache; where the
caches name one, each rank measures the two kinds in its own copies and every rank takes
the non-temporal ones while any measures plain ones several times as slow). This
measures, for each collective and size, ``auto`` with non-temporal stores from that
setting for every copy into the window (4 KiB where it is 0: "nt"), with plain stores
only ("plain"), with the channel's own choice ("auto": measured where it measures) and the
MPI library's call, interleaved round by round on one communicator, so a machine whose
speed drifts during the run (a virtual machine whose cores move) weighs on every
contender alike. The setting is local to a rank and changes no protocol, so the ranks
switch it between rounds without agreeing on anything.

Copies out of the window keep the channel's setting (``HPCDL_SHM_NONTEMPORAL_OUT_BYTES``).
Timing is ``benchmarks.bars``'s: OSU's loop, float32, the median over rounds of the
rank-averaged latency.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
from mpi4py import MPI

from benchmarks import osu
from benchmarks.bars import sized, sizes_by_four
from benchmarks.node_report import single_copy_line
from collectives.cli import ArgumentParser, dump_json, output_file, parse_size, run_main
from collectives.context import get_context
from collectives.node.channel import NONTEMPORAL, last_level_caches

BENCHES = ("allreduce", "reduce_scatter", "allgather", "bcast", "reduce")


def measure(comm: MPI.Comm, bench: str, sizes: list[int], rounds: int, nt_bytes: int) -> list[dict[str, Any]]:
    """Per size: the median latency (us) of ``auto`` with non-temporal stores from
    ``nt_bytes`` ("nt"), with plain stores ("plain"), with the channel's own stores
    ("auto"), and of MPI's call ("mpi"); the channel's own setting is restored afterwards."""
    ch = get_context(comm).channel()
    core = ch.core
    own = (ch.nontemporal, ch.nontemporal_broadcast, ch.measured_stores)
    setting = {"nt": (nt_bytes, nt_bytes, False), "plain": (0, 0, False), "auto": own, "mpi": own}
    rows = []
    for size, iters, skip, bufs in sized(comm, bench, sizes, np.dtype(np.float32)):
        cont = {
            "nt": osu.make_contender(bench, "auto", comm, size, np.dtype(np.float32), buffers=bufs),
            "mpi": osu.make_contender(bench, "mpi", comm, size, np.dtype(np.float32), buffers=bufs),
        }
        cont["plain"] = cont["auto"] = cont["nt"]
        names = list(setting)
        per: dict[str, list[float]] = {name: [] for name in names}
        valid = True
        for k in range(rounds):
            for name in names[k % 4 :] + names[: k % 4]:
                core.nontemporal, core.nontemporal_broadcast, core.measured = setting[name]
                valid = cont[name].check() and valid
                per[name].append(osu.stats(comm, osu.osu_loop(comm, cont[name].call, iters, skip))["avg"])
        core.nontemporal, core.nontemporal_broadcast, core.measured = own
        rows.append({"size": size, "valid": valid, **{name: statistics.median(per[name]) for name in names}})
    return rows


def table(bench: str, rows: list[dict[str, Any]], n: int, nt_bytes: int) -> str:
    lines = [
        f"# {bench}, float32, {n} ranks: median over rounds of OSU average latency (us); "
        f"nt: non-temporal stores from {nt_bytes} B",
        f"{'size':>10}{'nt us':>11}{'plain us':>11}{'auto us':>11}{'mpi us':>11}{'nt/plain':>10}{'nt/mpi':>9}"
        f"{'plain/mpi':>11}{'auto/mpi':>10}{'valid':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['size']:>10}{r['nt']:>11.2f}{r['plain']:>11.2f}{r['auto']:>11.2f}{r['mpi']:>11.2f}"
            f"{r['nt'] / r['plain']:>10.2f}{r['nt'] / r['mpi']:>9.2f}{r['plain'] / r['mpi']:>11.2f}"
            f"{r['auto'] / r['mpi']:>10.2f}{'yes' if r['valid'] else 'NO':>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min", type=parse_size, default="1K")
    p.add_argument("--max", type=parse_size, default="16M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--collectives", default=",".join(BENCHES))
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    p.require_at_least(("--rounds", args.rounds, 1), ("--min", args.min, 1), ("--max", args.max, args.min))
    comm = MPI.COMM_WORLD
    ch = get_context(comm).channel()
    core = ch.core
    if core is None:
        raise SystemExit("benchmarks.stores: the compiled loop is not built here (no C compiler at install)")
    nt_bytes = core.nontemporal or NONTEMPORAL
    caches = frozenset().union(*comm.allgather(last_level_caches()))
    record: dict[str, Any] = {
        "ranks": comm.size,
        "nontemporal_bytes": nt_bytes,
        "setting": ch.nontemporal,
        "measured": ch.measured_stores,
        "last_level_caches": len(caches),
        "single_copy_broadcast": ch.single_copy_broadcast,
        "broadcast_times": ch.broadcast_times,
        "machine": osu.machine(),
    }
    if comm.rank == 0:
        print(f"# {single_copy_line(ch.single_copy_broadcast, ch.broadcast_times)}", flush=True)
    for bench in args.collectives.split(","):
        rows = measure(comm, bench, sizes_by_four(args.min, args.max), args.rounds, nt_bytes)
        record.setdefault("results", {})[bench] = rows
        if comm.rank == 0:
            print(table(bench, rows, comm.size, nt_bytes), flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            dump_json(record, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
