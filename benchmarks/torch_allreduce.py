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
the device where CuPy is installed, gloo reduces CUDA tensors its own way, and each timed
loop ends with ``torch.cuda.synchronize()`` so queued GPU work counts. When the device path
ran, the runtime is then restarted with it off (``device_path=False``: staged through
pinned host memory) and the named call timed again, so the report sets the two paths side
by side ("staged" and the ratio staged / device); the report's header says which path the
first columns took. The array-level comparison of the device algorithms with the staged
one and gloo in one run is ``benchmarks/osu_allreduce.py -d cuda --compare ipc,staged,gloo``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
from mpi4py import MPI

import hpcdl as hvd
from benchmarks.osu import gloo_init
from collectives.cli import ArgumentParser, dump_json, output_file, parse_sizes, run_main
from hpcdl import state
from hpcdl.config import load_config
from hpcdl.staging import device_source
from hpcdl.train.launch import pick_device

CONTENDERS = ("hpcdl", "hpcdl unnamed", "hpcdl allreduce_", "gloo")
STAGED = "hpcdl staged"
"""The named call again with the device path off (``--device cuda`` runs where it was on)."""


def _iters(nbytes: int) -> int:
    return 400 if nbytes <= 64 << 10 else 60 if nbytes <= 1 << 20 else 12


def measure(
    sizes: list[int],
    rounds: int,
    iters: int | None = None,
    device: str = "cpu",
    contenders: tuple[str, ...] = CONTENDERS,
) -> list[dict[str, Any]]:
    """Per size: the median microseconds per call of each of ``contenders`` (collective)."""
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
        for c in contenders:
            if c == "gloo":
                g = t.clone()
                dist.all_reduce(g)
                assert torch.equal(g, want)
            else:
                assert torch.equal(calls[c](), want)
        ti.zero_()  # zeros stay zeros under repeated in-place sums: no overflow while timing
        tg.zero_()
        times: dict[str, list[float]] = {c: [] for c in contenders}
        for rnd in range(rounds + 1):  # round 0 warms up
            k0 = rnd % len(contenders)
            order = contenders[k0:] + contenders[:k0]
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


def on_device_path(device: str) -> bool:
    """True when the running runtime keeps ``device`` tensors on the GPU (the device path)."""
    if device != "cuda":
        return False
    probe = torch.zeros(1, device="cuda")
    return device_source(probe, state.running().config.device_path) is not None


def _path(device: str, on_device: bool) -> str:
    if device != "cuda":
        return ""
    return " (device path)" if on_device else " (staged through host memory)"


def report(rows: list[dict[str, Any]], ranks: int, device: str = "cpu", on_device: bool = False) -> str:
    staged = bool(rows) and STAGED in rows[0]["us"]
    head = f"{'size':>8} {'hpcdl':>12} {'hpcdl unnamed':>14} {'allreduce_':>12} {'gloo':>12} {'ratio':>8}"
    lines = [
        f"# synchronous allreduce (sum) of a float32 torch tensor on {device}{_path(device, on_device)}, "
        f"{ranks} ranks; microseconds per call,",
        "# median over rounds of the slowest rank's mean; ratio = hpcdl / gloo (< 1: hpcdl faster)"
        + ("; staged = the named call with the device path off, x = staged / hpcdl" if staged else ""),
        head + (f" {'staged':>12} {'x':>7}" if staged else "") + f" {'iters':>6}",
    ]
    for r in rows:
        u = r["us"]
        line = (
            f"{_fmt_size(r['size']):>8} {u['hpcdl']:>12.1f} {u['hpcdl unnamed']:>14.1f} "
            f"{u['hpcdl allreduce_']:>12.1f} {u['gloo']:>12.1f} {u['hpcdl'] / u['gloo']:>8.2f}"
        )
        if staged:
            line += f" {u[STAGED]:>12.1f} {u[STAGED] / u['hpcdl']:>7.1f}"
        lines.append(line + f" {r['iterations']:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", type=parse_sizes, default="4,1K,1M,16M", help="comma-separated byte sizes (K, M suffixes)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=None, help="calls per round (default: by size)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors live")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this file (rank 0)")
    a = p.parse_args(argv)
    p.require_at_least(("--rounds", a.rounds, 1))
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    torch.set_num_threads(1)
    hvd.init()
    on_device = on_device_path(a.device)
    rows = measure(a.sizes, a.rounds, a.iters, a.device)
    if on_device:  # the same call with the device path off, in this run
        hvd.shutdown()
        hvd.init(config=dataclasses.replace(load_config(), device_path=False))
        for r, s in zip(rows, measure(a.sizes, a.rounds, a.iters, a.device, ("hpcdl",)), strict=True):
            r["us"][STAGED] = s["us"]["hpcdl"]
    if hvd.rank() == 0:
        print(report(rows, hvd.size(), a.device, on_device), flush=True)
        if a.json:
            doc = {"ranks": hvd.size(), "device": a.device, "device_path": on_device, "rows": rows}
            with open(a.json, "w") as fh:
                dump_json(doc, fh, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
