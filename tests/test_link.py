"""Emulated links between nodes (``HPCDL_LINK``): messages across nodes take the link's
latency and bandwidth, the node's port is shared by the flows that leave it, and results
are bitwise those without a link. Timings are checked where the emulated cost dwarfs
this machine's own (milliseconds against tens of microseconds). The same holds for the
communicators the parameter servers and the pipeline wrap (tests/test_ps.py times the servers)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI
from reference import digest, make_input

import collectives as C
from collectives.config import Config
from collectives.context import get_context, node_transport
from collectives.cost import AlphaBeta, fit, link_from_allreduce, parse_link, ring_allreduce
from collectives.errors import ConfigError
from collectives.link import LinkComm, LinkTransport, emulate_comm, locate
from collectives.select import choose
from collectives.transport import MPITransport
from hpcdl.parallel.pp_comm import ACT, Link

WORLD = MPI.COMM_WORLD
N, ME = WORLD.Get_size(), WORLD.Get_rank()
SLOW = "latency=20ms,bandwidth=100MB/s"  # so that this machine's own cost of a message is a few % at most


def linked(link: str = SLOW, per_node: int = 1) -> MPI.Comm:
    comm = WORLD.Dup()
    get_context(comm, Config(link=link, ranks_per_node=per_node))
    return comm


def _best(run, reps: int = 3) -> float:
    """The fastest of ``reps`` timed calls of ``run``, each timed on every rank from one
    instant of the machine's clock (the one the link stamps its messages with) to the last
    rank's end. A clock started at each rank's own barrier exit would let a receiver that
    left the barrier late miss part of the link's time (ranks beyond the cores leave it
    milliseconds apart); from a common start, a late rank can only add time, which the
    fastest of the calls leaves out. Ranks done early wait for the others asleep: spinning in
    MPI's reduction, ranks beyond the cores would take them from the ranks still timed."""
    times = []
    for _ in range(reps):
        start = WORLD.allreduce(time.perf_counter(), op=MPI.MAX) + 10e-3  # time for every rank to leave it
        while (left := start - time.perf_counter()) > 0:
            time.sleep(left)
        run()
        elapsed = time.perf_counter() - start
        done = WORLD.Ibarrier()
        while not done.Test():
            time.sleep(1e-3)
        times.append(WORLD.allreduce(elapsed, op=MPI.MAX))
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
    for nbytes in (8, 4 << 20):
        buf = np.zeros(nbytes, np.uint8)

        def pingpong(buf=buf) -> None:
            if ME == 0:
                t.isend(buf, 1, 7).Wait()
                t.irecv(buf, 1, 8).Wait()
            elif ME == 1:
                t.irecv(buf, 0, 7).Wait()
                t.isend(buf, 0, 8).Wait()

        points.append((nbytes, _best(pingpong, reps=5) / 2))
    got = fit(points)
    assert got.alpha == pytest.approx(20e-3, rel=0.10) and got.beta == pytest.approx(100e6, rel=0.10), got
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spin", [-1, 0, 100])
def test_waits_on_the_link_poll_only_where_every_rank_has_a_core(spin):
    """A wait on the link's messages sleeps 20 µs between looks where ranks share cores (a
    timer's sleep: 77 µs on a virtual machine, which drowns an emulated latency of 5 µs) and
    polls where every rank has a core, decided by all the ranks of the communicator a
    transport was made over, which its splits keep; HPCDL_SHM_SPIN decides where set."""
    import os

    cpus = WORLD.allgather(sorted(os.sched_getaffinity(0)))  # every rank of these tests is on this machine
    want = N <= len(set().union(*map(set, cpus))) if spin < 0 else spin > 0
    comm = WORLD.Dup()
    t = get_context(comm, Config(link="eth-100g", ranks_per_node=1, shm_spin=spin)).transport
    half = t.split(ME % 2, ME)  # fewer ranks than cores, maybe: still the whole machine's decision
    assert isinstance(t, LinkTransport) and t.poll == want and half.poll == want
    reqs = [t.isend(np.zeros(1), (ME + 1) % N, 3), t.irecv(np.zeros(1), (ME - 1) % N, 3)]
    assert [r.poll for r in reqs] == [want, want]
    reqs[0].Waitall(reqs)
    x = np.arange(1000, dtype=np.float32) + ME
    want_sum = sum(np.arange(1000, dtype=np.float32) + r for r in range(N))
    np.testing.assert_array_equal(C.allreduce(x, algorithm="ring", comm=comm), want_sum)
    half.free()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_flat_ring_allreduce_across_the_link_measures_its_latency_and_bandwidth():
    comm = linked()
    sizes = (4 << 10, 4 << 20)
    points = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        points.append((nbytes, _best(lambda x=x: C.allreduce(x, algorithm="ring", comm=comm), reps=5)))
    got = link_from_allreduce(fit(points), N)
    assert got.alpha == pytest.approx(20e-3, rel=0.10) and got.beta == pytest.approx(100e6, rel=0.10), got
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
    for alg in ("ring", "recursive_doubling", "rabenseifner", "hierarchical"):
        want = C.allreduce(x, algorithm=alg, comm=plain)
        assert digest(C.allreduce(x, algorithm=alg, comm=slow)) == digest(want), alg
    picked = choose(get_context(slow), "allreduce", x.nbytes)  # auto: what the link's model says
    want = C.allreduce(x, algorithm=picked, comm=plain)
    assert digest(C.allreduce(x, comm=slow)) == digest(want)
    assert digest(C.allgather(x[:999], comm=slow)) == digest(C.allgather(x[:999], comm=plain))
    assert digest(C.broadcast(x, root=N - 1, comm=slow)) == digest(C.broadcast(x, root=N - 1, comm=plain))
    assert get_context(slow).transport.crossed > 0
    # across emulated nodes auto never picks MPI's own calls, which would not pay the link
    assert all(choose(get_context(slow), "allreduce", s) != "native" for s in (8, 1 << 12, 1 << 20, 1 << 26))
    plain.Free()
    slow.Free()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_links_fail_alike():
    comm = WORLD.Dup()
    with pytest.raises(ConfigError, match="set HPCDL_LINK alike on every rank"):
        get_context(comm, Config(link="eth-10g" if ME == 0 else "eth-25g", ranks_per_node=1))
    with pytest.raises(ConfigError, match="set HPCDL_LINK alike on every rank"):  # and where the job is located
        locate(comm, 1, parse_link("eth-10g") if ME == 0 else None)
    comm.Free()


def test_the_allreduce_model_counts_each_algorithms_steps():
    from collectives.cost import allreduce_times

    intra, inter = AlphaBeta(1e-6, 10e9), AlphaBeta(1e-3, 1e9)
    s = 8 << 20
    t = allreduce_times(s, 8, 2, intra, inter)  # 4 nodes of 2
    # a block goes round the ring twice, 7 steps each: 4 cross a node boundary, 3 do not;
    # but a node's last rank sends all 14 of its messages across, through its port
    path = 2 * (4 * (1e-3 + s / 8 / 1e9) + 3 * (1e-6 + s / 8 / 10e9))
    port = 14 * s / 8 / 1e9 + 1e-3
    assert t["ring"] == pytest.approx(path) and path > port
    wide = allreduce_times(s, 8, 4, intra, inter)["ring"]  # 2 nodes of 4: the port is the bound
    path = 2 * (2 * (1e-3 + s / 8 / 1e9) + 5 * (1e-6 + s / 8 / 10e9))
    assert wide == pytest.approx(port) and port > path
    assert allreduce_times(1024, 8, 2, intra, inter)["ring"] == pytest.approx(
        2 * (4e-3 + 3e-6) + 2 * 1024 / 1e9, rel=1e-3
    )
    assert allreduce_times(s, 8, 1, intra, inter)["ring"] == pytest.approx(14 * (1e-3 + s / 8 / 1e9))
    # distances 1 inside a node; 2 and 4 across, both ranks of a node sending at once
    assert t["recursive_doubling"] == pytest.approx((1e-6 + s / 10e9) + 2 * (1e-3 + 2 * s / 1e9))
    halving = (1e-3 + 2 * (s / 2) / 1e9) + (1e-3 + 2 * (s / 4) / 1e9) + (1e-6 + (s / 8) / 10e9)
    assert t["rabenseifner"] == pytest.approx(2 * halving)
    inside = 1e-6 + s / 2 / 10e9
    assert t["hierarchical"] == pytest.approx(2 * inside + 6 * (1e-3 + s / 4 / 1e9))
    small = allreduce_times(1024, 8, 2, intra, inter)  # the nodes' allreduce by recursive doubling
    assert small["hierarchical"] == pytest.approx(2 * (1e-6 + 512 / 10e9) + 2 * (1e-3 + 1024 / 1e9))
    from collectives.algorithms.hierarchical import CROSS_RING_BYTES

    assert CROSS_RING_BYTES == 64 << 10  # the size the model takes the nodes' allreduce to switch at
    three = allreduce_times(3 * 1024, 6, 2, intra, inter)["hierarchical"]  # 3 nodes fold onto 2
    assert three == pytest.approx(2 * (1e-6 + 1536 / 10e9) + 3 * (1e-3 + 3 * 1024 / 1e9))
    # with a port for each rank of a node, its ranks' messages do not share one
    two = allreduce_times(s, 8, 2, intra, inter, ports=2)
    assert two["recursive_doubling"] == pytest.approx((1e-6 + s / 10e9) + 2 * (1e-3 + s / 1e9))
    half = allreduce_times(s, 8, 1, intra, inter, ports=0.5)  # half a port: half its bandwidth
    assert half["ring"] == pytest.approx(14 * (1e-3 + s / 8 / 0.5e9))
    odd = allreduce_times(s, 6, 1, intra, inter)  # 6 ranks fold onto 4: two more exchanges
    assert odd["recursive_doubling"] == pytest.approx(2 * (1e-3 + s / 1e9) + 2 * (1e-3 + s / 1e9))


@pytest.mark.mpi(min_size=4)
def test_auto_across_a_slow_link_takes_what_the_model_says_and_it_wins():
    from collectives.cost import allreduce_times
    from collectives.select import NODE_PATH, link_rules

    if N != 4:
        pytest.skip("two nodes of two ranks")
    link = "latency=20ms,bandwidth=100MB/s"  # this machine's own ~3 ms a call at 4 ranks is small beside it
    comm = linked(link, per_node=2)
    ctx = get_context(comm)
    rules = link_rules(4, 2, parse_link(link))
    assert rules[-1][0] is None and {name for _, name in rules} <= {"ring", "recursive_doubling", "hierarchical"}
    for size in (8, 4 << 10, 1 << 16, 4 << 20):
        times = allreduce_times(size, 4, 2, NODE_PATH, parse_link(link))
        assert choose(ctx, "allreduce", size) == min(times, key=times.__getitem__)
    x = np.ones(1024, np.float32)  # 4 KiB: one latency across, against the flat ring's four
    ring = _best(lambda: C.allreduce(x, algorithm="ring", comm=comm), reps=2)
    auto = _best(lambda: C.allreduce(x, comm=comm), reps=2)
    assert auto < 0.5 * ring
    comm.Free()


@pytest.mark.mpi(min_size=4)
def test_auto_across_a_link_costs_a_nodes_messages_as_the_tuning_table_measured_them():
    import json
    import os
    import tempfile

    from collectives.cost import allreduce_times

    if N != 4:
        pytest.skip("two nodes of two ranks")
    slow = AlphaBeta(5e-3, 1e7)  # a node path as slow as this: the in-node rings of hierarchical cost
    path = WORLD.bcast(tempfile.mkstemp(suffix=".json")[1] if ME == 0 else None)
    if ME == 0:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"tables": [], "node_paths": [{"size": 2, "alpha": slow.alpha, "beta": slow.beta}]}, fh)
    WORLD.Barrier()
    comm = WORLD.Dup()
    ctx = get_context(comm, Config(link=SLOW, ranks_per_node=2, tuning_file=path))
    for size in (8, 4 << 10, 1 << 20, 4 << 20):  # hierarchical wins at 4 KiB and 4 MiB over the assumed path
        times = allreduce_times(size, 4, 2, slow, parse_link(SLOW))
        assert choose(ctx, "allreduce", size) == min(times, key=times.__getitem__) != "hierarchical"
    comm.Free()
    WORLD.Barrier()
    if ME == 0:
        os.remove(path)


@pytest.mark.mpi(min_size=4)
def test_auto_reduce_scatters_and_allgathers_across_a_slow_link_as_the_model_says():
    from collectives.cost import allgather_times, reduce_scatter_times
    from collectives.select import NODE_PATH

    if N != 4:
        pytest.skip("two nodes of two ranks")
    link = parse_link(SLOW)
    comm = linked(SLOW, per_node=2)
    ctx = get_context(comm)
    for collective, model in (("reduce_scatter", reduce_scatter_times), ("allgather", allgather_times)):
        for size in (8, 4 << 10, 1 << 16, 16 << 20):
            times = model(size, 4, 2, NODE_PATH, link)
            assert choose(ctx, collective, size) == min(times, key=times.__getitem__), (collective, size)
    x = np.ones(1024, np.float32)  # 4 KiB: one latency across by halving or doubling, two round the ring
    fast = {
        "reduce_scatter": lambda alg: C.reduce_scatter(x, algorithm=alg, comm=comm),
        "allgather": lambda alg: C.allgather(x[:256], algorithm=alg, comm=comm),
    }
    for collective, run in fast.items():
        ring = _best(lambda run=run: run("ring"), reps=2)
        auto = _best(lambda run=run: run("auto"), reps=2)
        assert auto < 0.75 * ring, (collective, auto, ring)
    want = C.reduce_scatter(x * (ME + 1), algorithm="ring", comm=comm)
    assert digest(C.reduce_scatter(x * (ME + 1), comm=comm)) == digest(want)  # sums of small integers: exact
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_device_arrays_cross_the_link_staged_even_where_mpi_takes_device_memory(monkeypatch):
    import fakecupy

    from collectives.cost import allreduce_times
    from collectives.select import NODE_PATH

    cp = fakecupy.install(monkeypatch)
    comm = WORLD.Dup()
    get_context(comm, Config(link=SLOW, ranks_per_node=1, cuda_aware_mpi="1"))  # native would skip the link
    x = cp.asarray(np.full(1 << 20, ME + 1, np.float32))  # 4 MiB of small integers: exact sums
    got = C.allreduce(x, comm=comm)
    assert isinstance(got, cp.ndarray) and np.array_equal(cp.asnumpy(got), np.full(1 << 20, N * (N + 1) / 2))
    least = min(allreduce_times(x.nbytes, N, 1, NODE_PATH, parse_link(SLOW)).values())  # what any algorithm pays
    assert _best(lambda: C.allreduce(x, comm=comm), reps=2) >= 0.9 * least
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_pipeline_stages_tensor_crosses_the_link_whole_in_its_time():
    locate(WORLD, 1, parse_link(SLOW))
    try:
        comm = emulate_comm(WORLD.Dup())
        assert isinstance(comm, LinkComm)
        pp = Link(comm)
        x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(5))  # 4 MiB

        def hop() -> None:  # the first carries the shape too, which crosses beside the bytes
            if ME == 0:
                pp.send(x, 1, ACT)
                pp.finish()
            elif ME == 1:
                assert torch.equal(pp.recv(0, ACT), x)

        assert _best(hop) == pytest.approx(20e-3 + x.nbytes / 100e6, rel=0.10)
        assert comm.crossed == (3 * x.nbytes if ME == 0 else 0) + (8 * 3 if ME == 0 else 0)
        comm.Free()
    finally:
        locate(WORLD, 0, None)


@pytest.mark.mpi(min_size=4)
def test_a_subset_of_located_ranks_keeps_the_nodes_of_the_whole():
    # nodes of 2 ranks: 0 and 2 are on different nodes, which a communicator of the even
    # ranks cannot tell from its own shared-memory split (all of it on one machine)
    sub = WORLD.Split(ME % 2, ME)
    r, m = sub.Get_rank(), sub.Get_size()
    alone = node_transport(MPITransport(sub), 2).comm.Get_size()  # without locate: the sub's own pairs
    # every rank's verdict on every rank, so that one rank's miss fails them all before locate's collective
    assert WORLD.allgather(alone == min(2, m - r // 2 * 2)) == [True] * WORLD.Get_size()
    locate(WORLD, 2, None)
    try:
        node = node_transport(MPITransport(sub), 2)
        assert node.comm.Get_size() == 1
        node.comm.Free()
    finally:
        locate(WORLD, 0, None)
    sub.Free()
