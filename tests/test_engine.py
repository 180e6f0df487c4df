"""Waiting without spinning, under mpiexec -n 2..4: the engine's two doorbells (shared memory
with futexes, and MPI messages) both run the engine correctly, including late ranks and a
stall that ends in an error; an idle engine on shared-memory doorbells uses no CPU; a rank
waiting in a node collective for a late peer sleeps instead of spinning."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives as C
import hpcdl as hvd
from collectives import unchecked
from collectives.context import get_context
from collectives.node import channel
from hpcdl.engine.doorbell import MPIDoorbell, ShmDoorbell

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(120), pytest.mark.usefixtures("clean_runtime")]

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "mpi"])
def test_both_doorbells_run_the_engine(shm):
    hvd.init(config=hvd.Config(shm_doorbell=shm, stall_check_time_seconds=0.3, stall_shutdown_time_seconds=1.5))
    n, r = hvd.size(), hvd.rank()
    # every rank of this job is on one node, so the shared-memory doorbell is taken when asked for
    assert type(hvd.state.current().engine.bell) is (ShmDoorbell if shm else MPIDoorbell)
    for i in range(20):
        if r == i % n:
            time.sleep(0.02)  # a different late rank each time: the others' engines wait for its ring
        x = torch.full((5,), float(r + i))
        out = hvd.allreduce(x, op=hvd.Sum, name=f"t{i}")
        assert torch.equal(out, torch.full((5,), float(sum(range(n)) + n * i)))
    handles = [hvd.allreduce_async(torch.full((3,), float(r)), op=hvd.Sum, name=f"a{i}") for i in range(8)]
    for h in handles:
        assert torch.equal(hvd.synchronize(h), torch.full((3,), float(sum(range(n)))))
    # a stall still ends in an error on every rank, with the engine asleep between cycles
    with pytest.raises(hvd.HpcdlError, match="submitted by ranks"):
        hvd.allreduce(torch.ones(2), name=f"only-{r}")
    hvd.shutdown()
    hvd.init(config=hvd.Config(shm_doorbell=shm))
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="again")
    assert torch.equal(out, torch.full((2,), float(n)))


def test_ranks_that_disagree_on_the_doorbell_all_use_mpi():
    hvd.init(config=hvd.Config(shm_doorbell=WORLD.rank != 1))
    assert type(hvd.state.current().engine.bell) is MPIDoorbell
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="mixed")
    assert torch.equal(out, torch.full((2,), float(hvd.size())))


def test_an_idle_engine_on_shared_memory_doorbells_sleeps():
    hvd.init(config=hvd.Config(shm_doorbell=True))
    hvd.allreduce(torch.ones(2), name="warm")
    engine = hvd.state.current().engine
    c0, t0 = engine.thread_cpu_seconds(), time.perf_counter()
    time.sleep(1.0)
    spent, idle = engine.thread_cpu_seconds() - c0, time.perf_counter() - t0
    # polling MPI every 0.2-2 ms costs 10-40 ms of CPU a second here; sleeping costs ~nothing
    assert spent < 0.01 * idle, f"the idle engine used {spent * 1e3:.1f} ms of CPU in {idle:.2f} s"
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after-idle")  # and it wakes for work
    assert torch.equal(out, torch.full((2,), float(hvd.size())))


@pytest.mark.parametrize("count", [4, 1 << 20], ids=["one-step", "chunked"])
def test_a_rank_waiting_for_a_late_peer_sleeps(count):
    comm = WORLD.Dup()
    try:
        ch = get_context(comm).chan
        assert ch is not None  # every rank on one node
        x = np.full(count, float(comm.rank + 1), np.float32)
        C.allreduce(x, comm=comm)  # warm: the window exists
        comm.Barrier()
        if comm.rank == 0:
            time.sleep(0.4)
        cpu, t = time.thread_time(), time.perf_counter()
        out = C.allreduce(x, comm=comm)
        spent, waited = time.thread_time() - cpu, time.perf_counter() - t
        assert np.array_equal(out, np.full(count, float(sum(range(1, comm.size + 1))), np.float32))
        if comm.rank != 0:
            assert waited > 0.3
            assert spent < 0.5 * waited, f"spent {spent * 1e3:.0f} ms of CPU waiting {waited * 1e3:.0f} ms"
        # the engine's hint: while its user thread computes, poll only briefly before sleeping
        unchecked.set_polite(comm, lambda: True)
        assert ch.budget() == channel.POLITE_SPIN
        unchecked.set_polite(comm, None)
        assert ch.budget() == ch.spin
    finally:
        comm.Free()
