"""OSU Micro-Benchmarks-style measurements of hpcdl's collectives, MPI's and gloo's.

Each ``benchmarks/osu_<name>.py`` is a thin front end to :func:`main`; run it as
``mpiexec -n 2 python benchmarks/osu_allreduce.py [options]`` or
``mpiexec -n 2 python -m benchmarks.osu_allreduce [options]``.

Without ``--compare`` the output is the OSU 7.x text format of the same test, column for
column (so OSU parsers read it): a header line, ``# Datatype:``, the column titles and one
row per size (``%-10d`` then ``%18.2f`` per latency column, ``%12d`` iterations, a
right-aligned ``%18s`` validation column with ``-c``). Timing follows OSU: a timer around
each call, an untimed barrier after it, ``-x`` untimed warm-up calls first (10 and 100
iterations above 8 KiB unless ``-x``/``-i`` say otherwise), per-rank averages reduced to
min/avg/max. "Size" means what it means in OSU: the vector for allreduce, reduce and
broadcast, the whole input for reduce-scatter (each rank gets ``1/n``), and each rank's
contribution for allgather.

Ours on top: ``-a NAME`` (any registered algorithm, ``auto``, ``native``), ``--compare
a,b,...`` (algorithms plus ``window`` for ``auto`` on buffers from ``collectives.empty``,
which the node algorithms read in place, ``window_inplace`` the same with ``out=x`` (as the
engine reduces its fusion buffer; allreduce only), ``mpi`` for the MPI library called directly and
``gloo`` for torch.distributed, measured in interleaved rounds, median per size, ratios to
the first),
``--busbw`` (nccl-tests algbw/busbw), ``--json FILE`` and ``--plot FILE.png``.
``-d cuda`` (OSU's flag) puts the buffers on the GPU: the contenders are then the device
algorithms (``algorithms(..., device=True)``), ``mpi`` (only over a CUDA-aware MPI) and
``gloo`` on CUDA tensors; each call is timed until the GPU has finished it (hpcdl's calls
are ordered on the stream and return before that); with ``--busbw`` a footer gives the
GPU's device-to-device copy rate and each contender's busbw at the largest size as a
share of it.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives as C
from collectives.cli import ArgumentParser, dump_json, output_file, parse_size, replace_file
from collectives.context import get_context
from collectives.node.channel import line_round_trips
from collectives.select import choose

__all__ = [
    "COLLECTIVES",
    "parse_args",
    "run",
    "format_rows",
    "main",
    "copy_bandwidth",
    "device_copy_bandwidth",
    "copy_share",
    "line_trips",
    "trips_text",
]

OSU_VERSION = "7.4"
LARGE = 8192
TITLES = {
    "allreduce": "Allreduce Latency Test",
    "reduce_scatter": "Reduce_scatter Latency Test",
    "allgather": "Allgather Latency Test",
    "bcast": "Broadcast Latency Test",
    "reduce": "Reduce Latency Test",
    "latency": "Latency Test",
    "bw": "Bandwidth Test",
}
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "bcast", "reduce")
#: nccl-tests' bus-bandwidth factors
BUS = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "bcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
DATATYPES = {
    "mpi_char": ("MPI_CHAR", np.int8),
    "mpi_short": ("MPI_SHORT", np.int16),
    "mpi_int": ("MPI_INT", np.int32),
    "mpi_long": ("MPI_LONG", np.int64),
    "mpi_float": ("MPI_FLOAT", np.float32),
    "mpi_double": ("MPI_DOUBLE", np.float64),
}
_API = {"bcast": "broadcast"}
_MPI_NAME = {
    "allreduce": "MPI_Allreduce",
    "reduce_scatter": "MPI_Reduce_scatter_block",
    "allgather": "MPI_Allgather",
    "bcast": "MPI_Bcast",
    "reduce": "MPI_Reduce",
}


# -- options ------------------------------------------------------------------------------
def parse_args(bench: str, argv: list[str] | None = None, ranks: int | None = None) -> argparse.Namespace:
    """Parse OSU's options (and ours) for benchmark ``bench`` run on ``ranks`` ranks (default:
    the world's), refusing what OSU 7.x refuses: fewer than one timed iteration, a negative
    warm-up, and a point-to-point test on other than exactly two ranks."""
    pt2pt = bench in ("latency", "bw")
    p = ArgumentParser(prog=f"osu_{bench}", description=f"OSU-style {bench} benchmark of hpcdl", allow_abbrev=False)
    p.add_argument("-m", "--message-size", default=None, help="[min:]max message size in bytes (K/M suffixes)")
    p.add_argument("-i", "--iterations", type=int, default=None, help="timed iterations per size")
    p.add_argument("-x", "--warmup", type=int, default=None, help="untimed warm-up iterations per size")
    p.add_argument("-f", "--full", action="store_true", help="min/max latency and iterations columns")
    p.add_argument("-c", "--validation", action="store_true", help="check results (Pass/Fail column)")
    p.add_argument("-T", "--type", default="mpi_char", choices=sorted(DATATYPES), help="datatype")
    if not pt2pt:
        p.add_argument("-a", "--algorithm", default="auto", help="hpcdl algorithm (or auto, native)")
        p.add_argument("--compare", default=None, help="comma-separated contenders: algorithms, window, mpi, gloo")
        p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size with --compare")
        p.add_argument("--busbw", action="store_true", help="add nccl-tests algbw/busbw columns (GB/s)")
        p.add_argument(
            "--plot", type=output_file, default=None, help="write latency and busbw against size to this PNG"
        )
    p.add_argument("--json", type=output_file, default=None, help="write the figures to this file (rank 0)")
    if not pt2pt:
        p.add_argument(
            "-d",
            "--accelerator",
            default="host",
            choices=("host", "cuda"),
            help="buffers in host memory or on the GPU (local rank %% GPUs; needs CuPy)",
        )
    args = p.parse_args(argv)
    args.bench = bench
    ranks = MPI.COMM_WORLD.size if ranks is None else ranks
    if pt2pt and ranks != 2:
        p.error(f"osu_{bench} is a point-to-point test: it needs exactly 2 ranks, not {ranks} (mpiexec -n 2)")
    if args.iterations is not None and args.iterations < 1:
        p.error(f"-i {args.iterations}: the iterations must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"-x {args.warmup}: the warm-up iterations must be at least 0")
    if getattr(args, "rounds", 1) < 1:
        p.error(f"--rounds {args.rounds}: must be at least 1")
    lo, hi = 1, (1 << 22 if pt2pt else 1 << 20)
    if args.message_size:
        parts = args.message_size.split(":")
        try:
            if len(parts) == 2:
                lo, hi = parse_size(parts[0]) if parts[0] else lo, parse_size(parts[1])
            else:
                hi = parse_size(parts[0])
        except argparse.ArgumentTypeError as exc:
            p.error(f"-m {args.message_size}: {exc}")
    if lo < 1 or hi < lo:
        p.error(f"-m {args.message_size}: need 1 <= min <= max")
    args.min_size, args.max_size = lo, hi
    if not pt2pt:
        names = args.compare.split(",") if args.compare else [args.algorithm]
        if args.accelerator == "cuda":
            known = set(C.algorithms(_API.get(bench, bench), device=True)) | {"mpi", "gloo"}
            why = use_gpu()
            if why:
                p.error(f"-d cuda: {why}")
        else:
            known = set(C.algorithms(_API.get(bench, bench))) | {"mpi", "gloo", "window", "window_inplace"}
        bad = [c for c in names if c not in known]
        if bad:
            p.error(f"unknown contender(s) {bad}; choose from {sorted(known)}")
        args.contenders = names
    return args


def sizes(args: argparse.Namespace, itemsize: int) -> list[int]:
    """OSU's sizes: powers of two from min to max, skipping those smaller than one element."""
    out, s = [], args.min_size
    while s <= args.max_size:
        if s >= itemsize:
            out.append(s)
        s *= 2
    return out


def iterations(args: argparse.Namespace, size: int, small: tuple[int, int], large: tuple[int, int]) -> tuple[int, int]:
    """(timed, warm-up) iterations for ``size``: OSU's defaults, overridden by -i/-x."""
    it, skip = large if size > LARGE else small
    return (args.iterations or it), (args.warmup if args.warmup is not None else skip)


# -- contenders ---------------------------------------------------------------------------
class Contender:
    """One way of running a collective at one size: ``call()`` runs it once on prepared
    buffers; ``check()`` runs it once more and says, on every rank, if every rank got the
    right result."""

    def __init__(
        self,
        call: Callable[[], Any],
        verify: Callable[[], bool],
        comm: MPI.Comm,
        reset: Callable[[], None] | None = None,
    ) -> None:
        self.call, self._verify, self._comm, self._reset = call, verify, comm, reset

    def check(self) -> bool:
        if self._reset is not None:
            self._reset()
        self.call()
        return bool(self._comm.allreduce(bool(self._verify()), op=MPI.LAND))


def _inputs(rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    # small integers: exact in every datatype, also after summing over a few ranks
    return ((np.arange(count) % 5) + rank + 1).astype(dtype)


def _expected(bench: str, n: int, count: int, dtype: np.dtype) -> np.ndarray:
    total = sum(_inputs(q, count, np.dtype(np.int64)) for q in range(n))
    return total.astype(dtype)


def use_gpu() -> str | None:
    """Make GPU ``local rank % GPUs`` current for this rank; why it cannot be, or None."""
    try:
        import cupy as cp

        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no CuPy, no driver, no device
        return f"no usable CUDA device here ({type(exc).__name__}: {exc})"
    if count == 0:
        return "no CUDA device here"
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    cp.cuda.Device(local.rank % count).use()
    local.Free()
    return None


def contender_buffers(
    bench: str, comm: MPI.Comm, size: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's input, output (its input for a broadcast) and expected output of ``bench``
    at OSU's ``size`` (bytes), in ordinary memory. Contenders compared side by side share one
    set (:func:`make_contender`'s ``buffers``): where the allocator puts an array, on huge
    pages or in the heap's reused 4 KiB ones, moves every library's copies alike (a 4 MiB
    allgather at 2 ranks, MPI's and hpcdl's, took 1.5-1.8 x as long on 4 KiB pages as on
    huge ones on the reference machine: ``benchmarks.pages``), so with a set each, a ratio
    would measure the arrays' placement as much as the libraries."""
    n, r = comm.size, comm.rank
    count = size // dtype.itemsize
    if bench == "reduce_scatter":
        block = count // n
        x = _inputs(r, block * n, dtype)
        return x, np.empty(block, dtype), _expected(bench, n, block * n, dtype)[r * block : (r + 1) * block]
    x = _inputs(r, count, dtype)
    if bench == "allgather":
        return x, np.empty(count * n, dtype), np.concatenate([_inputs(q, count, dtype) for q in range(n)])
    if bench == "bcast":
        return x, x, _inputs(0, count, dtype)
    return x, np.empty(count, dtype), _expected(bench, n, count, dtype)


def auto_algorithm(bench: str, comm: MPI.Comm, x: np.ndarray) -> str:
    """The algorithm ``auto`` takes for ``bench`` on this rank's input ``x`` (from its
    tuning rows, by the bytes it resolves on: an allgather's whole output)."""
    nbytes = x.nbytes * comm.size if bench == "allgather" else x.nbytes
    return "local" if comm.size == 1 else choose(get_context(comm), _API.get(bench, bench), nbytes)


def make_contender(
    bench: str,
    name: str,
    comm: MPI.Comm,
    size: int,
    dtype: np.dtype,
    device: str = "host",
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> Contender:
    """Buffers and the call for ``name`` running ``bench`` with OSU's ``size`` (bytes);
    ``device="cuda"``: the buffers on this rank's GPU. ``buffers``: the ordinary arrays
    (:func:`contender_buffers`) it shares with the other contenders of the same size (a set
    of its own where None); a window contender and a device one copy them where they run."""
    r = comm.rank
    count = size // dtype.itemsize
    x, out, want = buffers if buffers is not None else contender_buffers(bench, comm, size, dtype)
    if name in ("window", "window_inplace"):  # buffers from collectives.empty: read in place
        x, out = _in_window(x, comm), (None if out is x else _in_window(out, comm))
        out = x if out is None or (name == "window_inplace" and bench == "allreduce") else out
    if device == "cuda":
        return _device_contender(bench, name, comm, x, out, want)
    res: dict[str, Any] = {"out": out}

    if name in ("window", "window_inplace"):
        call = _hpcdl_call(bench, "auto", comm, x, out, res)
    elif name == "mpi":
        call = _mpi_call(bench, comm, x, out)
    elif name == "gloo":
        call = _gloo_call(bench, comm, x, out)
    else:
        call = _hpcdl_call(bench, name, comm, x, out, res)

    def verify() -> bool:
        return (bench == "reduce" and r != 0) or bool(np.array_equal(np.asarray(res["out"]), want))

    def reset() -> None:
        # no result of a previous call may pass for this one's (inputs are >= 1: never 0)
        if bench == "bcast" or out is x:  # the call overwrites its input
            x[...] = _inputs(r, count, dtype)
        else:
            out[...] = 0
            res["out"] = out

    return Contender(call, verify, comm, reset)


def _device_contender(bench, name, comm, x_host, out_host, want) -> Contender:
    """A contender on device buffers: hpcdl's device algorithms, MPI handed the device
    pointers (only where it is CUDA-aware), or gloo on CUDA tensors."""
    import cupy as cp

    from collectives.device.arrays import cuda_aware_mpi

    r = comm.rank
    x = cp.asarray(x_host)
    out = x if out_host is x_host else cp.asarray(out_host)
    res: dict[str, Any] = {"out": out}
    if name == "mpi":
        if not cuda_aware_mpi(os.environ.get("HPCDL_CUDA_AWARE_MPI", "auto")):
            raise SystemExit("-d cuda --compare mpi: this MPI is not CUDA-aware (HPCDL_CUDA_AWARE_MPI=1 if it is)")
        call = _mpi_call(bench, comm, x, out)
    elif name == "gloo":
        import torch

        call = _gloo_call(bench, comm, torch.from_dlpack(x), torch.from_dlpack(out), torch.cuda.synchronize)
    else:
        queue = _hpcdl_call(bench, name, comm, x, out, res)
        stream = cp.cuda.get_current_stream()

        def call() -> None:  # a call is ordered on the stream: timed until the GPU has done it, as MPI's
            queue()
            stream.synchronize()

    def verify() -> bool:
        return (bench == "reduce" and r != 0) or bool(np.array_equal(cp.asnumpy(res["out"]), want))

    def reset() -> None:
        if bench == "bcast" or out is x:
            x[...] = cp.asarray(x_host)
        else:
            out[...] = 0
            res["out"] = out

    return Contender(call, verify, comm, reset)


def _in_window(a: np.ndarray, comm: MPI.Comm) -> np.ndarray:
    w = C.empty(a.shape, a.dtype, comm=comm)
    w[...] = a
    return w


def _hpcdl_call(bench, alg, comm, x, out, res) -> Callable[[], Any]:
    # the same preallocated receive buffers the MPI calls get
    if bench == "allreduce":
        return lambda: C.allreduce(x, algorithm=alg, out=out, comm=comm)
    if bench == "reduce_scatter":
        return lambda: C.reduce_scatter(x, algorithm=alg, out=out, comm=comm)
    if bench == "allgather":
        return lambda: C.allgather(x, algorithm=alg, out=out, comm=comm)
    if bench == "bcast":
        return lambda: C.broadcast(x, 0, algorithm=alg, out=x, comm=comm)

    def call() -> None:  # reduce has no out=: the result is None off the root
        res["out"] = C.reduce(x, 0, algorithm=alg, comm=comm)

    return call


def _mpi_call(bench, comm, x, out) -> Callable[[], Any]:
    if bench == "allreduce":
        return lambda: comm.Allreduce(x, out, MPI.SUM)
    if bench == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(x, out, MPI.SUM)
    if bench == "allgather":
        return lambda: comm.Allgather(x, out)
    if bench == "bcast":
        return lambda: comm.Bcast(x, 0)
    return lambda: comm.Reduce(x, out, MPI.SUM, 0)


_GLOO: dict[str, Any] = {}


def gloo_init(comm: MPI.Comm) -> Any:
    """Join torch.distributed's gloo group on ``comm``'s ranks (once per process)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        addr = None
        if comm.rank == 0:
            s = socket.socket()
            s.bind(("", 0))
            addr = (socket.gethostname(), s.getsockname()[1])
            s.close()
        host, port = comm.bcast(addr, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank, world_size=comm.size)
    return dist


def _gloo_call(bench, comm, x, out, sync: Callable[[], Any] = lambda: None) -> Callable[[], Any]:
    """gloo on ``x`` and ``out`` (numpy arrays, or tensors already; ``sync`` waits for the
    queued GPU work of CUDA tensors)."""
    import torch

    dist = gloo_init(comm)
    tx = x if isinstance(x, torch.Tensor) else torch.from_numpy(x)
    tout = out if isinstance(out, torch.Tensor) else torch.from_numpy(out)
    if bench == "allreduce":
        # gloo reduces in place: reduce a copy so that the input stays the input
        work = tx.clone()

        def call() -> None:
            work.copy_(tx)
            dist.all_reduce(work)
            tout.copy_(work)
            sync()

        return call
    if bench == "reduce_scatter":
        return lambda: (dist.reduce_scatter_tensor(tout, tx), sync())
    if bench == "allgather":
        return lambda: (dist.all_gather_into_tensor(tout, tx), sync())
    if bench == "bcast":
        return lambda: (dist.broadcast(tx, 0), sync())
    work = tx.clone()

    def reduce_call() -> None:
        work.copy_(tx)
        dist.reduce(work, 0)
        tout.copy_(work)
        sync()

    return reduce_call


# -- measuring ------------------------------------------------------------------------------
def osu_loop(comm: MPI.Comm, call: Callable[[], Any], iters: int, skip: int) -> float:
    """OSU's loop: time each call, barrier after it untimed; return this rank's average (us)."""
    timer = 0.0
    wtime = MPI.Wtime
    for i in range(iters + skip):
        t0 = wtime()
        call()
        t1 = wtime()
        if i >= skip:
            timer += t1 - t0
        comm.Barrier()
    return timer * 1e6 / iters


def stats(comm: MPI.Comm, lat: float) -> dict[str, float]:
    """Min, average and max over the ranks of each rank's latency ``lat``, on every rank
    (OSU reduces onto rank 0; here every rank needs them for the rounds)."""
    return {
        "avg": comm.allreduce(lat, op=MPI.SUM) / comm.size,
        "min": comm.allreduce(lat, op=MPI.MIN),
        "max": comm.allreduce(lat, op=MPI.MAX),
    }


def run(
    args: argparse.Namespace, comm: MPI.Comm | None = None, on_row: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Measure every size; return rows ``{"size", "iterations", "results": {name: stats}, ...}``
    (``on_row(row)`` sees each as soon as it is measured)."""
    comm = comm or MPI.COMM_WORLD
    if args.bench in ("latency", "bw"):
        return _run_pt2pt(args, comm, on_row)
    dtype = np.dtype(DATATYPES[args.type][1])
    names = args.contenders
    rounds = args.rounds if len(names) > 1 else 1
    rows = []
    for size in sizes(args, dtype.itemsize):
        if args.bench == "reduce_scatter" and size // dtype.itemsize < comm.size:
            continue  # fewer elements than ranks: nothing to scatter
        iters, skip = iterations(args, size, (1000, 200), (100, 10))
        bufs = contender_buffers(args.bench, comm, size, dtype)
        cont = {name: make_contender(args.bench, name, comm, size, dtype, args.accelerator, bufs) for name in names}
        per: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for k in range(rounds):
            order = names[k % len(names) :] + names[: k % len(names)]
            for name in order:
                per[name].append(stats(comm, osu_loop(comm, cont[name].call, iters, skip)))
        results = {}
        nccl_bytes = size * comm.size if args.bench == "allgather" else size
        for name in names:
            med = {key: statistics.median(s[key] for s in per[name]) for key in ("avg", "min", "max")}
            algbw = nccl_bytes / (med["avg"] * 1e-6) / 1e9 if med["avg"] > 0 else 0.0
            med.update(algbw=algbw, busbw=algbw * BUS[args.bench](comm.size))
            results[name] = med
        row: dict[str, Any] = {"size": size, "iterations": iters, "results": results}
        if args.validation:
            row["validation"] = {name: cont[name].check() for name in names}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _run_pt2pt(
    args: argparse.Namespace, comm: MPI.Comm, on_row: Callable[[dict[str, Any]], None] | None
) -> list[dict[str, Any]]:
    if comm.size < 2:
        raise SystemExit(f"osu_{args.bench} needs at least two processes")
    r = comm.rank
    dtype = np.dtype(DATATYPES[args.type][1])
    rows = []
    for size in sizes(args, dtype.itemsize):
        count = size // dtype.itemsize
        s_buf = _inputs(r, count, dtype)
        r_buf = np.zeros(count, dtype)
        if args.bench == "latency":
            iters, skip = iterations(args, size, (10000, 100), (1000, 10))
            value = _pingpong(comm, s_buf, r_buf, iters, skip)
            ok = r != 1 or np.array_equal(r_buf, _inputs(0, count, dtype))
        else:
            iters, skip = iterations(args, size, (100, 10), (20, 2))
            value = _bandwidth(comm, s_buf, r_buf, iters, skip, window=64)
            ok = r != 1 or np.array_equal(r_buf, _inputs(0, count, dtype))
        value = comm.bcast(value, root=0)
        row: dict[str, Any] = {"size": size, "iterations": iters, "results": {"mpi": {"avg": value}}}
        if args.validation:
            row["validation"] = {"mpi": bool(comm.allreduce(bool(ok), op=MPI.LAND))}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _pingpong(comm, s_buf, r_buf, iters, skip) -> float:
    r = comm.rank
    comm.Barrier()
    t0 = 0.0
    for i in range(iters + skip):
        if i == skip:
            t0 = MPI.Wtime()
        if r == 0:
            comm.Send(s_buf, 1, 1)
            comm.Recv(r_buf, 1, 1)
        elif r == 1:
            comm.Recv(r_buf, 0, 1)
            comm.Send(s_buf, 0, 1)
    lat = (MPI.Wtime() - t0) * 1e6 / (2.0 * iters)
    comm.Barrier()
    return lat


def _bandwidth(comm, s_buf, r_buf, iters, skip, window: int) -> float:
    r = comm.rank
    ack = np.zeros(1, np.int32)
    comm.Barrier()
    t0 = 0.0
    for i in range(iters + skip):
        if i == skip:
            t0 = MPI.Wtime()
        if r == 0:
            MPI.Request.Waitall([comm.Isend(s_buf, 1, 100) for _ in range(window)])
            comm.Recv(ack, 1, 101)
        elif r == 1:
            MPI.Request.Waitall([comm.Irecv(r_buf, 0, 100) for _ in range(window)])
            comm.Send(ack, 0, 101)
    dt = MPI.Wtime() - t0
    comm.Barrier()
    return s_buf.nbytes / 1e6 * iters * window / dt if dt > 0 else 0.0


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 10) -> float:
    """Bytes copied per second by one numpy copy of an ``nbytes`` array (median of repeats)."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(repeats):
        t0 = MPI.Wtime()
        np.copyto(b, a)
        times.append(MPI.Wtime() - t0)
    return nbytes / statistics.median(times)


def line_trips(comm: MPI.Comm) -> list[float] | None:
    """Seconds a cache line takes from rank 0 to each other rank of rank 0's node and back
    (:func:`collectives.node.channel.line_round_trips` over each node's ranks), the same on
    every rank of ``comm``; None where not measured (ranks sharing cores, the compiled loop
    not built, or a pair that did not answer in time on any node). The state of the cores
    a run had: on a virtual machine the host may move its virtual CPUs between cores that
    share a cache and cores that do not."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        trips, late = line_round_trips(node), 0
    except TimeoutError:  # every rank of that node says so; the other nodes hear it below
        trips, late = None, 1
    finally:
        node.Free()
    if comm.allreduce(late, op=MPI.MAX):  # a side measurement: the run goes on without it
        return None
    return comm.bcast(trips, root=0)


def trips_text(before: list[float] | None, after: list[float] | None) -> str:
    """One line: :func:`line_trips` measured before and after a run, in ns (the range over
    the other ranks, with the median, where there are several)."""
    if before is None or after is None:
        return "a cache line's round trip between the ranks: not measured (they share cores, no compiled loop, or late)"

    def ns(trips: list[float]) -> str:
        lo, hi = min(trips) * 1e9, max(trips) * 1e9
        return f"{lo:.0f}" if len(trips) == 1 else f"{lo:.0f}-{hi:.0f} (median {statistics.median(trips) * 1e9:.0f})"

    whom = "the two ranks" if len(before) == 1 else "rank 0 and each other rank"
    return f"a cache line's round trip between {whom}: {ns(before)} ns before, {ns(after)} ns after"


DEVICE_COPY_BYTES = 256 << 20
"""The size of the copies that measure the device-to-device copy rate."""


def device_copy_bandwidth(nbytes: int = DEVICE_COPY_BYTES, copies: int = 10, repeats: int = 5) -> float:
    """Bytes copied per second by device-to-device copies of ``nbytes`` on the current GPU
    (``copies`` back to back between stream synchronizations, so the launch cost is
    amortized; the median of ``repeats``). Each byte is read once and written once."""
    import cupy as cp

    a = cp.ones(nbytes, cp.uint8)
    b = cp.empty_like(a)
    stream = cp.cuda.get_current_stream()
    b[...] = a
    stream.synchronize()
    times = []
    for _ in range(repeats):
        t0 = MPI.Wtime()
        for _ in range(copies):
            b[...] = a
        stream.synchronize()
        times.append((MPI.Wtime() - t0) / copies)
    return nbytes / statistics.median(times)


def copy_share(rows: list[dict[str, Any]], names: list[str], rate: float) -> str:
    """The footer of a ``-d cuda --busbw`` run: the device copy rate (bytes/s) and each
    contender's busbw at the largest size as a share of it."""
    if not rows:
        return f"# device-to-device copy rate: {rate / 1e9:.1f} GB/s"
    last = rows[-1]
    shares = ", ".join(f"{n} {last['results'][n]['busbw'] * 1e9 / rate:.3f}" for n in names)
    return (
        f"# device-to-device copy rate: {rate / 1e9:.1f} GB/s (one GPU, {DEVICE_COPY_BYTES >> 20} MiB copies); "
        f"busbw / copy rate at {last['size']} B: {shares}"
    )


# -- output -----------------------------------------------------------------------------------
def header(args: argparse.Namespace) -> list[str]:
    """The OSU header lines for ``args`` (a blank line first, as OSU prints)."""
    kind = "MPI-CUDA" if getattr(args, "accelerator", "host") == "cuda" else "MPI"  # OSU's own titles
    lines = ["", f"# OSU {kind} {TITLES[args.bench]} v{OSU_VERSION}", f"# Datatype: {DATATYPES[args.type][0]}."]
    return lines


def contenders(args: argparse.Namespace) -> list[str]:
    """The table's columns: the contenders compared, or ``mpi`` for the point-to-point tests."""
    return ["mpi"] if args.bench in ("latency", "bw") else list(getattr(args, "contenders", ["mpi"]))


def table_head(args: argparse.Namespace, names: list[str], ranks: int) -> list[str]:
    """The lines above the rows: OSU's header and the column heads (a side-by-side table's
    for several contenders)."""
    lines = header(args)
    if args.bench == "bw":
        lines.append(f"{'# Size':<10}{'Bandwidth (MB/s)':>18}" + (f"{'Validation':>18}" if args.validation else ""))
        return lines
    if len(names) == 1:
        head = f"{'# Size':<10}{'Avg Latency(us)':>18}"
        if args.full:
            head += f"{'Min Latency(us)':>18}{'Max Latency(us)':>18}{'Iterations':>12}"
        if getattr(args, "busbw", False):
            head += f"{'algbw(GB/s)':>14}{'busbw(GB/s)':>14}"
        if args.validation:
            head += f"{'Validation':>18}"
        return [*lines, head]
    base = names[0]
    lines.append(
        f"# {ranks} ranks; median over {args.rounds} interleaved rounds of each contender's OSU average "
        f"latency (us); ratios to {base}" + ("; busbw in GB/s (nccl-tests)" if args.busbw else "")
    )
    head = f"{'# Size':<10}" + "".join(f"{n + '(us)':>18}" for n in names)
    head += "".join(f"{n + '/' + base:>18}" for n in names[1:])
    if args.busbw:
        head += "".join(f"{n + ' busbw':>16}" for n in names)
    if args.validation:
        head += f"{'Validation':>18}"
    return [*lines, head]


def table_row(args: argparse.Namespace, row: dict[str, Any], names: list[str]) -> str:
    """One measured size as a line under :func:`table_head`."""
    if args.bench == "bw":
        line = f"{row['size']:<10d}{row['results']['mpi']['avg']:>18.2f}"
        if args.validation:
            line += f"{'Pass' if row['validation']['mpi'] else 'Fail':>18}"
        return line
    res = row["results"]
    if len(names) == 1:
        name = names[0]
        line = f"{row['size']:<10d}{res[name]['avg']:>18.2f}"
        if args.full:
            line += f"{res[name]['min']:>18.2f}{res[name]['max']:>18.2f}{row['iterations']:>12d}"
        if getattr(args, "busbw", False):
            line += f"{res[name]['algbw']:>14.2f}{res[name]['busbw']:>14.2f}"
        if args.validation:
            line += f"{'Pass' if row['validation'][name] else 'Fail':>18}"
        return line
    base = names[0]
    line = f"{row['size']:<10d}" + "".join(f"{res[n]['avg']:>18.2f}" for n in names)
    line += "".join(f"{res[n]['avg'] / res[base]['avg']:>18.2f}" for n in names[1:])
    if args.busbw:
        line += "".join(f"{res[n]['busbw']:>16.2f}" for n in names)
    if args.validation:
        bad = [n for n in names if not row["validation"][n]]
        line += f"{'Pass' if not bad else 'Fail:' + ','.join(bad):>18}"
    return line


def format_rows(args: argparse.Namespace, rows: list[dict[str, Any]], ranks: int) -> str:
    """Render rows: the OSU format for one contender, a side-by-side table for several."""
    names = list(rows[0]["results"]) if rows else contenders(args)
    return "\n".join(table_head(args, names, ranks) + [table_row(args, row, names) for row in rows])


def machine() -> dict[str, Any]:
    """What ran the benchmark, for the JSON record."""
    return {
        "host_cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "python": platform.python_version(),
    }


def plot(path: str, args: argparse.Namespace, rows: list[dict[str, Any]], ranks: int) -> None:
    """Latency and busbw against size, log axes, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows[0]["results"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    xs = [row["size"] for row in rows]
    for name in names:
        ax1.plot(xs, [row["results"][name]["avg"] for row in rows], marker=".", label=name)
        ax2.plot(xs, [row["results"][name]["busbw"] for row in rows], marker=".", label=name)
    for ax, title in ((ax1, "latency (us)"), (ax2, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{args.bench}, {DATATYPES[args.type][0]}, {ranks} ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(bench: str, argv: list[str] | None = None, comm: MPI.Comm | None = None) -> list[dict[str, Any]]:
    """Parse options, measure, print (rank 0) and return the rows. With ``--json`` the file
    is written again after each size, ``"complete": false`` until the last, so that a run
    cut off (by a time limit, say) leaves what it measured."""
    comm = comm or MPI.COMM_WORLD
    args = parse_args(bench, argv, comm.size)
    names = contenders(args)
    say = comm.rank == 0
    record: dict[str, Any] = {
        "benchmark": f"osu_{bench}",
        "argv": sys.argv[1:] if argv is None else argv,
        "ranks": comm.size,
        "datatype": DATATYPES[args.type][0],
        "machine": machine() if say else None,
        "device_copy_bandwidth": None,
        "complete": False,
        "rows": [],
    }

    def measured(row: dict[str, Any]) -> None:
        print(table_row(args, row, names), flush=True)
        record["rows"].append(row)
        if args.json:
            _write_json(args.json, record)

    if say:  # the header now and each row as it is measured, as OSU prints
        print("\n".join(table_head(args, names, comm.size)), flush=True)
    rows = run(args, comm, measured if say else None)
    rate = None
    if getattr(args, "accelerator", "host") == "cuda" and getattr(args, "busbw", False):
        comm.Barrier()  # rank 0 copies alone on its GPU
        rate = comm.bcast(device_copy_bandwidth() if say else None, root=0)
        if say:
            print(copy_share(rows, names, rate), flush=True)
    if say:
        if args.json:
            _write_json(args.json, {**record, "device_copy_bandwidth": rate, "complete": True, "rows": rows})
        if getattr(args, "plot", None) and rows:
            plot(args.plot, args, rows, comm.size)
    return rows


def _write_json(path: str, record: dict[str, Any]) -> None:
    """``record`` into ``path`` whole: a reader never finds half a file."""
    replace_file(path, lambda fh: dump_json(record, fh, indent=1))
