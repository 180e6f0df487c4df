"""hpcdl's torch collectives under mpiexec -n 1..4: every form against a local expectation,
autograd against the analytic gradient, process sets, join, the helpers, SyncBatchNorm.

Every rank builds every rank's input from a shared seed, so each expectation is computed
locally with plain torch, another way than the collective under test.
"""

from __future__ import annotations

import json

import pytest
import torch
from mpi4py import MPI
from tensors import FLOATS, INTS, autograd_through_allreduce_and_allgather, close, data, everyone, expected_reduce

import hpcdl as hvd

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.timeout(120), pytest.mark.usefixtures("runtime")]

WORLD = MPI.COMM_WORLD


# -- allreduce ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product], ids=lambda o: o.name)
def test_allreduce_every_op_and_dtype(dtype, op):
    xs = everyone((3, 5), dtype)
    me = xs[hvd.rank()].clone()
    want = expected_reduce(xs, op)
    close(hvd.allreduce(me, op=op, name=f"ar.{dtype}.{op.name}"), want)
    assert torch.equal(me, xs[hvd.rank()])  # out of place: input untouched


def test_allreduce_four_forms_and_scale_factors():
    r = hvd.rank()
    xs = everyone((4, 3), torch.float64, seed=1)
    want = expected_reduce(xs, hvd.Sum)
    close(hvd.allreduce(xs[r], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), want * 1.5)
    close(hvd.allreduce(xs[r], average=False), want)  # Horovod's deprecated argument
    t = xs[r].clone()
    assert hvd.allreduce_(t, op=hvd.Sum) is t
    close(t, want)
    h = hvd.allreduce_async(xs[r], op=hvd.Average, name="async")
    close(hvd.synchronize(h), want / hvd.size())
    t = xs[r].clone()
    h = hvd.allreduce_async_(t, op=hvd.Max)
    while not hvd.poll(h):
        pass
    assert hvd.synchronize(h) is t
    close(t, expected_reduce(xs, hvd.Max))
    with pytest.raises(hvd.HpcdlError, match="unknown handle"):
        hvd.synchronize(h)


def test_allreduce_non_contiguous_in_place():
    r = hvd.rank()
    base = everyone((6, 4), torch.float32, seed=2)
    t = base[r].clone().t()  # a transposed view: not contiguous
    assert not t.is_contiguous()
    # a new tensor: reduced in the contiguous copy, the input untouched
    out = hvd.allreduce(t, op=hvd.Sum)
    close(out, expected_reduce(base, hvd.Sum).t())
    assert torch.equal(t, base[r].t())
    b = hvd.broadcast(t, root_rank=0)
    assert torch.equal(b, base[0].t()) and torch.equal(t, base[r].t())
    hvd.allreduce_(t, op=hvd.Sum)
    close(t, expected_reduce(base, hvd.Sum).t())
    hvd.broadcast_(t, root_rank=0)
    close(t, expected_reduce(base, hvd.Sum).t())


def test_many_small_tensors_fuse_and_stay_correct():
    # submitted together before any synchronize: the engine packs them into one buffer
    r = hvd.rank()
    shapes = [(k + 1,) for k in range(40)] + [(3, 7), (0,), (1,)]
    xs = [everyone(s, torch.float32, seed=10 + i) for i, s in enumerate(shapes)]
    handles = [hvd.allreduce_async(x[r], op=hvd.Sum, name=f"fuse.{i}") for i, x in enumerate(xs)]
    for h, x in zip(handles, xs, strict=True):
        close(hvd.synchronize(h), expected_reduce(x, hvd.Sum))
    outs = hvd.grouped_allreduce([x[r] for x in xs], op=hvd.Average, name="grouped")
    for o, x in zip(outs, xs, strict=True):
        close(o, expected_reduce(x, hvd.Average))
    ts = [x[r].clone() for x in xs[:5]]
    assert hvd.grouped_allreduce_(ts, op=hvd.Sum) == ts
    for t, x in zip(ts, xs[:5], strict=True):
        close(t, expected_reduce(x, hvd.Sum))


def test_large_tensors_among_small_ones_are_reduced_in_place_unfused(tmp_path):
    # tensors of 1 MiB or more skip the fusion buffer; the small ones around them still fuse
    r = hvd.rank()
    # 1.2 MB, exactly 1 MiB and 4 MiB of float32 (at 3-4 ranks, 4 MiB goes to MPI, which
    # refuses aliased buffers: the in-place views must reach it as MPI_IN_PLACE)
    shapes = [(3,), (300_000,), (5,), (262_144,), (7,), (0,), (1_048_576,)]
    xs = [everyone(s, torch.float32, seed=40 + i) for i, s in enumerate(shapes)]
    path = hvd.broadcast_object(str(tmp_path / "tl.json"), root_rank=0)
    hvd.start_timeline(path)
    ts = [x[r].clone() for x in xs]
    outs = hvd.grouped_allreduce_(ts, op=hvd.Average, name="mixed")
    hvd.stop_timeline()
    for o, x in zip(outs, xs, strict=True):
        close(o, expected_reduce(x, hvd.Average))
    if r == 0:
        events = json.load(open(path))["traceEvents"]
        runs = [e for e in events if e["name"] == "ALLREDUCE" and e["pid"] == 0]
        sizes = sorted(e["args"]["bytes"] for e in runs if "fused" not in e["args"])
        assert sizes == [4 * 262_144, 4 * 300_000, 4 * 1_048_576]  # each large tensor on its own
        assert {e["args"]["fused"] for e in runs if "fused" in e["args"]} == {4}  # the four small ones together


def test_steady_state_uses_the_response_cache():
    r = hvd.rank()
    engine = hvd.state.current().engine
    xs = everyone((8,), torch.float32, seed=3)
    for _ in range(5):
        close(hvd.allreduce(xs[r], name="cached", op=hvd.Sum), expected_reduce(xs, hvd.Sum))
    descs = [d for d in engine.controller.cache if d[0] == "cached"]
    assert len(descs) == 1  # one signature, remembered after the first negotiation


def test_compression_fp16_and_bf16_stay_within_their_precision():
    r = hvd.rank()
    xs = [torch.randn(100, dtype=torch.float32, generator=torch.Generator().manual_seed(q)) for q in range(hvd.size())]
    want = torch.stack(xs).mean(0)
    for comp, tol in ((hvd.Compression.fp16, 2e-3), (hvd.Compression.bf16, 2e-2)):
        out = hvd.allreduce(xs[r], compression=comp)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    assert hvd.Compression.none.compress(xs[r])[0] is xs[r]


# -- allgather, broadcast, alltoall, reducescatter ----------------------------------------------
@pytest.mark.parametrize("dtype", [*FLOATS, *INTS, torch.bool], ids=str)
def test_allgather_uneven_rows(dtype):
    n, r = hvd.size(), hvd.rank()
    xs = [data(q, (q + 1, 2), dtype if dtype != torch.bool else torch.int8, seed=4) for q in range(n)]
    if dtype == torch.bool:
        xs = [x > 0 for x in xs]
    out = hvd.allgather(xs[r])
    assert torch.equal(out, torch.cat(xs))
    h = hvd.allgather_async(xs[r][:0] if r == 0 else xs[r])
    assert torch.equal(hvd.synchronize(h), torch.cat([xs[q] for q in range(1, n)] or [xs[0][:0]]))
    outs = hvd.grouped_allgather([xs[r], xs[r] * 1 if dtype != torch.bool else xs[r]])
    assert all(torch.equal(o, torch.cat(xs)) for o in outs)


@pytest.mark.parametrize("dtype", [*FLOATS, *INTS, torch.bool], ids=str)
def test_broadcast_forms(dtype):
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    xs = everyone((2, 3), dtype if dtype != torch.bool else torch.int8, seed=5)
    if dtype == torch.bool:
        xs = [x > 0 for x in xs]
    assert torch.equal(hvd.broadcast(xs[r], root), xs[root])
    t = xs[r].clone()
    assert hvd.broadcast_(t, 0) is t and torch.equal(t, xs[0])
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(xs[r], root)), xs[root])
    t = xs[r].clone()
    hvd.synchronize(hvd.broadcast_async_(t, root))
    assert torch.equal(t, xs[root])


@pytest.mark.parametrize("dtype", [*FLOATS, *INTS, torch.bool], ids=str)
def test_alltoall_every_dtype(dtype):
    n, r = hvd.size(), hvd.rank()
    xs = everyone((2 * n, 3), dtype if dtype != torch.bool else torch.int8, seed=9)
    if dtype == torch.bool:
        xs = [x > 0 for x in xs]
    want = torch.cat([xs[q][2 * r : 2 * r + 2] for q in range(n)])
    assert torch.equal(hvd.alltoall(xs[r]), want)
    sp = [1 + (j == r) for j in range(n)]  # uneven: two rows to itself, one to the others
    x = xs[r][: n + 1]
    out, received = hvd.alltoall(x, splits=sp)
    assert received.tolist() == [1 + (q == r) for q in range(n)]
    starts = [sum(1 + (j == q) for j in range(r)) for q in range(n)]
    assert torch.equal(out, torch.cat([xs[q][starts[q] : starts[q] + 1 + (q == r)] for q in range(n)]))


def test_alltoall_with_and_without_splits():
    n, r = hvd.size(), hvd.rank()

    # rank q sends (q + j) % 3 rows to rank j, each row tagged with (sender, receiver)
    def rows(q):
        sp = [(q + j) % 3 for j in range(n)]
        t = torch.cat([torch.tensor([[q, j]] * s, dtype=torch.float32).reshape(s, 2) for j, s in enumerate(sp)])
        return t, sp

    t, sp = rows(r)
    out, received = hvd.alltoall(t, splits=sp)
    assert received.tolist() == [(q + r) % 3 for q in range(n)]
    assert torch.equal(out, torch.cat([rows(q)[0][rows(q)[0][:, 1] == r] for q in range(n)]))
    even = torch.arange(2 * n, dtype=torch.int32) + 100 * r
    got = hvd.alltoall(even)
    assert got.tolist() == [100 * q + 2 * r + k for q in range(n) for k in range(2)]
    out2, rec2 = hvd.synchronize(hvd.alltoall_async(t, splits=torch.tensor(sp)))
    assert torch.equal(out2, out) and torch.equal(rec2, received)


@pytest.mark.parametrize("rows", [4, 7])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max], ids=lambda o: o.name)
def test_reducescatter_even_and_uneven_rows(rows, op):
    n, r = hvd.size(), hvd.rank()
    xs = everyone((rows, 3), torch.float64, seed=6)
    full = expected_reduce(xs, op)
    counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
    start = sum(counts[:r])
    mine = full[start : start + counts[r]]
    close(hvd.reducescatter(xs[r], op=op), mine)
    close(hvd.synchronize(hvd.reducescatter_async(xs[r], op=op)), mine)
    outs = hvd.grouped_reducescatter([xs[r], xs[r] * 2], op=op)
    close(outs[0], mine)
    close(outs[1], mine * 2)
    outs = hvd.synchronize(hvd.grouped_reducescatter_async([xs[r]], op=op))
    close(outs[0], mine)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_reducescatter_every_dtype(dtype):
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    xs = everyone((rows, 2), dtype, seed=11)
    for op in (hvd.Sum, hvd.Average):
        full = expected_reduce(xs, op)
        counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
        start = sum(counts[:r])
        close(hvd.reducescatter(xs[r], op=op), full[start : start + counts[r]])
    even = [x[: 2 * n] for x in xs]
    close(hvd.reducescatter(even[r], op=hvd.Sum), expected_reduce(even, hvd.Sum)[2 * r : 2 * r + 2])


def test_barrier_and_one_rank_results():
    hvd.barrier()
    t = torch.arange(3.0)
    if hvd.size() == 1:
        assert torch.equal(hvd.allreduce(t), t)
        assert torch.equal(hvd.allgather(t), t)


# -- autograd -------------------------------------------------------------------------------------
def test_allreduce_gradients_match_the_analytic_ones():
    n, r = hvd.size(), hvd.rank()
    xs = [torch.tensor([1.0 + q, -2.0 * q, 0.5 + 0.25 * q], dtype=torch.float64) for q in range(n)]
    w = [torch.tensor([1.0, 2.0 + q, -1.0], dtype=torch.float64) for q in range(n)]  # loss_q = <w_q, y>
    wsum = sum(w)
    for op, grad in (
        (hvd.Sum, lambda x: wsum),
        (hvd.Average, lambda x: wsum / n),
        (hvd.Max, lambda x: wsum * (x == torch.stack(xs).max(0).values)),
        (hvd.Min, lambda x: wsum * (x == torch.stack(xs).min(0).values)),
        (
            hvd.Product,
            lambda x: (
                wsum * torch.stack([xs[q] for q in range(n) if q != r] or [torch.ones(3, dtype=torch.float64)]).prod(0)
            ),
        ),
    ):
        x = xs[r].clone().requires_grad_()
        y = hvd.allreduce(x, op=op, prescale_factor=1.0)
        (y * w[r]).sum().backward()
        close(x.grad, grad(xs[r]).to(torch.float64))
    x = xs[r].clone().requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5) * w[r]).sum().backward()
    close(x.grad, wsum)
    # scale factors with Max and Product: y = 0.5 * op(3 x_q)
    x = xs[r].clone().requires_grad_()
    (hvd.allreduce(x, op=hvd.Max, prescale_factor=3.0, postscale_factor=0.5) * w[r]).sum().backward()
    close(x.grad, wsum * 1.5 * (xs[r] == torch.stack(xs).max(0).values))
    x = xs[r].clone().requires_grad_()
    y = hvd.allreduce(x, op=hvd.Product, prescale_factor=3.0, postscale_factor=0.5)
    close(y.detach(), 0.5 * torch.stack([3 * q for q in xs]).prod(0))
    (y * w[r]).sum().backward()
    others = [3 * xs[q] for q in range(n) if q != r] or [torch.ones(3, dtype=torch.float64)]
    close(x.grad, wsum * 1.5 * torch.stack(others).prod(0))
    xs2 = [x.clone().requires_grad_() for x in (xs[r], xs[r] * 2)]
    ys = hvd.grouped_allreduce(xs2, op=hvd.Sum)
    sum((y * w[r]).sum() for y in ys).backward()
    for x in xs2:
        close(x.grad, wsum)


def test_scale_factors_on_integer_tensors_scale_and_truncate_as_horovod_does():
    n, r = hvd.size(), hvd.rank()
    x = torch.full((4,), 5 + r, dtype=torch.int32)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.5, name="int-scaled")
    pre = sum(int((5 + q) * 0.5) for q in range(n))  # each rank's 0.5 x, truncated toward zero
    assert got.dtype == torch.int32 and torch.equal(got, torch.full((4,), int(pre * 1.5), dtype=torch.int32))
    y = torch.full((2 * n,), -7, dtype=torch.int64)
    got = hvd.reducescatter(y, op=hvd.Sum, prescale_factor=0.5, name="int-rs")
    assert torch.equal(got, torch.full((2,), -3 * n, dtype=torch.int64))  # trunc(-3.5) = -3
    fused = hvd.grouped_allreduce([torch.full((3,), 3, dtype=torch.int16)] * 2, op=hvd.Sum, postscale_factor=0.5)
    assert all(torch.equal(t, torch.full((3,), int(3 * n * 0.5), dtype=torch.int16)) for t in fused)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_scale_factors_on_16_bit_floats_scale_in_float32_as_horovod_does(dtype):
    """Horovod scales a 16-bit float tensor in float32 (the factor rounded to float32) and
    rounds once into the dtype, before and after the reduction, which sums in the dtype in
    rank order: its tests compare the results exactly."""
    n, r = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(31)
    xs = [torch.rand(64, generator=g).mul(30).to(dtype) for _ in range(n)]
    pre, post = torch.rand(2, generator=g, dtype=torch.float64).tolist()

    def scaled(t, f):
        return (t.float() * torch.tensor(f, dtype=torch.float32)).to(dtype)

    def rank_order_sum(ts):
        acc = ts[0].clone()
        for t in ts[1:]:
            acc += t  # one rounding into the dtype per addition
        return acc

    want = scaled(rank_order_sum([scaled(x, pre) for x in xs]), post)
    for name in ("alone", "fused"):  # a tensor reduced alone, and one packed with another
        if name == "alone":
            got = hvd.allreduce(xs[r], op=hvd.Sum, prescale_factor=pre, postscale_factor=post, name=f"scaled.{dtype}")
        else:
            got = hvd.grouped_allreduce(
                [xs[r], xs[r][:3].clone()], op=hvd.Sum, prescale_factor=pre, postscale_factor=post
            )[0]
        assert torch.equal(got, want), (name, (got.float() - want.float()).abs().max())
    k = 64 // n * n
    got = hvd.reducescatter(xs[r][:k], op=hvd.Sum, prescale_factor=pre, postscale_factor=post)
    per = k // n
    assert torch.equal(got, want[:k][r * per : (r + 1) * per])


def test_autograd_through_allreduce_and_allgather_on_the_cpu():
    autograd_through_allreduce_and_allgather(torch.device("cpu"))  # test_device_cuda runs the same on a GPU


def test_allgather_broadcast_alltoall_reducescatter_gradients():
    n, r = hvd.size(), hvd.rank()
    # Horovod's conventions: allgather's and broadcast's gradients average the output
    # gradients over the ranks (the analytic gradients sum them); reducescatter's is the
    # allgather of the output gradients, times the set's size for Sum
    # allgather: y = cat(x_q); loss_q = <W_q, y>: dL/dx_r = mean_q W_q[rows of r]
    rows = [q + 1 for q in range(n)]
    total = sum(rows)
    wts = [torch.arange(total * 2, dtype=torch.float64).reshape(total, 2) * (q + 1) for q in range(n)]
    x = torch.ones(rows[r], 2, dtype=torch.float64, requires_grad=True)
    (hvd.allgather(x) * wts[r]).sum().backward()
    start = sum(rows[:r])
    close(x.grad, (sum(wts) / n)[start : start + rows[r]])
    xg = [torch.ones(rows[r], 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    sum((y * wts[r]).sum() for y in hvd.grouped_allgather(xg)).backward()
    close(xg[1].grad, (sum(wts) / n)[start : start + rows[r]])
    # broadcast: y = x_root everywhere: the root's gradient is mean_q W_q, the others' zero
    root = n - 1
    vts = [torch.tensor([1.0, q + 2.0], dtype=torch.float64) for q in range(n)]
    x = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    (hvd.broadcast(x, root) * vts[r]).sum().backward()
    close(x.grad, sum(vts) / n if r == root else torch.zeros(2, dtype=torch.float64))
    # alltoall: the gradient of what this rank sent is what its receivers' losses say
    sp = [1] * n
    x = (torch.arange(n, dtype=torch.float64) + 10 * r).requires_grad_()
    out, _ = hvd.alltoall(x, splits=sp)
    (out * (torch.arange(n, dtype=torch.float64) + 1 + r)).sum().backward()
    # element j of rank r's input went to rank j, as its row r: weight r + 1 + j
    close(x.grad, torch.tensor([r + 1.0 + j for j in range(n)], dtype=torch.float64))
    # reducescatter(Sum) of (2n, 2): rank i gets rows [2i, 2i+2) summed; loss_i = <U_i, y_i>
    uts = [torch.full((2, 2), q + 1.0, dtype=torch.float64) for q in range(n)]
    x = torch.zeros(2 * n, 2, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum) * uts[r]).sum().backward()
    close(x.grad, torch.cat(uts) * n)
    x = torch.zeros(2 * n, 2, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Average) * uts[r]).sum().backward()
    close(x.grad, torch.cat(uts))
    x = torch.zeros(2 * n, 2, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0) * uts[r]).sum().backward()
    close(x.grad, torch.cat(uts) * n * 1.5)


# -- helpers --------------------------------------------------------------------------------------
class _Counting(torch.optim.Optimizer):
    """An optimizer whose state holds a tensor, a Python number, a string and a list."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["count"] = st.get("count", 0) + 1
                st["tag"] = f"seen-{st['count']}"
                st["history"] = [*st.get("history", []), float(p.grad.sum())]
                st["buf"] = st.get("buf", torch.zeros_like(p)) + p.grad
                p.add_(st["buf"], alpha=-g["lr"])


@pytest.mark.parametrize("root", [0, -1], ids=["root-0", "last-root"])
def test_broadcast_optimizer_state_with_missing_and_non_tensor_state(root):
    """The root's state becomes every rank's: parameters without a gradient (so without
    state) on some ranks, ranks that never stepped, and state entries that are numbers,
    strings and lists."""
    n, r = hvd.size(), hvd.rank()
    root = root % n
    torch.manual_seed(7)
    used, frozen = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    frozen.requires_grad_(False)  # never has a gradient, never gets state
    opt = _Counting(list(used.parameters()) + list(frozen.parameters()), lr=0.05 * (r + 1))
    for _ in range(r % 3):  # rank r steps r % 3 times: some ranks have no state at all
        opt.zero_grad()
        used(torch.full((1, 3), float(r + 1))).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    mine = opt.state_dict()
    every = hvd.allgather_object(mine)
    want = every[root]
    for sd in every:
        assert sd["param_groups"] == want["param_groups"]
        assert sorted(sd["state"]) == sorted(want["state"])
        for k, st in sd["state"].items():
            assert st.keys() == want["state"][k].keys()
            for key, v in st.items():
                w = want["state"][k][key]
                assert torch.equal(v, w) if torch.is_tensor(v) else v == w
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * (root + 1))


def test_broadcast_optimizer_state_of_a_new_optimizer_initializes_it_as_horovod_does():
    """Horovod's test_broadcast_state_no_grad: before the first step the state is made by one
    local step on zero gradients, so every parameter that requires grad has a gradient
    (zeros, alike on every rank) and state; a frozen parameter has neither."""

    class NoGrad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.b = torch.nn.Parameter(torch.rand(4, generator=torch.Generator().manual_seed(hvd.rank())))

    model = NoGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    a, b = opt.param_groups[0]["params"]
    assert a.grad is None and a not in opt.state
    assert b.grad is not None and torch.equal(b.grad, torch.zeros(4)) and "momentum_buffer" in opt.state[b]
    assert torch.equal(hvd.broadcast(b.grad, root_rank=0), b.grad)
    every = hvd.allgather_object(b.detach().clone())
    assert all(torch.equal(w, every[0]) for w in every)  # the initializing step is the same everywhere


def test_broadcast_parameters_optimizer_state_and_objects():
    r = hvd.rank()
    torch.manual_seed(100 + r)  # different weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    flat = torch.cat([v.double().reshape(-1) for v in model.state_dict().values()])
    states = torch.cat([s["momentum_buffer"].reshape(-1) for s in opt.state.values()])
    every = hvd.allgather_object((flat, states, opt.param_groups[0]["lr"]))
    for f, s, lr in every:
        assert torch.equal(f, every[0][0]) and torch.equal(s, every[0][1])
        assert lr == pytest.approx(0.1)
    obj = {"rank": r, "list": list(range(r + 3))}
    assert hvd.broadcast_object(obj, root_rank=hvd.size() - 1) == {
        "rank": hvd.size() - 1,
        "list": list(range(hvd.size() + 2)),
    }
    assert hvd.allgather_object(r * 10) == [q * 10 for q in range(hvd.size())]
    # the usual pattern: only the root has the object (the others' None has another type)
    assert hvd.broadcast_object({"lr": 0.1} if r == 0 else None, root_rank=0) == {"lr": 0.1}


def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch():
    n, r = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(7)
    full = torch.randn(3 * n, 4, 5, 5, generator=g, dtype=torch.float64)
    dy = torch.randn(3 * n, 4, 5, 5, generator=g, dtype=torch.float64)
    ref = torch.nn.BatchNorm2d(4).double()
    sync = hvd.SyncBatchNorm(4).double()
    with torch.no_grad():
        ref.weight.copy_(torch.linspace(0.5, 2, 4))
        sync.weight.copy_(ref.weight)
    xr = full.clone().requires_grad_()
    yr = ref(xr)  # once: each training-mode call moves the running statistics
    (yr * dy).sum().backward()
    mine = slice(3 * r, 3 * r + 3)
    x = full[mine].clone().requires_grad_()
    y = sync(x)
    (y * dy[mine]).sum().backward()
    close(y.detach(), yr.detach()[mine])
    close(x.grad, xr.grad[mine])
    close(sync.running_mean, ref.running_mean)
    close(sync.running_var, ref.running_var)
    # weight gradients are per rank (the optimizer averages them): summed they are the full one
    close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad)
    sync.eval()
    ref.eval()
    close(sync(full[mine]).detach(), ref(full[mine]).detach())


def test_sync_batch_norm_statistics_do_not_cancel_on_a_large_mean():
    # float32 around 3000: E[x^2] - E[x]^2 would lose the variance entirely
    n, r = hvd.size(), hvd.rank()
    full = 3000 + torch.randn(8 * n, 3, generator=torch.Generator().manual_seed(12))
    ref, sync = torch.nn.BatchNorm1d(3), hvd.SyncBatchNorm(3)
    want = ref(full)[8 * r : 8 * r + 8]
    got = sync(full[8 * r : 8 * r + 8])
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-3, atol=1e-4)


# -- process sets and join ----------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_process_sets():
    n, r = hvd.size(), hvd.rank()
    evens = hvd.add_process_set(hvd.ProcessSet(range(0, n, 2)))
    odds = hvd.add_process_set(list(range(1, n, 2)))
    assert evens.process_set_id != odds.process_set_id
    mine = evens if r % 2 == 0 else odds
    xs = everyone((3,), torch.float64, seed=8)
    members = mine.ranks
    out = hvd.allreduce(xs[r], op=hvd.Sum, process_set=mine)
    close(out, sum(xs[q] for q in members))
    assert torch.equal(hvd.allgather(xs[r][:1], process_set=mine), torch.cat([xs[q][:1] for q in members]))
    # roots are ranks of the job, as in Horovod
    assert torch.equal(hvd.broadcast(xs[r], members[-1], process_set=mine), xs[members[-1]])
    assert torch.equal(hvd.broadcast(xs[r], members[0], process_set=mine), xs[members[0]])
    x = xs[r].clone().requires_grad_()
    (hvd.broadcast(x, members[-1], process_set=mine) * 2).sum().backward()
    close(x.grad, torch.full((3,), 2.0 if r == members[-1] else 0.0, dtype=torch.float64))  # averaged
    hvd.barrier(process_set=mine)
    other = odds if mine is evens else evens
    with pytest.raises(hvd.HpcdlError, match="not a member"):
        hvd.allreduce(xs[r], process_set=other)
    assert mine.rank() == members.index(r) and mine.included() and not other.included()
    # the global set still works alongside
    close(hvd.allreduce(xs[r], op=hvd.Sum), expected_reduce(xs, hvd.Sum))
    assert hvd.remove_process_set(evens) and hvd.remove_process_set(odds)
    assert evens.process_set_id is None
    again = hvd.add_process_set([0, 1])
    hvd.shutdown()
    assert again.process_set_id is None  # ids mean nothing to a later init


@pytest.mark.mpi(min_size=2)
def test_requests_on_a_set_removed_in_the_same_cycle_still_finish():
    hvd.shutdown()
    hvd.init(config=hvd.Config(cycle_time=200))  # a long fusion window: both land in one cycle
    s = hvd.add_process_set([1])
    if hvd.rank() == 1:
        h = hvd.allreduce_async(torch.ones(2), name="on-s", op=hvd.Sum, process_set=s)
        hvd.remove_process_set(s)
        assert torch.equal(hvd.synchronize(h), torch.ones(2))
    else:
        hvd.remove_process_set(s)
    hvd.barrier()


@pytest.mark.mpi(min_size=2)
def test_process_set_with_different_ranks_raises_on_every_rank():
    ranks = [0, 1] if hvd.rank() == 0 else [0, hvd.size() - 1] if hvd.size() > 2 else [1]
    with pytest.raises(hvd.HpcdlError, match="ranks disagree.*ranks differs"):
        hvd.add_process_set(ranks)
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(hvd.size())))


@pytest.mark.mpi(min_size=2)
def test_init_registers_process_sets():
    hvd.shutdown()
    ps = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[ps])
    if hvd.rank() < 2:
        close(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps), torch.full((1,), 2.0))
    hvd.barrier()  # a rank that shuts down ends the job for every rank: wait for the others


@pytest.mark.mpi(min_size=2)
def test_join_with_uneven_work():
    n, r = hvd.size(), hvd.rank()
    steps = r + 1  # rank r has r + 1 batches
    results = [hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, name=f"step.{s}") for s in range(steps)]
    last = hvd.join()
    assert last == n - 1  # the rank with the most work joins last
    for s in range(steps):
        active = [q for q in range(n) if q + 1 > s]  # ranks that still had batch s
        close(results[s], torch.full((2,), float(sum(q + 1 for q in active))))
    # the runtime is usable afterwards, with everyone back
    close(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(n)))


@pytest.mark.mpi(min_size=2)
def test_allgather_and_broadcast_while_a_rank_has_joined_raise_there_as_in_horovod():
    """Only allreduce runs while ranks have joined; an allgather or a broadcast raises on
    the ranks that called it, and the runtime stays usable."""
    n, r = hvd.size(), hvd.rank()
    if r == 0:
        assert hvd.join() in range(1, n)
    else:
        with pytest.raises(hvd.HpcdlError, match=r"allgather 'g' cannot run while ranks \[0\] have joined"):
            hvd.allgather(torch.ones(1), name="g")
        with pytest.raises(hvd.HpcdlError, match=r"broadcast 'b' cannot run while ranks \[0\] have joined"):
            hvd.broadcast(torch.ones(1), 1, name="b")
        close(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="a"), torch.full((1,), float(n - 1)))
        hvd.join()
    assert hvd.allgather(torch.full((1,), float(r))).tolist() == [float(q) for q in range(n)]
    assert torch.equal(hvd.broadcast(torch.full((1,), float(r)), n - 1), torch.full((1,), float(n - 1)))


@pytest.mark.mpi(min_size=3)
def test_join_with_a_broadcast_on_a_process_set():
    r = hvd.rank()
    s = hvd.add_process_set([1, 2])
    x = torch.arange(4.0) + 100
    if r == 2:
        # rank 1, a member, has joined: a broadcast on the set raises here
        with pytest.raises(hvd.HpcdlError, match=r"cannot run while ranks \[1\] have joined"):
            hvd.broadcast(x, 2, process_set=s)
    last = hvd.join()
    # rank 2 joins after rank 1; the others join whenever they get there
    assert last != 1
    assert hvd.allgather(torch.tensor([last])).tolist() == [last] * hvd.size()
    if r in (1, 2):  # usable again once every rank has joined
        assert torch.equal(hvd.broadcast(x + r, 2, name="after-join", process_set=s), x + 2)
    hvd.remove_process_set(s)


@pytest.mark.mpi(min_size=2)
def test_allgather_into_a_flat_buffer_and_its_bad_shard_on_one_rank():
    """hpcdl's own in-place allgather (ZeroOptimizer's parameters) fills the other ranks'
    blocks; a shard that is not this rank's block, on rank 1 only, raises on every rank."""
    from hpcdl.ops import allgather_into_async as _allgather_into_async

    n, r = hvd.size(), hvd.rank()
    flat = torch.full((3 * n,), -1.0)
    flat[3 * r : 3 * r + 3] = torch.arange(3.0) + 10 * r
    assert (
        hvd.synchronize(_allgather_into_async(flat[3 * r : 3 * r + 3], flat, "into.ok", hvd.global_process_set)) is flat
    )
    assert torch.equal(flat, torch.cat([torch.arange(3.0) + 10 * q for q in range(n)]))
    k = 0 if r == 1 else 3 * r  # rank 1 hands in rank 0's block
    with pytest.raises(
        hvd.HpcdlError, match=r"rank 1: the gathered shard must be this rank's block of the flat output"
    ):
        hvd.synchronize(_allgather_into_async(flat[k : k + 3], flat, "into.bad", hvd.global_process_set))
