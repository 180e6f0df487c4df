"""DistributedOptimizer under mpiexec -n 1..4: N ranks training on their shards end where one
process training on the concatenated batches ends (float64), bitwise alike on every rank."""

from __future__ import annotations

import copy
import gc
import io
import warnings

import pytest
import torch

import hpcdl as hvd

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.timeout(120), pytest.mark.usefixtures("runtime")]

STEPS = 20
PER_RANK = 4


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank and in the reference
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: PER_RANK rows for each of ``n`` ranks."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n * PER_RANK, 6, generator=g, dtype=torch.float64), torch.randn(
        n * PER_RANK, 3, generator=g, dtype=torch.float64
    )


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def distributed_optimizer(opt, m, passes, **kw):
    return hvd.DistributedOptimizer(
        opt, named_parameters=m.named_parameters(), backward_passes_per_step=passes, bucket_bytes=512, **kw
    )


def zero(stage: int, **kw):
    def wrap(opt, m, passes):
        return hvd.ZeroOptimizer(
            opt, stage, named_parameters=m.named_parameters(), backward_passes_per_step=passes, bucket_bytes=512, **kw
        )

    return wrap


def train(
    make_opt, distributed: bool, passes: int = 1, clip: float | None = None, wrap=distributed_optimizer, tamper=None
) -> torch.Tensor:
    n, r = hvd.size(), hvd.rank()
    m = model()
    opt = make_opt(m.parameters())
    if distributed:
        opt = wrap(opt, m, passes)
    for step in range(STEPS):
        if tamper is not None:
            tamper(step, m)
        x, y = batch(step, n)
        if distributed:
            x, y = x[r * PER_RANK : (r + 1) * PER_RANK], y[r * PER_RANK : (r + 1) * PER_RANK]
        opt.zero_grad()
        for part in range(passes):  # each pass: its share's mean loss / passes, as Horovod's examples do
            rows = slice(part * len(x) // passes, (part + 1) * len(x) // passes)
            loss = torch.nn.functional.mse_loss(m(x[rows]), y[rows])
            (loss / passes).backward()
        if clip is not None:
            if distributed:
                opt.synchronize()
            if isinstance(opt, hvd.ZeroOptimizer):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            if distributed:
                with opt.skip_synchronize():
                    opt.step()
                continue
        opt.step()
    return flat(m)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def check_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-10, rel
    # bitwise identical on every rank
    every = hvd.allgather_object(got)
    assert all(torch.equal(e, every[0]) for e in every)


@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd-momentum", "adam"])
def test_ranks_match_one_process_on_the_concatenated_batches(make_opt):
    check_equal(train(make_opt, True), train(make_opt, False))


@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("passes", [2, 4])
def test_gradient_accumulation_equals_one_pass_over_a_larger_batch(make_opt, passes):
    """As in Horovod, accumulated passes add up: with each pass's loss divided by the
    passes, k passes over k slices equal one pass over the whole batch (one process)."""
    check_equal(train(make_opt, True, passes=passes), train(make_opt, False, passes=1))


def test_clipping_between_synchronize_and_step():
    check_equal(train(sgd, True, clip=0.05), train(sgd, False, clip=0.05))


def test_wrapper_keeps_class_state_and_refuses_zero_grad_in_flight():
    m = model()
    base = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
    base.step()  # momentum buffers exist now
    opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert all("momentum_buffer" in opt.state[p] for p in m.parameters())
    opt.zero_grad()
    m(torch.ones(2, 6, dtype=torch.float64)).sum().backward()  # every bucket is in flight now
    with pytest.raises(hvd.HpcdlError, match="zero_grad.*in flight"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    with pytest.raises(hvd.HpcdlError, match="computed 2 times before step"):
        m(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
        m(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
    opt.synchronize()


def test_unused_parameters_are_reduced_without_hanging():
    torch.manual_seed(3)
    used, unused = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    params = [("used." + k, v) for k, v in used.named_parameters()] + [
        ("unused." + k, v) for k, v in unused.named_parameters()
    ]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    before = unused.weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        used(torch.ones(1, 3, dtype=torch.float64) * (hvd.rank() + 1)).sum().backward()
        opt.step()
    assert torch.equal(unused.weight, before)  # zero gradient everywhere: unchanged
    mean = sum(q + 1 for q in range(hvd.size())) / hvd.size()
    torch.testing.assert_close(used.weight.grad, torch.full((2, 3), mean, dtype=torch.float64))


def _two_linears(seed: int):
    torch.manual_seed(seed)
    a, b = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    return a, b, [("a." + k, v) for k, v in a.named_parameters()] + [("b." + k, v) for k, v in b.named_parameters()]


@pytest.mark.mpi(min_size=2)
def test_a_gradient_missing_on_some_ranks_is_reduced_with_zeros_there_as_in_horovod():
    """Branch b runs on rank 0 only: every rank steps with b's gradient averaged as if the
    others had contributed zeros, as Horovod does, and nothing raises."""
    a, b, params = _two_linears(4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    x = torch.ones(1, 3, dtype=torch.float64)
    out = a(x).sum() + (b(x).sum() if hvd.rank() == 0 else 0)
    out.backward()
    opt.step()
    n = hvd.size()
    torch.testing.assert_close(b.weight.grad, torch.ones(2, 3, dtype=torch.float64) / n)  # rank 0's / n
    torch.testing.assert_close(a.weight.grad, torch.ones(2, 3, dtype=torch.float64))
    every = hvd.allgather_object(flat(b))
    assert all(torch.equal(e, every[0]) for e in every)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["keyword", "config"])
def test_check_missing_gradients_makes_it_an_error_naming_the_parameter_on_every_rank(how, monkeypatch):
    a, b, params = _two_linears(4)
    kw = {"check_missing_gradients": True} if how == "keyword" else {}
    if how == "config":
        monkeypatch.setattr(hvd.state.current(), "config", hvd.Config(check_missing_gradients=True))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params, **kw)
    x = torch.ones(1, 3, dtype=torch.float64)
    (a(x).sum() + (b(x).sum() if hvd.rank() == 0 else 0)).backward()
    with pytest.raises(hvd.HpcdlError, match=r"gradients of \['b.bias', 'b.weight'\] are missing on some ranks"):
        opt.step()


@pytest.mark.mpi(min_size=2)
def test_check_missing_gradients_set_on_some_ranks_only_is_an_error_on_every_rank():
    a, b, params = _two_linears(5)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p for _, p in params], lr=0.1),
        named_parameters=params,
        check_missing_gradients=hvd.rank() == 0,
    )
    x = torch.ones(1, 3, dtype=torch.float64)
    (a(x).sum() + b(x).sum()).backward()
    with pytest.raises(hvd.HpcdlError, match=r"check_missing_gradients is set on 1 of \d+ ranks"):
        opt.step()


def test_step_after_synchronize_warns_once_as_horovod_does():
    m = model()
    opt = distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, 1)
    x, y = batch(0, hvd.size())
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.synchronize()
    reduced = [p.grad.clone() for p in m.parameters()]
    with pytest.warns(UserWarning, match=r"optimizer.step\(\) called without optimizer.skip_synchronize\(\)") as rec:
        opt.step()
    assert len([w for w in rec if issubclass(w.category, UserWarning)]) == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), reduced, strict=True))  # reduced once
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plain step() does not warn
        opt.step()


def test_argument_errors_are_value_errors_and_hpcdl_errors():
    m = model()
    named = list(m.named_parameters())
    cases = [
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=named + named[:1]),
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=named[1:]),
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), backward_passes_per_step=0),
        lambda: hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage=3),
    ]
    for make in cases:
        with pytest.raises(ValueError) as info:
            make()
        assert isinstance(info.value, hvd.HpcdlError) and isinstance(info.value, hvd.HpcdlArgumentError)


def test_named_parameters_none_and_horovods_attributes():
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(m.parameters(), lr=0.1), num_groups=2, groups=None)
    assert isinstance(opt, torch.optim.Adagrad)
    assert (opt.op, opt.gradient_predivide_factor, opt.process_set) == (hvd.Average, 1.0, hvd.global_process_set)
    assert opt.backward_passes_per_step == 1 and opt.sparse_as_dense is False
    assert sorted(opt._parameter_names.values()) == [f"param.{i}" for i in range(len(list(m.parameters())))]
    x, y = batch(0, hvd.size())
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()  # trains


class _Bag(torch.nn.Module):
    """An embedding with sparse gradients, then a linear layer."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.emb = torch.nn.Embedding(10, 4, sparse=sparse).double()
        self.out = torch.nn.Linear(4, 1).double()

    def forward(self, idx):
        return self.out(self.emb(idx).sum(1))


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_reduce_to_the_dense_result(sparse_as_dense):
    """Embedding(sparse=True) under SGD: the same weights, bitwise alike on every rank, as
    the dense embedding trained on the concatenated batches in one process."""
    n, r = hvd.size(), hvd.rank()

    def data(step):
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, 10, (n * 2, 3), generator=g), torch.randn(n * 2, 1, generator=g, dtype=torch.float64)

    def run(distributed: bool) -> torch.Tensor:
        m = _Bag(sparse=distributed)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(), sparse_as_dense=sparse_as_dense)
        for step in range(5):
            idx, y = data(step)
            if distributed:
                idx, y = idx[r * 2 : (r + 1) * 2], y[r * 2 : (r + 1) * 2]
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(idx), y).backward()
            if distributed:
                assert m.emb.weight.grad.is_sparse
            opt.step()
            if distributed:
                assert m.emb.weight.grad.is_sparse
        return flat(m)

    check_equal(run(True), run(False))


def test_sparse_allreduce_async_gives_the_dense_sum_and_average():
    n, r = hvd.size(), hvd.rank()
    dense = torch.zeros(6, 2)
    dense[r % 5] = r + 1.0  # rows 0-4 shared by ranks 5 apart at 6 ranks and more
    dense[5] = 1.0  # a row every rank holds
    for op, want in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        h = hvd.sparse_allreduce_async(dense.to_sparse(), f"sparse.{op.name}", op)
        got = h().to_dense()
        expect = torch.zeros(6, 2)
        for q in range(n):
            expect[q % 5] += (q + 1.0) * want
        expect[5] += n * want
        torch.testing.assert_close(got, expect)
    h = hvd.sparse_allreduce_async(dense.to_sparse(), "sparse.sync", hvd.Sum)
    assert hvd.synchronize(h).is_sparse  # synchronize takes Horovod's callable handle too


@pytest.mark.mpi(min_size=2)
def test_zero_refuses_sparse_gradients_on_every_rank():
    m = _Bag(sparse=True)
    opt = hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage=2, named_parameters=m.named_parameters())
    with pytest.raises(hvd.HpcdlArgumentError, match=r"ZeroOptimizer shards dense gradients only; \['emb.weight'\]"):
        loss = m(torch.zeros(1, 3, dtype=torch.int64)).sum()
        loss.backward()
        opt.step()


def test_a_process_set_of_one_rank_sends_nothing_and_steps_as_the_plain_optimizer(monkeypatch):
    """Where reducing changes nothing (a process set of this rank alone, Average or Sum, no
    compression or predivide: a pipeline with one data-parallel replica), the optimizer
    sends no request, inside the backward pass or in step(), and trains bit for bit as the
    plain optimizer on the same batches, with gradient accumulation; a missing gradient
    still becomes zeros, as a reduction makes it. With compression it reduces as before."""
    import hpcdl.optim.buckets as buckets

    n, r = hvd.size(), hvd.rank()
    sets = [hvd.add_process_set([q]) for q in range(n)] if n > 1 else [hvd.global_process_set]
    mine = sets[r]
    sent = []
    for name in ("grouped_allreduce_async_", "allreduce_async"):
        real = getattr(buckets, name)
        monkeypatch.setattr(buckets, name, lambda *a, _real=real, _name=name, **k: sent.append(_name) or _real(*a, **k))

    def run(wrap: bool, op=hvd.Average, **kw) -> torch.Tensor:
        m = model()
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        if wrap:
            opt = distributed_optimizer(opt, m, 2, op=op, process_set=mine, **kw)
        for step in range(4):
            x, y = batch(step + 10 * r, 1)
            opt.zero_grad()
            for part in (x[:2], x[2:]):
                loss = torch.nn.functional.mse_loss(m(part), y[: len(part)])
                (loss / 2).backward()
            opt.step()
        return flat(m)

    try:
        want = run(False)
        for op in (hvd.Average, hvd.Sum):
            assert torch.equal(run(True, op), want) and sent == [], op
        m = model()  # the last layer unused: its gradients become zeros
        opt = distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, 1, process_set=mine)
        m[:2](torch.ones(1, 6, dtype=torch.float64)).sum().backward()
        opt.step()
        assert torch.equal(m[4].weight.grad, torch.zeros_like(m[4].weight)) and sent == []
        run(True, compression=hvd.Compression.fp16)  # not an identity: reduced
        assert "grouped_allreduce_async_" in sent
    finally:
        for ps in sets if n > 1 else []:
            hvd.remove_process_set(ps)


@pytest.mark.mpi(min_size=2)
def test_two_models_on_two_halves_of_the_job_each_with_its_own_process_set():
    """Horovod's pattern: even ranks train one model on their set, odd ranks another on
    theirs; each set reduces among its members only."""
    n, r = hvd.size(), hvd.rank()
    evens = hvd.add_process_set(list(range(0, n, 2)))
    odds = hvd.add_process_set(list(range(1, n, 2)))
    mine = evens if r % 2 == 0 else odds
    torch.manual_seed(11 + r % 2)
    m = torch.nn.Linear(3, 1).double()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(), process_set=mine
    )
    x = torch.full((1, 3), float(r + 1), dtype=torch.float64)
    m(x).sum().backward()
    opt.step()
    members = mine.ranks
    want = sum(q + 1.0 for q in members) / len(members)
    torch.testing.assert_close(m.weight.grad, torch.full((1, 3), want, dtype=torch.float64))
    every = hvd.allgather_object((r % 2, flat(m)))
    same = [w for k, w in every if k == r % 2]
    assert all(torch.equal(w, same[0]) for w in same)
    hvd.remove_process_set(evens)
    hvd.remove_process_set(odds)


def test_two_wrapped_optimizers_in_flight_together():
    g, d = model(1), model(2)  # a GAN's two networks, each with its own optimizer
    opt_g = hvd.DistributedOptimizer(torch.optim.SGD(g.parameters(), lr=0.1), named_parameters=g.named_parameters())
    opt_d = hvd.DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1), named_parameters=d.named_parameters())
    x = torch.ones(2, 6, dtype=torch.float64) * (hvd.rank() + 1)
    (g(x).sum() + d(x).sum()).backward()  # both optimizers' buckets are in flight now
    opt_g.step()
    opt_d.step()
    every = hvd.allgather_object((flat(g), flat(d)))
    assert all(torch.equal(e[0], every[0][0]) and torch.equal(e[1], every[0][1]) for e in every)


# -- ZeroOptimizer ----------------------------------------------------------------------------
def two_groups(params):
    """Adam with two parameter groups (different learning rates, weight decay on one)."""
    params = list(params)
    return torch.optim.Adam([{"params": params[:2], "lr": 0.02, "weight_decay": 0.01}, {"params": params[2:]}], lr=0.01)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("make_opt", [sgd, adam, two_groups], ids=["sgd-momentum", "adam", "adam-two-groups"])
def test_zero_matches_distributed_optimizer(stage, make_opt):
    # bucket_bytes=512 cuts the 6-16-8-3 model into several buckets, most split across ranks
    check_equal(train(make_opt, True, wrap=zero(stage)), train(make_opt, True))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_accumulation_and_clipping(stage):
    check_equal(train(sgd, True, passes=2, wrap=zero(stage)), train(sgd, True, passes=2))
    check_equal(train(adam, True, clip=0.05, wrap=zero(stage)), train(adam, True, clip=0.05))


def _set_parameters(step: int, m: torch.nn.Module) -> None:
    """Between steps, write into the parameters (step 3) and replace their tensors (step 6)."""
    with torch.no_grad():
        for p in m.parameters():
            if step == 3:
                p.mul_(0.5)
            elif step == 6:
                p.data = p.data * 2 + 0.01


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_follows_parameters_set_between_steps(stage):
    """ZeroOptimizer keeps the parameters in its flat buffers (p.data is a view there): writes
    into them and tensors put in their place between steps both reach the shards, and the
    weights still equal DistributedOptimizer's given the same changes."""
    check_equal(train(adam, True, wrap=zero(stage), tamper=_set_parameters), train(adam, True, tamper=_set_parameters))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_refuses_parameters_cast_after_it_was_built(stage):
    m = model()
    opt = hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage, named_parameters=m.named_parameters())
    m.float()  # the same Parameter objects, new float32 tensors: on every rank
    m(torch.ones(2, 6)).sum().backward()
    with pytest.raises(
        hvd.HpcdlError, match=r"became torch.float32 on cpu after the optimizer was built on torch.float64 on cpu"
    ):
        opt.step()


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("wrap", ["distributed", "zero2"])
def test_compression_stays_within_its_precision(compression, wrap):
    """Gradients cross the wire as 16-bit floats: after 20 SGD steps the weights differ from
    the uncompressed run by about the format's rounding (2^-11 fp16, 2^-8 bf16) times the
    step sizes, and not by more; float64 training, so the difference is the compression's."""
    comp = getattr(hvd.Compression, compression)
    if wrap == "zero2":
        got = train(sgd, True, wrap=zero(2, compression=comp))
    else:
        got = train(sgd, True, wrap=lambda o, m, k: distributed_optimizer(o, m, k, compression=comp))
    want = train(sgd, True)
    start = flat(model())
    rel = ((got - want).norm() / (want - start).norm()).item()  # relative to how far training moved
    eps = {"fp16": 2.0**-11, "bf16": 2.0**-8}[compression]
    assert 0 < rel <= 4 * eps, (rel, eps)  # compression did happen, within its precision
    every = hvd.allgather_object(got)
    assert all(torch.equal(e, every[0]) for e in every)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_holds_one_nth_of_the_state_plus_at_most_one_bucket(stage):
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40)).double()
    ref = copy.deepcopy(m)
    bucket = 8192
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = hvd.ZeroOptimizer(
        torch.optim.Adam(m.parameters(), lr=0.01), stage, named_parameters=m.named_parameters(), bucket_bytes=bucket
    )
    x = torch.randn(8, 64, dtype=torch.float64)
    m(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    plain.step()
    full_grad = sum(p.numel() * p.element_size() for p in m.parameters())
    opt.synchronize()
    if stage == 2:  # the reduced gradient is held as shards only
        assert all(p.grad is None for p in m.parameters())
        shard_grad = sum(b.zero.shard.grad.numel() * 8 for b in opt._buckets)
        assert full_grad / hvd.size() <= shard_grad <= full_grad / hvd.size() + bucket
    with opt.skip_synchronize():
        opt.step()
    full, mine = state_bytes(plain), state_bytes(opt.optim)
    n = hvd.size()
    every = hvd.allgather_object(mine)
    assert sum(every) >= full  # the shards cover the whole state (plus padding)
    assert all(full / n - bucket <= b <= full / n + bucket for b in every), (full, every)
    if n > 1:
        assert max(every) < full / n * 1.25  # and really are a 1/n share, not a copy


def test_zero_state_dict_is_the_plain_optimizers_state():
    """The consolidated state equals the state of one unsharded Adam on the concatenated
    batches, in Adam's own format, which a plain Adam loads."""
    n, r = hvd.size(), hvd.rank()
    m, ref = model(), model()
    opt = hvd.ZeroOptimizer(torch.optim.Adam(m.parameters(), lr=0.01), 2, bucket_bytes=512)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        x, y = batch(step, n)
        opt.zero_grad()
        torch.nn.functional.mse_loss(
            m(x[r * PER_RANK : (r + 1) * PER_RANK]), y[r * PER_RANK : (r + 1) * PER_RANK]
        ).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == sorted(st)
        for k, v in st.items():
            torch.testing.assert_close(got["state"][i][k], v, rtol=1e-10, atol=1e-14)
    plain = torch.optim.Adam(model().parameters(), lr=0.01)
    plain.load_state_dict(got)
    assert plain.state_dict()["param_groups"] == want["param_groups"]


def global_rows() -> int:
    """Rows per step, divisible by the job's rank count and by one fewer, so that every rank of
    either set gets equal shards (the mean of the shards' means is then the global mean)."""
    n = hvd.size()
    return 12 if n <= 4 else n * (n - 1)


def fixed_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    rows = global_rows()
    return torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randn(
        rows, 3, generator=g, dtype=torch.float64
    )


def zero_phase(m, state, steps, ps, stage):
    """Train ``m`` for ``steps`` on the ranks of ``ps`` with ZeroOptimizer(stage), starting from
    the consolidated ``state`` (if any); return the new consolidated state."""
    opt = hvd.ZeroOptimizer(torch.optim.Adam(m.parameters(), lr=0.01), stage, process_set=ps, bucket_bytes=512)
    if state is not None:
        opt.load_state_dict(state)
    k, me = ps.size(), ps.rank()
    rows = slice(me * global_rows() // k, (me + 1) * global_rows() // k)
    for step in steps:
        x, y = fixed_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x[rows]), y[rows]).backward()
        opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_checkpoint_moves_between_rank_counts(stage):
    """Train 5 steps on n-1 ranks, save, load on n ranks, train 5 more (and the other way
    round): the weights equal 10 uninterrupted steps of one unsharded Adam on the whole batch."""
    n = hvd.size()
    fewer = hvd.add_process_set(list(range(max(1, n - 1)))) if n > 1 else hvd.global_process_set
    try:
        ref = model()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        for step in range(10):
            x, y = fixed_batch(step)
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
        for first, second in ((fewer, hvd.global_process_set), (hvd.global_process_set, fewer)):
            m = model()
            saved = None
            if first.included():
                state = zero_phase(m, None, range(5), first, stage)
                if first.rank() == 0:  # a real checkpoint: bytes that torch.load reads without unpickling code
                    buf = io.BytesIO()
                    torch.save({"model": m.state_dict(), "optim": state}, buf)
                    saved = buf.getvalue()
            saved = hvd.broadcast_object(saved, root_rank=0)
            ckpt = torch.load(io.BytesIO(saved), weights_only=True)
            m = model()  # as a fresh job would
            m.load_state_dict(ckpt["model"])
            if second.included():
                zero_phase(m, ckpt["optim"], range(5, 10), second, stage)
                rel = ((flat(m) - flat(ref)).norm() / flat(ref).norm()).item()
                assert rel <= 1e-10, (first.ranks, second.ranks, rel)
    finally:
        if n > 1:
            hvd.remove_process_set(fewer)


def test_zero_refuses_bad_arguments():
    m = model()
    with pytest.raises(hvd.HpcdlArgumentError, match="stage=3 must be 1"):
        hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage=3)
    with pytest.raises(hvd.HpcdlError, match="cannot shard LBFGS"):
        hvd.ZeroOptimizer(torch.optim.LBFGS(m.parameters()))
    opt = hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(hvd.HpcdlError, match="saved parameter groups have"):
        opt.load_state_dict(torch.optim.SGD(list(m.parameters())[:2], lr=0.1).state_dict())
    with pytest.raises(hvd.HpcdlError, match="call synchronize"):
        opt.clip_grad_norm_(1.0)


@pytest.mark.mpi(min_size=2)
def test_zero_stage_differing_between_ranks_raises_on_every_rank():
    m = model()
    with pytest.raises(hvd.HpcdlError, match=r"ranks disagree on stage: \{0: 1, 1: 2"):
        hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage=1 if hvd.rank() == 0 else 2)
    with pytest.raises(hvd.HpcdlError, match=r"ranks disagree on buckets \(the models or bucket_bytes differ\)"):
        hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), bucket_bytes=512 if hvd.rank() == 0 else 1024)
    opt = hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))  # and the runtime goes on
    m(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
    opt.step()


def test_a_dropped_optimizer_stops_hooking_its_parameters():
    m = model()
    x = torch.ones(2, 6, dtype=torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    m(x).sum().backward()
    opt.step()
    del opt
    gc.collect()
    opt = hvd.ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), stage=2)  # a new wrapper, same parameters
    opt.zero_grad()
    m(x).sum().backward()  # only the new optimizer's hooks fire (else: "computed 2 times")
    opt.step()


@pytest.mark.mpi(min_size=2)
def test_a_rank_outside_the_optimizers_process_set_takes_no_part():
    """Horovod's test_optimizer_process_sets: every rank wraps its optimizer over the even
    ranks' set; the even ranks reduce among themselves, an odd rank steps on its own gradients."""
    n, r = hvd.size(), hvd.rank()
    evens = hvd.add_process_set(list(range(0, n, 2)))
    try:
        torch.manual_seed(3)
        m = torch.nn.Linear(3, 1).double()
        w0 = m.weight.detach().clone()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.5), named_parameters=m.named_parameters(), process_set=evens
        )
        x = torch.full((1, 3), float(r + 1), dtype=torch.float64)
        m(x).sum().backward()  # d/dw = x
        opt.step()
        mine = [q for q in range(n) if q % 2 == r % 2] if r % 2 == 0 else [r]
        grad = sum(torch.full((1, 3), float(q + 1), dtype=torch.float64) for q in mine) / len(mine)
        torch.testing.assert_close(m.weight.detach(), w0 - 0.5 * grad, rtol=0, atol=1e-15)
    finally:
        hvd.remove_process_set(evens)
