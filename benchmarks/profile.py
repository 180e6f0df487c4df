"""Where the time of one collective goes: cProfile of many identical calls on rank 0.

Run: ``mpiexec -n 2 python -m benchmarks.profile --collective allreduce --size 16M --calls 20``

The calls run back to back with OSU's untimed barrier between them, as in the benchmarks,
and the same preallocated receive buffers. Rank 0 prints its profile (the functions with
the most time of their own, then the per-call wall time without the profiler); the other
ranks run the same calls unprofiled. Python's profiler adds about a microsecond per
function call, so small-message figures are inflated; read them for proportions.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from benchmarks.osu import make_contender  # noqa: E402
from collectives.cli import ArgumentParser, parse_size, run_main  # noqa: E402

BENCH = {"allreduce": "allreduce", "reduce_scatter": "reduce_scatter", "allgather": "allgather"}
BENCH.update(broadcast="bcast", reduce="reduce")


def profile(collective: str, size: int, calls: int, algorithm: str, top: int, comm: MPI.Comm) -> str:
    """Profile ``calls`` calls; return rank 0's report (empty elsewhere)."""
    import numpy as np

    c = make_contender(BENCH[collective], algorithm, comm, size, np.dtype(np.float32))
    for _ in range(max(3, calls // 10)):  # warm-up: channel, caches, first-touch pages
        c.call()
        comm.Barrier()
    t = 0.0
    for _ in range(calls):  # unprofiled wall time per call
        t0 = time.perf_counter()
        c.call()
        t += time.perf_counter() - t0
        comm.Barrier()
    prof = cProfile.Profile()
    for _ in range(calls):
        if comm.rank == 0:
            prof.enable()
        c.call()
        if comm.rank == 0:
            prof.disable()
        comm.Barrier()
    if not c.check():
        raise SystemExit(f"{collective} {algorithm} {size} B gave a wrong result")
    if comm.rank != 0:
        return ""
    out = io.StringIO()
    out.write(
        f"# {collective} {algorithm}, {size} B float32, {comm.size} ranks: {t / calls * 1e6:.1f} us per call "
        f"unprofiled; profile of {calls} calls on rank 0\n"
    )
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collective", default="allreduce", choices=list(BENCH))
    p.add_argument("--size", type=parse_size, default="16M", help="OSU size in bytes (4, 64K, 16M)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("-a", "--algorithm", default="auto")
    p.add_argument("--top", type=int, default=14, help="functions listed")
    args = p.parse_args(argv)
    p.require_at_least(("--calls", args.calls, 1))
    text = profile(args.collective, args.size, args.calls, args.algorithm, args.top, MPI.COMM_WORLD)
    if text:
        print(text, flush=True)


if __name__ == "__main__":
    run_main(main)
