"""collectives.cost: the alpha-beta model fitted to measured times, against models known
in advance."""

from __future__ import annotations

import math

import pytest

from collectives.cost import AlphaBeta, fit, fit_ps_own, fit_ps_phases, ps_own_load, ps_times, ring_allreduce


def test_fit_recovers_the_model_that_made_the_points():
    true = AlphaBeta(5e-6, 4e9)
    points = [(s, true.time(s)) for s in (4, 1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    got = fit(points)
    assert got.alpha == pytest.approx(true.alpha, rel=1e-9) and got.beta == pytest.approx(true.beta, rel=1e-9)
    assert got.time(1 << 20, calls=3) == pytest.approx(3 * 5e-6 + (1 << 20) / 4e9)


def test_fit_weighs_every_size_by_its_own_time():
    """A 10% error at the largest size must not swamp the latency of the small ones (an
    unweighted fit would put alpha far off)."""
    true = AlphaBeta(2e-6, 1e10)
    points = [(s, true.time(s)) for s in (8, 64, 512, 4096)] + [(1 << 26, true.time(1 << 26) * 1.1)]
    got = fit(points)
    assert got.alpha == pytest.approx(2e-6, rel=0.15)
    assert all(abs(got.time(s) / t - 1) < 0.1 for s, t in points)


def test_fit_clamps_what_has_no_meaning():
    flat = fit([(4, 1e-3), (1 << 20, 1e-3), (1 << 22, 1e-3)])  # the same time at every size: latency alone
    assert flat.alpha == pytest.approx(1e-3) and math.isinf(flat.beta)
    steep = fit([(1 << 10, 1e-7), (1 << 20, 1.1e-3)])  # would need a negative latency: bandwidth alone
    assert steep.alpha == 0 and steep.beta > 0


@pytest.mark.parametrize("points", [[(4, 1e-6)], [(4, 1e-6), (4, 2e-6)], [(4, 0.0), (8, 1e-6)]])
def test_fit_refuses_too_few_sizes_or_a_time_that_is_not_positive(points):
    with pytest.raises(ValueError, match="fit: "):
        fit(points)


def test_the_parameter_servers_exchange_counts_each_ports_bytes():
    link, inside, s = AlphaBeta(1e-3, 1e8), AlphaBeta(1e-6, 1e10), 4 << 20
    half = s / 2 / link.beta  # one partition of two through a port
    # 2 nodes of 1 worker, 1 dedicated server, 2 partitions: each worker's first leaves its
    # port (S/2) and arrives; the server's port sends it to both (S), then the second likewise
    t = ps_times(s, 2, 1, inside, link, servers=1, piece=s // 2)
    assert t["ps-sync"] == pytest.approx(2 * link.alpha + 5 * half)
    assert t["hybrid"] == pytest.approx(t["ps-sync"])  # one worker a node: nothing to reduce inside it
    # 2 nodes of 2 workers, 2 servers on one node of their own: the hybrid's two shards leave
    # each node together (S), then the servers' port sends each shard's sum to 2 workers (2S),
    # between a ring reduce-scatter and a ring allgather inside the node
    t = ps_times(s, 4, 2, inside, link, servers=2, piece=s // 2)
    ring = 2 * (inside.alpha + s / 2 / inside.beta)
    assert t["hybrid"] == pytest.approx(2 * link.alpha + 6 * half + ring)
    # ps-sync there: the node's 4 partitions (2S) leave in two rounds, each server's arrives
    # with the first round or the second, and the port sends 4 workers each of them (4S)
    assert t["ps-sync"] == pytest.approx(2 * link.alpha + 2 * half + 8 * half)
    # co-located on 2 nodes of 1: each pushes its half that the other's server holds (S/2), which
    # then sends the sum of it back (S/2) through the same port
    t = ps_times(s, 2, 1, inside, link, piece=s // 2)
    assert t["ps-sync"] == pytest.approx(2 * link.alpha + 2 * half)
    assert ps_times(s, 2, 1, inside, link)["ps-sync"] == pytest.approx(2 * link.alpha + 4 * half)  # one partition
    assert ps_times(s, 2, 2, inside, link)["ps-sync"] == 0.0  # one node, its own server


def test_the_parameter_servers_own_work_adds_the_busiest_servers_contributions_and_is_fitted_back():
    link, inside, s = AlphaBeta(1e-3, 1e8), AlphaBeta(1e-6, 1e10), 4 << 20
    own = AlphaBeta(2e-4, 2e9)
    # 4 workers, 2 a node, 2 servers, partitions of S/2: under ps-sync each server holds one
    # partition that all 4 workers push (4 contributions, 2 S bytes); under the hybrid, one
    # shard of S/2 that one worker of each node pushes (2 contributions, S bytes)
    wire = ps_times(s, 4, 2, inside, link, servers=2, piece=s // 2)
    got = ps_times(s, 4, 2, inside, link, servers=2, piece=s // 2, own=own)
    assert got["ps-sync"] == pytest.approx(wire["ps-sync"] + 4 * own.alpha + 2 * s / own.beta)
    assert got["hybrid"] == pytest.approx(wire["hybrid"] + 2 * own.alpha + s / own.beta)
    assert ps_own_load(s, 4, 2, 2, s // 2) == (4, 2 * s) and ps_own_load(s, 4, 2, 2, s // 2, reduce=True) == (2, s)
    # co-located on 2 nodes of 1, one partition: the server holding it sums both workers'
    assert ps_own_load(s, 2, 1, 0, s) == (2, 2 * s)
    # uneven: 3 partitions over 2 servers: the one with two is the busiest
    assert ps_own_load(3 * s, 2, 1, 2, s) == (4, 4 * s)
    # the fit reads own back from exchanges timed without a link, over layouts and sizes
    points = []
    for workers, per_node, servers in ((4, 2, 4), (4, 1, 4), (2, 1, 1), (8, 2, 2)):
        for size in (1 << 20, 4 << 20, 16 << 20):
            piece = size / servers / 4
            calls, load = ps_own_load(size, workers, per_node, servers, piece)
            points.append((own.time(load, calls), size, workers, per_node, servers, piece))
    fitted = fit_ps_own(points)
    assert fitted.alpha == pytest.approx(own.alpha) and fitted.beta == pytest.approx(own.beta)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_ps_own(points[:1])
    # exchanges of different sizes whose contributions are all of one size tell nothing of the bytes
    even = [(1e-3 * n, n * (1 << 20), 4, 1, n, 1 << 20) for n in (1, 2, 4)]  # n servers, a partition each
    assert len({ps_own_load(*p[1:])[1] / ps_own_load(*p[1:])[0] for p in even}) == 1
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_ps_own(even)


def test_the_hybrids_phases_inside_a_node_are_fitted_back_from_its_exchanges_less_the_servers_work():
    own, phases, free = AlphaBeta(2e-4, 2e9), AlphaBeta(3e-3, 8e8), AlphaBeta(0.0, math.inf)
    NODE = AlphaBeta(1e-6, 1e10)  # noqa: N806 - a node's message path
    points = []
    for workers, per_node, servers in ((4, 2, 4), (8, 4, 2), (6, 3, 3)):
        for size in (1 << 20, 4 << 20, 16 << 20):
            piece = size / servers / 4
            # without a link: the servers' work on the hybrid's shards, and its two calls inside the
            # node, each moving (k - 1) / k of the gradient through a rank
            seconds = ps_times(size, workers, per_node, NODE, free, servers, piece, own=own, phases=phases)["hybrid"]
            k = per_node
            want = own.time(*reversed(ps_own_load(size, workers, per_node, servers, piece, reduce=True)))
            assert seconds == pytest.approx(want + 2 * phases.time(size * (k - 1) / k))
            assert ps_times(size, workers, per_node, NODE, free, servers, piece, own=own)["hybrid"] == pytest.approx(
                want + 2 * (k - 1) * NODE.time(size / k)  # without phases: a ring of the node's messages each way
            )
            points.append((seconds, size, workers, per_node, servers, piece))
    fitted = fit_ps_phases(points, own)
    assert fitted.alpha == pytest.approx(phases.alpha) and fitted.beta == pytest.approx(phases.beta)
    with pytest.raises(ValueError, match="no phases inside a node"):
        fit_ps_phases([(1e-3, 1 << 20, 4, 1, 4, 1 << 18)], own)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_ps_phases(points[:1], own)


def test_the_tuner_reads_a_nodes_message_cost_back_from_the_ring_allreduces_times():
    from collectives.tune import measured_node_path

    link = AlphaBeta(7e-6, 3e9)
    for ranks in (2, 4, 8):  # medians of two sweeps, one 5% slow
        meds = {
            s: [{"ring": ring_allreduce(link, ranks, s)}, {"ring": 1.05 * ring_allreduce(link, ranks, s)}]
            for s in (4 << 10, 64 << 10, 1 << 20, 16 << 20)
        }
        got = measured_node_path(meds, ranks)
        assert got.alpha == pytest.approx(1.025 * link.alpha, rel=1e-6)
        assert got.beta == pytest.approx(link.beta / 1.025, rel=1e-6)
