"""hpcdl.parallel.Pipeline: a model cut into one stage per rank, GPipe and 1F1B, against the
unpipelined model on the whole batch (float64 gradients to 1e-10) for m in {1, p, 2p + 1}
micro-batches; activation counts; a failing stage is an error on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import hpcdl as hvd
from hpcdl.parallel import Grid, Pipeline, balance_by_parameters

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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_gradients_equal_the_whole_batch_for_every_micro_batch_count(schedule):
    p = hvd.size()
    grid = Grid(dp=1, tp=1, pp=p)
    x, y = batch()
    reference = nn.Sequential(*layers(p + 1))
    want_loss = F.mse_loss(reference(x), y)
    want_loss.backward()
    want = [prm.grad for prm in reference.parameters()]
    for m in sorted({1, p, 2 * p + 1}):
        pipe = Pipeline(layers(p + 1), chunks=m, schedule=schedule)
        loss = pipe.train_step(x, y, F.mse_loss)
        assert loss == pytest.approx(want_loss.item(), rel=1e-12)
        # this stage's parameters are a slice of the whole model's, in order
        lo = sum(pipe.balance[: grid.pp_rank])
        whole = [list(lay.parameters()) for lay in layers(p + 1)]
        mine = [i for i, lay in enumerate(whole) if lo <= i < lo + pipe.balance[grid.pp_rank] for _ in lay]
        offsets = [sum(len(w) for w in whole[:i]) for i in range(len(whole))]
        flat_want = [want[offsets[i] + k] for i in sorted(set(mine)) for k in range(len(whole[i]))]
        got = [prm.grad for prm in pipe.parameters()]
        assert len(got) == len(flat_want)
        for a, b in zip(got, flat_want, strict=True):
            close(a, b)
        stages_left = p - grid.pp_rank
        assert pipe.peak_live == (m if schedule == "gpipe" else min(stages_left, m))
        pipe.close()
        assert pipe._link.comm == MPI.COMM_NULL  # freed
    grid.close()


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
