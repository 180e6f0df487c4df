"""The planner against what runs here: the GPT of ``benchmarks.parallel_gpt`` trained on
each DP x TP x PP grid of the job's ranks, and beside each measured step the step
``python -m hpcdl.plan``'s model predicts from this machine's measured rates.

Run: ``mpiexec -n 4 python -m benchmarks.plan_check [--grids 2x2x1,1x2x2,2x1x2,1x1x4,1x4x1]
[--steps 4] [--cores N] [--json F]``.

First the job measures the planner's inputs, none of them fitted to the grids' steps:

- compute: rank 0 alone (the other ranks wait asleep) times one tensor-parallel rank's
  share of a transformer block (:class:`BlockShare`), forward and backward, at several
  micro-batches and ``tp``; :func:`hpcdl.plan.fit_compute` fits the planner's rate and
  per-pass overhead to those times; the memory bandwidth is one copy of 64 MiB;
- the link between ranks: the α-β of the tensor-parallel allreduce on ranks 0 and 1, the
  others asleep (:func:`benchmarks.parallel_gpt.alpha_beta`);
- contention: every rank trains a replica's stack of blocks at once, and how much longer
  the slowest rank takes than the fitted rate and overhead say one rank alone takes for it,
  beyond the ranks' share of the cores (``--cores``, default the cores any of its ranks may
  run on), is the planner's ``contention`` (caches, memory, and cores that run slower when
  all are busy); the median of nine such steps;
- a call's cost beside its link's time: every rank runs forward and backward through a
  tensor-parallel block of two ranks and, alternately with it, through the same block's
  compute without its calls, under the same load; what the first takes beyond the second
  and the link's time is shared by its 4 calls: the planner's ``call_overhead``.

Then each grid trains as ``benchmarks.parallel_gpt`` trains it (``--batch-size`` sequences
per replica in ``--chunks`` micro-batches, 1F1B, Adam in fp32), and the table gives per
grid the measured step, the predicted one and their ratio, tokens per second measured and
predicted with their ranks, the contention it was predicted at (measured as above just
before and after the grid, two steps each, so that a machine whose pace drifts between the
calibration and a grid is followed), and the predicted step's parts. The planner's check
is that every prediction falls within 25% of its measurement and the two rankings agree; a
pair the prediction orders the other way whose timed steps overlap is marked "within their
steps' spread": the measurement does not order it either.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import hpcdl as hvd
from benchmarks.osu import copy_bandwidth
from benchmarks.parallel_gpt import alpha_beta, gpt_row, max_over_ranks
from collectives.cli import ArgumentParser, dump_json, output_file, run_main
from collectives.cost import AlphaBeta, link_from_allreduce, ring_allreduce
from hpcdl.parallel import Grid
from hpcdl.plan import GPT, GPU, Cluster, Layout, estimate, fit_compute, layer_pass
from hpcdl.train.data import corpus
from hpcdl.train.models import GPT as TinyGPT
from hpcdl.train.models import ParallelBlock

GRIDS = {2: "2x1x1,1x2x1,1x1x2", 4: "2x2x1,1x2x2,2x1x2,1x1x4,1x4x1"}
"""The default grids by the job's ranks (others: give ``--grids``)."""

POINTS = ((1, 1), (1, 4), (4, 1), (4, 2), (4, 4), (16, 1), (16, 4))
"""The (micro-batch, tp) at which rank 0 times a block's share for the compute fit."""

BOUND = 0.25
"""How far a prediction may fall from its measurement (relative)."""


class BlockShare(nn.Module):
    """The compute of one of ``tp`` ranks in a tensor-parallel transformer block
    (``hpcdl.train.models.ParallelBlock``) without its communication: layer norms on the
    whole width, ``heads / tp`` attention heads, ``1 / tp`` of the MLP's hidden units."""

    def __init__(self, d: int, heads: int, tp: int) -> None:
        super().__init__()
        self.heads, self.width = heads // tp, d // tp
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * self.width), nn.Linear(self.width, d)
        self.fc, self.out = nn.Linear(d, 4 * self.width), nn.Linear(4 * self.width, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, self.width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, self.width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _seconds(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()
    fn()
    return statistics.median(_seconds(fn) for _ in range(repeats))


def block_seconds(d: int, heads: int, seq: int, micro_batch: int, tp: int, repeats: int = 9) -> float:
    """Median seconds of a forward and backward of :class:`BlockShare` (input gradient
    included, as in a middle stage) on this process."""
    torch.manual_seed(0)
    block = BlockShare(d, heads, tp)
    x = torch.randn(micro_batch, seq, d, requires_grad=True)
    return _median_seconds(lambda: block(x).sum().backward(), repeats)


def _asleep_unless(mine: bool, work: Any) -> Any:
    """``work()`` on the ranks where ``mine``; the others wait for them asleep (polling a
    nonblocking barrier every 5 ms), so that they leave the cores to it."""
    out = work() if mine else None
    req = MPI.COMM_WORLD.Ibarrier()
    while not req.Test():
        time.sleep(5e-3)
    return out


def _slowest_rank_seconds(fn: Any, rounds: int) -> float:
    """The slowest rank's mean seconds of ``fn`` over ``rounds``, every rank starting from
    one barrier (collective over the world)."""
    hvd.barrier()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    return max_over_ranks((time.perf_counter() - t0) / rounds)


def replica_step(a: Any) -> Any:
    """A replica's compute, warmed up: ``--n-layer`` blocks (:class:`BlockShare`, tp 1)
    trained on ``--chunks`` micro-batches, one forward and backward after another."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[BlockShare(a.d_model, a.n_head, 1) for _ in range(a.n_layer)])
    x = torch.randn(a.batch_size // a.chunks, a.block_size, a.d_model, requires_grad=True)

    def step() -> None:
        for _ in range(a.chunks):
            blocks(x).sum().backward()

    step()
    return step


def contention(step: Any, alone: float, cores: int, samples: int = 9) -> float:
    """How many times as long compute takes when every rank computes at once as ``alone``
    says one rank takes, beyond their share of the cores: :func:`replica_step` on every
    rank at once from a barrier, ``samples`` times; the slowest rank's median over the
    ranks' share of a core (collective over the world).

    ``alone`` is the step's time from the compute fit (rank 0 alone), not a second timing
    of rank 0 alone: where a node's cores run at speeds that change from one moment to the
    next (a virtual machine's, by up to 1.5 times), a ratio of two timings would set the
    slowest of the ranks against one rank, and one moment against another. Set against the
    fit, the product of fit and contention is the pace of every rank at once, whatever
    speed the fit's moment caught."""
    together = statistics.median(_slowest_rank_seconds(step, 1) for _ in range(samples))
    return max(1.0, together / alone / max(1.0, hvd.size() / cores))


def call_seconds(a: Any, link: AlphaBeta, rounds: int = 6, samples: int = 3) -> float:
    """What a call between ranks costs beside its link's time (the planner's
    ``call_overhead``): every rank runs forward and backward through a tensor-parallel
    transformer block of two ranks (``hpcdl.train.models.ParallelBlock``: 4 allreduces),
    and, alternately with it, through the same block's compute alone (:class:`BlockShare`
    of 2 ranks) under the same load, every rank at once. The two medians' difference (the
    slowest rank's rounds), less the allreduces' link time, shared by the 4 calls. Neither
    the share of a core nor the contention enters it (collective over the world)."""
    n, b = hvd.size(), a.batch_size // a.chunks
    grid = Grid(dp=n // 2, tp=2, pp=1)
    torch.manual_seed(0)
    block = ParallelBlock(TinyGPT(a.block_size, 1, a.n_head, a.d_model).blocks[0], 0, grid)
    twin = BlockShare(a.d_model, a.n_head, 2)
    x = torch.randn(b, a.block_size, a.d_model, requires_grad=True)

    def parallel() -> None:
        block(x).sum().backward()

    def alone() -> None:
        twin(x).sum().backward()

    for _ in range(2):
        parallel()
        alone()
    with_calls, without = [], []
    for _ in range(samples):
        with_calls.append(_slowest_rank_seconds(parallel, rounds))
        without.append(_slowest_rank_seconds(alone, rounds))
    grid.close()
    links = 4 * ring_allreduce(link, 2, 4 * b * a.block_size * a.d_model)
    return max(0.0, (statistics.median(with_calls) - statistics.median(without) - links) / 4)


def measured_link(n: int, attempts: int = 3) -> AlphaBeta:
    """The link between two ranks that the tensor-parallel allreduce's α-β on ranks 0 and 1
    implies (the others asleep). A fit without a bandwidth (1 MiB took no longer than
    1 KiB: the timing was disturbed, as by a peer descheduled throughout) is measured
    again, up to ``attempts`` times (collective over the world)."""
    for _ in range(attempts):
        grid = Grid(dp=n // 2, tp=2, pp=1)
        models = _asleep_unless(hvd.rank() < 2, lambda g=grid: alpha_beta(g.tp_group))
        grid.close()
        link = link_from_allreduce(hvd.broadcast_object(models, 0)["allreduce"], 2)
        if math.isfinite(link.beta):
            break
    return link


def job_cores() -> int:
    """The cores the job's ranks may run on together: the union of every rank's CPU
    affinity. A rank bound to cores of its own (``mpiexec -bind-to core``, ``srun
    --cpu-bind``) may run on those alone, and counted as the job's they would make its
    ranks seem to share them (collective over the world)."""
    return len(set().union(*MPI.COMM_WORLD.allgather(os.sched_getaffinity(0))))


def calibrate(a: Any, cores: int) -> dict[str, Any]:
    """The planner's inputs measured on this machine (collective over the world)."""
    n = hvd.size()
    model = GPT(layers=a.n_layer, hidden=a.d_model, heads=a.n_head, seq=a.block_size, vocab=256)

    def timed() -> list[tuple[int, int, float]]:
        return [(b, t, block_seconds(a.d_model, a.n_head, a.block_size, b, t)) for b, t in POINTS if a.n_head % t == 0]

    times = hvd.broadcast_object(_asleep_unless(hvd.rank() == 0, timed), 0)
    hbm = hvd.broadcast_object(_asleep_unless(hvd.rank() == 0, lambda: 2 * copy_bandwidth()), 0)  # read and written
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = fit_compute(model, GPU(name="this machine's core", peak=1.0, memory=memory, hbm=hbm, intra="-"), times)
    link = measured_link(n)
    alone = a.chunks * a.n_layer * 3 * layer_pass(model, a.batch_size // a.chunks, 1, gpu, 1.0)  # forward, backward
    step = replica_step(a)
    cl = Cluster(
        gpus=n, gpu=gpu, gpus_per_node=n, intra=link, inter=link, nics_per_node=n, efficiency=1.0, word=4,
        cores_per_node=cores, contention=contention(step, alone, cores),
    )  # fmt: skip
    cl = replace(cl, call_overhead=call_seconds(a, link))
    return {"model": model, "cluster": cl, "block_times": times, "step": step, "alone": alone}


def predict(model: GPT, cl: Cluster, shape: tuple[int, int, int], a: Any) -> dict[str, Any]:
    """The planner's estimate of one grid's step as the benchmark trains it."""
    dp, tp, pp = shape
    lay = Layout(dp=dp, tp=tp, pp=pp, micro_batch=a.batch_size // a.chunks, zero=0, recompute=False, chunks=1)
    e = estimate(model, dp * a.batch_size, lay, cl)
    return {"step_s": e.step_s, "parts": dict(e.time)}


def ranks(values: list[float]) -> list[int]:
    """Each value's rank, 1 for the largest."""
    order = sorted(range(len(values)), key=lambda i: -values[i])
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r + 1
    return out


def report(rows: list[dict[str, Any]], cal: dict[str, Any], command: str, a: Any) -> str:
    cl: Cluster = cal["cluster"]
    tok = [r["tokens_per_s"] for r in rows]
    ptok = [r["tokens_per_s"] * r["step_s"] / r["predicted_step_s"] for r in rows]
    ranks_, pranks = ranks(tok), ranks(ptok)
    lines = [
        f"# {command}",
        f"# gpt: {a.n_layer} blocks, d_model {a.d_model}, {a.n_head} heads, context {a.block_size}; "
        f"{a.batch_size} sequences per replica in {a.chunks} micro-batches, 1f1b, fp32; median of {a.steps} steps",
        f"# measured: compute {cl.gpu.peak / 1e9:.1f} GFLOP/s + {cl.gpu.overhead * 1e6:.0f} us a layer pass, "
        f"memory {cl.gpu.hbm / 1e9:.2f} GB/s; link {cl.intra.alpha * 1e6:.1f} us + {cl.intra.beta / 1e9:.2f} GB/s; "
        f"{cl.gpus} ranks on {cl.cores_per_node} cores, contention {cl.contention:.2f}: share {cl.share():.2f}; "
        f"a call {cl.call_overhead * 1e3:.2f} ms beside its link",
        f"{'grid':<7} {'step ms':>8} {'predicted':>9} {'ratio':>6} {'tokens/s':>9} {'rank':>4} {'predicted':>9} "
        f"{'rank':>4} {'cont.':>5}  predicted parts ms: compute bubble tp pp dp",
    ]
    for r, rk, pt, prk in zip(rows, ranks_, ptok, pranks, strict=True):
        p = r["predicted_parts"]
        lines.append(
            f"{r['grid']:<7} {r['step_s'] * 1e3:>8.1f} {r['predicted_step_s'] * 1e3:>9.1f} "
            f"{r['predicted_step_s'] / r['step_s']:>6.2f} {r['tokens_per_s']:>9.0f} {rk:>4} {pt:>9.0f} {prk:>4} "
            f"{r.get('contention', cl.contention):>5.2f}  "
            + " ".join(f"{p[k] * 1e3:.1f}" for k in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm"))
        )
    lines.append(verdict_line(verdict(rows)))
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The check's outcome: the prediction furthest from its measurement (relative, signed),
    the pairs of grids whose tokens/s the prediction orders the other way round, with how
    far apart they measured, and of those the pairs whose steps' ranges overlap, which the
    measurement does not order (``unordered``)."""
    tok = [r["tokens_per_s"] for r in rows]
    ptok = [r["tokens_per_s"] * r["step_s"] / r["predicted_step_s"] for r in rows]
    swapped = discordant(tok, ptok)
    return {
        "worst": max((r["predicted_step_s"] / r["step_s"] - 1 for r in rows), key=abs),
        "bound": BOUND,
        "swapped": [[rows[i]["grid"], rows[j]["grid"], abs(tok[i] / tok[j] - 1)] for i, j in swapped],
        "unordered": [[rows[i]["grid"], rows[j]["grid"]] for i, j in swapped if _overlap(rows[i], rows[j])],
    }


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two grids' tokens/s over their timed steps (``step_range_s``) overlap."""
    if "step_range_s" not in a or "step_range_s" not in b:
        return False

    def span(r: dict[str, Any]) -> tuple[float, float]:
        tokens = r["tokens_per_s"] * r["step_s"]
        return tokens / r["step_range_s"][1], tokens / r["step_range_s"][0]

    (lo_a, hi_a), (lo_b, hi_b) = span(a), span(b)
    return lo_a <= hi_b and lo_b <= hi_a


def verdict_line(v: dict[str, Any]) -> str:
    """One line of :func:`verdict`'s outcome."""
    unordered = {tuple(p) for p in v.get("unordered", [])}

    def pair(a: str, b: str, gap: float) -> str:
        spread = ", within their steps' spread" if (a, b) in unordered else ""
        return f"{a} and {b} (measured {gap:.1%} apart{spread})"

    agree = "agree" if not v["swapped"] else "differ: " + ", ".join(pair(*s) for s in v["swapped"])
    bound = f"the bound is {v['bound']:.0%}"
    return f"worst prediction {v['worst']:+.1%} of its measurement ({bound}); rankings by tokens/s {agree}"


def discordant(measured: list[float], predicted: list[float]) -> list[tuple[int, int]]:
    """The pairs ``(i, j)`` that ``measured`` and ``predicted`` order differently."""
    n = len(measured)
    return [
        (i, j)
        for i in range(n)
        for j in range(i + 1, n)
        if (measured[i] - measured[j]) * (predicted[i] - predicted[j]) < 0
    ]


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grids", default=None, help=f"comma-separated dp x tp x pp (default by ranks: {GRIDS})")
    p.add_argument("--steps", type=int, default=4, help="timed steps per grid")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per batch")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per replica")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--cores", type=int, default=None, help="cores the ranks share (default: those any rank may run on)")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this file (rank 0)")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    cores = 1 if a.cores is None else a.cores
    p.require_at_least(("--steps", a.steps, 1), ("--chunks", a.chunks, 1), ("--cores", cores, 1))
    if a.batch_size % a.chunks:
        p.error(f"--batch-size {a.batch_size} is not a multiple of --chunks {a.chunks}")
    torch.set_num_threads(1)
    hvd.init()
    n = hvd.size()
    if n % 2 or (a.grids is None and n not in GRIDS):
        p.error(f"run on an even number of ranks; without --grids on one of {sorted(GRIDS)}")
    try:
        shapes = [tuple(int(v) for v in text.lower().split("x")) for text in (a.grids or GRIDS[n]).split(",")]
    except ValueError:
        p.error(f"--grids: {a.grids!r} is not a comma-separated list of dp x tp x pp")
    bad = [s for s in shapes if len(s) != 3 or s[0] * s[1] * s[2] != n or a.n_layer % s[2] or a.n_head % s[1]]
    if bad:
        p.error(f"--grids: {bad} do not have {n} ranks, or do not divide the layers and heads")
    cl_cores = a.cores or job_cores()
    cal = calibrate(a, cl_cores)
    a.schedule = "1f1b"
    train, _ = corpus(a.block_size)
    rows = []
    for shape in shapes:
        before = contention(cal["step"], cal["alone"], cl_cores, 2)
        row = gpt_row(shape, a, train)
        after = contention(cal["step"], cal["alone"], cl_cores, 2)
        cl = replace(cal["cluster"], contention=(before + after) / 2)
        guess = predict(cal["model"], cl, shape, a)
        row.update(predicted_step_s=guess["step_s"], predicted_parts=guess["parts"], contention=cl.contention)
        rows.append(row)
    if hvd.rank() == 0:
        cmd = f"mpiexec -n {n} python -m benchmarks.plan_check " + " ".join(argv)
        print(report(rows, cal, cmd.strip(), a), flush=True)
        if a.json:
            cl = cal["cluster"]
            out = {"calibration": {**asdict(cl), "share": cl.share()}, "block_times": cal["block_times"], "rows": rows}
            out["verdict"] = verdict(rows)
            with open(a.json, "w") as fh:
                dump_json(out, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
