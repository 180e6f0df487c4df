"""Our allreduce algorithms against the MPI library's own, side by side in one run.

Run: ``mpiexec -n 2 python -m benchmarks.allreduce_vs_native [--max 64M] [--all]``.

For each message size the contenders are measured in interleaved rounds (every contender
once per round, in rotating order), each round timing ``iters`` back-to-back calls after a
barrier; a round's time is the slowest rank's, and the figure is the median over rounds.
"MPI_Allreduce" is mpi4py's ``comm.Allreduce`` called directly: the baseline the issue
bars compare against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import collectives as C
from collectives.cli import run_main

BASELINE = "MPI_Allreduce"


def parse_size(text: str) -> int:
    """Parse ``4``, ``64K``, ``16M``, ``1G`` into bytes."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def sizes_between(lo: int, hi: int) -> list[int]:
    """Powers of four from ``lo`` to ``hi`` bytes (and ``hi`` itself)."""
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= 4
    return [*out, hi]


def iterations(nbytes: int) -> int:
    """Calls per timed round: enough to dwarf the timer at small sizes, few at large ones."""
    return max(2, min(200, (8 << 20) // max(nbytes, 1)))


def measure(comm: MPI.Comm, sizes: list[int], contenders: list[str], rounds: int) -> dict[int, dict[str, float]]:
    """Return median seconds per call for each size and contender (same on every rank)."""
    results: dict[int, dict[str, float]] = {}
    for nbytes in sizes:
        count = max(nbytes // 4, 1)
        x = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
        out = np.empty_like(x)
        iters = iterations(nbytes)

        def run(name: str, x: np.ndarray = x, out: np.ndarray = out) -> None:
            if name == BASELINE:
                comm.Allreduce(x, out)
            else:
                C.allreduce(x, algorithm=name, out=out, comm=comm)

        for name in contenders:  # warm-up: first-call set-up (windows, scratch) is not timed
            run(name)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for k in range(rounds):
            order = contenders[k % len(contenders) :] + contenders[: k % len(contenders)]
            for name in order:
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    run(name)
                dt = (time.perf_counter() - t0) / iters
                times[name].append(comm.allreduce(dt, op=MPI.MAX))
        results[nbytes] = {name: statistics.median(v) for name, v in times.items()}
    return results


def format_table(results: dict[int, dict[str, float]], contenders: list[str], ranks: int) -> str:
    """Render microseconds per call with each contender's ratio to the MPI baseline."""
    head = f"{'bytes':>10} " + " ".join(f"{c:>18}" for c in contenders)
    ratios = [c for c in contenders if c != BASELINE]
    head += " " + " ".join(f"{c + '/MPI':>22}" for c in ratios)
    lines = [f"# float32 allreduce, {ranks} ranks, microseconds per call (median of rounds)", head]
    for nbytes, row in results.items():
        line = f"{nbytes:>10} " + " ".join(f"{row[c] * 1e6:>18.2f}" for c in contenders)
        line += " " + " ".join(f"{row[c] / row[BASELINE]:>22.2f}" for c in ratios)
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min", default="4", help="smallest message in bytes (K/M suffixes)")
    p.add_argument("--max", default="64M", help="largest message in bytes")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per size")
    p.add_argument("--all", action="store_true", help="every registered algorithm, not only auto")
    p.add_argument("--json", help="also write the figures to this file (rank 0)")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    algs = [a for a in C.algorithms("allreduce") if a != "auto"] if args.all else []
    contenders = [BASELINE, "auto", *algs]
    sizes = sizes_between(parse_size(args.min), parse_size(args.max))
    results = measure(comm, sizes, contenders, args.rounds)
    if comm.rank == 0:
        print(format_table(results, contenders, comm.size), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"ranks": comm.size, "host_cpus": os.cpu_count(), "seconds": results}, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
