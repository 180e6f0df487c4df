"""Training throughput: the same model and batch per rank, trained with no communication,
with hpcdl's ``DistributedOptimizer`` and ``ZeroOptimizer(stage=2)``, with torch DDP over
gloo, and with Horovod when it is importable, side by side in one run.

Run: ``mpiexec -n 2 python -m benchmarks.train_throughput [--models mlp,cnn] [--steps 12]
[--rounds 3] [--json F]``.

Models: ``mlp`` is 4 Linear layers 2048 wide (2048 inputs, 10 classes: 12.6M parameters),
``cnn`` a small convolutional network on 3x32x32 images (1.1M parameters); both take a batch
of 64 per rank, cross-entropy, SGD with momentum, one torch thread per rank.

Each round builds every contender afresh (same initial weights), warms it up for 3 steps and
times ``steps`` steps; contenders rotate their order from round to round. Per step, each
rank records when backward starts, when its last gradient is accumulated (the last
post-accumulate hook: the end of backward's compute) and when ``step()`` returns; a step's
time is the slowest rank's. Columns:

- step: the median step time (forward, backward, optimizer step, all communication);
- samples/s: ranks x batch / step;
- exposed comm: the median time from the end of backward's compute to the end of ``step()``,
  less the same span of the no-communication row (the local optimizer step);
- hidden: for the hpcdl rows, the share of the engine's communication time (negotiation,
  fusion copies and the collectives, from an ``HPCDL_TIMELINE`` trace of extra steps) that
  falls inside backward;
- engine cpu: CPU time of hpcdl's engine thread per timed step (mean over ranks). For the
  other rows it is what an idle engine costs. With as many busy ranks as cores, every
  millisecond of it is taken from the training step.

The bars: hpcdl's step at most 1.10 x the no-communication step and at most 0.85 x
DDP-gloo's; a line for DistributedOptimizer and one for ZeroOptimizer(stage=2).

A last line per model gives a floor: the CPU time each rank spends allreducing the model's
gradients alone (``collectives.allreduce`` of each bucket's size, as DistributedOptimizer
buckets them, on otherwise idle cores), as a share of the no-communication step. With as
many busy ranks as cores, that time cannot hide behind backward; it adds to the step.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import collectives
import hpcdl as hvd
from benchmarks.osu import gloo_init
from collectives.cli import ArgumentParser, dump_json, output_file, run_main
from hpcdl import state

BATCH = 64
WARMUP = 3
NO_COMM = "no communication"
HPCDL = "hpcdl DistributedOptimizer"
ZERO = "hpcdl ZeroOptimizer(stage=2)"
DDP = "torch DDP (gloo)"
HOROVOD = "Horovod"


def mlp() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10))


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 8 * 8, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (2048,)),
    "cnn": (cnn, (3, 32, 32)),
}


def _horovod() -> Any:
    try:
        import horovod.torch as horovod  # type: ignore[import-not-found]
    except Exception:  # not installed, or built without torch: skip the row
        return None
    horovod.init()
    return horovod


class _Clock:
    """Per-step timestamps: backward start, last gradient accumulated, step end."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.last_grad = 0.0
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, _: torch.Tensor) -> None:
        self.last_grad = time.perf_counter()


def _build(contender: str, make: Callable[[], torch.nn.Module], horovod: Any) -> tuple[Any, Any, _Clock]:
    torch.manual_seed(0)
    model = make()
    clock = _Clock(model)  # registered before any wrapper's hooks
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if contender == HPCDL:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    elif contender == ZERO:
        opt = hvd.ZeroOptimizer(opt, stage=2, named_parameters=model.named_parameters())
    elif contender == DDP:
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif contender == HOROVOD:
        opt = horovod.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return model, opt, clock


def _steps(model: Any, opt: Any, clock: _Clock, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[list[float]]:
    """Train ``steps`` steps; per step [start, backward start, last gradient, end] (perf_counter)."""
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        opt.step()
        out.append([t0, t1, clock.last_grad, time.perf_counter()])
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)


def hidden_share(trace: dict[str, Any], backward: list[list[tuple[float, float]]], prefix: str) -> float:
    """The share of every rank's communication time (the engine's NEGOTIATE, MEMCPY and
    collective phases of ``prefix``'s requests) that lies inside that rank's backward spans
    (perf_counter seconds)."""
    t0 = {ev["pid"]: ev["args"]["perf_counter_at_ts0"] for ev in trace["traceEvents"] if ev["name"] == "clock"}
    hidden = total = 0.0
    for rank, spans in enumerate(backward):
        comm = _union(
            [
                (t0[rank] + ev["ts"] / 1e6, t0[rank] + (ev["ts"] + ev["dur"]) / 1e6)
                for ev in trace["traceEvents"]
                if ev["ph"] == "X"
                and ev["pid"] == rank
                and ev["name"] != "QUEUE"
                and ev["args"]["tensor"].startswith(prefix)
            ]
        )
        total += sum(b - a for a, b in comm)
        hidden += _overlap(comm, _union(spans))
    return hidden / total if total else 0.0


def _engine_cpu() -> float:
    """CPU seconds hpcdl's engine thread has used so far (its thread CPU clock)."""
    return state.current().engine.thread_cpu_seconds()


def allreduce_floor(make: Callable[[], torch.nn.Module], reps: int = 20) -> tuple[float, float]:
    """(bytes, median CPU seconds per rank) of allreducing one step's gradients alone: one
    float32 buffer per DistributedOptimizer bucket, averaged in place, on idle cores."""
    model = make()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    sizes = [sum(p.numel() for p in b.params) for b in opt.buckets]
    del opt, model
    world = MPI.COMM_WORLD
    bufs = [np.ones(n, np.float32) for n in sizes]
    cpu = []
    for i in range(reps + 2):
        world.Barrier()
        c = time.thread_time()
        for b in bufs:
            collectives.allreduce(b, op="avg", out=b, comm=world)
        if i >= 2:  # the first two warm the window and the pages
            cpu.append(world.allreduce(time.thread_time() - c, op=MPI.MAX))
    return 4.0 * sum(sizes), statistics.median(cpu)


def measure(model_name: str, rounds: int, steps: int, timeline_steps: int, horovod: Any) -> dict[str, Any]:
    world = MPI.COMM_WORLD
    make, shape = MODELS[model_name]
    g = torch.Generator().manual_seed(100 + world.rank)  # each rank its own batch
    x = torch.randn(BATCH, *shape, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    contenders = [NO_COMM, HPCDL, ZERO, DDP] + ([HOROVOD] if horovod is not None else [])
    per_step: dict[str, list[float]] = {c: [] for c in contenders}
    tail: dict[str, list[float]] = {c: [] for c in contenders}  # end of backward compute -> end of step
    engine_cpu: dict[str, list[float]] = {c: [] for c in contenders}  # hpcdl engine thread, per step
    rounds_ms: dict[str, list[float]] = {c: [] for c in contenders}  # each round's median step
    for rnd in range(rounds):
        k = rnd % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            model, opt, clock = _build(c, make, horovod)
            _steps(model, opt, clock, x, y, WARMUP)
            world.Barrier()
            c0 = _engine_cpu()
            stamps = _steps(model, opt, clock, x, y, steps)
            engine_cpu[c].append((_engine_cpu() - c0) / steps)
            # a step's time is the slowest rank's
            every = world.allgather([(s[3] - s[0], s[3] - s[2]) for s in stamps])
            for i in range(steps):
                per_step[c].append(max(e[i][0] for e in every))
                tail[c].append(max(e[i][1] for e in every))
            rounds_ms[c].append(statistics.median(per_step[c][-steps:]) * 1e3)
            del model, opt, clock
    result: dict[str, Any] = {"model": model_name, "ranks": world.size, "batch_per_rank": BATCH, "rows": {}}
    local_tail = statistics.median(tail[NO_COMM])
    for c in contenders:
        step = statistics.median(per_step[c])
        result["rows"][c] = {
            "step_ms": step * 1e3,
            "samples_per_s": world.size * BATCH / step,
            "exposed_ms": (statistics.median(tail[c]) - local_tail) * 1e3 if c != NO_COMM else 0.0,
            "hidden": None,
            # the mean over ranks of the per-round median: CPU the engine thread used per step
            "engine_cpu_ms": world.allreduce(statistics.median(engine_cpu[c])) / world.size * 1e3,
            # each round's median step over the same round's without communication: the rounds
            # interleave the contenders, so a slow spell of the machine falls on both of a pair
            "round_ratios": [mine / base for mine, base in zip(rounds_ms[c], rounds_ms[NO_COMM], strict=True)],
        }
    # the hidden share, from a timeline of extra steps (not the timed ones: tracing costs a little)
    for c in (HPCDL, ZERO):
        model, opt, clock = _build(c, make, horovod)
        _steps(model, opt, clock, x, y, WARMUP)
        scratch = tempfile.mkdtemp(prefix="hpcdl-train-throughput-") if world.rank == 0 else None
        path = world.bcast(None if scratch is None else os.path.join(scratch, "timeline.json"), root=0)
        hvd.start_timeline(path)
        stamps = _steps(model, opt, clock, x, y, timeline_steps)
        hvd.stop_timeline()
        backward = world.gather([(s[1], s[2]) for s in stamps], root=0)
        if world.rank == 0:
            with open(path) as fh:
                trace = json.load(fh)
            shutil.rmtree(scratch)
            result["rows"][c]["hidden"] = hidden_share(trace, backward, opt.name_prefix)
        del model, opt, clock
    result["rows"] = world.bcast(result["rows"], root=0)
    result["params"] = sum(p.numel() for p in make().parameters())
    result["floor_bytes"], result["floor_s"] = allreduce_floor(make)
    return result


def report(results: list[dict[str, Any]], command: str) -> str:
    lines = [f"# {command}"]
    for res in results:
        rows = res["rows"]
        base, ddp = rows[NO_COMM]["step_ms"], rows[DDP]["step_ms"]
        lines += [
            "",
            f"## {res['model']}: {res['params'] / 1e6:.1f}M parameters, batch {res['batch_per_rank']} per rank, "
            f"{res['ranks']} ranks; step = median of the slowest rank's step",
            f"{'':30} {'step ms':>9} {'samples/s':>10} {'exposed ms':>11} {'hidden':>7} {'engine cpu ms':>14} "
            f"{'/ no comm':>10} {'/ DDP':>7}",
        ]
        for c, r in rows.items():
            hidden = "" if r["hidden"] is None else f"{r['hidden'] * 100:.0f}%"
            lines.append(
                f"{c:30} {r['step_ms']:>9.1f} {r['samples_per_s']:>10.0f} {r['exposed_ms']:>11.1f} {hidden:>7} "
                f"{r.get('engine_cpu_ms', 0.0):>14.1f} "
                f"{r['step_ms'] / base:>10.2f} {r['step_ms'] / ddp:>7.2f}"
            )
        for c, who in ((HPCDL, "hpcdl"), (ZERO, "ZeroOptimizer(stage=2)")):
            h = rows[c]["step_ms"]
            lines.append(
                f"bars: {who} <= 1.10 x no comm: {h / base:.2f} {'PASS' if h <= 1.10 * base else 'MISS'}; "
                f"{who} <= 0.85 x DDP-gloo: {h / ddp:.2f} {'PASS' if h <= 0.85 * ddp else 'MISS'}"
            )
        if 0.85 * ddp < base:  # every contender's step includes the no-communication step's work
            lines.append(
                f"(0.85 x DDP-gloo = {0.85 * ddp:.1f} ms is below the no-communication step, {base:.1f} ms: "
                "that bar needs a step faster than training without communication)"
            )
        if "floor_s" in res:
            floor = res["floor_s"] * 1e3
            lines.append(
                f"floor: allreducing the {res['floor_bytes'] / 1e6:.1f} MB of gradients alone takes {floor:.1f} ms "
                f"of each rank's CPU on idle cores = {floor / base:.2f} x the no-communication step "
                f"(the 1.10 bar leaves {0.10 * base - floor:.1f} ms for everything else)"
            )
        if HOROVOD not in rows:
            lines.append("(Horovod is not importable here: no Horovod row)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="timed steps per contender and round")
    p.add_argument("--timeline-steps", type=int, default=6, help="steps traced for the hidden share")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this file (rank 0)")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    p.require_at_least(("--rounds", a.rounds, 1), ("--steps", a.steps, 1))
    models = a.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    torch.set_num_threads(1)
    hvd.init()
    gloo_init(MPI.COMM_WORLD)
    horovod = _horovod()
    results = [measure(m, a.rounds, a.steps, a.timeline_steps, horovod) for m in models]
    if hvd.rank() == 0:
        cmd = f"mpiexec -n {hvd.size()} python -m benchmarks.train_throughput " + " ".join(argv)
        print(report(results, cmd.strip()), flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                dump_json(results, fh, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
