"""The speed bars of the collectives, measured side by side in one run, with a verdict each.

Run: ``mpiexec -n 2 python -m benchmarks.bars [--rounds 5] [--max 64M] [--json F] [--plot F.png]``.

Timing is OSU's (a timer around each call, an untimed barrier after it, warm-up calls
first), float32, with iterations scaled to the size (OSU's 1000 below 8 KiB would take
hours at 64 MiB); each contender's per-rank averages are averaged over ranks, and the
figure is the median over interleaved rounds (every contender once per round, in rotating
order). "mpi" is the MPI library called directly through mpi4py; "gloo" is
``torch.distributed``. The copy bandwidth is one numpy copy of a 64 MiB array on rank 0.
Each row ends with the algorithm ``auto`` took for it on ordinary arrays (its tuning row's
pick; arrays in the window are read in place whatever the row says).

The bars ("auto" is a new user's call on ordinary arrays; "window" is ``auto`` on arrays
from ``collectives.empty``, which the node algorithms read in place; "window_inplace" the
same with ``out=x``, as the engine reduces its fusion buffer):
  every collective: auto <= 1.10 x mpi at every size
  allreduce:        auto <= 0.50 x mpi at every size >= 1 MiB; auto <= 0.33 x gloo at every
                    size; window (and window_inplace) busbw at 16 MiB >= 0.75 x copy bandwidth
A bar none of the run's sizes falls under says SKIP. Beside them, the bytes each rank
writes per 16 MiB allreduce (staged into the window, reduced, copied out) for ordinary and
window buffers, and the least any allreduce writes: its output, once. Under each table, a
cache line's round trip between the ranks before and after it
(:func:`benchmarks.osu.line_trips`): the state of the cores the table was measured in.
"""

from __future__ import annotations

import statistics
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives as C
from benchmarks import osu
from collectives.cli import ArgumentParser, dump_json, output_file, parse_size, run_main

BARS = {
    "allreduce": ["auto", "mpi", "window", "window_inplace", "gloo"],
    "reduce_scatter": ["auto", "mpi", "window"],
    "allgather": ["auto", "mpi", "window"],
    "bcast": ["auto", "mpi", "window"],
    "reduce": ["auto", "mpi", "window"],
}


def sizes_by_four(lo: int, hi: int) -> list[int]:
    """``lo``, ``4 lo``, ``16 lo`` … up to ``hi``: the sizes the bars are measured at."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def iterations(bench: str, size: int, ranks: int) -> tuple[int, int] | None:
    """The timed and warm-up iterations of ``bench`` at ``size`` bytes (float32), scaled to
    the size; None where the size cannot be run (a reduce-scatter of fewer elements than
    ranks)."""
    if bench == "reduce_scatter" and size // 4 < ranks:
        return None
    iters = max(5, min(1000, (32 << 20) // size))
    return iters, max(2, iters // 10)


def sized(
    comm: MPI.Comm, bench: str, sizes: list[int], dtype: np.dtype
) -> Iterator[tuple[int, int, int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """``(size, iters, skip, buffers)`` for each of ``sizes`` that ``bench`` can run: its
    timed and warm-up iterations (:func:`iterations`) and the ordinary arrays its contenders
    share (:func:`benchmarks.osu.contender_buffers`)."""
    for size in sizes:
        if (plan := iterations(bench, size, comm.size)) is not None:
            yield size, *plan, osu.contender_buffers(bench, comm, size, dtype)


def measure(comm: MPI.Comm, bench: str, names: list[str], sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    """Median (over rounds) of each contender's rank-averaged OSU latency, per size (us)."""
    dtype = np.dtype(np.float32)
    rows = []
    for size, iters, skip, bufs in sized(comm, bench, sizes, dtype):
        cont = {name: osu.make_contender(bench, name, comm, size, dtype, buffers=bufs) for name in names}
        ok = {name: cont[name].check() for name in names}
        per: dict[str, list[float]] = {name: [] for name in names}
        for k in range(rounds):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                per[name].append(osu.stats(comm, osu.osu_loop(comm, cont[name].call, iters, skip))["avg"])
        nccl_bytes = size * comm.size if bench == "allgather" else size
        res = {}
        for name in names:
            us = statistics.median(per[name])
            bw = nccl_bytes / (us * 1e-6) / 1e9
            res[name] = {"avg": us, "algbw": bw, "busbw": bw * osu.BUS[bench](comm.size), "valid": ok[name]}
        rows.append(
            {"size": size, "iterations": iters, "algorithm": osu.auto_algorithm(bench, comm, bufs[0]), "results": res}
        )
    return rows


def copy_bound_us(bench: str, size: int, n: int, copy_bw: float) -> float:
    """Time to copy, once, the bytes each rank must at least write: its output."""
    out_bytes = {"reduce_scatter": size / n, "allgather": size * n}.get(bench, size)
    return out_bytes / copy_bw * 1e6


def verdicts(bench: str, rows: list[dict[str, Any]], copy_bw: float, n: int) -> list[str]:
    """Each bar of ``bench``: PASS or MISS with the figures behind it."""
    out = []

    def bar(label: str, pairs: list[tuple[int, float]], limit: float) -> None:
        if not pairs:  # no size of the run falls under this bar
            out.append(f"SKIP {bench}: {label} <= {limit:.2f}; no size measured")
            return
        worst = max(pairs, key=lambda p: p[1])
        state = "PASS" if worst[1] <= limit else "MISS"
        misses = [f"{s}B:{v:.2f}" for s, v in pairs if v > limit]
        out.append(
            f"{state} {bench}: {label} <= {limit:.2f}; worst {worst[1]:.2f} at {worst[0]} B"
            + (f"; over at {', '.join(misses)}" if misses else "")
        )

    ratio = [(r["size"], r["results"]["auto"]["avg"] / r["results"]["mpi"]["avg"]) for r in rows]
    bar("auto/mpi at every size", ratio, 1.10)
    if bench == "allreduce":
        bar("auto/mpi at every size >= 1 MiB", [p for p in ratio if p[0] >= 1 << 20], 0.50)
        if all("gloo" in r["results"] for r in rows):
            bar(
                "auto/gloo at every size",
                [(r["size"], r["results"]["auto"]["avg"] / r["results"]["gloo"]["avg"]) for r in rows],
                0.33,
            )
        at16 = [r for r in rows if r["size"] == 16 << 20]
        for name in ("window", "window_inplace"):
            if not at16 or name not in at16[0]["results"]:
                continue
            bus = at16[0]["results"][name]["busbw"] * 1e9
            state = "PASS" if bus >= 0.75 * copy_bw else "MISS"
            out.append(
                f"{state} allreduce: {name} busbw at 16 MiB {bus / 1e9:.2f} GB/s >= 0.75 x copy bandwidth "
                f"{copy_bw / 1e9:.2f} GB/s = {0.75 * copy_bw / 1e9:.2f} GB/s (ratio {bus / copy_bw:.2f})"
            )
    else:
        big = [r for r in rows if r["size"] >= 1 << 20]
        for name in ("auto", "window", "mpi"):
            fr = [
                copy_bound_us(bench, r["size"], n, copy_bw) / r["results"][name]["avg"]
                for r in big
                if name in r["results"]
            ]
            if fr:
                out.append(
                    f"INFO {bench}: {name} reaches {min(fr):.2f}-{max(fr):.2f} of the copy bound "
                    "(time to copy its output once at the copy bandwidth) at sizes >= 1 MiB"
                )
    return out


def table(bench: str, rows: list[dict[str, Any]], names: list[str], copy_bw: float, n: int) -> str:
    # (title, width, value from a row's results) of each column after the size
    cols = [(nm + " us", max(14, len(nm) + 5), lambda res, nm=nm: res[nm]["avg"]) for nm in names]
    cols += [
        ("auto/" + nm, max(12, len(nm) + 10), lambda res, nm=nm: res["auto"]["avg"] / res[nm]["avg"])
        for nm in names[1:]
    ]
    if "window" in names:
        cols.append(("window/mpi", 12, lambda res: res["window"]["avg"] / res["mpi"]["avg"]))
    cols += [(nm + " busbw", 12, lambda res, nm=nm: res[nm]["busbw"]) for nm in ("auto", "mpi")]
    if "window" in names:
        cols.append(("win busbw", 12, lambda res: res["window"]["busbw"]))
    head = f"{'size':>10}" + "".join(f"{title:>{w}}" for title, w, _ in cols) + f"{'copy bound':>12}{'valid':>7}"
    head += f"  {'auto took'}"
    lines = [f"# {bench}, float32, {n} ranks: median over rounds of OSU average latency; busbw GB/s", head]
    for r in rows:
        res = r["results"]
        line = f"{r['size']:>10}" + "".join(f"{fn(res):>{w}.2f}" for _, w, fn in cols)
        line += f"{copy_bound_us(bench, r['size'], n, copy_bw):>12.2f}"
        line += f"{'yes' if all(res[nm]['valid'] for nm in names) else 'NO':>7}"
        line += f"  {r.get('algorithm', '?')}"
        lines.append(line)
    return "\n".join(lines)


def bytes_written(comm: MPI.Comm, size: int = 16 << 20) -> tuple[str, dict[str, Any]]:
    """The bytes this rank writes in one float32 allreduce of ``size`` bytes, by kind, on
    ordinary buffers and on window buffers (out separate, and in place), beside the least
    any allreduce writes: its output, once."""
    count = size // 4
    x = np.ones(count, np.float32)
    out = np.empty_like(x)
    wx, wout = C.empty(count, np.float32, comm=comm), C.empty(count, np.float32, comm=comm)
    wx[...] = 1
    cases = {
        "ordinary": lambda: C.allreduce(x, out=out, comm=comm),
        "window": lambda: C.allreduce(wx, out=wout, comm=comm),
        "window, in place": lambda: C.allreduce(wout, out=wout, comm=comm),
    }
    record = {}
    for name, call in cases.items():
        before = C.copied_bytes(comm)
        call()
        after = C.copied_bytes(comm)
        record[name] = {k: after[k] - before[k] for k in after}
    lines = [
        f"# bytes written per rank per allreduce, float32, {size} B, {comm.size} ranks (rank 0; "
        "one-node shm algorithm; minimum: the output, once)",
        f"{'buffers':>18}{'staged':>12}{'reduced':>12}{'copied out':>12}{'total':>12}{'/ minimum':>11}",
    ]
    for name, rec in record.items():
        total = sum(rec.values())
        lines.append(
            f"{name:>18}{rec['staged']:>12}{rec['reduced']:>12}{rec['copied_out']:>12}{total:>12}{total / size:>11.2f}"
        )
    lines.append(f"{'minimum':>18}{'':>12}{'':>12}{'':>12}{size:>12}{1:>11.2f}")
    return "\n".join(lines), record


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min", type=parse_size, default="4")
    p.add_argument("--max", type=parse_size, default="64M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--collectives", default=",".join(BARS))
    p.add_argument("--no-gloo", action="store_true", help="leave torch.distributed out")
    p.add_argument("--json", type=output_file, default=None)
    p.add_argument("--plot", type=output_file, default=None, help="PNG of allreduce latency and busbw against size")
    args = p.parse_args(argv)
    p.require_at_least(("--rounds", args.rounds, 1), ("--min", args.min, 1), ("--max", args.max, args.min))
    if unknown := [c for c in args.collectives.split(",") if c not in BARS]:
        p.error(f"--collectives: unknown {', '.join(unknown)}; the collectives are {', '.join(BARS)}")
    np.seterr(over="ignore")  # window_inplace sums its own result again and again: inf, at full speed
    comm = MPI.COMM_WORLD
    comm.Barrier()
    copy_bw = comm.bcast(osu.copy_bandwidth() if comm.rank == 0 else None, root=0)
    sizes = sizes_by_four(args.min, args.max)
    record: dict[str, Any] = {"ranks": comm.size, "copy_bandwidth": copy_bw, "machine": osu.machine(), "bars": {}}
    report = [f"# copy bandwidth (one numpy copy of 64 MiB, rank 0): {copy_bw / 1e9:.2f} GB/s"]
    text, record["bytes_written"] = bytes_written(comm)
    report.append(text)
    for bench in args.collectives.split(","):
        names = [nm for nm in BARS[bench] if not (args.no_gloo and nm == "gloo")]
        before = osu.line_trips(comm)
        rows = measure(comm, bench, names, sizes, args.rounds)
        after = osu.line_trips(comm)
        record.setdefault("line_round_trip_s", {})[bench] = {"before": before, "after": after}
        if comm.rank == 0:
            report.append(table(bench, rows, names, copy_bw, comm.size))
            report.append(f"# {osu.trips_text(before, after)}")
            report.extend(verdicts(bench, rows, copy_bw, comm.size))
            print("\n".join(report), flush=True)
            report = []
        record["bars"][bench] = rows
        if bench == "allreduce" and args.plot and comm.rank == 0:
            fake = types.SimpleNamespace(bench="allreduce", type="mpi_float")
            osu.plot(args.plot, fake, rows, comm.size)
    if comm.rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            dump_json(record, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
