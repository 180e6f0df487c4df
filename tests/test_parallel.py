"""hpcdl.parallel: the DP x TP x PP grid, and each tensor-parallel layer against its dense
twin (float64: forward, input and weight gradients to 1e-10), at 1-4 ranks; sequence
parallelism's communication against plain torch, and its blocks against the dense ones."""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpcdl as hvd
from hpcdl.parallel import (
    ColumnParallelLinear,
    Grid,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    gather_seq_from_tp,
    mark_sequence_parallel,
    reduce_scatter_seq_to_tp,
    scatter_seq_to_tp,
    tp_comm,
    vocab_parallel_cross_entropy,
)
from hpcdl.parallel.tp_comm import traffic

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120), pytest.mark.usefixtures("runtime")]

D = torch.float64


def shapes(n: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) whose product is n."""
    return [(n // (t * p), t, p) for t in range(1, n + 1) for p in range(1, n + 1) if n % (t * p) == 0]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    rel = ((got - want).norm() / max(want.norm().item(), 1e-300)).item()
    assert rel <= 1e-10, rel


def test_grid_coordinates_groups_and_neighbours_for_every_shape():
    n, r = hvd.size(), hvd.rank()
    for dp, tp, pp in shapes(n):
        g = Grid(dp=dp, tp=tp, pp=pp)
        assert (g.dp, g.tp, g.pp) == (dp, tp, pp) and g.rank == r
        assert g.rank_of(g.dp_rank, g.tp_rank, g.pp_rank) == r
        # TP fastest: a TP group is consecutive ranks
        assert g.tp_group.ranks == list(range(r - g.tp_rank, r - g.tp_rank + tp))
        assert g.dp_group.ranks == [g.rank_of(d, g.tp_rank, g.pp_rank) for d in range(dp)]
        assert g.pp_group.ranks == [g.rank_of(g.dp_rank, g.tp_rank, s) for s in range(pp)]
        assert g.is_first_stage == (g.pp_rank == 0) and g.is_last_stage == (g.pp_rank == pp - 1)
        assert g.prev_rank == (None if g.pp_rank == 0 else g.rank_of(g.dp_rank, g.tp_rank, g.pp_rank - 1))
        assert g.next_rank == (None if g.pp_rank == pp - 1 else g.rank_of(g.dp_rank, g.tp_rank, g.pp_rank + 1))
        assert str(g) == f"DP({g.dp_rank}/{dp}) TP({g.tp_rank}/{tp}) PP({g.pp_rank}/{pp}) rank {r}"
        # the groups work: a sum over each
        for group in (g.tp_group, g.dp_group, g.pp_group):
            got = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=group)
            assert got.item() == sum(group.ranks)
        g.close()
    g = Grid(tp=1, pp=1)  # dp inferred
    assert g.dp == n
    g.close()


def test_bad_grids_raise_on_every_rank():
    n, r = hvd.size(), hvd.rank()
    with pytest.raises(hvd.HpcdlArgumentError, match=rf"dp=1 x tp=1 x pp={n + 1} = {n + 1} != world size {n}"):
        Grid(dp=1, tp=1, pp=n + 1)
    with pytest.raises(hvd.HpcdlArgumentError, match="at most one size may be -1"):
        Grid(dp=-1, tp=-1)
    with pytest.raises(hvd.HpcdlArgumentError, match="must be positive integers or -1"):
        Grid(dp=0)
    if n > 1:
        with pytest.raises(hvd.HpcdlArgumentError, match="ranks disagree on the sizes"):
            Grid(dp=-1, tp=n if r == 0 else 1)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # usable afterwards


def tp_grid() -> Grid:
    """TP over the most ranks, up to 3, that divide the world (so that 12 features and 6
    heads split evenly), the rest data-parallel: TP 2 x DP 2 at 4 ranks, TP 3 x DP 2 at 6,
    TP 2 x DP 4 at 8; at a prime count above 3 (5, 7), TP 1 x DP n."""
    n = hvd.size()
    tp = max(t for t in (1, 2, 3) if n % t == 0)
    return Grid(dp=-1, tp=tp, pp=1)


def inputs(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear_equals_the_dense_layer(gather_output):
    g = tp_grid()
    torch.manual_seed(1)
    dense = nn.Linear(6, 12, dtype=D)
    torch.manual_seed(1)
    layer = ColumnParallelLinear(6, 12, gather_output=gather_output, dtype=D)  # the same draws, sliced
    lo, hi = g.tp_rank * 12 // g.tp, (g.tp_rank + 1) * 12 // g.tp
    assert torch.equal(layer.weight, dense.weight[lo:hi].detach()) and torch.equal(layer.bias, dense.bias[lo:hi])
    x, xd = inputs(3, 6, seed=2).requires_grad_(), inputs(3, 6, seed=2).requires_grad_()
    w = inputs(3, 12, seed=3)
    y, yd = layer(x), dense(xd)
    close(y, yd if gather_output else yd[:, lo:hi])
    (y * (w if gather_output else w[:, lo:hi])).sum().backward()
    (yd * w).sum().backward()
    close(x.grad, xd.grad)
    close(layer.weight.grad, dense.weight.grad[lo:hi])
    close(layer.bias.grad, dense.bias.grad[lo:hi])
    g.close()


@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_equals_the_dense_layer(input_is_parallel):
    g = tp_grid()
    torch.manual_seed(4)
    dense = nn.Linear(12, 5, dtype=D)
    layer = RowParallelLinear.from_dense(dense, input_is_parallel=input_is_parallel)
    lo, hi = g.tp_rank * 12 // g.tp, (g.tp_rank + 1) * 12 // g.tp
    x, xd = inputs(4, 12, seed=5), inputs(4, 12, seed=5).requires_grad_()
    x = (x[:, lo:hi] if input_is_parallel else x).clone().requires_grad_()
    w = inputs(4, 5, seed=6)
    y, yd = layer(x), dense(xd)
    close(y, yd)
    (y * w).sum().backward()
    (yd * w).sum().backward()
    close(x.grad, xd.grad[:, lo:hi] if input_is_parallel else xd.grad)
    close(layer.weight.grad, dense.weight.grad[:, lo:hi])
    close(layer.bias.grad, dense.bias.grad)
    g.close()


def test_vocab_parallel_embedding_and_cross_entropy_equal_the_dense_ones():
    g = tp_grid()
    torch.manual_seed(7)
    dense = nn.Embedding(12, 4, dtype=D)
    torch.manual_seed(7)
    emb = VocabParallelEmbedding(12, 4, dtype=D)
    ids = torch.tensor([[0, 5, 11], [3, 6, 9]])
    w = inputs(2, 3, 4, seed=8)
    y, yd = emb(ids), dense(ids)
    close(y, yd)
    (y * w).sum().backward()
    (yd * w).sum().backward()
    lo, hi = emb.start, emb.end
    close(emb.weight.grad, dense.weight.grad[lo:hi])
    # cross-entropy over vocabulary-parallel logits, never gathered
    full = inputs(2, 3, 12, seed=9) * 3
    target = torch.tensor([[1, 11, 6], [0, 7, 3]])
    part = full[..., lo:hi].clone().requires_grad_()
    fd = full.clone().requires_grad_()
    loss, want = (
        vocab_parallel_cross_entropy(part, target),
        F.cross_entropy(fd.view(-1, 12), target.view(-1), reduction="none"),
    )
    close(loss.view(-1), want)
    (loss * inputs(2, 3, seed=10)).sum().backward()
    (want.view(2, 3) * inputs(2, 3, seed=10)).sum().backward()
    close(part.grad, fd.grad[..., lo:hi])
    g.close()


def test_parallel_mlp_trains_as_the_dense_mlp():
    """A few SGD steps of a tensor-parallel MLP equal the dense twin's, slice by slice."""
    g = tp_grid()
    torch.manual_seed(11)
    dense = nn.Sequential(nn.Linear(4, 12), nn.GELU(), nn.Linear(12, 4)).double()
    mlp = ParallelMLP.from_dense(dense)
    opt, opt_d = torch.optim.SGD(mlp.parameters(), lr=0.1), torch.optim.SGD(dense.parameters(), lr=0.1)
    lo, hi = g.tp_rank * 12 // g.tp, (g.tp_rank + 1) * 12 // g.tp
    for step in range(3):
        x, y = inputs(5, 4, seed=20 + step), inputs(5, 4, seed=30 + step)
        for model, o in ((mlp, opt), (dense, opt_d)):
            o.zero_grad()
            F.mse_loss(model(x), y).backward()
            o.step()
        close(mlp.fc1.weight, dense[0].weight[lo:hi])
        close(mlp.fc2.weight, dense[2].weight[:, lo:hi])
        close(mlp.fc2.bias, dense[2].bias)
    if g.tp > 1:
        with pytest.raises(hvd.HpcdlArgumentError, match="must divide by the tensor-parallel size"):
            ColumnParallelLinear(4, 2 * g.tp + 1, dtype=D)
    g.close()


class _DenseAttention(nn.Module):
    """The GPT block's attention (hpcdl.train.models), the dense twin."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d, dtype=D), nn.Linear(d, d, dtype=D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("build", ["seed", "from_dense"])
def test_parallel_self_attention_equals_the_dense_attention(build):
    g = tp_grid()
    heads, d = 6, 12  # heads divide by 1, 2 and 3
    torch.manual_seed(12)
    dense = _DenseAttention(d, heads)
    torch.manual_seed(12)
    if build == "seed":
        attn = ParallelSelfAttention(d, heads, dtype=D)
    else:
        attn = ParallelSelfAttention.from_dense(dense.qkv, dense.proj, heads)
    x, xd = inputs(2, 5, d, seed=13).requires_grad_(), inputs(2, 5, d, seed=13).requires_grad_()
    w = inputs(2, 5, d, seed=14)
    y, yd = attn(x), dense(xd)
    close(y, yd)
    (y * w).sum().backward()
    (yd * w).sum().backward()
    close(x.grad, xd.grad)
    hd, per = d // heads, heads // g.tp
    rows = torch.cat([torch.arange(p * d + g.tp_rank * per * hd, p * d + (g.tp_rank + 1) * per * hd) for p in range(3)])
    close(attn.qkv_weight.grad, dense.qkv.weight.grad[rows])
    close(attn.qkv_bias.grad, dense.qkv.bias.grad[rows])
    lo, hi = g.tp_rank * d // g.tp, (g.tp_rank + 1) * d // g.tp
    close(attn.proj.weight.grad, dense.proj.weight.grad[:, lo:hi])
    close(attn.proj.bias.grad, dense.proj.bias.grad)
    g.close()


# -- sequence parallelism ------------------------------------------------------------------------
def test_sequence_comm_functions_equal_torch_references():
    """Each rank's upstream gradient differs (its own seed), so every backward is checked
    against a sum or a concatenation of all the ranks' gradients, computed here in torch."""
    g = tp_grid()
    group, n, r = g.tp_group, g.tp, g.tp_rank
    k = 2
    t = k * n

    def chunk(a: torch.Tensor, i: int) -> torch.Tensor:
        return a[:, i * k : (i + 1) * k]

    # scatter: the whole input, the same on every rank, to this rank's chunk; the chunks'
    # gradients concatenated
    full = inputs(2, t, 3, seed=40).requires_grad_()
    y = scatter_seq_to_tp(full, group)
    assert torch.equal(y, chunk(full.detach(), r))
    ups = [inputs(2, k, 3, seed=41 + i) for i in range(n)]
    y.backward(ups[r])
    assert torch.equal(full.grad, torch.cat(ups, dim=1))

    # gather: the ranks' chunks concatenated; backward, the sum over the ranks of their
    # gradients of the whole sequence, this rank's chunk of it
    parts = [inputs(2, k, 2, 3, seed=50 + i) for i in range(n)]
    x = parts[r].clone().requires_grad_()
    y = gather_seq_from_tp(x, group)
    assert torch.equal(y, torch.cat(parts, dim=1))
    ups = [inputs(2, t, 2, 3, seed=60 + i) for i in range(n)]
    y.backward(ups[r])
    close(x.grad, chunk(torch.stack(ups).sum(0), r))

    # reduce-scatter: the sum of the ranks' whole-sequence partials, this rank's chunk; the
    # chunks' gradients concatenated
    partial = [inputs(2, t, 3, seed=70 + i) for i in range(n)]
    x = partial[r].clone().requires_grad_()
    traffic.reset()
    y = reduce_scatter_seq_to_tp(x, group)
    close(y, chunk(torch.stack(partial).sum(0), r))
    ups = [inputs(2, k, 3, seed=80 + i) for i in range(n)]
    y.backward(ups[r])
    assert torch.equal(x.grad, torch.cat(ups, dim=1))
    # counted: the reduce-scatter of the whole float64 input forward, the allgather of this
    # rank's chunk of the gradient (and its length word) backward
    # (nothing with a TP group of one rank)
    got = traffic.snapshot()
    calls = {"allreduce": 0, "allgather": int(n > 1), "reducescatter": int(n > 1)}
    assert {k: c["calls"] for k, c in got.items()} == calls
    if n > 1:
        assert got["reducescatter"]["bytes"] == 2 * t * 3 * 8 and got["allgather"]["bytes"] == 2 * k * 3 * 8 + 8
        assert all(c["seconds"] > 0 for c in got.values() if c["calls"])
    g.close()


def test_allreduce_sequence_parallel_grads_sums_the_marked_gradients_only():
    g = tp_grid()
    group, n, r = g.tp_group, g.tp, g.tp_rank
    block = nn.Sequential(nn.LayerNorm(3, dtype=D), nn.Linear(3, 3, dtype=D))
    assert mark_sequence_parallel(block[0]) is block[0]
    assert [getattr(p, "sequence_parallel", False) for p in block.parameters()] == [True, True, False, False]
    every = [[inputs(*p.shape, seed=90 + 10 * j + i) for i in range(n)] for j, p in enumerate(block.parameters())]
    for p, gs in zip(block.parameters(), every, strict=True):
        p.grad = gs[r].clone()
    allreduce_sequence_parallel_grads(block, group)
    for j, (p, gs) in enumerate(zip(block.parameters(), every, strict=True)):
        if j < 2:
            close(p.grad, torch.stack(gs).sum(0))
        else:
            assert torch.equal(p.grad, gs[r])
    # only a sequence-parallel row layer marks its bias
    assert not any(getattr(p, "sequence_parallel", False) for p in ParallelMLP(4, 2 * n, dtype=D).parameters())
    sp = ParallelMLP(4, 2 * n, dtype=D, sequence_parallel=True)
    assert [name for name, p in sp.named_parameters() if getattr(p, "sequence_parallel", False)] == ["fc2.bias"]
    g.close()


def test_the_wait_in_tensor_parallel_calls_splits_into_their_own_cost_and_the_wait_for_a_later_peer():
    """TP rank r reaches each of five calls r x 10 ms after rank 0: rank r waits about
    (tp - 1 - r) x 10 ms a call for the last, and the calls' own cost (the least of the
    group's seconds in each) is what the last rank spent in them, on every rank. Lists of
    different lengths on a group's ranks raise on every rank."""
    from benchmarks.parallel_gpt import split_waiting

    g = tp_grid()
    group, n, r = g.tp_group, g.tp, g.tp_rank
    late, calls = 0.01, 5
    tp_comm.tp_sum(torch.ones(256, dtype=D), group)  # the first call sets the group's path up
    traffic.reset(keep_calls=True)
    for _ in range(calls):
        time.sleep(r * late)
        tp_comm.tp_sum(torch.ones(256, dtype=D), group)
    mine = traffic.calls
    traffic.reset()
    cost, waited = split_waiting(mine, group)
    last = torch.tensor([sum(mine) if r == n - 1 else 0.0], dtype=torch.float64)
    last = float(hvd.allreduce(last, op=hvd.Sum, process_set=group))  # what the last rank spent in the calls
    assert traffic.calls is None and len(mine) == calls
    # every other rank waited 10 ms or more in each call: the least is the last rank's
    assert 0 < cost == pytest.approx(last, rel=1e-9) and cost < calls * late, (cost, last)
    expected = calls * (n - 1 - r) * late
    assert 0.8 * expected <= waited <= expected + calls * late, (waited, expected)  # late wake-ups: some slack
    if n > 1:
        with pytest.raises(RuntimeError, match="made different numbers of calls"):
            split_waiting(mine + [0.001] if r == 0 else mine, group)
    g.close()


def test_sequence_parallel_bad_arguments_raise_on_every_rank():
    g = tp_grid()
    group, n = g.tp_group, g.tp
    with pytest.raises(hvd.HpcdlArgumentError, match="gather_output=True cannot be combined with sequence_parallel"):
        ColumnParallelLinear(4, 2 * n, gather_output=True, dtype=D, sequence_parallel=True)
    with pytest.raises(hvd.HpcdlArgumentError, match="gather_output=True cannot be combined with sequence_parallel"):
        ColumnParallelLinear.from_dense(nn.Linear(4, 2 * n, dtype=D), gather_output=True, sequence_parallel=True)
    with pytest.raises(hvd.HpcdlArgumentError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(2 * n, 4, input_is_parallel=False, dtype=D, sequence_parallel=True)
    with pytest.raises(hvd.HpcdlArgumentError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear.from_dense(nn.Linear(2 * n, 4, dtype=D), input_is_parallel=False, sequence_parallel=True)
    if n > 1:
        odd = inputs(2, 2 * n + 1, 3, seed=1)
        for f in (scatter_seq_to_tp, reduce_scatter_seq_to_tp):
            with pytest.raises(
                hvd.HpcdlArgumentError,
                match=rf"the sequence length \(dimension 1\) {2 * n + 1} must divide by the tensor-parallel size {n}",
            ):
                f(odd, group)
            with pytest.raises(hvd.HpcdlArgumentError, match=r"takes \(batch, sequence, ...\) tensors"):
                f(inputs(2 * n, seed=1), group)
        # chunks of unequal lengths (one more on TP rank 0): every rank sees all lengths
        lengths = [3] + [2] * (n - 1)
        mlp = ParallelMLP(4, 2 * n, dtype=D, sequence_parallel=True)
        with pytest.raises(hvd.HpcdlArgumentError, match=re.escape(f"the same length, not {lengths}")):
            mlp(inputs(2, lengths[g.tp_rank], 4, seed=1))
        # the group is usable afterwards
        y = gather_seq_from_tp(torch.full((1, 2, 1), float(g.tp_rank), dtype=D), group)
        assert torch.equal(y.flatten(), torch.arange(n, dtype=D).repeat_interleave(2))
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()
    g.close()


class _Residual(nn.Module):
    """Half a pre-norm transformer block: ``x + body(norm(x))``."""

    def __init__(self, norm: nn.Module, body: nn.Module) -> None:
        super().__init__()
        self.norm, self.body = norm, body

    def forward(self, x):
        return x + self.body(self.norm(x))


@pytest.mark.parametrize("build", ["seed", "from_dense"])
@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_sequence_parallel_block_equals_the_dense_block(kind, build):
    """LayerNorm -> ParallelMLP or ParallelSelfAttention with a residual, on this rank's
    sequence chunk, against the dense block on the whole sequence."""
    g = tp_grid()
    group, r, n = g.tp_group, g.tp_rank, g.tp
    d, heads, hidden, t = 12, 6, 24, 6  # heads, hidden and t divide by 1, 2 and 3
    norm = nn.LayerNorm(d, dtype=D)
    with torch.no_grad():  # away from the identity, so that its gradients mean something
        norm.weight.add_(inputs(d, seed=15) / 4)
        norm.bias.add_(inputs(d, seed=16) / 4)
    torch.manual_seed(17)
    if kind == "mlp":
        body = nn.Sequential(nn.Linear(d, hidden, dtype=D), nn.GELU(), nn.Linear(hidden, d, dtype=D))
        torch.manual_seed(17)
        if build == "seed":
            sp_body = ParallelMLP(d, hidden, dtype=D, sequence_parallel=True)
        else:
            sp_body = ParallelMLP.from_dense(body, sequence_parallel=True)
    else:
        body = _DenseAttention(d, heads)
        torch.manual_seed(17)
        if build == "seed":
            sp_body = ParallelSelfAttention(d, heads, dtype=D, sequence_parallel=True)
        else:
            sp_body = ParallelSelfAttention.from_dense(body.qkv, body.proj, heads, sequence_parallel=True)
    dense = _Residual(norm, body)
    block = _Residual(mark_sequence_parallel(copy.deepcopy(norm)), sp_body)

    lo, hi = r * t // n, (r + 1) * t // n  # this rank's sequence chunk
    full = inputs(2, t, d, seed=18)
    x, xd = full[:, lo:hi].clone().requires_grad_(), full.clone().requires_grad_()
    y, yd = block(x), dense(xd)
    assert y.shape == (2, t // n, d)
    close(gather_seq_from_tp(y.detach(), group), yd)
    w = inputs(2, t, d, seed=19)
    (y * w[:, lo:hi]).sum().backward()
    (yd * w).sum().backward()
    allreduce_sequence_parallel_grads(block, group)
    close(x.grad, xd.grad[:, lo:hi])
    close(block.norm.weight.grad, dense.norm.weight.grad)
    close(block.norm.bias.grad, dense.norm.bias.grad)
    if kind == "mlp":
        flo, fhi = r * hidden // n, (r + 1) * hidden // n
        close(sp_body.fc1.weight.grad, body[0].weight.grad[flo:fhi])
        close(sp_body.fc1.bias.grad, body[0].bias.grad[flo:fhi])
        close(sp_body.fc2.weight.grad, body[2].weight.grad[:, flo:fhi])
        close(sp_body.fc2.bias.grad, body[2].bias.grad)
    else:
        hd, per = d // heads, heads // n
        rows = torch.cat([torch.arange(p * d + r * per * hd, p * d + (r + 1) * per * hd) for p in range(3)])
        close(sp_body.qkv_weight.grad, body.qkv.weight.grad[rows])
        close(sp_body.qkv_bias.grad, body.qkv.bias.grad[rows])
        plo, phi = r * d // n, (r + 1) * d // n
        close(sp_body.proj.weight.grad, body.proj.weight.grad[:, plo:phi])
        close(sp_body.proj.bias.grad, body.proj.bias.grad)
    g.close()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_the_direct_path_gives_the_engines_results_without_its_requests(dtype, monkeypatch):
    """A grid's TP functions on CPU tensors run through collectives on the group's own
    communicator, not through the engine (no request is waited for); with the group detached
    they go through the engine again, and every result, forward and backward, is the same."""
    g = tp_grid()
    group, n = g.tp_group, g.tp
    if n == 1:
        g.close()
        pytest.skip("a TP group of one rank has no direct path to take")
    waited = []
    real = tp_comm.synchronize
    monkeypatch.setattr(tp_comm, "synchronize", lambda h: waited.append(h) or real(h))

    def run() -> list[torch.Tensor]:
        torch.manual_seed(5 + g.tp_rank)
        full = torch.randn(2, 2 * n, 3, dtype=dtype)
        x = full.clone().requires_grad_()
        y = reduce_scatter_seq_to_tp(x, group)
        z = gather_seq_from_tp(y * 2, group)
        (z * torch.arange(z.numel(), dtype=dtype).view_as(z)).sum().backward()
        w = nn.Linear(3, 3).to(dtype)
        mark_sequence_parallel(w)
        w(y.detach()).sum().backward()
        allreduce_sequence_parallel_grads(w, group)
        return [y.detach(), z.detach(), x.grad, w.bias.grad, tp_comm.tp_sum(full, group), tp_comm.tp_max(full, group)]

    direct = run()
    assert not waited  # no engine request on the direct path
    comm = tp_comm.detach(group)
    assert comm is not None
    try:
        engine = run()
        assert len(waited) == 7  # 2 forward, 2 backward, the marked gradients, the sum, the max
    finally:
        tp_comm.attach(group, comm)
    for a, b in zip(direct, engine, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)
    g.close()
