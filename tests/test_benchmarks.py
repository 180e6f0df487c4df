"""The OSU-style benchmarks and the tuner, at tiny sizes, under mpiexec -n 2, 3, 4."""

from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import collectives as C
from benchmarks import osu
from collectives import tune
from collectives.config import Config
from collectives.context import get_context
from collectives.select import NODE_PATH, choose

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD

#: OSU 7.4's own header lines (from its output with -f -c, and plain), which parsers key on
OSU_FULL = "# Size       Avg Latency(us)   Min Latency(us)   Max Latency(us)  Iterations        Validation"
OSU_PLAIN = "# Size       Avg Latency(us)"
OSU_BW = "# Size      Bandwidth (MB/s)"
ROW = re.compile(r"^(\d+) +(\d+\.\d\d) +(\d+\.\d\d) +(\d+\.\d\d) +(\d+) +(Pass|Fail)$")


def shared_path(suffix: str) -> str:
    """A temporary file name, the same on every rank (rank 0 writes it)."""
    name = tempfile.mktemp(suffix=suffix) if WORLD.rank == 0 else None
    return WORLD.bcast(name, root=0)


@pytest.mark.parametrize("bench", osu.COLLECTIVES)
def test_every_collective_benchmark_returns_validated_numbers(bench):
    n = WORLD.size
    opts = ["-m", "1:256", "-i", "3", "-x", "1", "-c", "-T", "mpi_float", "--compare", "auto,mpi,shm", "--rounds", "2"]
    args = osu.parse_args(bench, opts)
    rows = osu.run(args)
    want = [s for s in (4, 8, 16, 32, 64, 128, 256) if bench != "reduce_scatter" or s // 4 >= n]
    assert [r["size"] for r in rows] == want
    for r in rows:
        assert r["iterations"] == 3
        assert set(r["results"]) == {"auto", "mpi", "shm"}
        for name, res in r["results"].items():
            assert 0 < res["min"] <= res["avg"] <= res["max"], (bench, name, res)
            nccl_bytes = r["size"] * (n if bench == "allgather" else 1)
            assert res["algbw"] == pytest.approx(nccl_bytes / (res["avg"] * 1e-6) / 1e9)
            assert res["busbw"] == pytest.approx(res["algbw"] * osu.BUS[bench](n))
        assert all(r["validation"].values()), r["validation"]


@pytest.mark.parametrize("bench", osu.COLLECTIVES)
def test_validation_fails_on_every_rank_when_a_result_is_wrong(bench):
    c = osu.make_contender(bench, "auto", WORLD, 64, np.dtype(np.int32))
    assert c.check()
    c.call = lambda: None  # a collective that moves nothing leaves the output unwritten
    assert not c.check()


@pytest.mark.parametrize("bench", osu.COLLECTIVES)
def test_contenders_sharing_one_set_of_arrays_each_get_the_right_result(bench):
    bufs = osu.contender_buffers(bench, WORLD, 4096, np.dtype(np.float32))
    x0 = bufs[0].copy()
    names = ["auto", "mpi", "window", "auto"]  # in turn on the same input and output
    cont = [osu.make_contender(bench, name, WORLD, 4096, np.dtype(np.float32), buffers=bufs) for name in names]
    assert all(c.check() for c in cont) and all(c.check() for c in cont[::-1])
    if bench != "bcast":  # which writes the root's data into every rank's input
        assert np.array_equal(bufs[0], x0), "a call on the shared arrays changed the input"


def test_the_pages_benchmark_gives_mpi_and_auto_the_same_arrays_of_each_kind(capsys):
    from benchmarks import pages

    like = np.arange(300000, dtype=np.float32)
    got = {place: pages.placed(like, place, WORLD) for place in pages.PLACES}
    for place, a in got.items():
        assert np.array_equal(a, like) and C.is_shared(a) == (place == "window"), place
    assert got["huge"].ctypes.data % (2 << 20) == 0 and got["4k"].ctypes.data % (2 << 20) == 0
    assert pages.huge_share(got["4k"]) == 0.0 and pages.huge_share(got["window"]) == 0.0
    assert 0.0 <= pages.huge_share(got["huge"]) <= 1.0  # 1 where the kernel gives huge pages
    rows = pages.measure(WORLD, "allgather", [4096, 1 << 20], 1)
    assert [(r["size"], r["place"]) for r in rows] == [(s, p) for s in (4096, 1 << 20) for p in pages.PLACES]
    assert all(r["valid"] and r["mpi"] > 0 and r["auto"] > 0 for r in rows)
    text = pages.table("allgather", rows, WORLD.size)
    h, k = rows[3], rows[4]  # 1 MiB, huge and 4k
    assert f"# 1048576 B: 4k / huge: mpi {k['mpi'] / h['mpi']:.2f}, auto {k['auto'] / h['auto']:.2f};" in text


def test_text_output_is_the_osu_format_and_parses_as_osu_parsers_read_it():
    args = osu.parse_args("allreduce", ["-m", "1:32", "-i", "4", "-x", "2", "-f", "-c"])
    rows = osu.run(args)
    text = osu.format_rows(args, rows, WORLD.size)
    lines = text.split("\n")
    assert lines[:4] == ["", "# OSU MPI Allreduce Latency Test v7.4", "# Datatype: MPI_CHAR.", OSU_FULL]
    body = lines[4:]
    assert len(body) == 6
    for line, row in zip(body, rows, strict=True):
        # fixed widths, as OSU prints them: %-10d, %18.2f x3, %12d, %18s
        assert len(line) == 10 + 18 * 3 + 12 + 18
        m = ROW.match(line)
        assert m, line
        assert int(line[:10]) == row["size"]
        assert float(line[10:28]) == pytest.approx(row["results"]["auto"]["avg"], abs=0.006)
        assert int(line[64:76]) == 4 and line[76:].strip() == "Pass"
    plain = osu.parse_args("bcast", ["-m", "2:4", "-i", "2"])
    lines = osu.format_rows(plain, osu.run(plain), WORLD.size).split("\n")
    assert lines[1:4] == ["# OSU MPI Broadcast Latency Test v7.4", "# Datatype: MPI_CHAR.", OSU_PLAIN]
    assert [len(ln) for ln in lines[4:]] == [28, 28]


def test_point_to_point_latency_and_bandwidth():
    pair = WORLD.Split(0 if WORLD.rank < 2 else 1, WORLD.rank)  # OSU's pair: ranks 0 and 1
    if WORLD.rank < 2:
        lat = osu.parse_args("latency", ["-m", "1:16", "-i", "20", "-x", "2", "-c"], ranks=pair.size)
        rows = osu.run(lat, pair)
        assert [r["size"] for r in rows] == [1, 2, 4, 8, 16]
        assert all(r["results"]["mpi"]["avg"] > 0 and r["validation"]["mpi"] for r in rows)
        bw = osu.parse_args("bw", ["-m", "64:128", "-i", "3", "-x", "1"], ranks=pair.size)
        rows = osu.run(bw, pair)
        text = osu.format_rows(bw, rows, pair.size).split("\n")
        assert text[1:4] == ["# OSU MPI Bandwidth Test v7.4", "# Datatype: MPI_CHAR.", OSU_BW]
        assert all(r["results"]["mpi"]["avg"] > 0 for r in rows)
    pair.Free()


@pytest.mark.parametrize(
    "bench, argv, ranks, text",
    [
        ("allreduce", ["-i", "0"], 2, "-i 0: the iterations must be at least 1"),
        ("allreduce", ["-i", "-5"], 2, "-i -5: the iterations must be at least 1"),
        ("bcast", ["-x", "-1"], 2, "-x -1: the warm-up iterations must be at least 0"),
        ("allgather", ["--rounds", "0"], 2, "--rounds 0: must be at least 1"),
        ("latency", [], 3, "osu_latency is a point-to-point test: it needs exactly 2 ranks, not 3"),
        ("bw", [], 1, "osu_bw is a point-to-point test: it needs exactly 2 ranks, not 1"),
    ],
)
def test_options_osu_refuses_are_refused(bench, argv, ranks, text, capsys):
    with pytest.raises(SystemExit) as stop:
        osu.parse_args(bench, argv, ranks=ranks)
    assert stop.value.code == 2
    if WORLD.rank == 0:  # usage errors are printed once, by rank 0
        assert text in capsys.readouterr().err


def test_compare_with_gloo_busbw_json_and_plot():
    js, png = shared_path(".json"), shared_path(".png")
    try:
        rows = osu.main(
            "allreduce",
            [
                "-m",
                "4:64",
                "-i",
                "3",
                "-x",
                "1",
                "-T",
                "mpi_float",
                "--compare",
                "mpi,auto,gloo",
                "--rounds",
                "2",
                "--busbw",
                "-c",
                "--json",
                js,
                "--plot",
                png,
            ],
        )
        assert all(set(r["results"]) == {"mpi", "auto", "gloo"} for r in rows)
        assert all(all(r["validation"].values()) for r in rows)
        if WORLD.rank == 0:
            with open(js, encoding="utf-8") as fh:
                rec = json.load(fh)
            assert rec["ranks"] == WORLD.size and [r["size"] for r in rec["rows"]] == [4, 8, 16, 32, 64]
            with open(png, "rb") as fh:
                assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    finally:
        WORLD.Barrier()
        if WORLD.rank == 0:
            for f in (js, png):
                if os.path.exists(f):
                    os.remove(f)


def test_the_json_holds_each_size_as_soon_as_it_is_measured(monkeypatch):
    # a run cut off by a time limit (the node report's) leaves the sizes it measured
    js, seen, real = shared_path(".json"), [], osu.run

    def run(args, comm=None, on_row=None):
        def each(row):
            on_row(row)
            with open(js, encoding="utf-8") as fh:
                rec = json.load(fh)
            seen.append((rec["complete"], [r["size"] for r in rec["rows"]]))

        return real(args, comm, each if on_row else None)

    monkeypatch.setattr(osu, "run", run)
    try:
        osu.main("allreduce", ["-m", "4:16", "-i", "2", "-x", "1", "--compare", "mpi,auto", "--json", js])
        if WORLD.rank == 0:
            assert seen == [(False, [4]), (False, [4, 8]), (False, [4, 8, 16])]
            with open(js, encoding="utf-8") as fh:
                rec = json.load(fh)
            assert rec["complete"] and [r["size"] for r in rec["rows"]] == [4, 8, 16]
            left = [f for f in os.listdir(os.path.dirname(js)) if f.startswith(os.path.basename(js) + ".")]
            assert rec["machine"]["mpi"] and not left, left  # no partial file beside it
        else:
            assert seen == []
    finally:
        WORLD.Barrier()
        if WORLD.rank == 0 and os.path.exists(js):
            os.remove(js)


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--rounds", "0"], "--rounds 0: must be at least 1"),
        (["--sweeps", "-1"], "--sweeps -1: must be at least 1"),
        (["--iterations", "-3"], "--iterations -3: must be at least 0"),
        (["--min", "1M", "--max", "4K"], "--min 1048576 --max 4096: need 0 < min <= max"),
        (["--collectives", "allreduce,scan"], "--collectives: unknown scan; the collectives are allreduce"),
        (["--merge", "no-such-table.json"], "--merge: tuning_file='no-such-table.json' does not exist"),
    ],
)
def test_options_the_tuner_refuses_are_refused(argv, text, capsys):
    with pytest.raises(SystemExit) as stop:
        tune.main(["--out", "never-written.json", *argv])
    assert stop.value.code == 2 and not os.path.exists("never-written.json")
    if WORLD.rank == 0:
        assert text in capsys.readouterr().err


@pytest.mark.parametrize(
    "module, argv, text",
    [
        ("bars", ["--rounds", "0"], "--rounds 0: must be at least 1"),
        ("bars", ["--min", "1M", "--max", "4K"], "--max 4096: must be at least 1048576"),
        ("bars", ["--collectives", "allreduce,scan"], "--collectives: unknown scan; the collectives are allreduce"),
        ("torch_allreduce", ["--rounds", "-1"], "--rounds -1: must be at least 1"),
        ("train_throughput", ["--steps", "0"], "--steps 0: must be at least 1"),
        ("parallel_gpt", ["--steps", "0"], "--steps 0: must be at least 1"),
        ("plan_check", ["--chunks", "0"], "--chunks 0: must be at least 1"),
        ("plan_check", ["--cores", "0"], "--cores 0: must be at least 1"),
        ("ps_vs_allreduce", ["--section", "steps", "--steps", "0"], "--steps 0: must be at least 1"),
        ("ps_vs_allreduce", ["--section", "bytes", "--mib", "0"], "--mib 0: must be at least 1"),
        ("profile", ["--calls", "0"], "--calls 0: must be at least 1"),
        ("small_calls", ["--rounds", "0"], "--rounds 0: must be at least 1"),
        ("small_calls", ["--collectives", "allreduce,scan"], "--collectives takes allreduce, broadcast and allgather"),
        ("device_sync", ["--rounds", "0"], "--rounds 0: must be at least 1"),
        ("stores", ["--rounds", "0"], "--rounds 0: must be at least 1"),
        ("pages", ["--rounds", "0"], "--rounds 0: must be at least 1"),
        ("pages", ["--collectives", "allreduce,scan"], "--collectives takes allgather, allreduce, bcast"),
        pytest.param(
            "device_sync",
            ["--sizes", "4"],
            "no usable CUDA device here",
            marks=pytest.mark.skipif(osu.use_gpu() is None, reason="a GPU is here"),
        ),
    ],
)
def test_the_other_benchmarks_refuse_counts_below_one(module, argv, text, capsys):
    import importlib

    main = importlib.import_module(f"benchmarks.{module}").main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    if WORLD.rank == 0:
        assert text in capsys.readouterr().err


def test_tuner_writes_a_table_that_auto_follows():
    path = shared_path(".json")
    try:
        tune.main(
            ["--out", path, "--min", "4", "--max", "64", "--rounds", "1", "--iterations", "3"]
            + ["--collectives", "allreduce,allgather"]
        )
        WORLD.Barrier()
        with open(path, encoding="utf-8") as fh:
            table = json.load(fh)
        mine = {(e["collective"], e["size"], e["nodes"]): e["rules"] for e in table["tables"]}
        rules = mine[("allreduce", WORLD.size, 1)]
        # each row says whether the ranks outnumbered the cores they could run on
        assert {e.get("oversubscribed") for e in table["tables"]} == {_oversubscribed()}
        for e in table.get("node_paths", []):  # the ring's times as one message's α-β, where 4-64 B tell it
            assert e["size"] == WORLD.size > 1 and e["alpha"] > 0 and 0 < e["beta"] < 1e15, e
        assert rules[-1][0] is None and all(name in C.algorithms("allreduce") for _, name in rules)
        comm = WORLD.Dup()
        ctx = get_context(comm, Config(tuning_file=path))
        for nbytes in (4, 16, 64, 1 << 20):
            want = next(name for limit, name in rules if limit is None or nbytes <= limit)
            assert choose(ctx, "allreduce", nbytes) == want
        assert np.array_equal(C.allreduce(np.ones(3), comm=comm), np.full(3, float(WORLD.size)))
        comm.Free()
        # --merge keeps the table's other rows and adds the new ones
        tune.main(
            ["--out", path, "--merge", path, "--max", "16", "--rounds", "1", "--iterations", "3"]
            + ["--collectives", "reduce"]
        )
        WORLD.Barrier()
        with open(path, encoding="utf-8") as fh:
            merged = json.load(fh)
        assert [e for e in merged["tables"] if e["collective"] != "reduce"] == table["tables"]
        assert [e["collective"] for e in merged["tables"]].count("reduce") == 1 and len(merged["runs"]) == 2
    finally:
        WORLD.Barrier()
        if WORLD.rank == 0 and os.path.exists(path):
            os.remove(path)


def _oversubscribed() -> bool:
    """Whether this job's ranks (one node) outnumber the CPUs they may run on together."""
    cpus = WORLD.allgather(sorted(os.sched_getaffinity(0)))
    return WORLD.size > len(set().union(*map(set, cpus)))


def test_auto_passes_over_rows_measured_oversubscribed_where_ranks_have_a_core_each():
    n = WORLD.size
    over = _oversubscribed()
    table = {
        "tables": [
            {"collective": "allreduce", "size": n, "nodes": 1, "oversubscribed": True, "rules": [[None, "ring"]]},
            {"collective": "allreduce", "size": n + 1, "nodes": 1, "oversubscribed": False, "rules": [[None, "tree"]]},
        ]
    }
    path = shared_path(".json")
    try:
        if WORLD.rank == 0:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(table, fh)
        WORLD.Barrier()
        comm = WORLD.Dup()
        ctx = get_context(comm, Config(tuning_file=path))
        assert ctx.chan.oversubscribed is over
        want = "ring" if over else "tree"
        assert [choose(ctx, "allreduce", nbytes) for nbytes in (4, 1 << 20)] == [want, want]
        x = np.arange(1000, dtype=np.float64) * (WORLD.rank + 1)
        assert np.array_equal(C.allreduce(x, comm=comm), np.arange(1000.0) * (n * (n + 1) // 2))
        comm.Free()
    finally:
        WORLD.Barrier()
        if WORLD.rank == 0 and os.path.exists(path):
            os.remove(path)


@pytest.mark.parametrize("coll", ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"])
def test_profile_reports_on_rank_zero_only(coll):
    from benchmarks import profile

    text = profile.profile(coll, 64 * WORLD.size, 5, "auto", 5, WORLD)
    if WORLD.rank == 0:
        assert text.startswith(f"# {coll} auto, {64 * WORLD.size} B float32, {WORLD.size} ranks")
        assert "tottime" in text and "us per call unprofiled" in text
    else:
        assert text == ""


def test_the_stores_benchmark_times_both_kinds_and_checks_each(capsys):
    from benchmarks import stores

    if get_context(WORLD).channel().core is None:
        pytest.skip("the compiled loop is not built")
    rows = stores.measure(WORLD, "bcast", [4096, 1 << 20], 2, 1)
    assert [r["size"] for r in rows] == [4096, 1 << 20]
    assert all(r["valid"] and min(r["nt"], r["plain"], r["auto"], r["mpi"]) > 0 for r in rows)
    ch = get_context(WORLD).chan
    assert (ch.core.nontemporal, ch.core.nontemporal_broadcast, ch.core.measured) == (
        ch.nontemporal,
        ch.nontemporal_broadcast,
        ch.measured_stores,
    )
    text = stores.table("bcast", rows, WORLD.size, 1)
    head = ["size", "nt", "us", "plain", "us", "auto", "us", "mpi", "us", "nt/plain", "nt/mpi", "plain/mpi"]
    assert text.splitlines()[1].split() == [*head, "auto/mpi", "valid"]
    # what the channel chose for broadcasts read from the root's memory, and by what times
    from benchmarks.node_report import single_copy_line

    assert single_copy_line(0, {}) == "broadcasts go through the slots (single copy set off, or not measured)"
    assert single_copy_line(1 << 20, {}) == "broadcasts read the root's memory from 1 MiB (set, not measured)"
    line = single_copy_line(65536, {"slots": [9.7e-6, 233e-6], "single": [4.4e-6, 90.5e-6]})
    assert line == (
        "broadcasts read the root's memory from 64 KiB: measured at 64 KiB/2 MiB, "
        "through the slot 9.7/233.0 us, single copy 4.4/90.5 us"
    )


def test_device_copy_rate_and_the_busbw_share_footer(monkeypatch):
    import fakecupy

    fakecupy.install(monkeypatch)
    rate = osu.device_copy_bandwidth(1 << 20, copies=2, repeats=3)  # host memory standing in
    assert rate > 0
    rows = [
        {"size": 1024, "results": {"ipc": {"busbw": 1.0}, "staged": {"busbw": 0.5}}},
        {"size": 1 << 20, "results": {"ipc": {"busbw": 300.0}, "staged": {"busbw": 15.0}}},
    ]
    text = osu.copy_share(rows, ["ipc", "staged"], 3000e9)
    assert text.startswith("# device-to-device copy rate: 3000.0 GB/s")
    assert text.endswith("busbw / copy rate at 1048576 B: ipc 0.100, staged 0.005")


def test_torch_allreduce_benchmark_measures_every_contender():
    import hpcdl
    from benchmarks import torch_allreduce

    hpcdl.init()
    try:
        rows = torch_allreduce.measure([4, 4096], rounds=1, iters=3)
    finally:
        hpcdl.shutdown()
    assert [r["size"] for r in rows] == [4, 4096]
    for r in rows:
        assert set(r["us"]) == set(torch_allreduce.CONTENDERS)
        assert all(v > 0 for v in r["us"].values())
    text = torch_allreduce.report(rows, WORLD.size)
    assert "4 KiB" in text.splitlines()[-1] and "ratio" in text and "staged" not in text
    # the device path's run sets the staged path's named call beside it
    hpcdl.init()
    try:
        staged = torch_allreduce.measure([4, 4096], rounds=1, iters=3, contenders=("hpcdl",))
    finally:
        hpcdl.shutdown()
    assert all(set(s["us"]) == {"hpcdl"} for s in staged)
    for r, s in zip(rows, staged, strict=True):
        r["us"][torch_allreduce.STAGED] = s["us"]["hpcdl"]
    last = torch_allreduce.report(rows, WORLD.size).splitlines()[-1].split()
    u = rows[-1]["us"]
    assert last[-3] == f"{u[torch_allreduce.STAGED]:.1f}"
    assert last[-2] == f"{u[torch_allreduce.STAGED] / u['hpcdl']:.1f}"


def test_hidden_share_counts_communication_inside_backward():
    from benchmarks.train_throughput import hidden_share

    t0 = 100.0  # rank 0's perf_counter at ts 0
    trace = {
        "traceEvents": [
            {"name": "clock", "ph": "M", "pid": 0, "args": {"perf_counter_at_ts0": t0}},
            # 4 ms of communication of "opt.": 3 ms inside backward [100.000, 100.010]
            {"name": "NEGOTIATE_ALLREDUCE", "ph": "X", "pid": 0, "ts": 7000, "dur": 2000, "args": {"tensor": "opt.b0"}},
            {"name": "ALLREDUCE", "ph": "X", "pid": 0, "ts": 8000, "dur": 3000, "args": {"tensor": "opt.b0"}},
            {"name": "QUEUE", "ph": "X", "pid": 0, "ts": 0, "dur": 9000, "args": {"tensor": "opt.b0"}},  # not comm
            {"name": "ALLREDUCE", "ph": "X", "pid": 0, "ts": 0, "dur": 9000, "args": {"tensor": "other"}},
        ]
    }
    assert hidden_share(trace, [[(t0, t0 + 0.010)]], "opt.") == pytest.approx(3 / 4)
    assert hidden_share(trace, [[(t0 + 0.020, t0 + 0.030)]], "opt.") == 0.0


def test_train_throughput_benchmark_measures_every_row():
    import hpcdl
    from benchmarks import train_throughput as tt
    from benchmarks.osu import gloo_init

    hpcdl.init()
    gloo_init(WORLD)
    try:
        res = tt.measure("cnn", rounds=2, steps=2, timeline_steps=2, horovod=None)
    finally:
        hpcdl.shutdown()
    assert set(res["rows"]) == {tt.NO_COMM, tt.HPCDL, tt.ZERO, tt.DDP}
    for name, row in res["rows"].items():
        assert row["step_ms"] > 0 and row["samples_per_s"] == pytest.approx(
            WORLD.size * tt.BATCH / row["step_ms"] * 1e3
        )
        if name in (tt.HPCDL, tt.ZERO):
            assert 0.0 <= row["hidden"] <= 1.0
        assert 0.0 <= row["engine_cpu_ms"] < row["step_ms"]
        # a ratio to the step without communication per round, each of its own round's steps
        assert len(row["round_ratios"]) == 2 and all(v > 0 for v in row["round_ratios"])
    assert res["rows"][tt.NO_COMM]["round_ratios"] == [1.0, 1.0]
    # the engine only works for the hpcdl rows
    assert res["rows"][tt.HPCDL]["engine_cpu_ms"] > res["rows"][tt.NO_COMM]["engine_cpu_ms"]
    # the floor allreduces every gradient once: 4 bytes per parameter of the CNN
    assert res["floor_bytes"] == 4 * sum(p.numel() for p in tt.cnn().parameters())
    assert res["floor_s"] > 0
    text = tt.report([res], "cmd")
    assert "bars: hpcdl <= 1.10 x no comm" in text and "no Horovod row" in text
    assert "bars: ZeroOptimizer(stage=2) <= 1.10 x no comm" in text
    assert f"allreducing the {res['floor_bytes'] / 1e6:.1f} MB of gradients alone" in text


def test_train_throughput_report_says_when_the_ddp_bar_is_below_no_communication():
    from benchmarks import train_throughput as tt

    def res(no_comm, ddp):
        rows = {
            c: {"step_ms": ms, "samples_per_s": 1.0, "exposed_ms": 0.0, "hidden": None}
            for c, ms in [(tt.NO_COMM, no_comm), (tt.HPCDL, 66.0), (tt.ZERO, 66.0), (tt.DDP, ddp)]
        }
        return {"model": "cnn", "params": 1e6, "batch_per_rank": 64, "ranks": 2, "rows": rows}

    r = res(60.0, 65.0)
    r["floor_bytes"], r["floor_s"] = 50.4e6, 0.0072
    text = tt.report([r], "cmd")  # 0.85 x 65 = 55.25 < 60
    assert "takes 7.2 ms of each rank's CPU on idle cores = 0.12 x the no-communication step" in text
    assert "(the 1.10 bar leaves -1.2 ms for everything else)" in text
    assert "0.85 x DDP-gloo = 55.2 ms is below the no-communication step, 60.0 ms" in text
    assert "below the no-communication" not in tt.report([res(60.0, 80.0)], "cmd")  # 68 >= 60


@pytest.mark.parametrize("opts", [["-f"], ["--compare", "auto,mpi"]], ids=["osu", "compare"])
def test_the_header_comes_first_and_each_row_as_soon_as_it_is_measured(capsys, monkeypatch, opts):
    """Rank 0 prints the header before measuring and each row right after its size, as
    OSU does, instead of the whole table at the end; other ranks print nothing."""
    seen: list[str] = []
    real_run = osu.run

    def watched(args, comm=None, on_row=None):
        seen.append(capsys.readouterr().out)  # what was printed before any size was measured

        def row(r):
            if on_row is not None:
                on_row(r)
            seen.append(capsys.readouterr().out)

        return real_run(args, comm, row)

    monkeypatch.setattr(osu, "run", watched)
    rows = osu.main("allreduce", ["-m", "4:16", "-i", "3", "-x", "1", *opts])
    if WORLD.rank != 0:
        assert not any(seen)
        return
    assert "# OSU MPI Allreduce Latency Test" in seen[0] and "# Size" in seen[0]
    assert [chunk.split()[0] for chunk in seen[1:]] == [str(r["size"]) for r in rows] == ["4", "8", "16"]
    assert (
        seen[0] + "".join(seen[1:])
        == osu.format_rows(osu.parse_args("allreduce", ["-m", "4:16", *opts]), rows, WORLD.size) + "\n"
    )


def test_the_link_sweep_names_each_sizes_winner_and_auto_against_it(tmp_path):
    from benchmarks import link_sweep

    names = [*link_sweep.ALGORITHMS, "auto"]
    times = [(4, [9.0, 5.0, 7.0, 6.0, 5.5]), (1 << 20, [900.0, 990.0, 950.0, 600.0, 720.0])]
    rows = [{"size": s, "results": {n: {"avg": v} for n, v in zip(names, vs, strict=True)}} for s, vs in times]
    run = link_sweep.summarize("eth-10g", 2, 2, rows)
    small, large = run["sizes"]
    assert (small["winner"], large["winner"]) == ("recursive_doubling", "hierarchical")
    assert small["auto_over_winner"] == pytest.approx(1.1) and large["auto_over_winner"] == pytest.approx(1.2)
    # the model's figures are allreduce_times' for 2 nodes of 2 ranks at 10 Gbit/s, in µs
    from collectives.cost import allreduce_times, parse_link

    want = allreduce_times(1 << 20, 4, 2, NODE_PATH, parse_link("eth-10g"))
    assert large["predicted_us"]["ring"] == pytest.approx(want["ring"] * 1e6)
    lines = link_sweep.table(run)
    assert lines[0] == "### eth-10g, 2 nodes of 2" and "| 1048576 |" in lines[5] and lines[5].endswith("| 1.20 |")
    link_sweep.svg([run, run], tmp_path / "w.svg")
    svg = (tmp_path / "w.svg").read_text()
    assert svg.count('<rect x="190"') == 2 and svg.count(">x</text>") == 2  # auto over 1.10 x the winner, twice


def test_the_parameter_server_sweep_names_each_sizes_winner_beside_the_model(tmp_path, monkeypatch):
    from benchmarks import ps_links
    from collectives.cost import AlphaBeta, parse_link, ps_own_load, ps_times

    assert ps_links.parse_layout("2x2+4") == (2, 2, 4)
    with pytest.raises(ValueError, match="NODESxWORKERS_PER_NODE"):
        ps_links.parse_layout("2x2")
    us = [
        {"ring": 900.0, "hierarchical": 800.0, "ps-sync": 700.0, "hybrid": 750.0, "auto": 770.0},
        {"ring": 9e4, "hierarchical": 7e4, "ps-sync": 8e4, "hybrid": 6e4, "auto": 6.3e4},
    ]
    rows = [
        {"size": s, "us": u, "auto_took": t}
        for s, u, t in zip((1 << 20, 16 << 20), us, ("ps-sync", "hybrid"), strict=True)
    ]
    plain = [{"size": r["size"], "us": {k: v / 10 for k, v in r["us"].items()}} for r in rows]
    run = ps_links.summarize("eth-10g", "2x2+4", rows, plain)
    small, large = run["sizes"]
    assert (small["winner"], large["winner"]) == ("ps-sync", "hybrid")
    assert small["auto_over_best_ps"] == pytest.approx(1.1) and large["auto_over_best_ps"] == pytest.approx(1.05)
    want = ps_times(16 << 20, 4, 2, NODE_PATH, parse_link("eth-10g"), 4, 1 << 20)  # 4 partitions a server
    assert large["predicted_us"]["hybrid"] == pytest.approx(want["hybrid"] * 1e6)
    lines = ps_links.table(run)
    assert lines[0].startswith("### eth-10g: 2 nodes of 2 workers, 4 servers")
    assert lines[5].startswith("| 16 MiB | 90.0 (") and lines[5].endswith("| hybrid | 1.05 | 9.0 / 7.0 / 8.0 / 6.0 |")
    ps_links.svg([run], tmp_path / "p.svg")
    drawn = (tmp_path / "p.svg").read_text()
    assert drawn.count("<rect") == 2 * 4 + 4  # a bar per contender and size, the key
    # a mark over the model's winner of each size (its bar's middle), and one in the key
    marks = re.findall(r'<path class="model" d="M[\d.]+,[\d.]+ L[\d.]+,[\d.]+ L([\d.]+),', drawn)
    assert len(marks) == 2 + 1
    for k, s in enumerate(run["sizes"]):
        x = 60 + k * (9 * 4 + 10) + 9 * ps_links.CONTENDERS.index(s["predicted_winner"]) + 4
        assert float(marks[k]) == x
    # below the table: each prediction over its measurement: the model (here without the
    # servers' own work), the links alone, the links with the time without a link
    hybrid = want["hybrid"] * 1e6
    assert lines[-2].startswith("| 16 MiB | ") and lines[-2].endswith(
        f"| {hybrid / 6e4:.2f} / {hybrid / 6e4:.2f} / {(hybrid + 6e3) / 6e4:.2f} |"
    )
    assert "(no own work fitted)" in lines[-7]
    stored = tmp_path / "ps_links.json"
    stored.write_text(json.dumps({"command": "python -m benchmarks.ps_links", "runs": [run]}))
    monkeypatch.setattr("sys.argv", ["ps_links", "--render", str(stored), "--out", str(tmp_path / "again")])
    ps_links.main()
    assert (tmp_path / "again" / "ps_links.md").read_text() == "\n".join(lines)
    # --refit: the stored times summarized again, with the own work and the hybrid's phases
    # fitted to the stored runs without a link
    monkeypatch.setattr("sys.argv", ["ps_links", "--render", str(stored), "--refit", "--out", str(tmp_path / "re")])
    ps_links.main()
    by_layout = {"2x2+4": plain}
    want_own = ps_links.fit_own(by_layout)
    want = ps_links.summarize(
        "eth-10g", "2x2+4", rows, plain, own=want_own, phases=ps_links.fit_phases(by_layout, want_own)
    )
    again = (tmp_path / "re" / "ps_links.md").read_text()
    assert want_own is not None and again == "\n".join(ps_links.table(want)) != "\n".join(lines)
    # the servers' own work, fitted to the exchanges without a link: each layout's ps-sync
    # rows are the busiest server's contributions at 50 µs + bytes at 1 GB/s
    own = AlphaBeta(50e-6, 1e9)
    plain_by = {}
    for layout in ("2x2+4", "4x1+2"):
        nodes, per_node, servers = ps_links.parse_layout(layout)
        loads = {s: ps_own_load(s, 4, per_node, servers, s / servers / 4) for s in (1 << 20, 16 << 20)}
        plain_by[layout] = [
            {"size": s, "us": {"ps-sync": 1e6 * own.time(load, calls)}} for s, (calls, load) in loads.items()
        ]
    fitted = ps_links.fit_own(plain_by)
    assert fitted.alpha == pytest.approx(own.alpha) and fitted.beta == pytest.approx(own.beta)
    assert ps_links.fit_own({"2x2+4": plain_by["2x2+4"][:1]}) is None  # one size: nothing to fit
    # a contribution no slower at 16 MiB than at 1 MiB: no finite bandwidth fits, so none
    flat = [{"size": s, "us": {"ps-sync": 4e3}} for s in (1 << 20, 16 << 20)]
    assert ps_links.fit_own({"2x2+4": flat}) is None
    for bad in ("2x2+0", "0x1+1", "2x0+2"):
        with pytest.raises(ValueError, match="each at least 1"):
            ps_links.parse_layout(bad)
    run = ps_links.summarize("eth-10g", "2x2+4", rows, plain, own=fitted)
    large = run["sizes"][1]
    with_own = ps_times(16 << 20, 4, 2, NODE_PATH, parse_link("eth-10g"), 4, 1 << 20, own=fitted)
    assert large["predicted_us"]["hybrid"] == pytest.approx(with_own["hybrid"] * 1e6)
    assert large["link_us"]["hybrid"] == pytest.approx(hybrid) and hybrid < large["predicted_us"]["hybrid"]
    assert large["predicted_us"]["ring"] == large["link_us"]["ring"]  # the allreduces have no servers
    lines = ps_links.table(run)
    assert "(the servers' own work 50 µs + bytes at 1.00 GB/s a contribution)" in lines[-7]
    # the hybrid's phases inside a node, fitted to its exchanges without a link less the
    # servers' work: its predictions take them in place of a node's messages
    phases = AlphaBeta(2e-3, 5e8)
    for layout, rows_of in plain_by.items():
        nodes, per_node, servers = ps_links.parse_layout(layout)
        for row in rows_of:
            piece = row["size"] / servers / 4
            free = AlphaBeta(0.0, float("inf"))
            t = ps_times(row["size"], 4, per_node, NODE_PATH, free, servers, piece, own=own, phases=phases)
            row["us"]["hybrid"] = 1e6 * t["hybrid"]
    got = ps_links.fit_phases(plain_by, own)
    assert got.alpha == pytest.approx(phases.alpha) and got.beta == pytest.approx(phases.beta)
    assert ps_links.fit_phases({"4x1+2": plain_by["4x1+2"]}, own) is None  # one worker a node: no phases
    run = ps_links.summarize("eth-10g", "2x2+4", rows, plain, own=fitted, phases=got)
    phased = ps_times(16 << 20, 4, 2, NODE_PATH, parse_link("eth-10g"), 4, 1 << 20, own=fitted, phases=got)
    assert run["sizes"][1]["predicted_us"]["hybrid"] == pytest.approx(phased["hybrid"] * 1e6)
    assert run["sizes"][1]["predicted_us"]["ps-sync"] == pytest.approx(with_own["ps-sync"] * 1e6)
    assert "; the hybrid's phases inside a node 2000 µs + bytes at 0.50 GB/s a call)" in ps_links.table(run)[-7]
    model = with_own["hybrid"] * 1e6
    assert lines[-2].endswith(f"| {model / 6e4:.2f} / {hybrid / 6e4:.2f} / {(hybrid + 6e3) / 6e4:.2f} |")
    assert (tmp_path / "again" / "ps_links.svg").read_text() == (tmp_path / "p.svg").read_text()


def test_the_planner_check_counts_the_cores_any_rank_may_run_on(monkeypatch):
    from benchmarks import plan_check

    # bound as mpiexec -bind-to core:2 binds them: two cores a rank, none shared
    monkeypatch.setattr(plan_check.os, "sched_getaffinity", lambda pid: {2 * WORLD.rank, 2 * WORLD.rank + 1})
    assert plan_check.job_cores() == 2 * WORLD.size
    # unbound on a node of 3 cores: every rank may run on each
    monkeypatch.setattr(plan_check.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert plan_check.job_cores() == 3
    # a core each, the last two ranks on one
    monkeypatch.setattr(plan_check.os, "sched_getaffinity", lambda pid: {min(WORLD.rank, WORLD.size - 2)})
    assert plan_check.job_cores() == WORLD.size - 1


def test_the_planner_checks_contention_sets_the_slowest_rank_against_the_fit():
    import time

    import hpcdl
    from benchmarks import plan_check

    hpcdl.init()
    try:
        # the last rank's step takes 40 ms, the others' 10: the slowest rank sets the pace
        def step() -> None:
            time.sleep(0.04 if WORLD.rank == WORLD.size - 1 else 0.01)

        n = WORLD.size
        assert 3.6 < plan_check.contention(step, alone=0.01, cores=n, samples=3) < 6.0
        # beyond the ranks' share of the cores: n ranks sharing one core take n times the fit's step
        assert 3.6 < plan_check.contention(step, alone=0.01 / n, cores=1, samples=3) < 6.0
        # never below 1: a fit slower than every rank at once
        assert plan_check.contention(step, alone=1.0, cores=n, samples=3) == 1.0
    finally:
        hpcdl.shutdown()


def test_the_planner_check_predicts_each_grid_from_the_rates_it_measured():
    import hpcdl
    from benchmarks import plan_check
    from collectives.cost import AlphaBeta, ring_allreduce

    assert plan_check.ranks([3.0, 9.0, 5.0]) == [3, 1, 2]
    assert plan_check.discordant([3.0, 9.0, 5.0], [4.0, 8.0, 9.0]) == [(1, 2)]
    # measured a > b > c, predicted the other way round; a's and b's steps overlap: 95-105
    # and 96-101 tokens/s, which the measurement does not order; c's (49.5-50.5) overlap neither
    made = [("a", 100.0, 1.2, [0.95, 1.05]), ("b", 98.0, 0.9, [0.97, 1.02]), ("c", 50.0, 0.4, [0.99, 1.01])]
    keys = ("grid", "tokens_per_s", "predicted_step_s", "step_range_s")
    rows = [{"step_s": 1.0, **dict(zip(keys, m, strict=True))} for m in made]
    v = plan_check.verdict(rows)
    assert [s[:2] for s in v["swapped"]] == [["a", "b"], ["a", "c"], ["b", "c"]] and v["unordered"] == [["a", "b"]]
    line = plan_check.verdict_line(v)
    assert "a and b (measured 2.0% apart, within their steps' spread), a and c (measured 100.0% apart)," in line
    assert plan_check.verdict([{k: v for k, v in r.items() if k != "step_range_s"} for r in rows])["unordered"] == []
    path = shared_path(".json")
    argv = ["--grids", "2x1x1,1x2x1,1x1x2", "--steps", "1", "--n-layer", "2", "--d-model", "32", "--n-head", "2"]
    argv += ["--block-size", "16", "--batch-size", "4", "--chunks", "2", "--cores", "1", "--json", path]
    if WORLD.size > 3:
        pytest.skip("measured at 2 ranks (at 4, by hand: a minute on 2 cores)")
    try:
        if WORLD.size == 3:  # an odd number of ranks has no pairs to measure a call on
            with pytest.raises(SystemExit) as stop:
                plan_check.main(argv)
            assert stop.value.code == 2
            return
        plan_check.main(argv)
    finally:
        hpcdl.shutdown()
    if WORLD.rank != 0:
        return
    with open(path) as fh:
        out = json.load(fh)
    os.unlink(path)
    cal = out["calibration"]
    assert cal["cores_per_node"] == 1 and cal["contention"] >= 1 and cal["call_overhead"] >= 0
    assert cal["share"] == pytest.approx(2 * cal["contention"])  # 2 ranks on 1 core, and their caches
    assert [(b, t) for b, t, _ in out["block_times"]] == [(1, 1), (4, 1), (4, 2), (16, 1)]  # tp divides 2 heads
    rows = {r["grid"]: r for r in out["rows"]}
    assert list(rows) == ["2x1x1", "1x2x1", "1x1x2"]
    for r in rows.values():
        assert r["step_s"] > 0 and sum(r["predicted_parts"].values()) == pytest.approx(r["predicted_step_s"])
    # each grid is predicted at the contention measured beside it, the calibration's otherwise
    from argparse import Namespace

    from hpcdl.plan import GPT, GPU, Cluster

    fields = {k: v for k, v in cal.items() if k != "share"}
    fields.update(gpu=GPU(**cal["gpu"]), intra=AlphaBeta(*cal["intra"]), inter=AlphaBeta(*cal["inter"]))
    model = GPT(layers=2, hidden=32, heads=2, seq=16, vocab=256)
    for r in rows.values():
        assert r["contention"] >= 1
        shape = tuple(int(v) for v in r["grid"].split("x"))
        cl = Cluster(**{**fields, "contention": r["contention"]})
        again = plan_check.predict(model, cl, shape, Namespace(batch_size=4, chunks=2))
        assert again["step_s"] == pytest.approx(r["predicted_step_s"])
    # 1x2x1: 2 micro-batches of 2 blocks' 4 allreduces, the head's, the cross-entropy's 3 and the embedding's
    link, b = AlphaBeta(*cal["intra"]), 2
    act, sums = 4 * b * 16 * 32, 4 * b * 16
    per_mb = 10 * (ring_allreduce(link, 2, act) + cal["call_overhead"]) + 3 * (
        ring_allreduce(link, 2, sums) + cal["call_overhead"]
    )
    assert rows["1x2x1"]["predicted_parts"]["tp_comm"] == pytest.approx(2 * per_mb)
    assert rows["1x1x2"]["predicted_parts"]["tp_comm"] == 0.0 and rows["1x1x2"]["predicted_parts"]["bubble"] > 0


def test_a_bar_no_size_of_the_run_falls_under_says_skip():
    from benchmarks.bars import verdicts

    rows = [{"size": s, "results": {"auto": {"avg": 1.0}, "mpi": {"avg": 2.0}}} for s in (4, 1024)]
    out = verdicts("allreduce", rows, 1e10, 2)
    assert out[0] == "PASS allreduce: auto/mpi at every size <= 1.10; worst 0.50 at 4 B"
    assert out[1] == "SKIP allreduce: auto/mpi at every size >= 1 MiB <= 0.50; no size measured"
    rows.append({"size": 1 << 20, "results": {"auto": {"avg": 3.0}, "mpi": {"avg": 2.0}}})
    out = verdicts("allreduce", rows, 1e10, 2)
    assert out[:2] == [
        "MISS allreduce: auto/mpi at every size <= 1.10; worst 1.50 at 1048576 B; over at 1048576B:1.50",
        "MISS allreduce: auto/mpi at every size >= 1 MiB <= 0.50; worst 1.50 at 1048576 B; over at 1048576B:1.50",
    ]
