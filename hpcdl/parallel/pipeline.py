"""Pipeline parallelism: a sequence of layers cut into stages, one per rank of the grid's
PP group, trained on micro-batches with the GPipe (Huang et al., 2019) or the 1F1B
(PipeDream-Flush, Narayanan et al., 2021) schedule.

Every micro-batch's loss is weighted by its share of the batch, so the accumulated
gradients equal one backward over the whole batch's mean loss, whatever the number of
micro-batches (the factor other frameworks get wrong). GPipe runs every forward, then every
backward, and keeps all m micro-batches' activations; 1F1B starts backwards as soon as the
last stage can, and keeps at most ``stages - stage`` of them alive. :attr:`Pipeline.peak_live`
reports the count of the last step.

The layers are cut into contiguous stages that minimise the slowest stage: by parameter
count (:func:`balance_by_parameters`, the default), by each layer's measured forward and
backward time (:func:`balance_by_time`, agreed across ranks), or as given.

The schedule is written once, over :class:`~.pp_comm.Link`, which sends each micro-batch's
shape once and then its tensors alone while the shape stays the same. A stage whose layers
raise, or that hears that another did, tells its neighbours; every stage then raises the
same :class:`~hpcdl.errors.PipelineError`, and the pipeline is usable again on the next step.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

from collectives.context import get_context
from collectives.link import emulate_comm
from collectives.node.channel import SPIN

from .. import state
from ..errors import HpcdlArgumentError, PipelineError
from ..functions import check_on_every_rank
from .grid import Grid, current_grid
from .pp_comm import ACT, GRAD, Link

__all__ = ["Pipeline", "balance_by_parameters", "balance_by_time"]

SCHEDULES = ("gpipe", "1f1b")
BALANCES = ("parameters", "time")


def balance_by_parameters(layers: Sequence[nn.Module], stages: int) -> list[int]:
    """Layers per stage, contiguous, that minimise the largest stage's parameter count
    (every stage gets at least one layer)."""
    return _partition([sum(p.numel() for p in layer.parameters()) for layer in layers], stages)


def balance_by_time(layers: Sequence[nn.Module], stages: int, sample: torch.Tensor, repeats: int = 3) -> list[int]:
    """Layers per stage, contiguous, that minimise the largest stage's time.

    ``sample`` runs through the layers one at a time; each layer's forward and backward
    (to its parameters and, after the first layer, to its input) is timed, the best of
    ``repeats`` runs, and the times are split as :func:`balance_by_parameters` splits
    parameter counts. The layers are left as they were: no gradient accumulates in their
    parameters, and their buffers (batch-norm statistics) and the random number
    generators' state are restored.

    While the runtime runs the call is collective over every rank: a layer's time is the
    largest any rank measured, so every rank gets the same list, and a problem on any rank
    (bad arguments, a sample the layers cannot take) is an
    :class:`~hpcdl.errors.HpcdlArgumentError` on every rank.

    Args:
        layers: the whole model as a sequence of modules.
        stages: the number of pipeline stages.
        sample: an input of the first layer; a micro-batch of the training data times the
            layers as the pipeline will run them.
        repeats: runs of each layer; the fastest counts.
    """
    layers = list(layers)
    problem, times = None, None
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        problem = f"balance_by_time: stages={stages!r} must be a positive integer"
    elif len(layers) < stages:
        problem = f"balance_by_time: {len(layers)} layers cannot fill {stages} pipeline stages"
    elif not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        problem = f"balance_by_time: repeats={repeats!r} must be a positive integer"
    elif not isinstance(sample, torch.Tensor):
        problem = f"balance_by_time: sample must be a tensor (an input of the first layer), not {type(sample).__name__}"
    else:
        try:
            times = _layer_times(layers, sample, repeats)
        except _LayerError as exc:
            problem = str(exc)
    rt = state.peek()
    if rt is not None and rt.engine is not None:
        said = check_on_every_rank(problem, HpcdlArgumentError, times)
        counts = [len(t) for t in said]
        if len(set(counts)) > 1:
            raise HpcdlArgumentError(f"balance_by_time: ranks disagree on the number of layers ({counts}, by rank)")
        times = [max(column) for column in zip(*said, strict=True)]
    elif problem is not None:
        raise HpcdlArgumentError(problem)
    return _partition(times, stages)


class _LayerError(Exception):
    """A layer could not take the sample (its message names the layer)."""


def _layer_times(layers: list[nn.Module], sample: torch.Tensor, repeats: int) -> list[float]:
    """Each layer's best forward-and-backward time over ``repeats`` runs, fed the previous
    layer's output (the first, ``sample``)."""
    cuda = sample.is_cuda

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(sample.device)
        return time.perf_counter()

    times: list[float] = []
    x = sample.detach()
    with torch.random.fork_rng(devices=[sample.device] if cuda else []):
        for i, layer in enumerate(layers):
            saved = [(b, b.detach().clone()) for b in layer.buffers()]
            x.requires_grad_(i > 0 and x.is_floating_point())
            wrt = ([x] if x.requires_grad else []) + [p for p in layer.parameters() if p.requires_grad]
            best = float("inf")
            try:
                for _ in range(repeats):
                    start = now()
                    out = layer(x)
                    if not isinstance(out, torch.Tensor):
                        raise TypeError(f"it returned a {type(out).__name__}, not a tensor")
                    if out.requires_grad and wrt:
                        torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
                    best = min(best, now() - start)
            except Exception as exc:  # noqa: BLE001 - reported on every rank as a bad sample
                raise _LayerError(
                    f"balance_by_time: the sample could not pass layer {i} ({type(layer).__name__}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            finally:
                with torch.no_grad():
                    for b, value in saved:
                        b.copy_(value)
            times.append(best)
            x = out.detach()
    return times


def _partition(weights: Sequence[float], stages: int) -> list[int]:
    """Counts of contiguous layers per stage that minimise the largest stage's total
    weight, every stage getting at least one layer (a dynamic programme over the cuts)."""
    n = len(weights)
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise HpcdlArgumentError(f"stages={stages!r} must be a positive integer")
    if n < stages:
        raise HpcdlArgumentError(f"{n} layers cannot fill {stages} pipeline stages")
    prefix = [0.0]
    for x in weights:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[s][i]: the least largest stage when the first i layers fill s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def _layers_per_stage(balance: Any) -> list[int] | None:
    """``balance`` as a list of ints (layers per stage: any iterable of integers, numpy's
    included), or None where it is not one."""
    try:
        return [operator.index(b) for b in balance]
    except TypeError:
        return None


def _argument_problem(chunks: Any, schedule: Any, by: Any, balance: Any, sample: Any) -> str | None:
    """The first of :class:`Pipeline`'s arguments that is wrong on this rank, or None."""
    if schedule not in SCHEDULES:
        return f"schedule={schedule!r} is not one of {SCHEDULES}"
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        return f"chunks={chunks!r} must be a positive integer"
    if (by is not None and by not in BALANCES) or (by is None and _layers_per_stage(balance) is None):
        return f"balance={balance!r} is not one of {BALANCES} or a list of layers per stage"
    if by == "time" and sample is None:
        return "balance='time' needs sample=, an input of the first layer to time the layers on"
    if by != "time" and sample is not None:
        return "sample= is read only with balance='time'"
    return None


def _agree(problem: str | None, values: dict[str, Any]) -> None:
    """Raise :class:`~hpcdl.errors.HpcdlArgumentError` on every rank where any rank found a
    ``problem`` with its arguments, or where the ranks' ``values`` differ (collective over
    every rank, as building a pipeline is): stages built with different micro-batch counts
    or schedules would wait for each other's messages for ever. A rank with a problem sends
    no values (they might not even pickle)."""
    said = check_on_every_rank(problem, HpcdlArgumentError, None if problem else values, name="pipeline.arguments")
    for key in values:
        got = [v[key] for v in said]
        if any(g != got[0] for g in got):
            raise HpcdlArgumentError(f"Pipeline: ranks disagree on {key}: {dict(enumerate(got))} (by rank)")


def one_f_one_b(stages: int, stage: int, chunks: int, ahead: int = 0) -> list[tuple[str, int]]:
    """A stage's 1F1B order: it warms up with ``stages - stage - 1`` forwards
    (PipeDream-Flush's and Megatron-LM's count), then alternates one forward and one
    backward, then drains the remaining backwards.

    Args:
        stages: the pipeline's stages.
        stage: this stage's index, from 0.
        chunks: micro-batches per step.
        ahead: more warm-up forwards on every stage but the last, each keeping one more
            micro-batch's activations alive there (the benchmarks replay a step's spans in
            that order); :class:`Pipeline` runs 0.

    Returns:
        ``("F", i)`` for the forward of micro-batch ``i``, ``("B", i)`` for its backward, in
        the order the stage runs them.
    """
    if ahead < 0:
        raise ValueError(f"one_f_one_b: ahead={ahead} must be >= 0")
    warm = min(stages - stage - 1 + (ahead if stage < stages - 1 else 0), chunks)
    steady = [step for k in range(chunks - warm) for step in (("F", warm + k), ("B", k))]
    return [("F", i) for i in range(warm)] + steady + [("B", k) for k in range(chunks - warm, chunks)]


def wait_spin(comm: MPI.Comm) -> int | None:
    """How a pipeline stage waits for its neighbours (:class:`~.pp_comm.Link`'s ``spin``):
    as the collectives' shared-memory waits on ``comm``'s node do (its channel's ``spin``:
    ``HPCDL_SHM_SPIN``, by default full where the node's ranks have a core each, counted
    over the cores they may run on together). A full budget waits in MPI's blocking calls;
    a smaller one looks that many times, then sleeps between looks (collective over
    ``comm``'s node, where its channel is not made yet)."""
    if comm.Get_size() < 2:
        return None
    spin = get_context(comm).channel().spin
    return None if spin >= SPIN else spin


class Pipeline(nn.Module):
    """This rank's stage of ``layers`` on the grid's pipeline (building it is collective
    over every rank, as the grid is).

    Args:
        layers: the whole model as a sequence of modules (an ``nn.Sequential`` or a list);
            every rank passes the same, and keeps its stage's slice.
        grid: the grid (default: the most recently built).
        chunks: micro-batches per step.
        schedule: ``"1f1b"`` (default) or ``"gpipe"``.
        balance: layers per stage, or how to find them: ``"parameters"`` (the default,
            :func:`balance_by_parameters`) or ``"time"`` (:func:`balance_by_time` over
            ``sample``, every rank agreeing).
        sample: with ``balance="time"``, an input of the first layer (a micro-batch).

    Every rank must pass the same ``chunks``, ``schedule``, ``balance`` and layers. Where
    the first three or the number of layers differ, where a balance by parameters cuts the
    ranks' layers differently, or where any rank's argument is bad, every rank raises
    :class:`~hpcdl.errors.HpcdlArgumentError` (collective over every rank).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        grid: Grid | None = None,
        chunks: int = 1,
        schedule: str = "1f1b",
        balance: Sequence[int] | str | None = None,
        sample: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        grid = grid or current_grid()
        layers = list(layers)
        p = grid.pp
        by = "parameters" if balance is None else balance if isinstance(balance, str) else None
        problem = _argument_problem(chunks, schedule, by, balance, sample)
        given = _layers_per_stage(balance) if by is None else by  # layers per stage, or how to find them
        _agree(problem, {"chunks": chunks, "schedule": schedule, "balance": given, "layers": len(layers)})
        if by == "time":
            balance = balance_by_time(layers, p, sample)  # agreed across the ranks
        elif by == "parameters":
            balance = balance_by_parameters(layers, p)
            _agree(None, {"layers per stage, by parameters (do the models differ?)": balance})
        else:
            balance = given
        if len(balance) != p or any(b < 1 for b in balance) or sum(balance) != len(layers):
            raise HpcdlArgumentError(  # alike on every rank: the ranks agree on the balance and the layers
                f"balance={balance} must give each of the {p} stages at least one of the {len(layers)} layers"
            )
        lo = sum(balance[: grid.pp_rank])
        self.stage = nn.Sequential(*layers[lo : lo + balance[grid.pp_rank]])
        self.grid, self.chunks, self.schedule, self.balance = grid, chunks, schedule, balance
        self.peak_live = 0
        """The most micro-batches whose activations this stage held at once in the last step."""
        self.steps_done = 0
        """Schedules run (training steps and evaluations); the timeline's ``step`` argument.
        Each micro-batch's forward and backward compute is a ``PIPELINE_FORWARD`` or
        ``PIPELINE_BACKWARD`` span on the row ``pipeline stage <s>`` while a timeline is
        written."""
        self.spans: list[tuple[str, int, float, float]] = []
        """This stage's compute in the last training step: ``(phase, micro_batch, start,
        end)`` in the order it ran, ``phase`` ``"F"`` (a forward) or ``"B"`` (a backward, the
        last stage's loss included), times in ``time.perf_counter`` seconds. The pipeline's
        bubble is measured from them (``benchmarks.parallel_gpt``); they reach the timeline
        when the step ends, so writing one adds nothing between the spans."""
        # the pipeline's own communicator: its stages, ranked by stage (collective over the world)
        line = grid.dp_rank * grid.tp + grid.tp_rank
        rt = state.running()
        self._link = Link(emulate_comm(rt.comm.Split(line, grid.pp_rank)), wait_spin(rt.comm))

    def close(self) -> None:
        """Free the pipeline's communicator (collective over its stages). After a failed
        step the communicator that failed is left unfreed: sends to the failed stage may
        never complete."""
        if self._link.comm != MPI.COMM_NULL:
            self._link.comm.Free()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's layers alone (the schedule is :meth:`train_step`)."""
        return self.stage(x)

    @property
    def device(self) -> torch.device:
        """Where this stage computes: the device of its first parameter (or buffer), else the
        CPU. Activations and gradients from the neighbouring stages are received there."""
        for t in (*self.stage.parameters(), *self.stage.buffers()):
            return t.device
        return torch.device("cpu")

    def train_step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> float:
        """Forward and backward of one batch through every stage; the gradients accumulate
        in this stage's parameters as one backward of the batch's mean loss would leave them.

        Args:
            inputs: the batch (read on the first stage; others may pass None).
            targets: its targets (read on the last stage).
            loss_fn: ``loss_fn(outputs, targets)``, a micro-batch's mean loss.

        Returns:
            The batch's mean loss, on every stage.
        """
        g, link, dev = self.grid, self._link, self.device
        s, p = g.pp_rank, g.pp
        xs: Sequence[torch.Tensor | None] = []
        ts: Sequence[torch.Tensor | None] = []
        total = 0
        kept: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses: list[float] = []
        live = peak = 0
        spans = self.spans = []

        def fwd(i: int) -> None:
            nonlocal live, peak
            x = xs[i] if g.is_first_stage else link.recv(s - 1, ACT, i, dev).requires_grad_()
            t0 = time.perf_counter()
            out = self.stage(x)
            spans.append(("F", i, t0, time.perf_counter()))
            if not g.is_last_stage:
                link.send(out, s + 1, ACT, i)
            kept[i] = (None if g.is_first_stage else x, out)
            live += 1
            peak = max(peak, live)

        def bwd(i: int) -> None:
            nonlocal live
            x, out = kept.pop(i)
            if g.is_last_stage:
                t0 = time.perf_counter()
                if len(ts[i]):
                    loss = loss_fn(out, ts[i])
                    losses.append(float(loss.detach()) * len(ts[i]) / total)
                    (loss * (len(ts[i]) / total)).backward()
                else:  # more chunks than samples: an empty micro-batch adds nothing (a mean of none is NaN)
                    (out.sum() * 0.0).backward()
            else:
                grad = link.recv(s + 1, GRAD, i, dev)
                t0 = time.perf_counter()
                out.backward(grad)
            spans.append(("B", i, t0, time.perf_counter()))
            if x is not None:
                link.send(x.grad, s - 1, GRAD, i)
            live -= 1

        problem = None
        try:
            xs, ts = self._split(inputs, targets)
            total = sum(len(t) for t in ts if t is not None)
            for forward, i in self._order():
                (fwd if forward else bwd)(i)
        except PipelineError as exc:  # a neighbour passed on another stage's failure
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - this stage's layers failed: every stage must hear it
            problem = f"pipeline stage {s} failed: {type(exc).__name__}: {exc}"
        if problem is not None:
            for peer, tag in ((s - 1, GRAD), (s + 1, ACT)):
                if 0 <= peer < p:
                    link.send_error(problem, peer, tag)
        self.peak_live = peak
        self._record(spans)
        return self._conclude(problem, sum(losses))

    def _split(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None
    ) -> tuple[Sequence[torch.Tensor | None], Sequence[torch.Tensor | None]]:
        """The batch's micro-batches on this stage: ``inputs`` cut on the first stage,
        ``targets`` on the last, None elsewhere. Run inside a schedule, so that a stage
        given no tensor fails the step on every stage instead of leaving them waiting."""
        g, m = self.grid, self.chunks
        for needed, value, name, where in (
            (g.is_first_stage, inputs, "inputs", "first"),
            (g.is_last_stage, targets, "targets", "last"),
        ):
            if needed and not isinstance(value, torch.Tensor):
                raise TypeError(f"the {where} stage needs {name}, a tensor, not {type(value).__name__}")
        xs = torch.tensor_split(inputs, m) if g.is_first_stage else [None] * m
        ts = torch.tensor_split(targets, m) if g.is_last_stage else [None] * m
        return xs, ts

    def _order(self) -> list[tuple[bool, int]]:
        """This stage's steps of a batch in order: ``(True, i)`` the forward of micro-batch
        ``i``, ``(False, i)`` its backward. GPipe runs every forward, then every backward;
        1F1B as :func:`one_f_one_b`."""
        m = self.chunks
        if self.schedule == "gpipe":
            return [(True, i) for i in range(m)] + [(False, i) for i in range(m)]
        return [(kind == "F", i) for kind, i in one_f_one_b(self.grid.pp, self.grid.pp_rank, m)]

    def _conclude(self, problem: str | None, value: Any) -> Any:
        """End a schedule on every stage: the last stage's ``value``, or the first failure
        as a :class:`PipelineError` on every stage."""
        self.steps_done += 1
        try:
            said = check_on_every_rank(problem, PipelineError, value, process_set=self.grid.pp_group)
        except PipelineError:  # sends to a failed stage may never be matched: leave them behind
            self._link.abandon()
            raise
        self._link.finish()  # every stage ran its whole schedule: every send is matched
        return said[-1]

    def _record(self, spans: list[tuple[str, int, float, float]]) -> None:
        """This step's compute spans on the timeline, when one is written."""
        engine = state.running().engine
        if engine is None:
            return
        for phase, micro_batch, start, end in spans:
            engine.record(
                f"pipeline stage {self.grid.pp_rank}",
                "PIPELINE_FORWARD" if phase == "F" else "PIPELINE_BACKWARD",
                start,
                end,
                step=self.steps_done,
                micro_batch=micro_batch,
            )

    @torch.no_grad()
    def evaluate(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        metric_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Forward of one batch through every stage, without gradients, in ``chunks``
        micro-batches; returns the sum over the micro-batches of ``metric_fn(outputs,
        targets)`` (a tensor of sums, e.g. the summed loss and the count), computed on the
        last stage and returned on every stage."""
        g, link, dev = self.grid, self._link, self.device
        s, m = g.pp_rank, self.chunks
        total: torch.Tensor | None = None
        problem = None
        try:
            xs, ts = self._split(inputs, targets)
            for i in range(m):
                x = xs[i] if g.is_first_stage else link.recv(s - 1, ACT, i, dev)
                out = self.stage(x)
                if not g.is_last_stage:
                    link.send(out, s + 1, ACT, i)
                elif len(ts[i]):  # an empty micro-batch (more chunks than samples) adds nothing
                    value = metric_fn(out, ts[i]).detach()
                    total = value if total is None else total + value
        except PipelineError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - every stage must hear of it
            problem = f"pipeline stage {s} failed: {type(exc).__name__}: {exc}"
        if problem is not None and s + 1 < g.pp:
            link.send_error(problem, s + 1, ACT)
        return self._conclude(problem, total)
