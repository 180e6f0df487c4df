"""The same collective on arrays on huge pages, on 4 KiB pages and in the window, MPI's and
hpcdl's side by side in one run.

Run: ``mpiexec -n 2 python -m benchmarks.pages [--collectives allgather,allreduce,bcast]
[--sizes 1M,4M,16M] [--rounds 5]``.

Where the allocator puts an array moves the time of every library's copies. A large numpy
array is a fresh mapping that the kernel backs with 2 MiB pages (numpy asks for them where
transparent huge pages are ``madvise``); once a process has freed large arrays, glibc
serves the next ones from its heap, whose pages are already there in 4 KiB, and the
kernel's page walks and cross-memory reads cost more on those; ``collectives.empty``'s
arrays lie in the node's shared window. So two contenders given arrays of their own, as in
one process one after the other, can differ by where their arrays fell rather than by what
they do. This gives MPI and ``auto`` the same arrays of each kind: ``huge`` and ``4k``
are mappings of their own (``madvise`` ``MADV_HUGEPAGE`` or ``MADV_NOHUGEPAGE``, 2 MiB
aligned) and ``window`` comes from ``collectives.empty``; beside each, the share of its
bytes the kernel reports on huge pages (``AnonHugePages`` in ``/proc/self/smaps``), on rank
0. Timing is ``benchmarks.bars``'s: OSU's loop, float32, the median over interleaved
rounds of the rank-averaged latency, every result checked.
"""

from __future__ import annotations

import mmap
import statistics
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives as C
from benchmarks import osu
from benchmarks.bars import sized
from collectives.cli import ArgumentParser, dump_json, output_file, parse_size, run_main

PLACES = ("huge", "4k", "window")
BENCHES = ("allgather", "allreduce", "bcast", "reduce_scatter", "reduce")
_HUGE = 2 << 20


def placed(like: np.ndarray, place: str, comm: MPI.Comm) -> np.ndarray:
    """A copy of ``like`` on huge pages (``"huge"``, from a 2 MiB boundary), on 4 KiB pages
    (``"4k"``), each a private mapping of its own, or in the window (``"window"``: ``collectives.empty``)."""
    if place == "window":
        a = C.empty(like.shape, like.dtype, comm=comm)
        if not C.is_shared(a, comm=comm):
            raise SystemExit(f"benchmarks.pages: no room for {like.nbytes} B in the window (HPCDL_SHM_ARENA_BYTES)")
    else:
        span = -(-max(like.nbytes, 1) // _HUGE) * _HUGE + _HUGE  # whole 2 MiB pages from an aligned start
        m = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a shared one gets no huge pages
        m.madvise(mmap.MADV_HUGEPAGE if place == "huge" else mmap.MADV_NOHUGEPAGE)
        raw = np.frombuffer(m, np.uint8)  # the array keeps the mapping alive
        skip = -raw.ctypes.data % _HUGE
        a = raw[skip : skip + like.nbytes].view(like.dtype).reshape(like.shape)
    a[...] = like
    return a


def huge_share(a: np.ndarray) -> float:
    """The share of ``a``'s bytes in mappings the kernel backs with huge pages: each mapping
    that overlaps ``a`` counts its ``AnonHugePages`` up to the overlap (exact where ``a`` has
    mappings of its own, as :func:`placed` gives it; nan where smaps cannot be read)."""
    lo, hi = a.ctypes.data, a.ctypes.data + a.nbytes
    got, overlap = 0, 0
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as fh:
            for line in fh:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(v, 16) for v in head.split("-"))
                    overlap = max(0, min(end, hi) - max(start, lo))
                elif head == "AnonHugePages:" and overlap:
                    got += min(int(line.split()[1]) << 10, overlap)
    except OSError:
        return float("nan")
    return got / a.nbytes if a.nbytes else 0.0


def measure(comm: MPI.Comm, bench: str, sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    """Per size and place: MPI's and ``auto``'s median latency (us) on the same arrays, the
    arrays' huge-page share (rank 0's) and whether every result was right."""
    dtype = np.dtype(np.float32)
    rows = []
    for size, iters, skip, (x0, out0, want) in sized(comm, bench, sizes, dtype):
        cont, share = {}, {}
        for place in PLACES:
            x = placed(x0, place, comm)
            out = x if out0 is x0 else placed(out0, place, comm)
            bufs = (x, out, want)
            share[place] = min(huge_share(x), huge_share(out))
            for name in ("mpi", "auto"):
                cont[(place, name)] = osu.make_contender(bench, name, comm, size, dtype, buffers=bufs)
        keys = list(cont)
        valid = {k: cont[k].check() for k in keys}
        per: dict[Any, list[float]] = {k: [] for k in keys}
        for r in range(rounds):
            at = r * 3 % len(keys)
            for k in keys[at:] + keys[:at]:
                per[k].append(osu.stats(comm, osu.osu_loop(comm, cont[k].call, iters, skip))["avg"])
        valid = {k: valid[k] and cont[k].check() for k in keys}
        for place in PLACES:
            mpi, auto = (statistics.median(per[(place, name)]) for name in ("mpi", "auto"))
            ok = valid[(place, "mpi")] and valid[(place, "auto")]
            rows.append(
                {"size": size, "place": place, "huge_share": share[place], "mpi": mpi, "auto": auto, "valid": ok}
            )
    return rows


def table(bench: str, rows: list[dict[str, Any]], n: int) -> str:
    """The rows as text, and per size how far 4 KiB pages moved each contender from huge ones."""
    lines = [
        f"# {bench}, float32, {n} ranks: median over rounds of OSU average latency (us), "
        "MPI and auto on the same arrays",
        f"{'size':>10}{'place':>8}{'huge':>6}{'mpi us':>11}{'auto us':>11}{'auto/mpi':>10}{'valid':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['size']:>10}{r['place']:>8}{r['huge_share']:>6.2f}{r['mpi']:>11.2f}{r['auto']:>11.2f}"
            f"{r['auto'] / r['mpi']:>10.2f}{'yes' if r['valid'] else 'NO':>7}"
        )
    by = {(r["size"], r["place"]): r for r in rows}
    for size in sorted({r["size"] for r in rows}):
        h, k, w = by[(size, "huge")], by[(size, "4k")], by[(size, "window")]
        lines.append(
            f"# {size} B: 4k / huge: mpi {k['mpi'] / h['mpi']:.2f}, auto {k['auto'] / h['auto']:.2f}; "
            f"window / huge: mpi {w['mpi'] / h['mpi']:.2f}, auto {w['auto'] / h['auto']:.2f}; "
            f"auto on 4k / mpi on huge {k['auto'] / h['mpi']:.2f}, auto on huge / mpi on 4k {h['auto'] / k['mpi']:.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes",
        type=lambda v: [parse_size(s) for s in v.split(",")],
        default="1M,4M,16M",
        help="comma-separated sizes per rank (bytes; K, M suffixes)",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--collectives", default="allgather,allreduce,bcast", help="of " + ",".join(BENCHES))
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    p.require_at_least(("--rounds", args.rounds, 1))
    benches = args.collectives.split(",")
    if any(b not in BENCHES for b in benches):
        p.error(f"--collectives takes {', '.join(BENCHES)}")
    sizes = args.sizes
    comm = MPI.COMM_WORLD
    record: dict[str, Any] = {"ranks": comm.size, "machine": osu.machine(), "results": {}}
    for bench in benches:
        rows = measure(comm, bench, sizes, args.rounds)
        record["results"][bench] = rows
        if comm.rank == 0:
            print(table(bench, rows, comm.size), flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            dump_json(record, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
