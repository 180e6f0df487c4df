"""Adasum (Maleki et al.): the distributed recursive halving against a numpy reference of
the pairwise formula combined in a binary tree, for collectives.unchecked.adasum, hvd.allreduce
(op=hvd.Adasum) and DistributedOptimizer(op=hvd.Adasum), Horovod's delta optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives as C
import hpcdl as hvd
from collectives import unchecked
from hpcdl.optim.distributed import AdasumReducer, DistributedReducer

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("clean_runtime")]

WORLD = MPI.COMM_WORLD
N, ME = WORLD.size, WORLD.rank
POWER_OF_TWO = N & (N - 1) == 0


def pairwise(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    dot, aa, bb = a @ b, a @ a, b @ b
    ac = 1.0 - dot / (2 * aa) if aa >= 1e-8 else 1.0
    bc = 1.0 - dot / (2 * bb) if bb >= 1e-8 else 1.0
    return ac * a + bc * b


def tree(vectors: list[np.ndarray]) -> np.ndarray:
    """Neighbours first, then pairs of pairs, as the ranks combine."""
    vs = [v.reshape(-1).astype(np.float64) for v in vectors]
    while len(vs) > 1:
        vs = [pairwise(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
    return vs[0]


def vectors(count: int, seed: int, dtype=np.float64) -> list[np.ndarray]:
    base = np.random.default_rng(seed).standard_normal(count)
    # partly parallel, partly orthogonal: rank q's vector mixes a shared part and its own
    return [(0.5 * base + np.random.default_rng([seed, q]).standard_normal(count)).astype(dtype) for q in range(N)]


def test_the_pairwise_formula_sums_orthogonal_and_averages_parallel_vectors():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    assert np.allclose(pairwise(a, b), a + b)
    assert np.allclose(pairwise(a * 3, a * 3), a * 3)
    assert np.allclose(pairwise(a, np.zeros(2)), a)


@pytest.mark.parametrize("count", [0, 1, 7, 1000])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_agreed_adasum_matches_the_tree_of_pairwise_combines(count, dtype):
    xs = vectors(count, count + 1, dtype)
    if not POWER_OF_TWO:
        with pytest.raises(C.InvalidArgumentError, match=f"power-of-two number of ranks, not {N}"):
            unchecked.adasum(xs[ME])
        return
    got = unchecked.adasum(xs[ME])
    want = tree(xs)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64).reshape(-1), want, rtol=tol, atol=tol)
    every = WORLD.allgather(got.tobytes())
    assert all(e == every[0] for e in every)  # bitwise alike on every rank


def test_hvd_allreduce_with_adasum_per_tensor_and_the_rank_count_check():
    hvd.init()
    xs = vectors(50, 3)
    ys = vectors(9, 4)
    if not POWER_OF_TWO:
        with pytest.raises(hvd.HpcdlArgumentError, match=rf"op=Adasum needs a power-of-two number of ranks; .* {N}"):
            hvd.allreduce(torch.from_numpy(xs[ME]), op=hvd.Adasum, name="ada")
        return
    got = hvd.allreduce(torch.from_numpy(xs[ME]), op=hvd.Adasum, name="ada")
    np.testing.assert_allclose(got.numpy(), tree(xs), rtol=1e-12, atol=1e-12)
    # grouped: each tensor combined on its own (dot products per tensor, as Horovod)
    a, b = hvd.grouped_allreduce([torch.from_numpy(xs[ME]), torch.from_numpy(ys[ME])], op=hvd.Adasum)
    np.testing.assert_allclose(a.numpy(), tree(xs), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b.numpy(), tree(ys), rtol=1e-12, atol=1e-12)
    with pytest.raises(hvd.HpcdlArgumentError, match="op=Adasum combines floating-point tensors, not int32"):
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum, name="ada-int")


def test_distributed_optimizer_with_adasum_is_horovods_delta_optimizer():
    """Each rank steps SGD on its own batch; the changes are combined with Adasum and added
    to the starting weights. Reference: the same in numpy, per parameter."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    if not POWER_OF_TWO:
        with pytest.raises(hvd.HpcdlArgumentError, match="needs a power-of-two number of ranks"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
        return
    ref = [p.detach().numpy().copy() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), op=hvd.Adasum
    )
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + ME)
        x, y = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        # the reference: every rank's gradient at the shared starting weights
        grads = hvd.allgather_object([p.grad.detach().numpy().copy() for p in model.parameters()])
        ref = [w + tree([-0.1 * grads[q][i] for q in range(N)]).reshape(w.shape) for i, w in enumerate(ref)]
        for p, w in zip(model.parameters(), ref, strict=True):
            np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-12)
    every = hvd.allgather_object([p.detach().clone() for p in model.parameters()])
    assert all(all(torch.equal(a, b) for a, b in zip(e, every[0], strict=True)) for e in every)


def test_distributed_optimizer_picks_the_adasum_reducer_for_op_adasum_only():
    """As Horovod's factory does: op=Adasum gets the delta optimizer's class, the other ops
    the plain one; either way the result is an instance of the wrapped optimizer's class."""
    hvd.init()
    plain = hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), op=hvd.Sum)
    assert isinstance(plain, torch.optim.SGD) and isinstance(plain, DistributedReducer)
    assert not isinstance(plain, AdasumReducer)
    if POWER_OF_TWO:
        ada = hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), op=hvd.Adasum)
        assert isinstance(ada, torch.optim.SGD) and isinstance(ada, AdasumReducer)


def test_adasum_on_a_rank_outside_its_process_set_is_the_plain_local_step():
    """Every rank wraps its optimizer with op=Adasum over a set of two ranks (one at two
    ranks); the members combine their changes with Adasum, the others step on their own."""
    hvd.init()
    members = [0, 1] if N > 2 else [0]
    ps = hvd.add_process_set(members)
    try:
        m = torch.nn.Linear(3, 1, bias=False).double()
        with torch.no_grad():
            m.weight.fill_(1.0)
        sgd = torch.optim.SGD(m.parameters(), lr=0.5)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), op=hvd.Adasum, process_set=ps)
        m(torch.full((1, 3), float(ME + 1), dtype=torch.float64)).sum().backward()  # d/dw = x
        opt.step()
        changes = [np.full(3, -0.5 * (q + 1)) for q in (members if ME in members else [ME])]
        want = 1.0 + tree(changes)
        np.testing.assert_allclose(m.weight.detach().numpy().reshape(-1), want, rtol=1e-12, atol=1e-12)
    finally:
        hvd.remove_process_set(ps)
