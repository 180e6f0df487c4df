"""The parameter-server hybrid (hpcdl.ps, HybridOptimizer): the partition layout against
its invariants, then whole jobs under mpiexec (tests/ps_job.py) with dedicated servers
(HPCDL_PS_SERVERS), on simulated nodes (HPCDL_RANKS_PER_NODE) and with co-located ones:
sync equals DistributedOptimizer and ssp with s=0 equals sync (float64, 20 steps);
bounded staleness under a straggler; async progress past a stalled worker; checkpoints
that resume bitwise; bad input on every rank; stalls named; a dead server ends the job;
across an emulated link (HPCDL_LINK), the same parameters in the link's time."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from conftest import mpiexec_job, mpiexec_start
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.cost import AlphaBeta, parse_link, ps_times
from collectives.select import NODE_PATH, load_table
from hpcdl.ps import PartitionPlan
from hpcdl.train.config import ConfigError, parse_config

JOB = ["tests/ps_job.py"]


# -- the layout --------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    numels=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    node_ranks=st.integers(1, 4),
    servers=st.integers(1, 5),
    partition_bytes=st.integers(1, 4096),
    itemsize=st.sampled_from([2, 4, 8]),
)
def test_partitions_cover_every_element_once_within_the_cap_and_balance_the_servers(
    numels, node_ranks, servers, partition_bytes, itemsize
):
    lay = PartitionPlan(numels, itemsize, node_ranks, servers, partition_bytes)
    per = max(1, partition_bytes // itemsize)
    for b, n in enumerate(numels):
        m = lay.shard_numels[b]
        assert m * node_ranks >= n > (m - 1) * node_ranks  # whole shards, less than one of padding
        for shard in range(node_ranks):
            covered = sorted((p.lo, p.hi) for p in lay.of_bucket(b, shard))
            assert covered[0][0] == 0 and covered[-1][1] == m
            assert all(a[1] == c[0] for a, c in zip(covered, covered[1:], strict=False))  # contiguous, no overlap
    assert all(0 < p.numel <= per and 0 <= p.server < servers for p in lay.pieces)
    load = [sum(p.numel * itemsize for p in lay.of_server(s)) for s in range(servers)]
    assert load == lay.server_bytes
    largest = max(p.numel for p in lay.pieces) * itemsize
    assert max(load) - min(load) <= largest  # largest first onto the lightest server


def test_the_layout_is_the_same_whatever_computes_it():
    a = PartitionPlan([1000, 17, 4096], 4, 2, 3, 1024)
    b = PartitionPlan([1000, 17, 4096], 4, 2, 3, 1024)
    # shards of 500, 9 and 2048 elements, cut every 256: 2, 1 and 8 partitions per shard
    assert a.pieces == b.pieces and len(a.pieces) == 2 * (2 + 1 + 8)


# -- whole jobs --------------------------------------------------------------------------------
SHAPES = {
    "2 workers + 1 server": (3, {"HPCDL_PS_SERVERS": "1"}, []),
    "2 nodes x 2 workers + 2 servers": (6, {"HPCDL_PS_SERVERS": "2", "HPCDL_RANKS_PER_NODE": "2"}, []),
    "co-located, 2 nodes x 1 worker": (2, {"HPCDL_RANKS_PER_NODE": "1"}, ["colocated"]),
    "co-located, 1 node x 2 workers": (2, {}, ["colocated"]),
}


def run(scenario: list[str], n: int, env: dict[str, str], workers: int, timeout: float = 150) -> str:
    proc = mpiexec_job(JOB + scenario, n=n, env=env, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count(f"OK {scenario[0]}") == workers, out[-4000:]
    return out


# dedicated servers run on 2 nodes x 2 workers + 2 servers, which covers 2 workers + 1 server
@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "2 workers + 1 server"])
def test_sync_equals_distributed_optimizer_and_ssp_zero_equals_sync(shape):
    n, env, args = SHAPES[shape]
    workers = n - int(env.get("HPCDL_PS_SERVERS", 0))
    run(["equivalence", *args], n, env, workers)


def test_waits_on_the_servers_sleep_only_where_a_hosts_ranks_outnumber_its_cores():
    from hpcdl.ps import NAP, wait_nap

    a_core_each = [("a", [0]), ("a", [1]), ("b", [0]), ("b", [1])]
    assert wait_nap(-1, a_core_each) == 0.0
    assert wait_nap(-1, [("a", [0, 1]), ("a", [0, 1]), ("b", [0])]) == 0.0  # unbound, no more ranks than cores
    assert wait_nap(-1, [("a", [0]), ("a", [1]), ("b", [0]), ("b", [0])]) == NAP  # host b: 2 ranks on one core
    assert wait_nap(-1, [("a", [0, 1])] * 3) == NAP
    # HPCDL_SHM_SPIN decides where it is set, as for the collectives' waits
    assert wait_nap(0, a_core_each) == NAP and wait_nap(2000, [("a", [0])] * 3) == 0.0


def test_a_wait_that_polls_never_takes_a_timer_sleep_and_one_that_naps_does(monkeypatch):
    """Where a rank has a core of its own its waits poll: ``time.sleep(0)`` is a timer sleep
    on Linux (77 µs on a virtual machine), which answered a message only every 77 µs."""
    from collectives.link import LinkRequest
    from hpcdl.ps import wire

    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(wire.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    for nap in (0.0, 1e-3):
        slept.clear()
        due = time.perf_counter_ns() + 3_000_000  # a request that completes 3 ms from now
        wire.wait_politely([LinkRequest([], at=due)], nap=nap)
        assert time.perf_counter_ns() >= due
        assert (slept == []) == (nap == 0.0), (nap, slept[:5])
        assert all(0 < s <= 1e-3 for s in slept)


@pytest.mark.parametrize("nap", [0.0, 1e-3])
def test_an_idle_server_polls_without_a_timer_sleep_only_where_it_has_a_core(monkeypatch, nap):
    """A dedicated server with a core of its own (``nap`` 0) polls within its window after a
    message, yielding its core without a timer sleep; one that shares cores sleeps."""
    import threading

    from mpi4py import MPI

    from hpcdl.ps import server, wire

    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(server.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    monkeypatch.setattr(server, "POLL_WINDOW", 60.0)  # every pass of this test within the window
    comm = MPI.COMM_SELF.Dup()
    srv = server.Server(comm, 0, [0], nap=nap)
    t = threading.Thread(target=srv.serve)
    t.start()
    for _ in range(20):
        real_sleep(1e-3)
        comm.send(wire.Stats(7), dest=0, tag=wire.CTRL)
        reply = comm.recv(source=0, tag=wire.CTRL_REPLY)
        assert not reply.ok and "no table 7" in reply.value
    comm.send(wire.Bye(), dest=0, tag=wire.CTRL)
    t.join(30)
    comm.Free()
    assert not t.is_alive()
    assert (slept == []) == (nap == 0.0), (nap, slept[:5])


def test_a_worker_waiting_on_its_co_located_server_sums_and_replies_itself():
    """The waiting thread does the server's work on the partitions while the server's own
    thread is not looking (here it never runs), and leaves control messages to it."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from hpcdl.ps import PartitionPlan, TableSpec, Tags, server, wire

    comm = MPI.COMM_SELF.Dup()
    srv = server.Server(comm, 0, [0])
    spec = TableSpec("t", "sync", 0, [1000], 4, "float32", 1, [[0]], 1024, [0], [0])
    answer = comm.irecv(source=0, tag=wire.CTRL_REPLY)  # a send to oneself waits for its receive
    srv._control(0, wire.Register(spec))  # what its thread, which never runs here, would do
    slot = answer.wait().value
    plan, tags = PartitionPlan([1000], 4, 1, 1, 1024), Tags(slot, 4)
    grad = torch.arange(1000, dtype=torch.float32)
    for step in range(3):
        got = torch.zeros(1000)
        reqs = []
        for pc in plan.of_bucket(0, 0):
            reqs.append(comm.Irecv(wire.as_bytes(got[pc.lo : pc.hi]), 0, tags.reply(pc.index)))
            reqs.append(comm.Isend(wire.as_bytes(grad[pc.lo : pc.hi] * (step + 1)), 0, tags.push(pc.index)))
        wire.wait_politely(reqs, nap=0.0, progress=srv.serve_once)
        np.testing.assert_array_equal(got.numpy(), grad.numpy() * (step + 1))  # one contributor: its own
    asked = [comm.isend(wire.Stats(slot), dest=0, tag=wire.CTRL)]
    srv.serve_once()
    assert comm.Iprobe(0, wire.CTRL)  # still there, for the server's thread
    asked.append(comm.isend(wire.Bye(), dest=0, tag=wire.CTRL))
    answer = comm.irecv(source=0, tag=wire.CTRL_REPLY)
    srv.serve()  # the server's own loop: the Stats answered, then the goodbye
    assert answer.wait().ok
    MPI.Request.waitall(asked)
    srv.serve_once()  # after the end: nothing
    comm.Free()


@pytest.mark.parametrize("spin, nap", [("0", "0.001"), ("2000", "0.0")])
def test_a_job_whose_waits_sleep_or_spin_exchanges_the_same(spin, nap):
    run(["waits", nap], 3, {"HPCDL_PS_SERVERS": "1", "HPCDL_SHM_SPIN": spin}, 2)


@pytest.mark.parametrize("shape", ["2 workers + 1 server", "co-located, 2 nodes x 1 worker"])
def test_staleness_stays_bounded_with_a_straggler_and_async_passes_a_stalled_worker(shape):
    n, env, args = SHAPES[shape]
    run(["straggler", *args], n, env, 2)


# (ranks, environment, arguments, workers, workers a node, dedicated servers (0: co-located),
# link, tolerance): a 4 MiB gradient in two partitions. The hybrid's reduce-scatter and
# allgather inside the node each wait for a negotiation of the runtime across the nodes, which
# ps_times leaves out: a few latencies, so its link has a short one, and 25% (the planner's bar)
LINKED = {
    "2 workers + 1 server": (
        3,
        {"HPCDL_PS_SERVERS": "1", "HPCDL_RANKS_PER_NODE": "1"},
        [],
        2,
        1,
        1,
        "latency=20ms,bandwidth=100MB/s",
        0.1,
    ),
    "co-located, 2 nodes x 1 worker": (
        2,
        {"HPCDL_RANKS_PER_NODE": "1"},
        ["colocated"],
        2,
        1,
        0,
        "latency=20ms,bandwidth=100MB/s",
        0.1,
    ),
    "2 nodes x 2 workers + 2 servers": (
        6,
        {"HPCDL_PS_SERVERS": "2", "HPCDL_RANKS_PER_NODE": "2"},
        [],
        4,
        2,
        2,
        "latency=2ms,bandwidth=50MB/s",
        0.25,
    ),
}


@pytest.mark.parametrize("shape", list(LINKED))
def test_across_an_emulated_link_the_servers_give_the_same_parameters_in_the_time_the_model_says(shape):
    n, env, args, workers, per_node, servers, link, tolerance = LINKED[shape]
    model = ps_times(4 << 20, workers, per_node, NODE_PATH, parse_link(link), servers, 2 << 20)
    path = min(model, key=model.__getitem__)
    for _ in range(2):  # the timing once more where this shared machine disturbed the first
        found = {}
        for with_link in ("", link):
            out = run(["link", *args], n, {**env, "HPCDL_LINK": with_link}, workers)
            lines = re.findall(r"LINK reduced (\w+) digest (\w+) step ([\d.]+)", out)
            assert len(lines) == workers and len(set(lines)) == 1, out[-2000:]
            found[with_link] = lines[0]
        (plain_reduced, plain, plain_s), (reduced, linked, linked_s) = found[""], found[link]
        assert plain == linked, "the link changed the parameters"
        assert plain_reduced == "False", "node_reduce='auto' reduced inside the node on one machine without a link"
        assert reduced == str(path == "hybrid" and per_node > 1), (reduced, model)  # auto took the model's path
        # the step without a link is this machine's own work, which the link's time may hide or not
        want, mine, took = model[path], float(plain_s), float(linked_s)
        if (1 - tolerance) * want <= took <= (1 + tolerance) * (want + mine):
            return
    raise AssertionError(
        f"twice a step took {took * 1e3:.1f} ms across the link and {mine * 1e3:.1f} ms without; the link's model "
        f"says {want * 1e3:.1f} ms"
    )


def test_auto_costs_the_servers_own_work_and_the_hybrids_phases_where_the_tuning_table_holds_them(tmp_path):
    # across a fast link the pure parameter server moves fewer bytes than the hybrid's three
    # phases; where each contribution costs a server as much as the node report's ps_own
    # says, the hybrid's fewer contributions a server win
    env = {"HPCDL_PS_SERVERS": "2", "HPCDL_RANKS_PER_NODE": "2", "HPCDL_LINK": "ib-ndr"}
    own = {"alpha": 1e-3, "beta": 1e8}
    link, args = parse_link("ib-ndr"), (4 << 20, 4, 2, NODE_PATH)
    assert min(ps_times(*args, link, 2, 2 << 20), key=ps_times(*args, link, 2, 2 << 20).get) == "ps-sync"
    with_own = ps_times(*args, link, 2, 2 << 20, own=AlphaBeta(**own))
    assert min(with_own, key=with_own.get) == "hybrid"
    table = tmp_path / "tuning.json"
    table.write_text(json.dumps({**load_table(), "ps_own": own}))
    found = {}
    for tuning in (None, str(table)):
        out = run(["link"], 6, {**env, "HPCDL_TUNING_FILE": tuning or ""}, 4)  # "": the packaged table
        lines = re.findall(r"LINK reduced (\w+) digest (\w+) step", out)
        assert len(set(lines)) == 1, out[-2000:]
        found[tuning] = lines[0]
    assert found[None][0] == "False" and found[str(table)][0] == "True", found
    assert found[None][1] == found[str(table)][1]  # the same parameters either way
    # and where the hybrid's phases inside a node cost as much as the table's ps_phases says,
    # they outweigh what its fewer contributions save: the pure parameter server again
    phases = {"alpha": 0.1, "beta": 1e9}
    slow = ps_times(*args, link, 2, 2 << 20, own=AlphaBeta(**own), phases=AlphaBeta(**phases))
    assert min(slow, key=slow.get) == "ps-sync"
    table.write_text(json.dumps({**load_table(), "ps_own": own, "ps_phases": phases}))
    out = run(["link"], 6, {**env, "HPCDL_TUNING_FILE": str(table)}, 4)
    assert set(re.findall(r"LINK reduced (\w+) digest (\w+) step", out)) == {("False", found[None][1])}, out[-2000:]


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_checkpoint_of_the_servers_state_resumes_bitwise(mode):
    run(["checkpoint", mode], 3, {"HPCDL_PS_SERVERS": "1"}, 2)


def test_ssp_and_async_take_one_clocks_update_per_clock_with_adam():
    run(["step_size"], 5, {"HPCDL_PS_SERVERS": "1"}, 4)  # 4 workers: a clock is 4 of the server's steps


@pytest.mark.timeout(600)
def test_ssp_trains_like_sync_over_eight_seeds():
    run(["seeds"], 5, {"HPCDL_PS_SERVERS": "1"}, 4, timeout=600)


def test_optimizers_of_disjoint_process_sets_on_one_node_share_the_servers():
    run(["subsets"], 5, {"HPCDL_PS_SERVERS": "1"}, 4, timeout=240)


def test_partitions_of_a_bfloat16_model_travel_to_the_servers_and_back():
    run(["bfloat16"], 3, {"HPCDL_PS_SERVERS": "1"}, 2)


@pytest.mark.parametrize("shape", ["2 workers + 1 server", "co-located, 1 node x 2 workers"])
def test_bad_input_raises_on_every_worker_and_the_next_optimizer_works(shape):
    n, env, _ = SHAPES[shape]
    out = run(["errors"], n, env, 2)
    if "HPCDL_PS_SERVERS" in env:  # and once the servers have ended, a later init says so
        assert out.count("OK init after the servers ended") == 2, out[-3000:]


def test_server_counts_that_disagree_or_leave_no_worker_raise_on_every_rank():
    run(["init_errors"], 2, {}, 2)
    proc = mpiexec_job(JOB + ["errors"], n=2, env={"HPCDL_PS_SERVERS": "2"}, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("ps_servers=2 leaves no worker: the job has 2 ranks") == 2, out[-3000:]


def test_a_worker_far_behind_is_named_by_the_server():
    env = {"HPCDL_PS_SERVERS": "1", "HPCDL_STALL_CHECK_TIME_SECONDS": "1"}
    out = run(["stall"], 3, env, 2)
    pattern = r"parameter server 0: .* workers \[0\] wait for every worker's clock 0, held back by workers \[1\]"
    assert re.search(pattern, out), out


def test_a_killed_server_ends_the_job_and_its_pid_is_named():
    job = mpiexec_start(JOB + ["forever"], n=3, env={"HPCDL_PS_SERVERS": "1"})
    try:
        pid = None
        for line in job.stdout:
            if line.startswith(b"SERVER_PID"):
                pid = int(line.split()[1])
                break
        assert pid is not None
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
    text = (out + err).decode(errors="replace")
    assert job.returncode != 0 and took < 60
    assert re.search(rf"parameter servers 0 = rank 2 \(pid {pid} on", err.decode(errors="replace") + text)
    assert str(pid) in text  # the launcher's report of the dead process


# -- the training job ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, mode, least",
    [
        ("2 nodes x 2 workers + 2 servers", "sync", 0.97),  # node reduction, two servers
        # ssp's result depends on timing (how stale each pull is): the 97% bar is measured by
        # benchmarks/ps_vs_allreduce.py; this guards against a broken ssp with some margin
        ("2 workers + 1 server", "ssp", 0.96),
    ],
)
def test_the_default_digits_run_trains_through_parameter_servers(tmp_path, shape, mode, least):
    n, env, _ = SHAPES[shape]
    args = ["-m", "hpcdl.train", "--dp", "ps", "--ps-mode", mode, "--no-progress", "--run-dir", str(tmp_path)]
    proc = mpiexec_job(args, n=n, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dp"] == f"ps {mode}" and summary["world_size"] == n - int(env["HPCDL_PS_SERVERS"])
    assert summary["final"]["accuracy"] >= least, summary["final"]
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert [s["rank"] for s in ranks["servers"]] == list(range(summary["world_size"], n))
    if mode == "ssp":
        assert max(int(v) for v in summary["staleness"]["max_lag"].values()) <= 4


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_the_training_job_resumes_bitwise_through_parameter_servers(mode):
    run(["train_resume", mode], 3, {"HPCDL_PS_SERVERS": "1"}, 2, timeout=240)


def test_parameter_server_options_that_cannot_work_are_refused_before_work():
    for argv, text in (
        (["--ps-servers", "1"], "only dp='ps' uses"),
        (["--dp", "ps", "--zero", "2"], "zero=2 shards them"),
        (["--dp", "ps", "--model", "gpt", "--tp", "2"], "does not run on a tp/pp grid"),
        (["--dp", "ps", "--ps-mode", "async", "--precision", "fp16"], "steps on the servers"),
    ):
        with pytest.raises(ConfigError, match=re.escape(text)):
            parse_config(argv, environ={})
