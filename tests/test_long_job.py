"""A long job of independent calls, as Horovod's users run their test suites: scenarios that
raise on every rank by design, interleaved with correct calls whose results are checked,
process-set churn (sets added and removed, and sets left registered) and async handles left
unawaited. After every exception the next collective works; nothing left behind makes a
later call hang or mismatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hpcdl as hvd

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(240), pytest.mark.usefixtures("runtime")]


def _n_r() -> tuple[int, int]:
    return hvd.size(), hvd.rank()


# -- scenarios that raise on every rank --------------------------------------------------------------
def shape_mismatch(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlError, match="shape differs"):
        hvd.allreduce(torch.ones(2 + (r == 1)), name=f"shape.{i}")


def dtype_mismatch(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlError, match="dtype differs"):
        hvd.allreduce(torch.ones(2, dtype=torch.float64 if r == 1 else torch.float32), name=f"dtype.{i}")


def op_mismatch(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlError, match="op differs"):
        hvd.allreduce(torch.ones(2), op=hvd.Max if r == 1 else hvd.Sum, name=f"op.{i}")


def bad_op(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlArgumentError, match="is not one of hpcdl.Average"):
        hvd.allreduce(torch.ones(2), op="max" if r == 1 else hvd.Max, name=f"badop.{i}")


def bad_root(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlArgumentError, match="is not a rank of the process set"):
        hvd.broadcast(torch.ones(2), n + 3, name=f"root.{i}")


def name_in_flight(i):
    # a request stays in flight until every rank has submitted it: each rank asks again for
    # a name some peer submits only after this rank's check (even ranks first, then odd),
    # so the request cannot have finished, however quickly the engine works
    n, r = _n_r()
    if r % 2 == 0:
        h = hvd.allreduce_async(torch.ones(2), name=f"twice.{i}")
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(torch.ones(2), name=f"twice.{i}")
        hvd.allreduce(torch.ones(1), name=f"gate1.{i}")
        hvd.allreduce(torch.ones(1), name=f"gate2.{i}")
        h2 = hvd.allreduce_async(torch.ones(2), name=f"twice2.{i}")
    else:
        hvd.allreduce(torch.ones(1), name=f"gate1.{i}")
        h = hvd.allreduce_async(torch.ones(2), name=f"twice.{i}")
        h2 = hvd.allreduce_async(torch.ones(2), name=f"twice2.{i}")
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(torch.ones(2), name=f"twice2.{i}")
        hvd.allreduce(torch.ones(1), name=f"gate2.{i}")
    assert torch.equal(hvd.synchronize(h), torch.ones(2))  # Average of ones
    assert torch.equal(hvd.synchronize(h2), torch.ones(2))


def splits_do_not_add_up(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlArgumentError, match="non-negative row counts"):
        hvd.alltoall(torch.ones(n), splits=[2] * n if r == 1 else [1] * n, name=f"splits.{i}")


def uneven_without_splits(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlArgumentError, match="do not divide evenly"):
        hvd.alltoall(torch.ones(n + (r == 1)), name=f"even.{i}")


def wrong_device(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlArgumentError, match="hpcdl moves CPU and CUDA tensors only"):
        hvd.allreduce(torch.ones(2, device="meta" if r == 1 else "cpu"), name=f"meta.{i}")


def item_shape_mismatch(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlError, match="shape after the first dimension differs"):
        hvd.allgather(torch.ones(1, 1 + (r == 1)), name=f"item.{i}")


def scalar_reducescatter(i):
    with pytest.raises(hvd.HpcdlArgumentError, match="at least one dimension"):
        hvd.reducescatter(torch.tensor(1.0), name=f"rs0.{i}")


def bool_allreduce(i):
    with pytest.raises(hvd.HpcdlArgumentError, match="does not support dtype bool"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool), name=f"bool.{i}")


def leaf_in_place(i):
    n, r = _n_r()
    t = torch.ones(2, requires_grad=r == 1)
    with pytest.raises(hvd.HpcdlArgumentError, match="leaf tensor that requires grad"):
        hvd.allreduce_(t, name=f"leaf.{i}")


def unregistered_set(i):
    with pytest.raises(hvd.HpcdlError, match="is not registered"):
        hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0]))


def duplicate_names(i):
    m = torch.nn.Linear(2, 2)
    named = list(m.named_parameters())
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=named + named[:1])


def zero_stage(i):
    with pytest.raises(hvd.HpcdlArgumentError, match="stage=3"):
        hvd.ZeroOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), stage=3)


def not_a_tensor(i):
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce([1.0, 2.0])


def unknown_handle(i):
    with pytest.raises(hvd.HpcdlError, match="unknown handle"):
        hvd.synchronize(10**9 + i)


def adasum_on_ints(i):
    with pytest.raises(hvd.HpcdlArgumentError, match="Adasum"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum, name=f"ada.{i}")


def scale_mismatch(i):
    n, r = _n_r()
    with pytest.raises(hvd.HpcdlError, match="prescale_factor differs"):
        hvd.allreduce(torch.ones(2), prescale_factor=2.0 if r == 1 else 1.0, name=f"pre.{i}")


def join_then_allgather(i):
    n, r = _n_r()
    if r == 0:
        hvd.join()
        return
    with pytest.raises(hvd.HpcdlError, match="cannot run while ranks \\[0\\] have joined"):
        hvd.allgather(torch.ones(1), name=f"joined.{i}")
    hvd.join()


ERRORS = [
    shape_mismatch,
    dtype_mismatch,
    op_mismatch,
    bad_op,
    bad_root,
    name_in_flight,
    splits_do_not_add_up,
    uneven_without_splits,
    wrong_device,
    item_shape_mismatch,
    scalar_reducescatter,
    bool_allreduce,
    leaf_in_place,
    unregistered_set,
    duplicate_names,
    zero_stage,
    not_a_tensor,
    unknown_handle,
    adasum_on_ints,
    scale_mismatch,
    join_then_allgather,
]


# -- correct calls, checked ---------------------------------------------------------------------------
def sums(i):
    n, r = _n_r()
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        got = hvd.allreduce(torch.full((5,), r + 1, dtype=dtype), op=hvd.Sum, name=f"sum.{i}.{dtype}")
        assert torch.equal(got, torch.full((5,), n * (n + 1) // 2, dtype=dtype))


def gathers(i):
    n, r = _n_r()
    got = hvd.allgather(torch.full((r + 1, 2), float(r)), name=f"gather.{i}")
    assert torch.equal(got, torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)]))


def broadcasts(i):
    n, r = _n_r()
    root = i % n
    assert torch.equal(hvd.broadcast(torch.full((3,), float(r)), root, name=f"b.{i}"), torch.full((3,), float(root)))


def alltoalls(i):
    n, r = _n_r()
    got, splits = hvd.alltoall(torch.arange(n, dtype=torch.float32) + 10 * r, splits=[1] * n, name=f"a2a.{i}")
    assert torch.equal(got, torch.tensor([10.0 * q + r for q in range(n)])) and splits.tolist() == [1] * n


def reducescatters(i):
    n, r = _n_r()
    got = hvd.reducescatter(torch.ones(2 * n, 3), op=hvd.Sum, name=f"rs.{i}")
    assert torch.equal(got, torch.full((2, 3), float(n)))


def grouped(i):
    n, r = _n_r()
    outs = hvd.grouped_allreduce([torch.full((k + 1,), float(r)) for k in range(3)], op=hvd.Average)
    assert all(torch.allclose(o, torch.full((k + 1,), (n - 1) / 2)) for k, o in enumerate(outs))


def set_churn(i):
    """A set added, used and removed; every third time one is left registered."""
    n, r = _n_r()
    members = list(range(i % 2, n, 2)) or [0]
    ps = hvd.add_process_set(members)
    if r in members:
        got = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps, name=f"set.{i}")
        assert got.item() == len(members)
    if i % 3:
        hvd.remove_process_set(ps)


def unawaited(i):
    """An async allreduce whose handle is never synchronized."""
    hvd.allreduce_async(torch.ones(2), name=f"left.{i}")


def optimizer_steps(i):
    n, r = _n_r()
    torch.manual_seed(i)
    m = torch.nn.Linear(3, 1).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    m(torch.full((1, 3), float(r + 1), dtype=torch.float64)).sum().backward()
    opt.step()
    mean = sum(q + 1.0 for q in range(n)) / n
    assert torch.allclose(m.weight.grad, torch.full((1, 3), mean, dtype=torch.float64))


def objects(i):
    n, r = _n_r()
    assert hvd.broadcast_object({"i": i, "r": r}, root_rank=n - 1) == {"i": i, "r": n - 1}
    assert hvd.allgather_object(r * i) == [q * i for q in range(n)]


CORRECT = [
    sums,
    gathers,
    broadcasts,
    alltoalls,
    reducescatters,
    grouped,
    set_churn,
    unawaited,
    optimizer_steps,
    objects,
]


def still_works(tag: str) -> None:
    n, r = _n_r()
    got = hvd.allreduce(torch.tensor([float(r), 1.0]), op=hvd.Sum, name=f"check.{tag}")
    assert got.tolist() == [n * (n - 1) / 2, float(n)], tag


def test_a_long_job_of_failing_and_correct_calls_keeps_working():
    scenarios = []
    for k in range(max(len(ERRORS), len(CORRECT)) * 2):
        scenarios.append(ERRORS[k % len(ERRORS)])
        scenarios.append(CORRECT[k % len(CORRECT)])
    assert len(scenarios) >= 40
    for i, scenario in enumerate(scenarios):
        scenario(i)
        still_works(f"{i}.{scenario.__name__}")
    # every rank ran every scenario in step: the same count of checks everywhere
    counts = hvd.allgather_object(len(scenarios))
    assert counts == [len(scenarios)] * hvd.size()
    assert np.all(np.array(counts) >= 40)
