"""hpcdl's Horovod basics in one process and under mpiexec -n 2, 3, 4: ranks, node layout,
init on a subset, what the build reports."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from mpi4py import MPI

import hpcdl as hvd
from collectives.config import Config
from collectives.context import get_context
from collectives.device.nccl import available as nccl_available

pytestmark = pytest.mark.usefixtures("clean_runtime")

WORLD = MPI.COMM_WORLD


def test_hpcdl_basics_on_one_rank():
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()
    # help() and signatures show the default process set before init
    assert "every rank" in repr(hvd.global_process_set)
    assert "process_set: 'ProcessSet' = ProcessSet(process_set_id=0" in str(inspect.signature(hvd.allreduce))
    with pytest.raises(hvd.HpcdlError, match="list of ranks"):
        hvd.init(comm="world")
    with pytest.raises(hvd.HpcdlError, match=r"distinct world ranks in \[0, 1\)"):
        hvd.init([0, 1])
    hvd.init([0])
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built()
    # what Horovod's scripts ask of a build this one is not: each answers False, not AttributeError
    assert [f() for f in (hvd.gloo_enabled, hvd.ddl_built, hvd.ccl_built, hvd.rocm_built)] == [False] * 4
    assert hvd.nccl_built() is nccl_available()  # CuPy with NCCL loadable: False where CuPy is missing
    assert hvd.cuda_built() is (torch.version.cuda is not None)
    assert isinstance(hvd.mpi_threads_supported(), bool)
    assert hvd.HorovodInternalError is hvd.HpcdlError and issubclass(hvd.HpcdlError, RuntimeError)
    hvd.shutdown()
    hvd.init()
    assert hvd.size() == 1
    hvd.shutdown()
    assert not hvd.is_initialized()


@pytest.mark.mpi
def test_a_launcher_whose_tasks_mpi_sees_as_jobs_of_one_rank_stops_init(monkeypatch):
    # as under Open MPI's mpirun with an mpi4py that loads MPICH: each task alone would train alone
    hvd.shutdown()
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", str(WORLD.size + 2))
    library = MPI.Get_library_version().splitlines()[0].strip()
    if WORLD.size == 1:
        said = rf"^mpiexec \(Open MPI\) started 3 tasks, but MPI sees each as a separate 1-rank job; "
        said += rf"launch with the mpiexec of the MPI library mpi4py loads \({re.escape(library)}\)$"
        with pytest.raises(hvd.HpcdlError, match=said):
            hvd.init([0])
        assert not hvd.is_initialized()
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")  # a launcher of one task: a world of one is right
    hvd.init()  # several ranks: MPI sees the launcher's tasks as one job (however many it says)
    assert hvd.size() == WORLD.size
    hvd.shutdown()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_ranks_and_node_layout_match_mpi():
    hvd.init()
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size()) == (WORLD.rank, WORLD.size)
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    assert (hvd.local_rank(), hvd.local_size()) == (node.rank, node.size)
    # every rank is on this one machine: one node, so cross rank 0 of 1
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous()
    node.Free()
    hvd.init()  # a second init is a no-op, as in Horovod
    assert hvd.size() == WORLD.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_simulated_nodes_give_local_and_cross_ranks():
    # two ranks per simulated node: local = rank % 2, cross = rank // 2
    comm = WORLD.Dup()
    get_context(comm, Config(ranks_per_node=2))
    hvd.init(comm)
    n, r = WORLD.size, WORLD.rank
    assert (hvd.local_rank(), hvd.local_size()) == (r % 2, 2 if r < n - n % 2 else 1)
    assert hvd.cross_rank() == r // 2
    assert hvd.cross_size() == ((n + 1) // 2 if r % 2 == 0 else n // 2)
    assert hvd.is_homogeneous() == (n % 2 == 0)
    hvd.shutdown()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_init_on_a_list_of_ranks():
    members = list(range(1, WORLD.size))
    if WORLD.rank == 0:
        with pytest.raises(hvd.HpcdlError, match="world rank 0 is not in the list"):
            hvd.init(members)
        assert not hvd.is_initialized()
    else:
        hvd.init(members)
        assert (hvd.rank(), hvd.size()) == (WORLD.rank - 1, WORLD.size - 1)
    WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_init_with_lists_that_differ_raises_on_every_rank():
    ranks = [0, 1] if WORLD.rank != 1 else [1, 0]
    with pytest.raises(hvd.HorovodInternalError, match=r"ranks \[1\] passed a different list"):
        hvd.init(ranks)
    assert not hvd.is_initialized()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        ({"comm": [0, 10**6]}, r"rank 1: init\(comm=\[0, 1000000\]\): need distinct world ranks"),
        ({"comm": "world"}, r"rank 1: init\(comm=...\) takes an mpi4py communicator or a list of ranks"),
        ({"config": 5}, r"rank 1: init\(config=...\) takes an hpcdl.Config, not int"),
        ({"process_sets": [[0, 1]]}, r"init\(process_sets=...\): ranks \[1\] passed different process sets"),
    ],
)
def test_bad_init_arguments_on_one_rank_raise_on_every_rank(args, message):
    # only rank 1 passes something wrong; the others would otherwise wait in the exchange
    with pytest.raises(hvd.HpcdlError, match=message):
        hvd.init(**args) if WORLD.rank == 1 else hvd.init()
    assert not hvd.is_initialized()
    hvd.init()  # and init works again afterwards
    assert hvd.size() == WORLD.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pending", ["in flight", "called after"])
def test_a_shutdown_on_one_rank_shuts_every_rank_down_and_init_starts_them_all_again(pending):
    """Rank k shuts down while the others have a request in flight (or make a call after):
    their request fails naming rank k, every rank then reads is_initialized() False, and
    init() on every rank starts a runtime that works; for each k in turn. The MPI barrier
    orders rank k's shutdown after the others' checks and submissions, which would otherwise
    race with it (a request submitted after the shutdown arrived raises at submission)."""
    n, r = WORLD.size, WORLD.rank
    for stopper in range(n):
        hvd.init()
        assert hvd.is_initialized()
        handle = None
        if r != stopper and pending == "in flight":
            handle = hvd.allreduce_async(torch.ones(4), op=hvd.Sum, name="never-on-the-stopper")
        WORLD.Barrier()
        if r == stopper:
            hvd.shutdown()
        else:
            with pytest.raises(hvd.HpcdlError, match=rf"shut down by rank {stopper}; call hpcdl.init\(\)"):
                if handle is not None:
                    hvd.synchronize(handle)
                else:
                    hvd.barrier()
        assert not hvd.is_initialized()
        hvd.init()
        assert hvd.is_initialized()
        out = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name=f"after-{stopper}")
        assert torch.equal(out, torch.full((3,), float(sum(range(n)))))
        hvd.shutdown()
