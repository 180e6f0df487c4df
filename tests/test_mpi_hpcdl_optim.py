"""DistributedOptimizer under mpiexec -n 1..4: N ranks training on their shards end where one
process training on the concatenated batches ends (float64), bitwise alike on every rank."""

from __future__ import annotations

import pytest
import torch

import hpcdl as hvd

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.timeout(120)]

STEPS = 20
PER_RANK = 4


@pytest.fixture(autouse=True)
def _runtime():
    hvd.init()
    yield
    hvd.shutdown()


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


def train(make_opt, distributed: bool, passes: int = 1, clip: float | None = None) -> torch.Tensor:
    n, r = hvd.size(), hvd.rank()
    m = model()
    opt = make_opt(m.parameters())
    if distributed:
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=m.named_parameters(), backward_passes_per_step=passes, bucket_bytes=512
        )
    for step in range(STEPS):
        x, y = batch(step, n)
        if distributed:
            x, y = x[r * PER_RANK : (r + 1) * PER_RANK], y[r * PER_RANK : (r + 1) * PER_RANK]
        opt.zero_grad()
        for part in range(passes):  # each pass: the mean loss over its share of the batch
            rows = slice(part * len(x) // passes, (part + 1) * len(x) // passes)
            loss = torch.nn.functional.mse_loss(m(x[rows]), y[rows])
            (loss / (1 if distributed else passes)).backward()
        if clip is not None:
            if distributed:
                opt.synchronize()
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


def test_gradient_accumulation_equals_one_pass_over_a_larger_batch():
    check_equal(train(sgd, True, passes=2), train(sgd, False, passes=2))


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


@pytest.mark.mpi(min_size=2)
def test_a_gradient_missing_on_some_ranks_only_names_the_parameter_on_every_rank():
    torch.manual_seed(4)
    a, b = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    params = [("a." + k, v) for k, v in a.named_parameters()] + [("b." + k, v) for k, v in b.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    x = torch.ones(1, 3, dtype=torch.float64)
    out = a(x).sum() + (b(x).sum() if hvd.rank() == 0 else 0)  # b is used on rank 0 only
    out.backward()
    with pytest.raises(hvd.HpcdlError, match=r"gradients of \['b.bias', 'b.weight'\] are missing on some ranks"):
        opt.step()


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
