"""Latency of a synchronous ``hpcdl.allreduce`` of a torch tensor against ``torch.distributed``
(gloo) ``all_reduce`` of the same tensor, side by side in one run.

Run: ``mpiexec -n 2 python -m benchmarks.torch_allreduce [--sizes 4,1K,1M,16M] [--rounds 5]
[--device cpu|cuda] [--json F]``.

Both contenders reduce (sum) the same float32 tensor on every rank; hpcdl goes through its
whole runtime (autograd function, request, engine thread, negotiation, ``collectives``
with ``algorithm="auto"``, completion) and names the tensor, as a training loop does, so
the steady state uses the response cache; the "unnamed" column numbers each call afresh
(a full negotiation every time), and ``allreduce_`` reduces in place (no new output
tensor to allocate and fault in). Each round times ``iters`` back-to-back calls per
contender after a barrier and takes the slowest rank's mean; the figure is the median
over rounds, with contenders interleaved in rotating order.

With ``--device cuda`` every tensor lives on GPU ``local rank % GPUs``: hpcdl keeps it on
the device where CuPy is installed (``HPCDL_DEVICE_PATH=0``: staged through pinned host
memory, so two runs compare the paths; the report's header says which ran), gloo reduces
CUDA tensors its own way, and each timed loop ends with ``torch.cuda.synchronize()`` so
queued GPU work counts. The array-level comparison of the device algorithms with the staged
one and gloo in one run is ``benchmarks/osu_allreduce.py -d cuda --compare ipc,staged,gloo``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from mpi4py import MPI

import hpcdl as hvd
from benchmarks.osu import gloo_init
from collectives.cli import ArgumentParser, dump_json, parse_sizes, run_main
from hpcdl import state
from hpcdl.staging import device_source
from hpcdl.train.launch import pick_device

CONTENDERS = ("hpcdl", "hpcdl unnamed", "hpcdl allreduce_", "gloo")


def _iters(nbytes: int) -> int:
    return 400 if nbytes <= 64 << 10 else 60 if nbytes <= 1 << 20 else 12


def measure(sizes: list[int], rounds: int, iters: int | None = None, device: str = "cpu") -> list[dict[str, Any]]:
    """Per size: the median microseconds per call of every contender (collective)."""
    world = MPI.COMM_WORLD
    dist = gloo_init(world)
    dev = pick_device(device, hvd.local_rank())  # GPU local rank % GPUs, as the training job

    def settle() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    rows = []
    for size in sizes:
        n = max(size // 4, 1)
        t = torch.ones(n, dtype=torch.float32, device=dev)
        k = iters or _iters(size)
        # the in-place contenders get their own tensors
        ti, tg = t.clone(), t.clone()
        calls = {
            "hpcdl": lambda t=t: hvd.allreduce(t, name="bench", op=hvd.Sum),
            "hpcdl unnamed": lambda t=t: hvd.allreduce(t, op=hvd.Sum),
            "hpcdl allreduce_": lambda ti=ti: hvd.allreduce_(ti, name="bench_", op=hvd.Sum),
            "gloo": lambda tg=tg: dist.all_reduce(tg),
        }
        # correctness first: every contender's sum of ones is the rank count
        want = torch.full((n,), float(world.size), device=dev)
        assert torch.equal(calls["hpcdl"](), want)
        assert torch.equal(calls["hpcdl unnamed"](), want)
        assert torch.equal(calls["hpcdl allreduce_"](), want)
        ti.zero_()  # zeros stay zeros under repeated in-place sums: no overflow while timing
        tg.zero_()
        g = t.clone()
        dist.all_reduce(g)
        assert torch.equal(g, want)
        times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        for rnd in range(rounds + 1):  # round 0 warms up
            k0 = rnd % len(CONTENDERS)
            order = CONTENDERS[k0:] + CONTENDERS[:k0]
            for c in order:
                fn = calls[c]
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                settle()
                us = (time.perf_counter() - t0) / k * 1e6
                slowest = world.allreduce(us, op=MPI.MAX)
                if rnd:
                    times[c].append(slowest)
        rows.append({"size": size, "iterations": k, "us": {c: statistics.median(v) for c, v in times.items()}})
    return rows


def _fmt_size(b: int) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f and b % f == 0:
            return f"{b // f} {unit}"
    return f"{b} B"


def _path(device: str) -> str:
    """How the runtime moves CUDA tensors in this run."""
    if device != "cuda":
        return ""
    probe = torch.zeros(1, device="cuda")
    on = device_source(probe, state.running().config.device_path) is not None
    return " (device path)" if on else " (staged through host memory)"


def report(rows: list[dict[str, Any]], ranks: int, device: str = "cpu") -> str:
    lines = [
        f"# synchronous allreduce (sum) of a float32 torch tensor on {device}{_path(device)}, {ranks} ranks; "
        "microseconds per call,",
        "# median over rounds of the slowest rank's mean; ratio = hpcdl / gloo (< 1: hpcdl faster)",
        f"{'size':>8} {'hpcdl':>12} {'hpcdl unnamed':>14} {'allreduce_':>12} {'gloo':>12} {'ratio':>8} {'iters':>6}",
    ]
    for r in rows:
        u = r["us"]
        lines.append(
            f"{_fmt_size(r['size']):>8} {u['hpcdl']:>12.1f} {u['hpcdl unnamed']:>14.1f} "
            f"{u['hpcdl allreduce_']:>12.1f} {u['gloo']:>12.1f} "
            f"{u['hpcdl'] / u['gloo']:>8.2f} {r['iterations']:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", type=parse_sizes, default="4,1K,1M,16M", help="comma-separated byte sizes (K, M suffixes)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=None, help="calls per round (default: by size)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors live")
    p.add_argument("--json", default=None, help="also write the figures to this file (rank 0)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    torch.set_num_threads(1)
    hvd.init()
    rows = measure(a.sizes, a.rounds, a.iters, a.device)
    if hvd.rank() == 0:
        print(report(rows, hvd.size(), a.device), flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                dump_json({"ranks": hvd.size(), "device": a.device, "rows": rows}, fh, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
