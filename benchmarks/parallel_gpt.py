"""Tensor, pipeline and data parallelism side by side: the byte-level GPT of ``hpcdl.train``
trained on each DP x TP x PP grid of the job's ranks, and a pipeline of equal stages.

Run: ``mpiexec -n 4 python -m benchmarks.parallel_gpt [--grids 2x2x1,1x2x2,2x1x2,1x1x4,1x4x1]
[--steps 6] [--chunks 8] [--schedule 1f1b] [--json F]``.

Per grid (dp x tp x pp), the GPT (``--n-layer`` blocks of width ``--d-model``, context
``--block-size``) trains with Adam under ``DistributedOptimizer`` over the grid's DP group,
``--batch-size`` sequences per replica in ``--chunks`` micro-batches. Columns:

- tokens/s: the tokens of every replica's batches per second of the slowest rank's median
  step;
- act MiB: the largest stage's peak of activation memory held for backward during a step
  (the bytes of the distinct tensors autograd saved and had not yet released, counted with
  ``torch.autograd.graph.saved_tensors_hooks``; received activations included);
- live: the most micro-batches whose activations a stage held at once (1F1B: at most the
  stages from it to the last; GPipe: every micro-batch);
- param MiB/rank: the largest rank's parameter bytes (the dense model's divided by tp x pp,
  give or take the replicated layer norms and position table);
- bubble: the pipeline's idle share, measured on the timed steps from every stage's
  forward and backward spans (:attr:`hpcdl.parallel.Pipeline.spans`): a step lasts from its
  first span's start to its last span's end on any stage, and a stage's bubble is the share
  of that time it does not compute; mean over the stages, median over the steps
  (:func:`bubbles`). Beside it the schedule's own ``(p - 1) / (m + p - 1)``.

Below the table, per pipeline, the bubble of its slowest stage (the one that computes
longest and so sets the step; the formula is for stages of equal compute, and where they
differ the others also wait for the slowest), the same spans replayed with hops that cost
nothing, which splits the excess into the stages' unequal compute and the hops' cost, and
that cost in time per micro-batch. For 1F1B, the same spans also replayed with one more
warm-up forward on every stage but the last: where that replay comes out lower, the stages'
compute varies from micro-batch to micro-batch and 1F1B passes each slow micro-batch on to
the neighbours, which one more micro-batch in flight would absorb.

For each grid with tp > 1, a line explains the step by its tensor-parallel traffic: the
calls and bytes per step of the TP functions (:data:`hpcdl.parallel.tp_comm.traffic`), the
time the slowest rank waited in them, split into the calls' own cost and the wait for a
later peer (a rank that reaches a call first waits for the others' compute:
:func:`split_waiting`), and the time predicted by α-β models (:mod:`collectives.cost`) of
each kind of call, fitted to calls of 1 KiB to 1 MiB made on the grid's TP group just
before (:func:`alpha_beta`), to set against the calls' own cost.

The last line is a pipeline of ``p`` stages of equal layers (each a stack of Linear layers,
tp = 1, dp = 1 over the job's ranks), where the slowest stage's bubble should be within 10%
of the formula: its communication is small beside its compute. Its stages' compute is
still not equal: the first stage's backward computes no gradient of its input, and the
last stage's includes the loss.

With more ranks than cores (4 ranks on the 2-core reference machine) the ranks take turns
on the cores, so a stage's idle time is partly another's compute: the figures are then
correctness and memory, not speed.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hpcdl as hvd
from benchmarks.node_report import bubble_line
from collectives.cli import ArgumentParser, dump_json, output_file, run_main
from collectives.cost import AlphaBeta, fit
from hpcdl.parallel import Grid, Pipeline, gather_from_tp, reduce_scatter_seq_to_tp
from hpcdl.parallel.pipeline import one_f_one_b
from hpcdl.parallel.tp_comm import tp_sum, traffic
from hpcdl.train.data import corpus
from hpcdl.train.models import GPT, parallel_gpt, parallel_gpt_loss

GRIDS = "2x2x1,1x2x2,2x1x2,1x1x4,1x4x1"


class ActivationMeter:
    """Peak bytes of the distinct tensors autograd holds for backward (by storage)."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, t.untyped_storage().nbytes()]
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.t

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]


class _Held:
    """A saved tensor; its release is counted when autograd drops it."""

    def __init__(self, meter: ActivationMeter, key: int, t: torch.Tensor) -> None:
        self.meter, self.key, self.t = meter, key, t

    def __del__(self) -> None:
        self.meter.release(self.key)


def max_over_ranks(x: float) -> float:
    """The largest of every rank's ``x`` (collective), through hpcdl's engine, as every
    other call here (a rank blocked in an MPI collective of its own while its peers wait on
    the engine is not a pattern to time)."""
    return float(hvd.allreduce(torch.tensor([float(x)], dtype=torch.float64), op=hvd.Max, name="bench.max"))


Span = tuple[float, str, int, float]
"""A stage's compute span: start (µs), ``"F"`` or ``"B"``, micro-batch, duration (µs)."""

Step = dict[int, tuple[int, list[Span]]]
"""One training step's spans: by rank, that rank's stage and its spans in the order they ran."""

Replay = tuple[list[float], float]
"""A step's spans replayed (:func:`_replay`): each stage's busy time and the step's length."""


def step_spans(pipe: Pipeline) -> Step:
    """Every rank's :attr:`~hpcdl.parallel.Pipeline.spans` of the last step, by rank
    (collective over the world)."""
    mine = (pipe.grid.pp_rank, [(a * 1e6, k, i, (b - a) * 1e6) for k, i, a, b in pipe.spans])
    return dict(enumerate(hvd.allgather_object(mine)))


def _lines(rows: Step) -> list[list[int]] | None:
    """The step's pipelines: each the ranks of one dp and tp coordinate, the n-th rank of each
    stage in rank order, first stage first; None where the stages have different numbers of
    ranks (not a grid's pipelines)."""
    by_stage: dict[int, list[int]] = {}
    for rank in sorted(rows):
        by_stage.setdefault(rows[rank][0], []).append(rank)
    if len({len(ranks) for ranks in by_stage.values()}) != 1:
        return None
    return [list(line) for line in zip(*(by_stage[s] for s in sorted(by_stage)), strict=True)]


def bubbles(steps: list[Step], schedule: str = "1f1b") -> dict[str, float] | None:
    """The pipeline's bubble over ``steps`` (run with ``schedule``), each pipeline of each
    step on its own (a step lasts from its first span's start to its last span's end on any
    of its stages), the median over them:

    - ``mean``: the share of the step a stage does not compute, mean over the stages;
    - ``slowest``: that share on the pipeline's slowest stage, the one that computes longest
      over the steps and so sets their length. ``(p - 1) / (m + p - 1)`` is the bubble of
      stages of equal compute; where they differ, the others also wait for the slowest, and
      only this one compares;
    - ``replayed``, ``replayed_slowest``: the same from the same spans replayed with hops
      that cost nothing (:func:`_replay`): the bubble of the stages' compute alone;
    - ``replayed_ahead_slowest`` (1F1B only): the slowest stage's, from the same spans
      replayed with free hops in the schedule that runs one more warm-up forward on every
      stage but the last (one more micro-batch of activations held there). Below
      ``replayed_slowest``, the stages' compute varies from micro-batch to micro-batch and
      1F1B, whose stages wait on each other every micro-batch, passes each stage's slow
      micro-batches on to its neighbours; where it equals it, they do not;
    - ``hop_s``: what the hops (sends, receives, the schedule's own Python) added to the
      step, in seconds per micro-batch: the measured step less the replayed, over ``m``;
    - ``between_s``: the slowest stage's time between its first span's start and its last
      span's end that it did not compute, in seconds per micro-batch: its own sends,
      receives and Python, and any wait for the others (in a step where another stage ran
      slow);
    - ``gap_s``: the slowest stage's typical gap before a forward (its first left out): on
      the last stage, the backward's gradient sent and the next activation received.

    None where no step has spans that form a schedule."""
    runs: dict[int, list[tuple[list[list[Span]], float, list[float], Replay, Replay | None]]] = {}
    for rows in steps:
        for j, line in enumerate(_lines(rows) or []):
            order = [rows[rank][1] for rank in line]
            if not all(order):
                continue
            replayed = _replay([[(k, i, d) for _, k, i, d in spans] for spans in order])
            if replayed is None:
                continue  # the spans do not form a schedule (a step cut short)
            ahead = _replay_ahead(order) if schedule == "1f1b" else None
            start = min(spans[0][0] for spans in order)
            span = max(t + d for spans in order for t, _, _, d in spans) - start
            busy = [sum(d for *_, d in spans) for spans in order]
            runs.setdefault(j, []).append((order, span, busy, replayed, ahead))
    got: dict[str, list[float]] = {}
    for line_runs in runs.values():
        total = [sum(run[2][s] for run in line_runs) for s in range(len(line_runs[0][2]))]
        slow = max(range(len(total)), key=lambda s: (total[s], s))  # of equals, the later (the loss)
        for order, span, busy, (replay_busy, replay_span), ahead in line_runs:
            if ahead is not None:
                got.setdefault("replayed_ahead_slowest", []).append(1.0 - ahead[0][slow] / ahead[1])
            m = max(1, sum(1 for s in order[0] if s[1] == "F"))
            first, last = order[slow][0], order[slow][-1]
            for key, value in (
                ("mean", statistics.mean(1.0 - b / span for b in busy)),
                ("slowest", 1.0 - busy[slow] / span),
                ("replayed", statistics.mean(1.0 - b / replay_span for b in replay_busy)),
                ("replayed_slowest", 1.0 - replay_busy[slow] / replay_span),
                ("hop_s", (span - replay_span) / m * 1e-6),
                ("between_s", (last[0] + last[3] - first[0] - busy[slow]) / m * 1e-6),
            ):
                got.setdefault(key, []).append(value)
            mine = order[slow]
            gaps = [(b[0] - a[0] - a[3]) * 1e-6 for a, b in itertools.pairwise(mine) if b[1] == "F"]
            got.setdefault("gap_s", []).extend(gaps)
    return {k: statistics.median(v) for k, v in got.items() if v} if got else None  # no gap_s with one micro-batch


CALIBRATION_BYTES = (1 << 10, 16 << 10, 256 << 10, 1 << 20)
"""The sizes at which :func:`alpha_beta` times each tensor-parallel collective."""


def alpha_beta(group: Any, repeats: int = 8) -> dict[str, AlphaBeta]:
    """Each kind of tensor-parallel collective's α-β model on ``group`` (collective over its
    ranks): fitted to the median time of ``repeats`` calls at each of
    :data:`CALIBRATION_BYTES`, made through the TP functions themselves and timed by their
    :data:`~hpcdl.parallel.tp_comm.traffic` counts, as the step's calls are."""
    k = group.size()
    make = {
        "allreduce": lambda n: tp_sum(torch.ones(n), group),
        "allgather": lambda n: gather_from_tp(torch.ones(n), group),
        "reducescatter": lambda n: reduce_scatter_seq_to_tp(torch.ones(1, k, max(1, n // k)), group),
    }
    models = {}
    for kind, call in make.items():
        points = []
        for nbytes in CALIBRATION_BYTES:
            call(nbytes // 4)  # warm-up
            times = []
            for _ in range(repeats):
                traffic.reset()
                call(nbytes // 4)
                times.append(traffic.counts[kind]["seconds"])
            points.append((traffic.counts[kind]["bytes"], statistics.median(times)))
        models[kind] = fit(points)
    traffic.reset()
    return models


def split_waiting(calls: list[float], group: Any) -> tuple[float, float]:
    """``calls`` (this rank's seconds in each tensor-parallel call, in order) split into the
    calls' own cost and the wait for peers (collective over the world; the ranks of each TP
    ``group`` made the same calls in the same order): a call's own cost is the least of its
    group's ranks' seconds in it, the time it took once the last of them arrived, and what
    this rank waited beyond that was for a later peer. Both summed over the calls."""
    own = torch.tensor(calls, dtype=torch.float64)
    lengths = hvd.allreduce(torch.tensor([len(calls), -len(calls)], dtype=torch.float64), op=hvd.Max, process_set=group)
    if max_over_ranks(float(lengths.sum() != 0)):
        raise RuntimeError("the ranks of a tensor-parallel group made different numbers of calls")
    least = hvd.allreduce(own, op=hvd.Min, process_set=group, name="bench.least")
    return float(least.sum()), float((own - least).sum())


def _tp_columns(
    grid: Grid, counts: dict[str, dict[str, float]], calls: list[float], steps: int, models: dict[str, AlphaBeta]
):
    """The step's tensor-parallel traffic (calls, bytes, seconds measured and predicted, each
    per step; the slowest rank's seconds, split into the calls' own cost and the wait for a
    later peer: :func:`split_waiting`) and the α-β models behind the prediction."""
    measured = sum(c["seconds"] for c in counts.values()) / steps
    predicted = sum(models[k].time(c["bytes"], c["calls"]) for k, c in counts.items() if c["calls"]) / steps
    cost, waited = split_waiting(calls, grid.tp_group)
    return {
        "tp_calls": sum(c["calls"] for c in counts.values()) / steps,
        "tp_bytes": sum(c["bytes"] for c in counts.values()) / steps,
        "tp_seconds": max_over_ranks(measured),
        "tp_call_seconds": max_over_ranks(cost / steps),
        "tp_peer_wait_seconds": max_over_ranks(waited / steps),
        "tp_predicted_seconds": max_over_ranks(predicted),
        "tp_models": {k: {"alpha_s": m.alpha, "beta_Bps": m.beta} for k, m in models.items()},
    }


def _replay_ahead(order: list[list[Span]]) -> Replay | None:
    """The spans of a 1F1B step (``order[s]``: stage s's, as they ran) replayed with free
    hops in the order with one more warm-up forward on every stage but the last; None where
    they did not run in 1F1B's order."""
    p, m = len(order), sum(1 for span in order[0] if span[1] == "F")
    if any([(k, i) for _, k, i, _ in spans] != one_f_one_b(p, s, m) for s, spans in enumerate(order)):
        return None
    took = [{(k, i): d for _, k, i, d in spans} for spans in order]
    return _replay([[(k, i, took[s][(k, i)]) for k, i in one_f_one_b(p, s, m, ahead=1)] for s in range(p)])


def _replay(order: list[list[tuple[str, int, float]]]) -> Replay | None:
    """Replay one pipeline's spans (``order[s]``: stage s's ``(kind, micro-batch,
    duration)`` in the order they ran) with free hops: each stage's busy time and the
    step's length, or None where no span can start."""
    p = len(order)
    end: dict[tuple[int, str, int], float] = {}
    free, at, busy = [0.0] * p, [0] * p, [0.0] * p
    while any(at[s] < len(order[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if at[s] == len(order[s]):
                continue
            k, i, d = order[s][at[s]]
            dep = (s - 1, "F", i) if k == "F" and s > 0 else (s + 1, "B", i) if k == "B" and s < p - 1 else None
            if dep is not None and dep not in end:
                continue
            start = max(free[s], end[dep] if dep else 0.0)
            end[(s, k, i)] = free[s] = start + d
            busy[s] += d
            at[s] += 1
            moved = True
        if not moved:
            return None
    return busy, max(free)


def measure(
    layers: list[nn.Module],
    grid: Grid,
    batch: Any,
    loss_fn: Any,
    chunks: int,
    schedule: str,
    steps: int,
    tokens_per_batch: int,
) -> dict[str, Any]:
    """Train ``layers`` on ``grid`` and measure one row (collective over the world)."""
    pipe = Pipeline(layers, grid, chunks=chunks, schedule=schedule)
    inner = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    opt = hvd.DistributedOptimizer(
        inner, named_parameters=pipe.named_parameters(), backward_passes_per_step=chunks, process_set=grid.dp_group
    )

    def step(k: int) -> None:
        opt.zero_grad()
        x, y = batch(k)
        pipe.train_step(x, y, loss_fn)
        opt.step()

    for k in range(2):  # warm-up
        step(k)
    models = alpha_beta(grid.tp_group) if grid.tp > 1 else {}
    times, steps_spans = [], []
    traffic.reset(keep_calls=grid.tp > 1)
    for k in range(steps):
        hvd.barrier()
        t0 = time.perf_counter()
        step(2 + k)
        times.append(max_over_ranks(time.perf_counter() - t0))
        steps_spans.append(step_spans(pipe))
    counts, calls = traffic.snapshot(), traffic.calls
    traffic.reset()
    bubble = bubbles(steps_spans, schedule) or {}
    meter = ActivationMeter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        step(0)
    live = pipe.peak_live
    param_bytes = sum(p.numel() * p.element_size() for p in pipe.parameters())
    row = {
        "grid": f"{grid.dp}x{grid.tp}x{grid.pp}",
        "chunks": chunks,
        "schedule": schedule,
        "step_s": statistics.median(times),
        "step_range_s": [min(times), max(times)],
        "tokens_per_s": grid.dp * tokens_per_batch / statistics.median(times),
        "activation_bytes": max_over_ranks(meter.peak),
        "live": int(max_over_ranks(live)),
        "param_bytes": max_over_ranks(param_bytes),
        "bubble": bubble.get("mean"),
        "bubble_slowest": bubble.get("slowest"),
        "bubble_replayed": bubble.get("replayed"),
        "bubble_replayed_slowest": bubble.get("replayed_slowest"),
        "bubble_replayed_ahead_slowest": bubble.get("replayed_ahead_slowest"),
        "hop_s": bubble.get("hop_s"),
        "between_s": bubble.get("between_s"),
        "gap_s": bubble.get("gap_s"),
        "bubble_formula": (grid.pp - 1) / (chunks + grid.pp - 1),
    }
    if models:
        row.update(_tp_columns(grid, counts, calls, steps, models))
    pipe.close()
    return row


def gpt_row(shape: tuple[int, int, int], a: Any, train: Any) -> dict[str, Any]:
    dp, tp, pp = shape
    grid = Grid(dp=dp, tp=tp, pp=pp)
    torch.manual_seed(0)
    gpt = GPT(a.block_size, a.n_layer, a.n_head, a.d_model)
    layers = parallel_gpt(gpt, grid)
    dense_bytes = sum(p.numel() * p.element_size() for p in gpt.parameters())

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * k + grid.dp_rank)
        return train.batch(torch.randint(len(train), (a.batch_size,), generator=g))

    row = measure(
        layers,
        grid,
        batch,
        lambda out, t: parallel_gpt_loss(out, t, grid),
        a.chunks,
        a.schedule,
        a.steps,
        a.batch_size * a.block_size,
    )
    row["dense_param_bytes"] = dense_bytes
    grid.close()
    return row


def equal_row(a: Any) -> dict[str, Any]:
    """A pipeline of equal stages over every rank (tp = dp = 1)."""
    n = hvd.size()
    grid = Grid(dp=1, tp=1, pp=n)
    torch.manual_seed(0)
    width = a.equal_width
    layers = [nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)]) for _ in range(n)]

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(k)
        return torch.randn(a.batch_size * 8, width, generator=g), torch.randn(a.batch_size * 8, width, generator=g)

    row = measure(layers, grid, batch, F.mse_loss, a.chunks, a.schedule, a.steps, 0)
    row["grid"] = f"1x1x{n} equal"
    row["tokens_per_s"] = None
    row["dense_param_bytes"] = row["param_bytes"] * n
    grid.close()
    return row


def report(rows: list[dict[str, Any]], command: str, a: Any) -> str:
    mib = 1 << 20
    lines = [
        f"# {command}",
        f"# gpt: {a.n_layer} blocks, d_model {a.d_model}, {a.n_head} heads, context {a.block_size}; "
        f"{a.batch_size} sequences per replica in {a.chunks} micro-batches, {a.schedule}; median of {a.steps} steps",
        f"{'grid dp x tp x pp':<18} {'step ms':>8} {'tokens/s':>9} {'act MiB':>8} {'live':>5} "
        f"{'param MiB/rank':>15} {'of dense':>8} {'bubble':>7} {'(p-1)/(m+p-1)':>14}",
    ]
    for r in rows:
        tok = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] is not None else "-"
        bub = f"{r['bubble']:.3f}" if r["bubble"] is not None else "-"
        lines.append(
            f"{r['grid']:<18} {r['step_s'] * 1e3:>8.1f} {tok:>9} {r['activation_bytes'] / mib:>8.2f} {r['live']:>5} "
            f"{r['param_bytes'] / mib:>15.3f} {r['param_bytes'] / r['dense_param_bytes']:>8.2f} {bub:>7} "
            f"{r['bubble_formula']:>14.3f}"
        )
    lines += _tp_lines(rows)
    lines += [line for r in rows if (line := bubble_line(r))]
    return "\n".join(lines)


def _tp_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per grid with tp > 1: its tensor-parallel traffic per step, the time its ranks waited
    in it, split into the calls' own cost (beside what the α-β models measured on its TP
    group predict) and the wait for a later peer."""
    lines = []
    for r in rows:
        if "tp_calls" not in r:
            continue
        models = "; ".join(
            f"{k} {m['alpha_s'] * 1e6:.0f} us + {m['beta_Bps'] / 1e9:.2f} GB/s" for k, m in r["tp_models"].items()
        )
        lines.append(
            f"{r['grid']} tensor parallelism per step: {r['tp_calls']:.0f} calls, {r['tp_bytes'] / (1 << 20):.2f} MiB; "
            f"{r['tp_seconds'] * 1e3:.1f} ms waiting in them of a {r['step_s'] * 1e3:.1f} ms step: "
            f"{r['tp_call_seconds'] * 1e3:.1f} ms the calls' own, where alpha-beta predicts "
            f"{r['tp_predicted_seconds'] * 1e3:.1f} ms ({models}), and {r['tp_peer_wait_seconds'] * 1e3:.1f} ms "
            "for a later peer"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grids", default=GRIDS, help=f"comma-separated dp x tp x pp (default {GRIDS})")
    p.add_argument("--steps", type=int, default=6, help="timed steps per grid")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per batch")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--batch-size", type=int, default=32, help="sequences per replica")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--equal-width", type=int, default=512, help="width of the equal stages' Linear layers")
    p.add_argument("--no-equal", action="store_true", help="skip the pipeline of equal stages")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this file (rank 0)")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    p.require_at_least(("--steps", a.steps, 1))
    shapes = []
    for text in a.grids.split(","):
        try:
            shapes.append(tuple(int(v) for v in text.lower().split("x")))
        except ValueError:
            p.error(f"--grids: {text!r} is not dp x tp x pp")
        if len(shapes[-1]) != 3:
            p.error(f"--grids: {text!r} is not dp x tp x pp")
    torch.set_num_threads(1)
    hvd.init()
    n = hvd.size()
    bad = [s for s in shapes if s[0] * s[1] * s[2] != n]
    if bad:
        p.error(f"--grids: {['x'.join(map(str, s)) for s in bad]} do not have {n} ranks")
    train, _ = corpus(a.block_size)
    rows = [gpt_row(s, a, train) for s in shapes]
    if not a.no_equal and n > 1:
        rows.append(equal_row(a))
    if hvd.rank() == 0:
        cmd = f"mpiexec -n {n} python -m benchmarks.parallel_gpt " + " ".join(argv)
        print(report(rows, cmd.strip(), a), flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                dump_json(rows, fh, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
