"""hpcdl's engine under mpiexec -n 2..4: every mismatch raises on every rank (and the runtime
stays usable), stalls are reported and, with a shutdown time, end in an error on every
rank; the timeline holds every rank's events; engine settings that steer decisions agree."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl as hvd

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(120), pytest.mark.usefixtures("clean_runtime")]

WORLD = MPI.COMM_WORLD


def usable() -> None:
    """The runtime still works: a sum over every rank."""
    out = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="still-usable")
    assert torch.equal(out, torch.full((3,), float(hvd.size())))


@pytest.mark.parametrize(
    "what, make, pattern",
    [
        ("shape", lambda r: hvd.allreduce(torch.ones(3 + (r == 1)), name="x"), r"shape differs: \(3,\) on ranks \[0"),
        (
            "dtype",
            lambda r: hvd.allreduce(torch.ones(3, dtype=torch.float64 if r == 1 else torch.float32), name="x"),
            r"dtype differs: 'float32' on ranks \[0.*'float64' on ranks \[1\]",
        ),
        ("op", lambda r: hvd.allreduce(torch.ones(3), op=hvd.Max if r == 1 else hvd.Sum, name="x"), "op differs"),
        (
            "kind",
            lambda r: hvd.broadcast(torch.ones(3), 0, name="x") if r == 1 else hvd.allreduce(torch.ones(3), name="x"),
            "operation differs: 'allreduce' on ranks .*'broadcast' on ranks \\[1\\]",
        ),
        ("root", lambda r: hvd.broadcast(torch.ones(3), r % 2, name="x"), "root_rank differs"),
        (
            "allgather item shape",
            lambda r: hvd.allgather(torch.ones(2, 3 + (r == 1)), name="x"),
            "shape after the first dimension differs",
        ),
        (
            "bad input on one rank",
            lambda r: hvd.allreduce(torch.ones(3, dtype=torch.bool if r == 1 else torch.float32), name="x"),
            r"rank 1: allreduce does not support dtype bool",
        ),
        (
            "device on one rank",
            lambda r: hvd.allreduce(torch.ones(3, device="meta" if r == 1 else "cpu"), name="x"),
            r"rank 1: tensor on meta: hpcdl moves CPU and CUDA tensors only",
        ),
        (
            "scale factor on one rank",
            lambda r: hvd.allreduce(torch.ones(3, dtype=torch.int32), prescale_factor=2.0 if r == 1 else 1.0, name="x"),
            r"ranks disagree on allreduce 'x': prescale_factor differs",
        ),
    ],
)
def test_mismatch_raises_on_every_rank_and_the_runtime_stays_usable(what, make, pattern):
    hvd.init()
    with pytest.raises(hvd.HpcdlError, match=pattern):
        make(hvd.rank())
    usable()
    with pytest.raises(hvd.HorovodInternalError):  # Horovod's name for the same error
        make(hvd.rank())
    usable()


def test_mismatch_after_the_signature_was_cached():
    hvd.init()
    for _ in range(3):
        hvd.allreduce(torch.ones(4), name="cached")
    # rank 0 sends the cached bit, rank 1 a new descriptor: still compared
    with pytest.raises(hvd.HpcdlError, match=r"shape differs: \(4,\) on ranks \[0"):
        hvd.allreduce(torch.ones(4 if hvd.rank() != 1 else 5), name="cached")
    usable()


def test_duplicate_name_in_flight_is_a_local_error():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    # rank r's own name "dup-r" cannot complete before the other ranks submit it, which they
    # do only after the out-of-band barrier: so it is surely still in flight when rank r
    # submits it again (a single shared name could complete in between)
    own = hvd.allreduce_async(torch.full((2,), float(r)), op=hvd.Sum, name=f"dup-{r}")
    with pytest.raises(hvd.HpcdlError, match=f"'dup-{r}': a request with this name is already in flight"):
        hvd.allreduce_async(torch.ones(2), name=f"dup-{r}")
    WORLD.Barrier()
    others = {
        q: hvd.allreduce_async(torch.full((2,), float(q)), op=hvd.Sum, name=f"dup-{q}") for q in range(n) if q != r
    }
    assert torch.equal(hvd.synchronize(own), torch.full((2,), float(r * n)))
    for q, h in others.items():
        assert torch.equal(hvd.synchronize(h), torch.full((2,), float(q * n)))
    usable()


def test_adasum_and_bad_arguments():
    hvd.init()
    # an op on one rank only: every rank raises, naming who passed what
    pattern = r"ranks disagree on allreduce 'ada': op differs: 'sum' on ranks|rank 1: op=Adasum needs a power-of-two"
    with pytest.raises(hvd.HpcdlError, match=pattern):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum if hvd.rank() == 1 else hvd.Sum, name="ada")
    with pytest.raises(TypeError, match="takes torch.Tensor arguments"):
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(hvd.HpcdlError, match=r"root_rank=\d+ is not a rank"):
        hvd.broadcast(torch.ones(2), hvd.size())
    usable()


@pytest.mark.parametrize(
    "splits, rows, pattern",
    [
        (lambda n: [1] * n, lambda n: n + 1, r"must be \d+ non-negative row counts, one per rank"),
        (lambda n: [-1] + [1] * (n - 1), lambda n: n - 2, r"must be \d+ non-negative row counts"),
        (lambda n: [1.5] * n, lambda n: 3, r"must be integers"),
        (lambda n: torch.ones(n, dtype=torch.float32), lambda n: n, r"must be integers"),
        (lambda n: None, lambda n: n + 1, r"do not divide evenly over \d+ ranks; pass splits"),
    ],
    ids=["sum", "negative", "floats", "float-tensor", "even-split"],
)
def test_alltoall_splits_are_argument_errors_on_every_rank(splits, rows, pattern):
    """Bad splits on rank 1 only: every rank raises an HpcdlArgumentError (a ValueError)."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    with pytest.raises(ValueError, match=pattern) as info:  # the other ranks pass good splits
        hvd.alltoall(torch.ones(rows(n) if r == 1 else n), splits=splits(n) if r == 1 else [1] * n, name="a2a")
    assert isinstance(info.value, hvd.HpcdlArgumentError)
    usable()


def test_check_on_every_rank_raises_one_message_everywhere_or_returns_the_payloads():
    """A problem found on some ranks is the same error on every rank of the set; without one
    every rank gets every rank's payload."""
    from hpcdl.functions import check_on_every_rank

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert check_on_every_rank(None, payload=r * r) == [q * q for q in range(n)]
    odd = [q for q in range(n) if q % 2]
    want = "; ".join(f"rank {q}: bad {q}" for q in odd)
    with pytest.raises(hvd.HpcdlArgumentError) as info:
        check_on_every_rank(f"bad {r}" if r % 2 else None, hvd.HpcdlArgumentError, payload=r)
    assert str(info.value) == want
    with pytest.raises(KeyError, match="everywhere"):  # the same problem everywhere is said once
        check_on_every_rank("everywhere", KeyError)
    if n > 2:  # over a process set, named by the ranks of the whole job
        last = hvd.add_process_set([0, n - 1])
        if last.included():
            with pytest.raises(hvd.HpcdlError, match=rf"^rank {n - 1}: late$"):
                check_on_every_rank("late" if r == n - 1 else None, process_set=last)
        hvd.remove_process_set(last)
    usable()


def test_a_name_in_flight_is_an_argument_error():
    hvd.init()
    h = hvd.allreduce_async(torch.ones(2), name="twice")
    with pytest.raises(ValueError, match="already in flight on this rank") as info:
        hvd.allreduce_async(torch.ones(2), name="twice")
    assert isinstance(info.value, hvd.HpcdlError)
    hvd.synchronize(h)
    usable()


def test_wrong_types_name_the_argument_and_what_is_accepted_on_every_rank():
    hvd.init()
    r = hvd.rank()
    accepted = "hpcdl.Average, Sum, Adasum, Min, Max, Product"
    with pytest.raises(hvd.HpcdlError, match=rf"rank 1: op=.sum. is not one of {accepted}"):
        hvd.allreduce(torch.ones(2), op="sum" if r == 1 else hvd.Sum, name="str-op")
    # numpy integers are ranks too; a bad one is shown as a plain integer
    got = hvd.broadcast(torch.full((2,), float(r)), root_rank=np.int64(1), name="np-root")
    assert torch.equal(got, torch.ones(2))
    with pytest.raises(hvd.HpcdlError, match=rf"root_rank={hvd.size()} is not a rank") as info:
        hvd.broadcast(torch.ones(2), root_rank=np.int64(hvd.size()), name="np-bad-root")
    assert "np.int64" not in str(info.value)
    with pytest.raises(TypeError, match="process_set must be a ProcessSet, not str"):
        hvd.allreduce(torch.ones(2), process_set="all")
    usable()


def test_in_place_into_a_leaf_that_requires_grad_is_refused_on_every_rank_as_torch_does():
    hvd.init()
    r = hvd.rank()
    leaf = torch.ones(3, requires_grad=True)
    plain = torch.ones(3)
    with pytest.raises(hvd.HpcdlError, match=r"rank 1: allreduce_ would write in place into a leaf tensor"):
        hvd.allreduce_(leaf if r == 1 else plain, name="leaf")
    with pytest.raises(hvd.HpcdlError, match=r"broadcast_ would write in place into a leaf tensor"):
        hvd.broadcast_(leaf, root_rank=0, name="leaf-bcast")
    assert torch.equal(leaf.detach(), torch.ones(3))  # untouched
    with torch.no_grad():  # as torch allows it there
        hvd.allreduce_(leaf, op=hvd.Sum, name="leaf-no-grad")
    assert torch.equal(leaf.detach(), torch.full((3,), float(hvd.size())))
    usable()


def test_names_that_differ_stall_and_end_in_an_error_on_every_rank():
    hvd.init(config=hvd.Config(stall_check_time_seconds=0.5, stall_shutdown_time_seconds=1.5))
    r = hvd.rank()
    t0 = time.monotonic()
    with pytest.raises(hvd.HpcdlError) as info:
        hvd.allreduce(torch.ones(2), name=f"named-by-rank-{r}")
    msg = str(info.value)
    assert "HPCDL_STALL_SHUTDOWN_TIME_SECONDS" in msg
    for q in range(hvd.size()):  # every rank's name, with the ranks missing it
        others = [p for p in range(hvd.size()) if p != q]
        assert f"'named-by-rank-{q}' submitted by ranks [{q}], missing on ranks {others}" in msg
    assert time.monotonic() - t0 < 30
    with pytest.raises(hvd.HpcdlError, match="stalled"):  # the engine has stopped everywhere
        usable()
    hvd.shutdown()
    hvd.init()
    usable()


def test_a_rank_that_never_submits_is_reported_then_shut_down(caplog):
    hvd.init(config=hvd.Config(stall_check_time_seconds=0.3, stall_shutdown_time_seconds=1.5))
    r = hvd.rank()
    caplog.set_level(logging.WARNING, logger="hpcdl")
    if r != 1:
        with pytest.raises(hvd.HpcdlError, match=r"'lonely' submitted by ranks \[0.*missing on ranks \[1\]"):
            hvd.allreduce(torch.ones(2), name="lonely")
    else:
        time.sleep(3.0)  # rank 1 never submits; its engine still takes part in the cycles
        with pytest.raises(hvd.HpcdlError, match="'lonely'.*missing on ranks \\[1\\]"):
            hvd.allreduce(torch.ones(2), name="other")
    if r == 0:
        warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
        assert any("'lonely' submitted by ranks" in w and "missing on ranks [1]" in w for w in warnings)


def test_a_late_rank_is_only_logged_without_a_shutdown_time(caplog):
    hvd.init(config=hvd.Config(stall_check_time_seconds=0.3))
    caplog.set_level(logging.WARNING, logger="hpcdl")
    if hvd.rank() == 1:
        time.sleep(1.5)
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="late")
    assert torch.equal(out, torch.full((2,), float(hvd.size())))
    if hvd.rank() == 0:
        assert any("'late' submitted by ranks" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("late", [False, True], ids=["pending", "submitted-after"])
def test_shutdown_on_one_rank_fails_the_others_requests(late):
    hvd.init()
    if hvd.rank() == 1:
        hvd.shutdown()
        with pytest.raises(ValueError, match="not been initialized"):
            hvd.allreduce(torch.ones(2))
        return
    if late:
        time.sleep(1.0)  # rank 1's shutdown has certainly gone through every engine by now
    with pytest.raises(hvd.HpcdlError, match="shut down by rank 1"):
        hvd.allreduce(torch.ones(2), name="never")
    with pytest.raises(hvd.HpcdlError, match="shut down by rank 1"):  # and it stays so
        hvd.allreduce(torch.ones(2))


@pytest.fixture
def shared_dir():
    """A temporary directory named by rank 0 (every rank's pytest tmp_path would race)."""
    path = WORLD.bcast(tempfile.mkdtemp() if WORLD.rank == 0 else None)
    yield path
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_a_timeline_rank_0_cannot_write_raises_on_every_rank_at_its_start(shared_dir, monkeypatch):
    """start_timeline and HPCDL_TIMELINE with a path in a missing directory raise on every
    rank when they start, naming the path (not when the trace is written, at the end)."""
    missing = os.path.join(shared_dir, "no", "trace.json")
    hvd.init()
    with pytest.raises(hvd.HpcdlArgumentError, match=rf"rank 0: start_timeline\('{missing}'\): its directory"):
        hvd.start_timeline(missing)
    hvd.allreduce(torch.ones(2), name="after the refused timeline")  # the runtime goes on
    hvd.shutdown()
    monkeypatch.setenv("HPCDL_TIMELINE", missing)
    with pytest.raises(hvd.HpcdlError, match=rf"rank 0: HPCDL_TIMELINE='{missing}': its directory .* does not exist"):
        hvd.init()
    assert not hvd.is_initialized()


def test_timeline_has_every_ranks_events(shared_dir):
    path = os.path.join(shared_dir, "timeline.json")
    hvd.init()
    hvd.start_timeline(path, mark_cycles=True)
    handles = [hvd.allreduce_async(torch.ones(10 + k), name=f"t.{k}") for k in range(6)]
    for h in handles:
        hvd.synchronize(h)
    hvd.allgather(torch.ones(hvd.rank() + 1, 2), name="gathered")
    hvd.broadcast(torch.ones(3), 0, name="sent")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        doc = json.load(open(path))
        events = doc["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == set(range(hvd.size()))
        for rank in range(hvd.size()):
            names = {e["name"] for e in spans if e["pid"] == rank}
            assert {"QUEUE", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "ALLGATHER", "BROADCAST"} <= names
            rows = [e for e in events if e["ph"] == "M" and e["pid"] == rank and e["name"] == "process_name"]
            assert rows[0]["args"]["name"] == f"rank {rank}"
        algs = {e["args"]["algorithm"] for e in spans if e["name"] == "ALLREDUCE"}
        assert algs and all(isinstance(a, str) and a for a in algs)
        assert any(e["name"] == "CYCLE_START" for e in events)
    usable()


def test_timeline_from_the_config_is_written_at_shutdown(shared_dir):
    path = os.path.join(shared_dir, "env-timeline.json")
    hvd.init(config=hvd.Config(timeline=path, fusion_threshold=1 << 20))
    handles = [hvd.allreduce_async(torch.ones(100), name=f"f.{k}") for k in range(8)]
    for h in handles:
        hvd.synchronize(h)
    hvd.shutdown()
    WORLD.Barrier()
    if WORLD.rank == 0:
        spans = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == set(range(WORLD.size))
        fused = [e for e in spans if e["name"] == "ALLREDUCE" and e["args"].get("fused", 1) > 1]
        assert fused, "eight small tensors submitted together should share a fusion buffer"
        assert any(e["name"] == "MEMCPY_IN_FUSION_BUFFER" for e in spans)


def test_engine_settings_that_steer_decisions_must_agree():
    cfg = hvd.Config(fusion_threshold=0) if WORLD.rank == 1 else hvd.Config()
    with pytest.raises(hvd.HpcdlError, match=r"same fusion_threshold \(HPCDL_FUSION_THRESHOLD\).*0 on rank 1"):
        hvd.init(config=cfg)
    assert not hvd.is_initialized()
    hvd.init(config=hvd.Config(cycle_time=5.0 if WORLD.rank == 1 else 1.0))  # local only: fine
    usable()


def test_timeline_started_twice_raises_on_every_rank(shared_dir):
    hvd.init()
    path = os.path.join(shared_dir, "twice.json")
    hvd.start_timeline(path)
    with pytest.raises(hvd.HpcdlError, match="already being written"):
        hvd.start_timeline(path)
    hvd.stop_timeline()
    usable()


def test_a_name_belongs_to_its_process_set_and_crossed_sets_raise_on_every_rank():
    """As in Horovod, disjoint sets (a grid's data-parallel groups) use one name at once;
    ranks that submit one name in two sets, each waiting for the other's ranks, raise."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    evens, odds = hvd.add_process_set(range(0, n, 2)), hvd.add_process_set(range(1, n, 2))
    mine = evens if r % 2 == 0 else odds
    for _ in range(2):  # the second time from the response cache
        got = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="shared", process_set=mine)
        assert got.item() == sum(mine.ranks)
    both = hvd.add_process_set([0, 1])
    other = hvd.add_process_set([0, 1, *range(2, n)])  # every rank, as a second set
    if r in (0, 1):  # rank 0 names the world's copy, rank 1 the pair's: each waits for the other
        ps = both if r == 1 else other
    else:  # a member of the world's copy that comes late must get the error too, not wait alone
        ps = other
        time.sleep(0.5)
    with pytest.raises(hvd.HpcdlError, match=r"ranks disagree on request 'crossed': process set differs"):
        hvd.allreduce(torch.ones(2), name="crossed", process_set=ps)
    usable()
    for ps in (evens, odds, both, other):
        hvd.remove_process_set(ps)


def test_removing_a_process_set_with_a_request_pending_raises_on_every_rank():
    hvd.init()
    ps = hvd.add_process_set([0, 1])
    x = torch.ones(2)
    h = hvd.allreduce_async(x, name="pending", op=hvd.Sum, process_set=ps) if hvd.rank() == 0 else None
    with pytest.raises(hvd.HpcdlError, match=r"still has requests in flight: \['pending'\]"):
        hvd.remove_process_set(ps)
    if hvd.rank() == 1:  # the missing member catches up; then removal works
        assert torch.equal(hvd.allreduce(x, name="pending", op=hvd.Sum, process_set=ps), x * 2)
    if h is not None:
        assert torch.equal(hvd.synchronize(h), x * 2)
    assert hvd.remove_process_set(ps)
    usable()


def test_distributed_optimizer_arguments_raise_on_every_rank():
    hvd.init()
    lin = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
    with pytest.raises(hvd.HpcdlError, match="op must be one of hpcdl.Average, hpcdl.Sum, hpcdl.Adasum"):
        hvd.DistributedOptimizer(sgd, op=hvd.Max)
    with pytest.raises(hvd.HpcdlArgumentError, match=r"groups='two' must be a non-negative integer or a list"):
        hvd.DistributedOptimizer(sgd, groups="two")
    with pytest.raises(hvd.HpcdlError, match=r"duplicate names: \['w'\]"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("w", lin.weight), ("w", lin.bias)])
    with pytest.raises(hvd.HpcdlError, match=r"misses optimizer parameters at positions \[1\]"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("w", lin.weight)])
    with pytest.raises(hvd.HpcdlError, match="backward_passes_per_step=0 must be a positive integer"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=lin.named_parameters())
    lin(torch.ones(1, 2)).sum().backward()  # the bucket is in flight
    with pytest.raises(hvd.HpcdlError, match="set_backward_passes_per_step.*in flight"):
        opt.set_backward_passes_per_step(2)
    opt.step()
    usable()
