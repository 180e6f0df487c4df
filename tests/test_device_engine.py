"""hpcdl's torch layer on the device path, under mpiexec -n 1..4, on the CuPy stand-in.

On a GPU, a CUDA tensor on the device path reaches the engine as a CuPy view, is
negotiated with ``device`` memory in its signature and runs through the collectives'
device entry points. Here ``fakecupy`` takes CuPy's place and CPU tensors take the CUDA
tensors': the three conversions between torch and CuPy (``device_source``, ``to_cupy``,
``ready_event``) are replaced by host twins; everything after them runs as on a GPU: the
requests, negotiation, fusion into the device buffer, the executors, joined ranks, and
the ``ipc`` schedules on host windows. Results are checked against torch on every rank's
inputs and are bitwise alike on every rank. ``test_device_cuda.py`` runs the same calls on CUDA
tensors where there is a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import types

import fakecupy
import pytest
import torch
from mpi4py import MPI
from tensors import close, data, everyone, expected_reduce

import hpcdl as hvd
from collectives.blocks import block_counts, offsets
from collectives.context import get_context
from collectives.device import ipc
from hpcdl import state
from hpcdl.ops import allgather_into_async, reducescatter_into_async
from hpcdl.ops import requests as reqmod
from hpcdl.staging import MOVABLE, to_numpy

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.timeout(120), pytest.mark.usefixtures("clean_runtime")]

WINDOW = 1 << 14  # the ipc window: calls of more than a few KiB take several chunks


class Ready:
    """The stand-in for a CUDA event recorded when a request was submitted: the engine must
    synchronize it before reading the tensor; ``then`` (a pending "kernel") runs then."""

    def __init__(self, t: torch.Tensor, log: list, pending: dict) -> None:
        self.then = pending.pop(t.data_ptr(), None)
        self.log = log

    def synchronize(self) -> None:
        if self.then is not None:
            self.then()
            self.then = None
        self.log.append(self)


@pytest.fixture()
def device(monkeypatch):
    """The runtime with CPU tensors taken on the device path: CuPy views are the stand-in's
    arrays over the tensors' memory. Gives the log of awaited ready events, the pending
    "kernels" by data pointer, and the global set's engine state."""
    cp = fakecupy.install(monkeypatch)
    log: list[Ready] = []
    pending: dict[int, object] = {}

    def device_source(t, enabled):
        ok = enabled and t.device.type == "cpu" and t.dtype in MOVABLE
        return t.detach().contiguous() if ok else None

    monkeypatch.setattr(reqmod, "device_source", device_source)
    monkeypatch.setattr(reqmod, "to_cupy", lambda t: to_numpy(t).view(cp.ndarray))
    monkeypatch.setattr(reqmod, "ready_event", lambda t: Ready(t, log, pending))
    hvd.init()
    info = state.running().engine.sets.get(0)
    ctx = get_context(info.comm)
    if info.comm.size > 1:  # every rank at once, before the engine first uses the communicator
        ctx.device["ipc"] = ipc.HostPeers(ctx.topology().node, WINDOW)
    yield types.SimpleNamespace(cp=cp, log=log, pending=pending, info=info)
    hvd.shutdown()


def same_everywhere(t: torch.Tensor) -> None:
    every = hvd.allgather_object(t)
    assert all(torch.equal(e, every[0]) for e in every)


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max], ids=["sum", "avg", "max"])
def test_allreduce_forms_on_the_device_path(device, dtype, op):
    n, r = hvd.size(), hvd.rank()
    xs = everyone((3001,), dtype, seed=1)
    want = expected_reduce(xs, op)
    got = hvd.allreduce(xs[r], op=op, name="one")
    close(got, want)
    same_everywhere(got)
    y = xs[r].clone()
    assert hvd.allreduce_(y, op=op, name="inplace") is y
    assert torch.equal(y, got)
    # small tensors fused into the device buffer, a large one alone, with scale factors
    shapes = [(7,), (3, 11), (64,), (50_000,)]
    parts = [everyone(s, dtype, seed=2 + i) for i, s in enumerate(shapes)]
    floating = dtype.is_floating_point
    pre, post = (0.5, 4.0) if floating else (1.0, 1.0)
    before = len(device.log)
    outs = hvd.grouped_allreduce([p[r] for p in parts], op=op, prescale_factor=pre, postscale_factor=post, name="g")
    assert len(device.log) == before + len(shapes)  # every request's event awaited
    for p, o in zip(parts, outs, strict=True):
        close(o, (expected_reduce([x * pre for x in p], op) * post).to(dtype) if floating else expected_reduce(p, op))
        same_everywhere(o)
    if n > 1:
        assert isinstance(device.info.device_fusion, device.cp.ndarray)  # fused on the "GPU"
        assert device.info.fusion.nbytes == 0  # and not in the host buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_allgather_broadcast_alltoall_on_the_device_path(device, dtype):
    n, r = hvd.size(), hvd.rank()
    rows = [1 + 2 * q for q in range(n)]
    parts = [data(q, (rows[q], 3), torch.int64, seed=5).to(dtype) for q in range(n)]
    got = hvd.allgather(parts[r], name="ag")
    assert torch.equal(got, torch.cat(parts))
    assert len(device.log) == 1
    for root in range(n):
        x = data(r, (257,), torch.int64, seed=6).to(dtype)
        want = data(root, (257,), torch.int64, seed=6).to(dtype)
        assert torch.equal(hvd.broadcast(x, root, name=f"b{root}"), want)
        assert hvd.broadcast_(x, root, name=f"bi{root}") is x
        assert torch.equal(x, want)
    splits = [(r + q) % 3 for q in range(n)]
    rows_r = sum(splits)
    x = (torch.arange(rows_r * 2).reshape(rows_r, 2) + 1000 * r).to(dtype)
    out, received = hvd.alltoall(x, splits=splits, name="a2a")
    # rank q sends (q + r) % 3 rows to rank r: its rows starting after those for ranks < r
    want = []
    for q in range(n):
        sq = [(q + p) % 3 for p in range(n)]
        xq = (torch.arange(sum(sq) * 2).reshape(sum(sq), 2) + 1000 * q).to(dtype)
        start = sum(sq[:r])
        want.append(xq[start : start + sq[r]])
    assert torch.equal(out, torch.cat(want))
    assert received.tolist() == [(q + r) % 3 for q in range(n)]
    assert len(device.log) == 1 + 2 * n + 1  # every request's event awaited


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
def test_reducescatter_on_the_device_path(device, dtype):
    n, r = hvd.size(), hvd.rank()
    for rows in (4 * n, 4 * n + 3):  # even rows (reduce-scatter) and uneven (allreduce, then this rank's rows)
        xs = everyone((rows, 5), dtype, seed=rows)
        counts = block_counts(rows, n)
        off = offsets(counts)
        got = hvd.reducescatter(xs[r], op=hvd.Sum, name=f"rs{rows}")
        close(got, expected_reduce(xs, hvd.Sum)[off[r] : off[r + 1]])
        if dtype.is_floating_point:
            got = hvd.reducescatter(xs[r], op=hvd.Average, prescale_factor=2.0, name=f"rsa{rows}")
            close(got, expected_reduce([2 * x for x in xs], hvd.Average)[off[r] : off[r + 1]])
    # into the caller's buffer, as ZeroOptimizer's gradient shard
    flat = everyone((10 * n + 1,), dtype, seed=9)
    counts = block_counts(flat[r].numel(), n)
    off = offsets(counts)
    shard = torch.empty(counts[r], dtype=dtype)
    res = hvd.synchronize(reducescatter_into_async(flat[r], shard, "into", hvd.Sum, hvd.global_process_set, 1.0, 1.0))
    assert res is shard
    close(shard, expected_reduce(flat, hvd.Sum)[off[r] : off[r + 1]])


def test_allgather_into_the_flat_buffer_on_the_device_path(device):
    n, r = hvd.size(), hvd.rank()
    k = 1000
    full = torch.zeros(n * k, dtype=torch.float64)
    shard = full[r * k : (r + 1) * k]
    shard.copy_(data(r, (k,), torch.float64, seed=11))
    res = hvd.synchronize(allgather_into_async(shard, full, "params", hvd.global_process_set))
    assert res is full
    assert torch.equal(full, torch.cat(everyone((k,), torch.float64, seed=11)))


def test_a_request_is_read_only_after_its_ready_event(device):
    """The input holds stale values until its "kernel" runs at the event's synchronize: a
    result computed from it before then would be wrong."""
    n, r = hvd.size(), hvd.rank()
    for shape in [(5,), (40_000,)]:  # fused, and alone
        t = torch.zeros(shape)
        device.pending[t.data_ptr()] = lambda t=t: t.fill_(r + 1.0)
        close(hvd.allreduce(t, op=hvd.Sum, name=f"late{shape[0]}"), torch.full(shape, n * (n + 1) / 2))
    b = torch.zeros(300)
    device.pending[b.data_ptr()] = lambda: b.fill_(7.0)
    assert torch.equal(hvd.broadcast(b, 0, name="lateb"), torch.full((300,), 7.0))


def test_the_timeline_names_the_device_path(device, run_dir):
    n = hvd.size()
    path = os.path.join(run_dir, "device.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(10), name="alone")
    hvd.grouped_allreduce([torch.ones(5), torch.ones(6)], name="fused")
    hvd.allgather(torch.ones(2, 2), name="g")
    hvd.broadcast(torch.ones(3), 0, name="b")
    hvd.reducescatter(torch.ones(4 * n), name="rs")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        spans = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
        data_spans = [e for e in spans if e["name"] in ("ALLREDUCE", "ALLGATHER", "BROADCAST", "REDUCESCATTER")]
        assert {e["name"] for e in data_spans} == {"ALLREDUCE", "ALLGATHER", "BROADCAST", "REDUCESCATTER"}
        assert {e["args"]["algorithm"] for e in data_spans} == {"device"}


def _train(wrap, steps: int = 6) -> torch.Tensor:
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    if wrap is not None:
        opt = wrap(opt, m)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(4 * n, 6, generator=g, dtype=torch.float64)
        y = torch.randn(4 * n, 3, generator=g, dtype=torch.float64)
        if wrap is not None:
            x, y = x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4]
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize(
    "wrap",
    [
        lambda opt, m: hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(), bucket_bytes=512),
        lambda opt, m: hvd.ZeroOptimizer(opt, 1, named_parameters=m.named_parameters(), bucket_bytes=512),
        lambda opt, m: hvd.ZeroOptimizer(opt, 2, named_parameters=m.named_parameters(), bucket_bytes=512),
    ],
    ids=["distributed", "zero1", "zero2"],
)
def test_optimizers_on_the_device_path_equal_one_process_on_the_whole_batch(device, wrap, request):
    got = _train(wrap)
    before = len(device.log)
    want = _train(None)
    # every step's reductions went the device path; on one rank DistributedOptimizer has
    # nothing to reduce and sends nothing
    alone = hvd.size() == 1 and request.node.callspec.id == "distributed"
    assert len(device.log) == before and (before == 0 if alone else before >= 6)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-10, rel
    same_everywhere(got)


@pytest.mark.mpi(min_size=2)
def test_device_memory_on_one_rank_and_host_on_another_fails_everywhere(device, monkeypatch):
    r = hvd.rank()
    if r == 1:  # this rank stages its tensors through host memory
        monkeypatch.setattr(reqmod, "device_source", lambda t, enabled: None)
    for count in (4, 100_000):
        with pytest.raises(hvd.HpcdlError, match=r"memory differs: 'device' on ranks \[0.*'host' on ranks \[1\]"):
            hvd.allreduce(torch.ones(count), name=f"mixed{count}")
    with pytest.raises(hvd.HpcdlError, match="memory differs"):
        hvd.allgather(torch.ones(2, 2), name="mixed-ag")
    monkeypatch.setattr(reqmod, "device_source", lambda t, enabled: t if enabled and t.device.type == "cpu" else None)
    close(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="usable"), torch.full((3,), float(hvd.size())))


@pytest.mark.mpi(min_size=2)
def test_a_joined_rank_stands_in_for_device_allreduces(device):
    n, r = hvd.size(), hvd.rank()
    last = n - 1
    if r == last:
        assert hvd.join() in range(last)  # one of the others joins last
        return
    shapes = [(9,), (33,), (60_000,)]  # fused, and alone
    outs = hvd.grouped_allreduce([torch.full(s, r + 1.0) for s in shapes], op=hvd.Sum, name="j")
    for s, o in zip(shapes, outs, strict=True):
        close(o, torch.full(s, float(sum(q + 1 for q in range(last)))))
    assert isinstance(device.info.device_fusion, device.cp.ndarray)
    hvd.join()


@pytest.mark.mpi(min_size=2)
def test_a_joined_rank_without_cupy_fails_the_device_allreduce_everywhere_instead_of_hanging(device, monkeypatch):
    n, r = hvd.size(), hvd.rank()
    if r == n - 1:
        monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails on this rank
        hvd.join()
    else:
        for shape in [(5,), (60_000,)]:
            with pytest.raises(hvd.HpcdlError, match="memory"):
                hvd.allreduce(torch.ones(shape), name=f"j{shape[0]}")
        hvd.join()
    MPI.COMM_WORLD.Barrier()
    monkeypatch.setitem(sys.modules, "cupy", device.cp)
    close(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="usable"), torch.full((3,), float(n)))
