"""hpcdl.parallel.Pipeline: a model cut into one stage per rank, GPipe and 1F1B, against the
unpipelined model on the whole batch (float64 gradients to 1e-10) for m in {1, p, 2p + 1}
micro-batches and for batch shapes that change between steps and within one; shapes sent
once per micro-batch, then data alone; activation counts; a failing stage is an error on
every rank; balancing by parameter count and by measured layer time."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import hpcdl as hvd
from hpcdl.parallel import Grid, Pipeline, balance_by_parameters
from hpcdl.parallel.pipeline import balance_by_time
from hpcdl.parallel.pp_comm import ACT, Link

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120), pytest.mark.usefixtures("runtime")]


def layers(depth: int) -> list[nn.Module]:
    torch.manual_seed(5)
    out: list[nn.Module] = []
    for i in range(depth):
        out += [nn.Linear(4 if i == 0 else 6, 6, dtype=torch.float64), nn.Tanh()]
    return [*out, nn.Linear(6, 2, dtype=torch.float64)]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    rel = ((got - want).norm() / max(want.norm().item(), 1e-300)).item()
    assert rel <= 1e-10, rel


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return torch.randn(11, 4, generator=g, dtype=torch.float64), torch.randn(11, 2, generator=g, dtype=torch.float64)


def reference(depth: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[list[torch.Tensor]]]:
    """The unpipelined model's loss on the whole batch and its gradients, layer by layer."""
    model = nn.Sequential(*layers(depth))
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), [[prm.grad for prm in lay.parameters()] for lay in model]


def check_stage(pipe: Pipeline, grid: Grid, want: list[list[torch.Tensor]]) -> None:
    """This stage's gradients are those of its slice of the whole model's layers, in order."""
    lo = sum(pipe.balance[: grid.pp_rank])
    mine = [g for lay in want[lo : lo + pipe.balance[grid.pp_rank]] for g in lay]
    got = [prm.grad for prm in pipe.parameters()]
    assert len(got) == len(mine)
    for a, b in zip(got, mine, strict=True):
        close(a, b)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_gradients_equal_the_whole_batch_for_every_micro_batch_count(schedule):
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    x, y = batch()
    want_loss, want = reference(p + 1, x, y)
    for m in sorted({1, p, 2 * p + 1, 15}):  # 15 > the 11 samples: empty micro-batches add nothing
        pipe = Pipeline(layers(p + 1), chunks=m, schedule=schedule)
        loss = pipe.train_step(x, y, F.mse_loss)
        assert loss == pytest.approx(want_loss, rel=1e-12)
        check_stage(pipe, grid, want)
        stages_left = p - grid.pp_rank
        assert pipe.peak_live == (m if schedule == "gpipe" else min(stages_left, m))
        pipe.close()
        assert pipe._link.comm == MPI.COMM_NULL  # freed
    grid.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_shapes_travel_once_per_micro_batch_and_a_changed_batch_shape_gives_the_whole_batch_gradients(schedule):
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    s = grid.pp_rank
    pipe = Pipeline(layers(p + 1), chunks=3, schedule=schedule)
    link = pipe._link
    streams = (s > 0) + (s < p - 1)  # gradients to the previous stage, activations to the next
    x, y = batch()
    # rows of each step, and how many of its 3 micro-batches differ in size from the last
    # step's: 11 rows are 4 + 4 + 3, 10 are 4 + 3 + 3, 3 are 1 + 1 + 1
    for rows, changed in ((11, 3), (11, 0), (10, 1), (10, 0), (11, 1), (3, 3), (3, 0)):
        pipe.zero_grad()
        headers, messages = link.headers_sent, link.messages_sent
        loss = pipe.train_step(x[:rows], y[:rows], F.mse_loss)
        assert link.messages_sent - messages == 3 * streams
        assert link.headers_sent - headers == changed * streams
        want_loss, want = reference(p + 1, x[:rows], y[:rows])
        assert loss == pytest.approx(want_loss, rel=1e-12)
        check_stage(pipe, grid, want)
    pipe.close()
    grid.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spin", [None, 0, 64])  # MPI's blocking probe; sleeping at once; 64 looks, then sleeping
def test_a_link_sends_a_shape_only_when_it_changes_and_both_ends_forget_shapes_on_abandon(spin):
    rank = MPI.COMM_WORLD.rank
    link = Link(MPI.COMM_WORLD.Dup(), spin)
    g = torch.Generator().manual_seed(3)
    sent = [  # (micro-batch slot, tensor): 10 of the 12 need their shape sent
        (0, torch.randn(2, 3, generator=g)),
        (0, torch.randn(2, 3, generator=g)),  # the same dtype and shape: data alone
        (0, torch.randn(2, 3, generator=g, dtype=torch.float64)),  # another dtype
        (1, torch.randn(2, 3, generator=g)),  # another slot keeps its own shape
        (0, torch.arange(5)),
        (0, torch.tensor(2.5, dtype=torch.bfloat16)),  # no dimension
        (0, torch.empty(0, 4)),  # no element
        (1, torch.randn(2, 3, generator=g)),  # slot 1's shape still holds
        (0, torch.randn(4, 2, generator=g).half()),
        (0, torch.arange(6, dtype=torch.int32).reshape(2, 3)),
        (0, torch.randn(3, 4, generator=g).t()),  # not contiguous
        (0, torch.randn(*[2] * 8, generator=g)),  # eight dimensions
    ]
    if rank == 0:
        for slot, t in sent:
            link.send(t, 1, ACT, slot)
        link.send_error("pipeline stage 0 failed: RuntimeError: boom", 1, ACT)
        link.finish()
        assert (link.headers_sent, link.messages_sent) == (10, 12)
    elif rank == 1:
        for slot, t in sent:
            got = link.recv(0, ACT, slot)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
        with pytest.raises(hvd.PipelineError, match="^pipeline stage 0 failed: RuntimeError: boom$"):
            link.recv(0, ACT, 0)
    first = link.comm
    link.abandon()
    first.Free()
    last = sent[-1][1]
    if rank == 0:  # the receiver forgot the shape too: it travels again
        link.send(last, 1, ACT, 0)
        link.finish()
        assert (link.headers_sent, link.messages_sent) == (11, 13)
    elif rank == 1:
        assert torch.equal(link.recv(0, ACT, 0), last)
    link.comm.Free()


def test_balance_by_parameters_and_bad_arguments():
    lay = [nn.Linear(10, 10), nn.Linear(10, 20), nn.Linear(20, 1), nn.Linear(1, 1)]  # 110, 220, 21, 2
    assert balance_by_parameters(lay, 2) == [1, 3]  # the largest stage: 243 parameters
    assert balance_by_parameters(lay, 3) == [1, 1, 2]  # 220
    with pytest.raises(hvd.HpcdlArgumentError, match="1 layers cannot fill 2 pipeline stages"):
        balance_by_parameters([nn.Identity()], 2)
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    with pytest.raises(hvd.HpcdlArgumentError, match="must give each of the"):
        Pipeline(layers(p + 1), balance=[1] * (p + 1))
    with pytest.raises(hvd.HpcdlArgumentError, match="schedule='zigzag'"):
        Pipeline(layers(p + 1), schedule="zigzag")
    grid.close()


class _Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_failing_stage_is_an_error_on_every_stage_and_the_next_step_works(where, schedule):
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    lay = layers(p + 1)
    bad = list(lay)
    bad.insert(0 if where == "first" else len(bad), _Boom())
    balance = [1] * (p - 1) + [len(bad) - (p - 1)] if where == "last" else [2] + [1] * (p - 2) + [len(bad) - p]
    pipe = Pipeline(bad, chunks=3, schedule=schedule, balance=balance)
    failed = 0 if where == "first" else p - 1
    x, y = batch()
    with pytest.raises(hvd.PipelineError, match=rf"pipeline stage {failed} failed: RuntimeError: boom"):
        pipe.train_step(x, y, F.mse_loss)
    # a pipeline of good layers on the same grid runs afterwards
    good = Pipeline(layers(p + 1), chunks=2, schedule=schedule)
    assert good.train_step(x, y, F.mse_loss) > 0
    grid.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_evaluate_sums_the_metric_over_the_batch_for_every_micro_batch_count(schedule):
    # 13 micro-batches of 11 samples: two of them empty, which add nothing
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    x, y = batch()
    model = nn.Sequential(*layers(p + 1))
    want = F.mse_loss(model(x), y, reduction="sum").item()
    for m in (1, p, 13):
        pipe = Pipeline(layers(p + 1), chunks=m, schedule=schedule)
        got = pipe.evaluate(
            x, y, lambda out, t: torch.stack([F.mse_loss(out, t, reduction="sum"), t.new_tensor(len(t))])
        )
        assert got[0].item() == pytest.approx(want, rel=1e-12) and got[1].item() == len(x)
        pipe.close()
    grid.close()


@pytest.mark.mpi(min_size=2)
def test_arguments_that_differ_between_ranks_are_an_error_on_every_rank_not_a_wait():
    # stages cutting the batch into different numbers of micro-batches would wait for ever
    # for a micro-batch their neighbour never sends
    p, r = hvd.size(), hvd.rank()
    grid = Grid(dp=1, tp=1, pp=p)
    others = ", ".join(f"{k}: 4" for k in range(1, p))
    with pytest.raises(hvd.HpcdlArgumentError, match=rf"^Pipeline: ranks disagree on chunks: \{{0: 3, {others}\}}"):
        Pipeline(layers(p + 1), chunks=3 if r == 0 else 4)
    with pytest.raises(hvd.HpcdlArgumentError, match="ranks disagree on schedule"):
        Pipeline(layers(p + 1), schedule="gpipe" if r == p - 1 else "1f1b")
    with pytest.raises(hvd.HpcdlArgumentError, match="ranks disagree on balance"):
        Pipeline(layers(p + 1), balance="time" if r == 0 else "parameters", sample=batch()[0] if r == 0 else None)
    with pytest.raises(hvd.HpcdlArgumentError, match="ranks disagree on layers: "):
        Pipeline(layers(p + 1 + (r == 1)))
    # models whose layers differ in size are cut differently by their parameter counts
    wide = [nn.Linear(50, 50) if r == 1 and i == 0 else layer for i, layer in enumerate(layers(p + 1))]
    with pytest.raises(hvd.HpcdlArgumentError, match=r"ranks disagree on layers per stage, by parameters \(do"):
        Pipeline(wide)
    # a bad argument on one rank alone: the same error on every rank
    with pytest.raises(hvd.HpcdlArgumentError, match=r"^rank 1: chunks=0 must be a positive integer$"):
        Pipeline(layers(p + 1), chunks=0 if r == 1 else 2)
    with pytest.raises(hvd.HpcdlArgumentError, match=r"^rank 0: balance=\[1, 'x'\] is not one of"):
        Pipeline(layers(p + 1), balance=[1, "x"] if r == 0 else None)
    # a rank with a bad argument sends no values, which might not even pickle
    with pytest.raises(hvd.HpcdlArgumentError, match=r"^rank 1: schedule=<function"):
        Pipeline(layers(p + 1), schedule=(lambda: None) if r == 1 else "1f1b")
    # and the grid still builds pipelines that train right (a balance as a tuple on one rank
    # and a list on the others is the same balance)
    x, y = batch()
    cut = [1] * (p - 1) + [len(layers(p + 1)) - (p - 1)]
    pipe = Pipeline(layers(p + 1), chunks=2, balance=tuple(cut) if r == 0 else np.array(cut) if r == 1 else cut)
    assert pipe.balance == cut and all(type(b) is int for b in pipe.balance)
    want_loss, want = reference(p + 1, x, y)
    assert pipe.train_step(x, y, F.mse_loss) == pytest.approx(want_loss, rel=1e-12)
    check_stage(pipe, grid, want)
    pipe.close()
    grid.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("missing", ["inputs", "targets"])
def test_a_stage_given_no_batch_fails_the_step_on_every_stage_and_the_next_step_works(schedule, missing):
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    pipe = Pipeline(layers(p + 1), chunks=3, schedule=schedule)
    x, y = batch()
    # each rank passes the batch, but the stage that reads the missing part passes None
    reads = grid.is_first_stage if missing == "inputs" else grid.is_last_stage
    given = (None if reads and missing == "inputs" else x, None if reads and missing == "targets" else y)
    where, stage = ("first", 0) if missing == "inputs" else ("last", p - 1)
    text = rf"pipeline stage {stage} failed: TypeError: the {where} stage needs {missing}, a tensor, not NoneType"
    with pytest.raises(hvd.PipelineError, match=text):
        pipe.train_step(*given, F.mse_loss)
    with pytest.raises(hvd.PipelineError, match=text):
        pipe.evaluate(*given, lambda out, t: F.mse_loss(out, t, reduction="sum").reshape(1))
    pipe.zero_grad()
    want_loss, want = reference(p + 1, x, y)
    assert pipe.train_step(x, y, F.mse_loss) == pytest.approx(want_loss, rel=1e-12)
    check_stage(pipe, grid, want)
    pipe.close()
    grid.close()


class _FailOnce(nn.Module):
    """The identity, but its call number ``countdown`` (counted from when it is set) raises."""

    def __init__(self) -> None:
        super().__init__()
        self.countdown = 0

    def forward(self, x):
        self.countdown -= 1
        if self.countdown == 0:
            raise RuntimeError("once")
        return x


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_after_a_failed_step_shapes_travel_again_and_the_same_pipeline_is_right(schedule):
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    s = grid.pp_rank
    flaky = _FailOnce()  # the last layer: on the last stage
    pipe = Pipeline([*layers(p + 1), flaky], chunks=3, schedule=schedule)
    link = pipe._link
    streams = (s > 0) + (s < p - 1)
    x, y = batch()
    pipe.train_step(x, y, F.mse_loss)
    flaky.countdown = 2  # the second micro-batch of the next step fails
    with pytest.raises(hvd.PipelineError, match=rf"pipeline stage {p - 1} failed: RuntimeError: once"):
        pipe.train_step(x[:10], y[:10], F.mse_loss)
    pipe.zero_grad()
    headers = link.headers_sent
    loss = pipe.train_step(x[:10], y[:10], F.mse_loss)
    assert link.headers_sent - headers == 3 * streams  # every shape again
    want_loss, want = reference(p + 1, x[:10], y[:10])
    assert loss == pytest.approx(want_loss, rel=1e-12)
    check_stage(pipe, grid, [*want, []])
    pipe.close()
    grid.close()


def _stack(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(n)])


class _Products(nn.Module):
    """``n`` products with fixed 512 x 512 matrices: the work of ``n`` linears, no parameter."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(n, 512, 512) / 512**0.5)

    def forward(self, x):
        for w in self.w:
            x = x @ w
        return x


def test_balance_by_time_gives_the_slow_layers_stages_of_their_own_on_every_rank():
    torch.manual_seed(4)
    # 2 stacked linears cost some 30 times the 4 ReLUs after them together, and the 32
    # products at the end some 10 times the 2 linears: the best partitions leave the products
    # alone, and the best split of the layers before them leaves the 2 linears alone
    lay = [_stack(2), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU(), _Products(32)]
    x = torch.randn(128, 512)
    got = [balance_by_time(lay, stages, x) for stages in (2, 3)]
    assert got == [[5, 1], [1, 4, 1]]
    assert [balance_by_parameters(lay, stages) for stages in (2, 3)] == [[1, 5], [1, 1, 4]]  # blind to the products
    assert all(other == got for other in hvd.allgather_object(got))
    assert all(prm.grad is None for prm in nn.ModuleList(lay).parameters())  # nothing accumulated
    # buffers and the random number generator's state are restored
    norm, sample, rng = nn.BatchNorm1d(4), torch.randn(8, 4), torch.get_rng_state()
    assert balance_by_time([norm, nn.Dropout(0.5)], 2, sample, repeats=2) == [1, 1]
    assert norm.num_batches_tracked.item() == 0 and norm.running_mean.abs().max().item() == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_balance_by_time_bad_arguments_fail_on_every_rank():
    lay = [nn.Linear(4, 4), nn.ReLU()]
    x = torch.randn(8, 4)
    for args, match in (
        ((lay, 0, x), "stages=0 must be a positive integer"),
        ((lay, 3, x), "2 layers cannot fill 3 pipeline stages"),
        ((lay, 2, x, 0), "repeats=0 must be a positive integer"),
        ((lay, 2, [[1.0] * 4]), "sample must be a tensor .* not list"),
        ((lay, 2, torch.randn(8, 3)), r"the sample could not pass layer 0 \(Linear\): RuntimeError"),
    ):
        with pytest.raises(hvd.HpcdlArgumentError, match=match):
            balance_by_time(*args)
    if hvd.size() > 1:  # one rank's bad sample is every rank's error
        mine = torch.randn(8, 5) if hvd.rank() == 1 else x
        with pytest.raises(hvd.HpcdlArgumentError, match=r"^rank 1: .*could not pass layer 0 "):
            balance_by_time(lay, 2, mine)
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    with pytest.raises(hvd.HpcdlArgumentError, match="balance='time' needs sample="):
        Pipeline(layers(p + 1), balance="time")
    with pytest.raises(hvd.HpcdlArgumentError, match="balance='flops' is not one of"):
        Pipeline(layers(p + 1), balance="flops")
    with pytest.raises(hvd.HpcdlArgumentError, match="sample= is read only with balance='time'"):
        Pipeline(layers(p + 1), sample=x)
    grid.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_balanced_by_time_gives_the_whole_batch_gradients(schedule):
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    x, y = batch()
    pipe = Pipeline(layers(p + 1), chunks=3, schedule=schedule, balance="time", sample=x[:4])
    assert len(pipe.balance) == p and sum(pipe.balance) == len(layers(p + 1))
    assert all(b == pipe.balance for b in hvd.allgather_object(pipe.balance))
    loss = pipe.train_step(x, y, F.mse_loss)
    want_loss, want = reference(p + 1, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    check_stage(pipe, grid, want)
    pipe.close()
    grid.close()


def test_the_timeline_shows_every_micro_batchs_forward_and_backward_on_its_stage(tmp_path):
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    pipe = Pipeline(layers(p + 1), chunks=3)
    x, y = batch()
    pipe.train_step(x, y, F.mse_loss)  # untraced
    path = MPI.COMM_WORLD.bcast(str(tmp_path / "timeline.json"), root=0)
    hvd.start_timeline(path)
    pipe.train_step(x, y, F.mse_loss)
    hvd.stop_timeline()
    seen = None
    if hvd.rank() == 0:
        with open(path) as fh:
            events = json.load(fh)
        events = events["traceEvents"] if isinstance(events, dict) else events
        seen = sorted(
            (e["pid"], e["name"], e["args"]["step"], e["args"]["micro_batch"])
            for e in events
            if e.get("name", "").startswith("PIPELINE_")
        )
    want = sorted((s, f"PIPELINE_{k}", 1, i) for s in range(p) for k in ("FORWARD", "BACKWARD") for i in range(3))
    assert MPI.COMM_WORLD.bcast(seen, root=0) == want
    # the spans the timeline got are the step's own, kept on the stage in the schedule's order
    spans, warm = pipe.spans, min(p - grid.pp_rank - 1, 3)  # 1F1B: warm-up forwards, then one each, then drain
    order = [("F", i) for i in range(warm)] + [x for k in range(3 - warm) for x in (("F", warm + k), ("B", k))]
    assert [(k, i) for k, i, _, _ in spans] == order + [("B", k) for k in range(3 - warm, 3)]
    assert all(a < b for _, _, a, b in spans) and all(b <= a for (*_, b), (_, _, a, _) in itertools.pairwise(spans))
    if hvd.rank() == 0:
        mine = sorted(
            (e["args"]["micro_batch"], e["name"], round(e["ts"]), round(e["dur"]))
            for e in events
            if e.get("pid") == 0 and e.get("name", "").startswith("PIPELINE_")
        )
        kept = sorted((i, "PIPELINE_FORWARD" if k == "F" else "PIPELINE_BACKWARD") for k, i, _, _ in spans)
        assert [m[:2] for m in mine] == kept
        assert sorted(round((b - a) * 1e6) for *_, a, b in spans) == pytest.approx(sorted(m[3] for m in mine), abs=1)
    pipe.close()
    grid.close()


@pytest.mark.mpi(min_size=2)
def test_a_stage_waits_in_mpi_with_a_core_per_rank_and_sleeps_between_looks_where_ranks_outnumber_them(monkeypatch):
    import os

    from collectives.config import Config
    from collectives.context import get_context
    from collectives.node import channel
    from hpcdl.parallel.pipeline import wait_spin

    n, me = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank

    def waits(config: Config) -> int | None:
        comm = MPI.COMM_WORLD.Dup()
        get_context(comm, config)
        try:
            return wait_spin(comm)
        finally:
            comm.Free()

    cores = len(os.sched_getaffinity(0))  # every rank's here: the node's ranks share them
    assert waits(Config()) == (None if n <= cores else channel.POLITE_SPIN)
    # HPCDL_SHM_SPIN: sleep at once; spin throughout; a budget of its own
    assert (waits(Config(shm_spin=0)), waits(Config(shm_spin=10**9)), waits(Config(shm_spin=100))) == (0, None, 100)
    # ranks bound to a core each (srun, mpiexec --bind-to core) may each run on one core
    # only, but have one each: they wait in MPI; bound to one core together, they sleep
    monkeypatch.setattr(channel, "process_cpus", lambda: [me])
    assert waits(Config()) is None
    monkeypatch.setattr(channel, "process_cpus", lambda: [0])
    assert waits(Config()) == channel.POLITE_SPIN
    with pytest.raises(ValueError, match="spin=-1 must be None or >= 0"):
        Link(MPI.COMM_WORLD, -1)


@pytest.mark.mpi(min_size=2)
def test_received_activations_and_gradients_land_on_the_stage_device(monkeypatch):
    """Models the GPU failure "weight is on cuda:0, different from other tensors on cpu"
    (``--tp 2 --pp 2 --device cuda``): bytes travel through host memory, so a received tensor
    must be moved to the receiving stage's device. Here a link receives onto ``meta`` (a device
    other than the CPU that a CPU build has), and every receive of a pipeline step asks for the
    device of the stage's parameters."""
    grid = Grid(dp=1, tp=1, pp=hvd.size())
    comm = MPI.COMM_WORLD.Dup()
    link = Link(comm)
    r = comm.rank
    if r == 0:
        link.send(torch.arange(6, dtype=torch.float64).reshape(2, 3), 1, ACT)
    elif r == 1:
        got = link.recv(0, ACT, device="meta")
        assert got.device.type == "meta" and got.shape == (2, 3) and got.dtype == torch.float64
    link.finish()
    comm.Free()
    asked = []
    recv = Link.recv

    def recording(self, source, stream, slot=0, device=None):  # None: the caller did not say
        asked.append(device if device is None else torch.device(device))
        return recv(self, source, stream, slot, device or "cpu")

    monkeypatch.setattr(Link, "recv", recording)
    pipe = Pipeline(layers(hvd.size()), grid, chunks=3)
    x, y = batch()
    pipe.train_step(x, y, F.mse_loss)
    pipe.evaluate(x, y, lambda o, t: F.mse_loss(o, t, reduction="sum").reshape(1))
    stage_device = next(pipe.stage.parameters()).device
    assert pipe.device == stage_device
    receives = 3 * (grid.pp_rank > 0) * 2 + 3 * (grid.pp_rank < grid.pp - 1)  # activations (train, evaluate), gradients
    assert asked == [stage_device] * receives, asked
    pipe.close()
    grid.close()
