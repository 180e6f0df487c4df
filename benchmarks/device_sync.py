"""What a device allreduce costs with and without the host waiting for it, and with the ranks'
work ordered by CUDA IPC events or by the host.

Run: ``mpiexec -n 2 python -m benchmarks.device_sync [--sizes 4,4K,64K,1M,4M,16M]
[--rounds 3] [--json F]`` on a GPU (ranks share the GPUs there are), once without MPS and
once under it to see what MPS changes.

For float32 CuPy arrays of each size, the median over rounds of the time per call (µs,
the slowest rank's) of:

- ``ipc each`` / ``ipc queued``: ``collectives.allreduce(x, algorithm="ipc", out=out)``
  with the stream synchronized after every call, or once after all of them (the calls are
  ordered on the stream, so the host may queue the next one before the GPU has done the
  last);
- ``ipc-host each`` / ``ipc-host queued``: the same schedules, with each step's event
  synchronized by the host before the ranks' barrier instead of waited for on the GPU (no
  stream of one process waits on another's);
- ``staged each`` / ``staged queued``: through pinned host memory.

Where ``ipc`` costs about the same in every form, its time is the GPU's, not the host's
waits: on a GPU shared without MPS, the switches between the ranks' contexts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from mpi4py import MPI

import collectives as C
from collectives.cli import ArgumentParser, dump_json, output_file, parse_size, run_main
from collectives.device import ipc

from .osu import use_gpu

__all__ = ["FORMS", "measure", "main"]

FORMS = ("ipc each", "ipc queued", "ipc-host each", "ipc-host queued", "staged each", "staged queued")


@contextmanager
def host_ordered() -> Iterator[None]:
    """``ipc``'s events synchronized by the host at each step, for the block."""
    record, wait = ipc.CudaPeers.record, ipc.CudaPeers.wait

    def record_and_finish(self: ipc.CudaPeers, k: int) -> None:
        record(self, k)
        self.events[k].synchronize()

    ipc.CudaPeers.record = record_and_finish  # type: ignore[method-assign]
    ipc.CudaPeers.wait = lambda self, k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        ipc.CudaPeers.record, ipc.CudaPeers.wait = record, wait  # type: ignore[method-assign]


def _time(comm: MPI.Comm, call: Callable[[], Any], sync: Callable[[], None], each: bool, iters: int) -> float:
    for _ in range(3):
        call()
    sync()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
        if each:
            sync()
    sync()
    return comm.allreduce((time.perf_counter() - t0) / iters * 1e6, MPI.MAX)


def measure(comm: MPI.Comm, size: int, rounds: int) -> dict[str, Any]:
    """One row: every form's µs per call at ``size`` bytes, and whether the results were right."""
    import cupy as cp

    n = max(1, size // 4)
    x = cp.arange(n, dtype=cp.float32) + comm.rank
    out = cp.empty_like(x)
    sync = cp.cuda.get_current_stream().synchronize
    iters = 40 if size < (1 << 20) else 15
    row: dict[str, Any] = {"size": size}
    for form in FORMS:
        alg, each = form.split()[0].removesuffix("-host"), form.endswith("each")
        with host_ordered() if "-host" in form else nullcontext():
            call = lambda: C.allreduce(x, algorithm=alg, out=out, comm=comm)  # noqa: E731
            row[form] = statistics.median(_time(comm, call, sync, each, iters) for _ in range(rounds))
    want = sum(n - 1 + r for r in range(comm.size))
    row["valid"] = bool(comm.allreduce(int(cp.asnumpy(out)[-1] == want), MPI.MIN))
    return row


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="device_sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4,4K,64K,1M,4M,16M", help="comma-separated sizes in bytes (K, M suffixes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    p.require_at_least(("--rounds", args.rounds, 1))
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    why = use_gpu()
    if why:
        p.error(why)
    comm = MPI.COMM_WORLD
    say = comm.rank == 0
    if say:
        print(f"# allreduce of float32 CuPy arrays, {comm.size} ranks; µs per call, median of {args.rounds}")
        print(f"{'size':>9} " + " ".join(f"{f:>16}" for f in FORMS) + "  valid", flush=True)
    rows = []
    for size in sizes:
        row = measure(comm, size, args.rounds)
        rows.append(row)
        if say:
            print(f"{size:>9} " + " ".join(f"{row[f]:>16.1f}" for f in FORMS) + f"  {row['valid']}", flush=True)
    if say and args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            dump_json({"ranks": comm.size, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
