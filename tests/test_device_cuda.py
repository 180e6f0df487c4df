"""hpcdl on CUDA tensors under mpiexec -n 1..4, skipped where torch sees no GPU.

Every collective's CUDA form against a local expectation (results on the input's device,
in-place forms writing the CUDA tensor); DistributedOptimizer and ZeroOptimizer on a CUDA
model against one process on the concatenated batch; fp16 with dynamic loss scaling
skipping the same step on every rank; ``hpcdl.train --device cuda --precision fp16``
reaching the accuracy bar and resuming bitwise. Ranks share GPUs (local rank % GPUs), so
two ranks run on a machine with one GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from tensors import autograd_through_allreduce_and_allgather, close, data, everyone, expected_reduce

import hpcdl as hvd
from hpcdl.config import load_config
from hpcdl.staging import device_source
from hpcdl.train import TrainConfig, run
from hpcdl.train import checkpoint as ckpt
from hpcdl.train.launch import pick_device

pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
    pytest.mark.usefixtures("shutdown_after"),
]


@pytest.fixture()
def dev():
    hvd.init()
    return pick_device("cuda", hvd.local_rank())


def on(d: torch.device, t: torch.Tensor) -> torch.Tensor:
    return t.to(d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
def test_allreduce_forms_on_cuda(dev, dtype):
    r = hvd.rank()
    xs = everyone((5, 3), dtype, seed=1)
    x = on(dev, xs[r])
    out = hvd.allreduce(x, op=hvd.Sum)
    assert out.device == dev
    close(out.cpu(), expected_reduce(xs, hvd.Sum).to(dtype))
    assert torch.equal(x.cpu(), xs[r])  # the input is untouched
    t = on(dev, xs[r])
    assert hvd.allreduce_(t, op=hvd.Max) is t
    close(t.cpu(), expected_reduce(xs, hvd.Max).to(dtype))
    # asynchronous, scaled, non-contiguous
    if dtype.is_floating_point:
        nc = on(dev, xs[r]).t()
        assert not nc.is_contiguous()
        h = hvd.allreduce_async_(nc, op=hvd.Sum, prescale_factor=0.5, postscale_factor=2.0)
        assert hvd.synchronize(h) is nc
        close(nc.cpu(), expected_reduce(xs, hvd.Sum).to(dtype).t())
        avg = hvd.allreduce(on(dev, xs[r]))
        close(avg.cpu(), expected_reduce(xs, hvd.Average).to(dtype))


def test_grouped_allreduce_mixes_devices(dev):
    r = hvd.rank()
    a, b = everyone((7,), torch.float32, seed=2), everyone((2, 2), torch.float64, seed=3)
    outs = hvd.grouped_allreduce([on(dev, a[r]), b[r]], op=hvd.Sum)
    assert [o.device.type for o in outs] == ["cuda", "cpu"]
    close(outs[0].cpu(), expected_reduce(a, hvd.Sum).float())
    close(outs[1], expected_reduce(b, hvd.Sum))
    ts = [on(dev, a[r]), on(dev, b[r])]
    hvd.grouped_allreduce_(ts, op=hvd.Sum)
    close(ts[0].cpu(), expected_reduce(a, hvd.Sum).float())
    close(ts[1].cpu(), expected_reduce(b, hvd.Sum))


def test_allgather_broadcast_alltoall_reducescatter_on_cuda(dev):
    r, n = hvd.rank(), hvd.size()
    # allgather: rank q contributes q + 1 rows
    rows = [data(q, (q + 1, 3), torch.float32, seed=4) for q in range(n)]
    got = hvd.allgather(on(dev, rows[r]))
    assert got.device == dev and torch.equal(got.cpu(), torch.cat(rows))
    g1, g2 = hvd.grouped_allgather([on(dev, rows[r]), rows[r].double()])
    assert g1.device == dev and g2.device.type == "cpu" and torch.equal(g1.cpu().double(), g2)
    # broadcast, new tensor and in place
    xs = everyone((4,), torch.bfloat16, seed=5)
    root = n - 1
    b = hvd.broadcast(on(dev, xs[r]), root_rank=root)
    assert b.device == dev and torch.equal(b.cpu(), xs[root])
    t = on(dev, xs[r])
    assert hvd.broadcast_(t, root_rank=0) is t and torch.equal(t.cpu(), xs[0])
    # alltoall: rank q sends q + k + 1 rows to rank k, each row tagged (sender, receiver)
    splits = [r + k + 1 for k in range(n)]
    send = torch.cat([torch.tensor([[r, k]] * s, dtype=torch.float32) for k, s in enumerate(splits)])
    recv, rsplits = hvd.alltoall(on(dev, send), splits=splits)
    want = torch.cat([torch.tensor([[q, r]] * (q + r + 1), dtype=torch.float32) for q in range(n)])
    assert recv.device == dev and torch.equal(recv.cpu(), want)
    assert rsplits.tolist() == [q + r + 1 for q in range(n)]
    # reducescatter: rank r gets its block of the sum
    ys = everyone((2 * n + 1, 2), torch.float32, seed=6)
    part = hvd.reducescatter(on(dev, ys[r]), op=hvd.Sum)
    full = expected_reduce(ys, hvd.Sum).float()
    counts = [len(c) for c in torch.tensor_split(torch.arange(2 * n + 1), n)]
    start = sum(counts[:r])
    assert part.device == dev
    close(part.cpu(), full[start : start + counts[r]])


def test_the_device_path_and_the_staged_path_agree(dev, run_dir):
    """Where CuPy is installed, CUDA tensors stay on the GPU (the timeline names the device
    path); restarted with the device path off, the same calls give the same results."""
    if device_source(torch.zeros(1, device=dev), True) is None:
        pytest.skip("CuPy cannot be loaded here: CUDA tensors are staged")
    r, n = hvd.rank(), hvd.size()

    def calls() -> list[torch.Tensor]:
        xs = everyone((100_001,), torch.float32, seed=9)
        small = everyone((17,), torch.bfloat16, seed=10)
        rows = [data(q, (q + 2, 3), torch.float64, seed=11) for q in range(n)]
        splits = [1 + (r + k) % 2 for k in range(n)]
        return [
            hvd.allreduce(on(dev, xs[r]), op=hvd.Sum, name="ar"),
            *hvd.grouped_allreduce([on(dev, s) for s in (small[r], small[r] * 2)], op=hvd.Average, name="fused"),
            hvd.allgather(on(dev, rows[r]), name="ag"),
            hvd.broadcast(on(dev, xs[r]), n - 1, name="b"),
            hvd.reducescatter(on(dev, xs[r][: 10 * n]), op=hvd.Sum, name="rs"),
            hvd.alltoall(on(dev, torch.arange(float(sum(splits))) + 100 * r), splits=splits, name="a2a")[0],
        ]

    path = os.path.join(run_dir, "device.json")
    hvd.start_timeline(path)
    on_device = calls()
    hvd.stop_timeline()
    if r == 0:
        spans = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
        algs = {e["args"]["algorithm"] for e in spans if e["name"] in ("ALLREDUCE", "ALLGATHER", "BROADCAST")}
        assert algs == {"device"}, algs
    hvd.shutdown()
    hvd.init(config=dataclasses.replace(load_config(), device_path=False))
    staged = calls()
    for a, b in zip(on_device, staged, strict=True):
        assert a.device == dev and b.device == dev
        close(a.cpu(), b.cpu())


def test_autograd_through_cuda_allreduce_and_allgather(dev):
    autograd_through_allreduce_and_allgather(dev)  # test_ops runs the same on the CPU


def _model(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return m.double().to(dev)


@pytest.mark.parametrize("wrap", ["distributed", "zero1", "zero2"])
def test_optimizers_on_cuda_equal_one_process_on_the_whole_batch(dev, wrap):
    r, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4 * n, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4 * n,), generator=g)
    model, ref = _model(dev), _model(dev)
    inner = torch.optim.Adam(model.parameters(), lr=0.05)
    if wrap == "distributed":
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    else:
        opt = hvd.ZeroOptimizer(inner, stage=int(wrap[-1]), named_parameters=model.named_parameters())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    xd, yd = x.to(dev), y.to(dev)
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(model(xd[4 * r : 4 * r + 4]), yd[4 * r : 4 * r + 4]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(xd), yd).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.device == dev
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10)
    if wrap != "distributed":  # the consolidated state holds the reference optimizer's
        st = opt.state_dict()["state"]
        for i, q in enumerate(ref.parameters()):
            torch.testing.assert_close(st[i]["exp_avg"].to(dev), ref_opt.state[q]["exp_avg"], rtol=1e-9, atol=1e-12)


def test_fp16_loss_scaling_skips_the_same_step_on_every_rank(dev):
    """An overflow on one rank only makes every rank's reduced gradient non-finite: every
    rank skips that step and halves its scale; the next step updates every rank alike."""
    r = hvd.rank()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dev)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=100)
    g = torch.Generator().manual_seed(10 + r)
    x, y = torch.randn(16, 8, generator=g).to(dev), torch.randint(0, 4, (16,), generator=g).to(dev)

    def step(overflow: bool) -> None:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        if overflow:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    before = [p.detach().clone() for p in model.parameters()]
    step(overflow=r == 0)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert scaler.get_scale() == 2.0**11
    step(overflow=False)
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert scaler.get_scale() == 2.0**11
    assert all(torch.isfinite(p).all() for p in model.parameters())
    mine = [p.detach().cpu().numpy().tobytes() for p in model.parameters()]
    assert all(o == mine for o in hvd.allgather_object(mine))


def test_train_fp16_on_cuda_reaches_the_accuracy_bar(run_dir):
    summary = run(TrainConfig.from_flat(device="cuda", precision="fp16", run_dir=run_dir, progress=False))
    assert summary["device"].startswith("cuda") and summary["final"]["accuracy"] >= 0.97, summary
    if hvd.rank() == 0:
        saved = torch.load(summary["checkpoint"], weights_only=True)
        assert 0 < saved["scaler"]["scale"] and len(saved["cuda_rng"]) == hvd.size()


def test_a_resumed_cuda_fp16_run_ends_where_an_uninterrupted_one_does(run_dir):
    base = dict(device="cuda", precision="fp16", model="cnn", batch_size=64, checkpoint_every=4, keep_checkpoints=1)
    base.update(max_steps=14, progress=False)
    whole = run(TrainConfig.from_flat(run_dir=os.path.join(run_dir, "whole"), **base))

    class StopError(Exception):
        pass

    def stop(step):
        if step == 10:
            raise StopError

    parted = os.path.join(run_dir, "parted")
    with pytest.raises(StopError):
        run(TrainConfig.from_flat(run_dir=parted, **base), on_step=stop)
    resumed = run(TrainConfig.from_flat(run_dir=parted, resume=True, **base))
    assert resumed["resumed_from"].endswith("step-00000008.pt")
    if hvd.rank() == 0:
        a = torch.load(whole["checkpoint"], weights_only=True)
        b = torch.load(resumed["checkpoint"], weights_only=True)
        assert a["scaler"] == b["scaler"]
        for k, v in a["model"].items():
            if hvd.size() <= 2:
                assert torch.equal(b["model"][k], v), k
            else:
                assert torch.allclose(b["model"][k], v, rtol=1e-4, atol=1e-6), k
        assert ckpt.steps_in(os.path.join(parted, "checkpoints")) == [14]  # rank 0 writes and prunes


def test_sync_batch_norm_on_cuda_matches_the_cpu(dev):
    """SyncBatchNorm gathers its statistics on the input's device (they meet x there), so a
    CUDA input gives what the CPU gives; the CPU twin is test_ops' SyncBatchNorm test."""
    n, r = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(7)
    full = torch.randn(3 * n, 4, 5, generator=g, dtype=torch.float64)
    ref = torch.nn.BatchNorm1d(4).double()
    sync = hvd.SyncBatchNorm(4).double().to(dev)
    mine = slice(3 * r, 3 * r + 3)
    x = full[mine].clone().to(dev).requires_grad_()
    y = sync(x)
    y.sum().backward()
    assert y.device == dev and x.grad.device == dev
    close(y.detach().cpu(), ref(full).detach()[mine])


def test_pipeline_on_cuda_receives_onto_the_stage_device(dev):
    """Every stage on the GPU: received activations and gradients land there (the CPU twin
    is test_pipeline's device test)."""
    from hpcdl.parallel import Grid, Pipeline

    if hvd.size() < 2:
        pytest.skip("a pipeline needs 2 stages")
    grid = Grid(dp=1, tp=1, pp=hvd.size())
    torch.manual_seed(5)
    layers = [torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(hvd.size())]
    pipe = Pipeline([lay.to(dev) for lay in layers], grid, chunks=2)
    x = torch.randn(6, 4, dtype=torch.float64, device=dev)
    loss = pipe.train_step(x, x, F.mse_loss)
    torch.manual_seed(5)
    ref = torch.nn.Sequential(*[torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(hvd.size())])
    assert loss == pytest.approx(F.mse_loss(ref(x.cpu()), x.cpu()).item(), rel=1e-10)
    pipe.close()
    grid.close()
