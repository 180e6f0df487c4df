"""Emulated links between nodes (``HPCDL_LINK``): messages across nodes take the link's
latency and bandwidth, the node's port is shared by the flows that leave it, and results
are bitwise those without a link. Timings are checked where the emulated cost dwarfs
this machine's own (milliseconds against tens of microseconds)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI
from reference import digest, make_input

import collectives as C
from collectives.config import Config
from collectives.context import get_context
from collectives.cost import AlphaBeta, fit, link_from_allreduce, parse_link, ring_allreduce
from collectives.errors import ConfigError
from collectives.link import LinkTransport

WORLD = MPI.COMM_WORLD
N, ME = WORLD.Get_size(), WORLD.Get_rank()
SLOW = "latency=5ms,bandwidth=100MB/s"


def linked(link: str = SLOW, per_node: int = 1) -> MPI.Comm:
    comm = WORLD.Dup()
    get_context(comm, Config(link=link, ranks_per_node=per_node))
    return comm


def _best(run, reps: int = 3) -> float:
    """The fastest of ``reps`` timed calls of ``run`` (every rank starting together)."""
    times = []
    for _ in range(reps):
        WORLD.Barrier()
        t0 = time.perf_counter()
        run()
        times.append(WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return min(times)


def test_a_bad_link_is_a_config_error():
    with pytest.raises(ConfigError, match="expected one of"):
        Config(link="carrier-pigeon")
    with pytest.raises(ConfigError, match="latency"):
        Config(link="latency=fast")
    assert parse_link(Config(link="ib-hdr").link) == AlphaBeta(2e-6, 25e9)


@pytest.mark.mpi(min_size=2)
def test_a_ping_pong_across_the_link_measures_its_latency_and_bandwidth():
    comm = linked()
    t = get_context(comm).transport
    assert isinstance(t, LinkTransport) and len(set(t.nodes)) == N
    points = []
    for nbytes in (8, 1 << 20):
        buf = np.zeros(nbytes, np.uint8)

        def pingpong(buf=buf) -> None:
            if ME == 0:
                t.isend(buf, 1, 7).Wait()
                t.irecv(buf, 1, 8).Wait()
            elif ME == 1:
                t.irecv(buf, 0, 7).Wait()
                t.isend(buf, 0, 8).Wait()

        points.append((nbytes, _best(pingpong) / 2))
    got = fit(points)
    assert got.alpha == pytest.approx(5e-3, rel=0.10) and got.beta == pytest.approx(100e6, rel=0.10), got
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_flat_ring_allreduce_across_the_link_measures_its_latency_and_bandwidth():
    if N > 2:  # on a small machine, ranks beyond its cores wait milliseconds for MPI's own calls
        pytest.skip("timed at 2 ranks")
    comm = linked()
    sizes = (4 << 10, 4 << 20)
    points = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        points.append((nbytes, _best(lambda x=x: C.allreduce(x, algorithm="ring", comm=comm))))
    got = link_from_allreduce(fit(points), N)
    assert got.alpha == pytest.approx(5e-3, rel=0.10) and got.beta == pytest.approx(100e6, rel=0.10), got
    for nbytes, seconds in points:  # the one cost model the planner uses predicts each call
        assert seconds == pytest.approx(ring_allreduce(parse_link(SLOW), N, nbytes), rel=0.10)
    comm.Free()


@pytest.mark.mpi(min_size=4)
def test_two_flows_leaving_one_node_share_its_port():
    # two simulated nodes of two ranks: ranks 0 and 1 send 2 MiB each to 2 and 3 at once,
    # and each flow gets about half the bandwidth; alone, a flow gets all of it
    comm = linked("latency=1ms,bandwidth=100MB/s", per_node=2)
    t = get_context(comm).transport
    assert t.nodes[0] == t.nodes[1] != t.nodes[2] == t.nodes[3]
    buf = np.zeros(2 << 20, np.uint8)
    alone = 1e-3 + buf.nbytes / 100e6

    def flows(senders: tuple[int, ...]) -> None:
        if ME in senders:
            t.isend(buf, ME + 2, 9).Wait()
        elif ME - 2 in senders:
            t.irecv(buf, ME - 2, 9).Wait()

    assert _best(lambda: flows((0,))) == pytest.approx(alone, rel=0.10)
    assert _best(lambda: flows((0, 1))) == pytest.approx(alone + buf.nbytes / 100e6, rel=0.10)
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_results_across_the_link_are_bitwise_those_without_it():
    plain, slow = WORLD.Dup(), linked("latency=20us,bandwidth=5GB/s")
    get_context(plain, Config(ranks_per_node=1))
    x = make_input(ME, 100_003, np.float32, "sum", seed=3)
    for alg in ("ring", "recursive_doubling", "rabenseifner", "hierarchical", "auto"):
        want = C.allreduce(x, algorithm=alg, comm=plain)
        assert digest(C.allreduce(x, algorithm=alg, comm=slow)) == digest(want), alg
    assert digest(C.allgather(x[:999], comm=slow)) == digest(C.allgather(x[:999], comm=plain))
    assert digest(C.broadcast(x, root=N - 1, comm=slow)) == digest(C.broadcast(x, root=N - 1, comm=plain))
    assert get_context(slow).transport.crossed > 0
    # across emulated nodes auto never picks MPI's own calls, which would not pay the link
    from collectives.select import choose

    assert all(choose(get_context(slow), "allreduce", s) != "native" for s in (8, 1 << 12, 1 << 20, 1 << 26))
    plain.Free()
    slow.Free()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_links_fail_alike():
    comm = WORLD.Dup()
    with pytest.raises(ConfigError, match="set HPCDL_LINK alike on every rank"):
        get_context(comm, Config(link="eth-10g" if ME == 0 else "eth-25g", ranks_per_node=1))
    comm.Free()
