"""The node report (benchmarks.node_report): one command that runs every step under a
budget and writes a small directory whose summary agrees with the raw figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import mpiexec_job

from benchmarks.node_report import (
    BAR,
    Runner,
    binding_flags,
    bubble_line,
    crossover,
    gpu_iterations,
    huge_pages,
    machine,
    model_cores,
    node_tuning,
    ps_layouts,
    rank_counts,
    single_copy_line,
    summarize,
    world_check,
    worst_ratios,
)
from benchmarks.osu import trips_text
from benchmarks.ps_links import summarize as summarize_ps
from collectives.config import read_tuning_file
from collectives.cost import AlphaBeta
from collectives.launcher import launcher_size
from collectives.select import load_table, rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rank_counts_double_up_to_one_rank_per_core():
    assert rank_counts(1) == [2]
    assert rank_counts(2) == [2]
    assert rank_counts(16) == [2, 4, 8, 16]
    assert rank_counts(12) == [2, 4, 8, 12]
    assert rank_counts(64, cap=8) == [2, 4, 8]


def test_worst_ratios_take_the_largest_auto_over_mpi_on_each_side_of_64_kib():
    def row(size, auto, mpi, alg, window=None):
        res = {"auto": {"avg": auto}, "mpi": {"avg": mpi}, **({"window": {"avg": window}} if window else {})}
        return {"size": size, "algorithm": alg, "results": res}

    rows = [row(4, 2.0, 4.0, "shm"), row(65536, 12.0, 10.0, "shm"), row(1 << 20, 300.0, 200.0, "ring", 80.0)]
    got = worst_ratios({"bars": {"allreduce": rows}})["allreduce"]
    assert got["worst_small"] == (65536, 1.2)
    assert got["worst_large"] == (1 << 20, 1.5)
    assert got["over_bar"] == [65536, 1 << 20] and BAR == 1.10
    # the summary names the algorithm auto took at each size over the bar
    report = {"machine": {}, "date": "d", "seconds": 1.0, "budget": 2.0, "runs": [], "steps": ["collectives"]}
    text = summarize({**report, "collectives": {"4": {"allreduce": got}}})
    cells = "| 1.20 (64 KiB) **over** | 1.50 (1 MiB) **over** | 64 KiB (shm), 1 MiB (ring; window 0.40) |"
    assert f"| 4 | allreduce {cells}" in text and got["window"] == {str(1 << 20): 0.4}


def run_report(tmp_path, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.node_report", "--out", str(tmp_path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _what_did_not_finish(out) -> str:
    """The runs of a report that did not end well, each with the end of its output."""
    try:
        runs = json.loads((out / "report.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return ""
    text = ""
    for r in runs:
        if r.get("status") != "ok":
            log = out / "raw" / f"{r['name']}.txt"
            tail = log.read_text()[-3000:] if log.exists() else ""
            text += f"\n--- {r['command']}: {r.get('status')}\n{tail}"
    return text


@pytest.mark.timeout(300)
def test_a_quick_report_writes_a_small_directory_whose_summary_matches_the_raw_figures(tmp_path):
    proc = run_report(tmp_path, "--quick", "--max-ranks", "2", "--budget", "200")
    assert proc.returncode == 0, proc.stdout + proc.stderr + _what_did_not_finish(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"report.json", "summary.md", "raw"} <= names
    total = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert total < 5 << 20, total
    report = json.loads((tmp_path / "report.json").read_text())
    summary = (tmp_path / "summary.md").read_text()
    assert report["rank_counts"] == [2] and all(r["status"] == "ok" for r in report["runs"])
    # every rank bound to a core of its own (the wheel's MPICH is Hydra), as the summary says;
    # two cores cannot give each of two training ranks two
    assert report["binding"].startswith("each rank bound to a core (mpiexec -bind-to core); ")
    assert "to two (mpiexec -bind-to core:2)" in report["binding"]
    assert all(r["command"].startswith("mpiexec -bind-to core -n ") for r in report["runs"])
    assert f"Ranks: {report['binding']}." in summary
    # every collective's worst small ratio, recomputed from the benchmark's own JSON
    raw = json.loads((tmp_path / "raw" / "collectives_np2.json").read_text())
    for coll, rows in raw["bars"].items():
        ratios = [(r["size"], r["results"]["auto"]["avg"] / r["results"]["mpi"]["avg"]) for r in rows]
        size, worst = max(ratios, key=lambda x: x[1])
        assert f"| 2 | {coll} | {worst:.2f} (" in summary, (coll, worst, summary)
    assert "ranks, allreduce:" in summary.split("## What the tuner")[1]
    # one tuning file for every rank count: the packaged table with the rows measured here
    tuned = read_tuning_file(str(tmp_path / "tuning.json"))
    measured = json.loads((tmp_path / "raw" / "tuner_np2.json").read_text())["tables"]
    here = [e for e in tuned["tables"] if e["size"] == 2 and e["nodes"] == 1]
    assert [{k: v for k, v in e.items() if k != "machine"} for e in here] == measured
    assert all(e["machine"].endswith("node report") for e in here)
    assert [e for e in tuned["tables"] if e["size"] != 2] == [e for e in load_table()["tables"] if e["size"] != 2]
    assert report["tuning_file"] == "tuning.json" and "`HPCDL_TUNING_FILE=tuning.json`" in summary
    for coll, rows in raw["bars"].items():  # what auto took: at 2 ranks the packaged rows' pick, shm
        assert {r["algorithm"] for r in rows} == {"shm"}, (coll, rows)
    small = json.loads((tmp_path / "raw" / "small_calls_np2.json").read_text())
    trips = small["line_round_trip_s"]  # two ranks with a core each: one pair, timed before and after the calls
    assert all(len(trips[k]) == 1 and 0 < trips[k][0] < 1e-2 for k in ("before", "after")), trips
    assert f"- 2 ranks: {trips_text(trips['before'], trips['after'])}" in summary
    assert f"round trip between the two ranks: {trips['before'][0] * 1e9:.0f} ns before" in summary
    for row in small["rows"]:  # each part of a small call in the table; the one step is what the call takes
        assert {"total", "python", "step", "wait", "barrier", "mpi", "waited", "polls", "sleeps", "wakes"} <= set(row)
        assert row["one_step"] and row["wait"] >= 0 and row["wait"] == max(0.0, row["step"] - row["copy"])
        cells = f"| 2 | {row['collective']} | {row['size']} | {row['total']:.2f} | {row['python']:.2f} |"
        assert cells in summary, (cells, summary)
        waits = [row[k] for k in ("waited", "polls", "sleeps", "wakes")]  # the loop's counters per step
        assert (None in waits) == (not row["compiled"]) and all(w is None or w >= 0 for w in waits)
        counts = " | ".join("-" if w is None else f"{w:.3g}" for w in waits)
        assert f"| {row['mpi']:.2f} | {counts} |" in summary
    stores = json.loads((tmp_path / "raw" / "stores_np2.json").read_text())
    for coll, rows in stores["results"].items():  # non-temporal against plain stores, size by size
        assert all(r["valid"] for r in rows)
        cells = ", ".join(f"{r['size'] >> 10} KiB {r['nt'] / r['plain']:.2f}" for r in rows)
        assert f"| 2 | {stores['last_level_caches']} | {stores['setting']} | {coll} | {cells} |" in summary
    if stores["measured"]:  # each rank measures: the channel's own choice against the faster kind, recomputed
        auto = sorted(r["auto"] / min(r["nt"], r["plain"]) for rows in stores["results"].values() for r in rows)
        assert f"own choice took {auto[len(auto) // 2]:.2f} x the faster of the two" in summary
    else:
        assert "HPCDL_SHM_NONTEMPORAL_BYTES" in summary or "The default suits this node" in summary
    chose = single_copy_line(stores["single_copy_broadcast"], stores["broadcast_times"])
    assert f"2 ranks: {chose}." in summary
    assert "hpcdl DistributedOptimizer" in summary and "Pipeline bubble" in summary
    rows = json.loads((tmp_path / "raw" / "pipeline_np2.json").read_text())
    pp = next(r for r in rows if r["grid"] == "1x1x2")
    assert f"the slowest stage's bubble measured {pp['bubble_slowest']:.3f}" in summary.split("## Pipeline bubble")[1]
    # no schedule of the same spans ends sooner than the replay, which starts each as soon as it can
    assert 0 < pp["bubble_replayed_slowest"] < 1 and pp["hop_s"] > 0
    tp = [r for r in json.loads((tmp_path / "raw" / "pipeline_np2.json").read_text()) if r["grid"] == "1x2x1"][0]
    assert tp["tp_calls"] > 0 and tp["tp_bytes"] > 0 and 0 < tp["tp_seconds"] < tp["step_s"]
    assert f"{tp['tp_calls']:.0f} tensor-parallel calls of {tp['tp_bytes'] / (1 << 20):.2f} MiB" in summary
    # the wait split: the calls' own cost (the least of the ranks' seconds in each) is at most any rank's seconds
    assert 0 < tp["tp_call_seconds"] <= tp["tp_seconds"] + 1e-12 and tp["tp_peer_wait_seconds"] >= 0
    own, peer = tp["tp_call_seconds"] * 1e3, tp["tp_peer_wait_seconds"] * 1e3
    assert f"{own:.1f} ms the calls' own" in summary and f"{peer:.1f} ms for a later peer" in summary
    # the planner against the GPT's steps, each grid's line from the check's own JSON
    plan = json.loads((tmp_path / "raw" / "plan_np2.json").read_text())
    assert [r["grid"] for r in plan["rows"]] == ["2x1x1", "1x1x2"]
    section = summary.split("## The planner against the GPT's measured steps")[1]
    for row in plan["rows"]:
        line = f"- {row['grid']}: measured {row['step_s'] * 1e3:.1f} ms, predicted {row['predicted_step_s'] * 1e3:.1f} "
        assert line in section, (line, section)
        assert f"x, contention {row['contention']:.2f})" in section
    assert f"- worst {plan['verdict']['worst']:+.1%} (the bound is 25%)" in section
    # parameter servers against allreduce across a link: each row's winner recomputed from the worker part's own JSON
    ps = json.loads((tmp_path / "ps_links.json").read_text())
    section = summary.split("## Parameter servers against allreduce across emulated links")[1]
    assert [(run["link"], run["layout"]) for run in ps["runs"]] == [("eth-25g", "2x1+2")]
    ms = lambda us: " / ".join(f"{us[c] / 1e3:.2f}" for c in ("ring", "hierarchical", "ps-sync", "hybrid"))  # noqa: E731
    for run in ps["runs"]:
        measured = json.loads((tmp_path / "raw" / "ps_2x1_2_eth-25g.json").read_text())
        alone = json.loads((tmp_path / "raw" / "ps_2x1_2_nolink.json").read_text())
        for s, row, own in zip(run["sizes"], measured, alone, strict=True):
            assert s["size"] == row["size"] == own["size"] == 64 << 10
            assert s["winner"] == min(("ring", "ps-sync"), key=row["us"].__getitem__)  # one path each, one a node
            assert f"- eth-25g, 2x1+2, 64 KiB: {ms(row['us'])}: {s['winner']} wins (the model: " in section
            assert f"- 2x1+2, without a link (this node's own cost): 64 KiB {ms(own['us'])}" in section
            took = f'`node_reduce="auto"` took {row["auto_took"]}, '
            best = min(row["us"]["ps-sync"], row["us"]["hybrid"])
            assert took + f"{row['us']['auto'] / best:.2f} x the better parameter-server path" in section
    # one size: the servers' own work is not fitted, and tuning.json holds none
    assert report["ps"]["ps_own"] is None and report["ps"]["ps_phases"] is None and "ps_own" not in tuned
    assert "- the servers' own work: not fitted here (it needs exchanges without a link at two partition" in section


def test_the_parameter_server_step_places_its_layouts_by_the_cores_and_says_why_it_did_not_run():
    assert ps_layouts(16) == ps_layouts(8) == ["2x2+4", "4x1+4"]  # 8 ranks each: 4 or 2 workers a node, 4 servers
    assert ps_layouts(7) == ps_layouts(4) == ["2x1+2"]
    assert ps_layouts(2) == []
    report = {"machine": {}, "date": "d", "seconds": 1.0, "budget": 2.0, "runs": [], "steps": ["ps"]}
    report["ps"] = {"skipped": "it needs 4 ranks with a core each (2 workers, 2 servers); this node runs 2"}
    assert "- not run: it needs 4 ranks with a core each" in summarize(report)
    report["ps"] = {"runs": []}
    assert "## Parameter servers against allreduce across emulated links\n\n- did not finish" in summarize(report)
    # a run with the servers' own work fitted: the summary gives it, and the model's winner
    # with it: one worker a node across 10 Gbit/s, where the links alone have the servers win
    us = {"ring": 9e3, "hierarchical": 8e3, "ps-sync": 7e3, "hybrid": 6e3, "auto": 6e3}
    rows = [{"size": 4 << 20, "us": us, "auto_took": "ps-sync"}]
    plain = [{"size": 4 << 20, "us": {k: v / 4 for k, v in us.items()}}]
    own = {"alpha": 1.5e-3, "beta": 2.5e8}
    alone = summarize_ps("eth-10g", "4x1+4", rows, plain)
    assert alone["sizes"][0]["predicted_winner"] == "ps-sync"
    run = summarize_ps("eth-10g", "4x1+4", rows, plain, own=AlphaBeta(**own))
    report["ps"] = {"runs": [run], "ps_own": own, "ps_phases": {"alpha": 2e-3, "beta": 1e9}}
    text = summarize(report)
    assert (
        "inside a node (reduce-scatter, allgather), fitted to its exchanges without a link less the servers' " in text
    )
    assert "servers' work: 2000 µs + a rank's bytes at 1.00 GB/s (`ps_phases` in `tuning.json`)" in text
    assert "fitted to the exchanges without a link: 1500 µs + its bytes at 0.25 GB/s (`ps_own` in `tuning.json`" in text
    assert "- eth-10g, 4x1+4, 4 MiB: 9.00 / 8.00 / 7.00 / 6.00: ps-sync wins (the model: ring)" in text


def test_ranks_are_bound_to_a_core_each_by_the_launchers_own_option():
    hydra = "HYDRA build details:\n    Version:                                 5.0.2\n"
    assert binding_flags(hydra, "core") == ["-bind-to", "core"] and binding_flags(hydra, "none") == []
    ompi = "mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
    assert binding_flags(ompi, "core") == ["--bind-to", "core:overload-allowed"]
    assert binding_flags(ompi, "none") == ["--bind-to", "none"]  # Open MPI binds unless told not to
    assert binding_flags("mpirun (OpenRTE) 4.1.5\n", "none") == ["--bind-to", "none"]
    assert binding_flags("Intel(R) MPI Library for Linux* OS, Version 2021.9\n", "core") is None
    assert binding_flags("", "core") is None  # no launcher answered
    # a training rank's compute thread and its engine's thread, on two cores of its own
    assert binding_flags(hydra, "core", 2) == ["-bind-to", "core:2"] and binding_flags(hydra, "none", 2) == []
    assert binding_flags(ompi, "core", 2) == ["--map-by", "slot:PE=2", "--bind-to", "core"]
    assert binding_flags(ompi, "none", 2) == ["--bind-to", "none"]
    assert [model_cores(n, 16) for n in (2, 4, 8, 9, 16)] == [2, 2, 2, 1, 1]
    assert model_cores(2, 2) == 1


def test_a_model_step_on_a_node_with_two_cores_a_rank_binds_each_rank_to_two(tmp_path):
    r = Runner(tmp_path, 120, "core", cores=4)
    assert r.run("model", 2, ["platform"], 60, model=True)  # Hydra takes the option and runs
    assert r.run("collective", 2, ["platform"], 60)
    assert r.run("crowded", 3, ["platform"], 60, model=True)
    model, collective, crowded = (e["command"] for e in r.runs)
    assert model == "mpiexec -bind-to core:2 -n 2 python -m platform"
    assert collective == "mpiexec -bind-to core -n 2 python -m platform"
    assert crowded == "mpiexec -bind-to core -n 3 python -m platform"
    assert Runner(tmp_path, 120, "none", cores=4).flags(2) == []


def test_a_budget_too_small_for_a_step_skips_it_and_says_so(tmp_path):
    proc = run_report(tmp_path, "--quick", "--max-ranks", "2", "--budget", "10")
    assert proc.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "## What did not finish" in summary and "skipped: the budget was spent" in summary
    report = json.loads((tmp_path / "report.json").read_text())
    assert summarize(report) == summary


def test_bad_options_are_refused(tmp_path):
    for args, says in (
        (["--budget", "1"], "must be"),
        (["--max-ranks", "1"], "must be"),
        (["--steps", "tuner,gpus"], "unknown gpus"),
    ):
        proc = run_report(tmp_path, *args)
        assert proc.returncode == 2 and says in proc.stderr


def test_a_report_started_as_one_of_several_tasks_or_into_a_directory_it_cannot_make_stops_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """Under ``mpiexec -n 2`` or ``srun -n 2`` every task would run the whole report into one
    directory: each stops at once and says why. A Slurm batch script is one process (no step
    id), as is ``srun -n 1``."""
    from benchmarks import node_report

    for var in ("OMPI_COMM_WORLD_RANK", "HYDI_CONTROL_FD", "SLURM_STEP_ID", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert launcher_size({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) is None  # the batch script
    assert launcher_size({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}) == 1  # srun -n 1
    for env, who in (
        ({"HYDI_CONTROL_FD": "7", "PMI_RANK": "1", "PMI_SIZE": "2"}, "2 tasks by mpiexec (MPICH hydra)"),
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, "4 tasks by srun (Slurm)"),
    ):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert node_report.main(["--out", str(tmp_path / "r"), "--quick"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"started as one of {who}; run it once" in err, err
        assert not (tmp_path / "r").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stop:
        node_report.main(["--out", str(tmp_path / "file" / "r"), "--quick"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"--out {tmp_path / 'file' / 'r'}: cannot make the directory" in err, err
    assert "Traceback" not in err


def test_under_mpiexec_every_rank_of_the_report_stops_at_once_and_nothing_is_written(tmp_path):
    proc = mpiexec_job(["-m", "benchmarks.node_report", "--out", str(tmp_path / "r"), "--quick"], n=2, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("node_report: started as one of 2 tasks by mpiexec (MPICH hydra); run it once") == 2
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


def test_a_launcher_whose_ranks_each_see_one_rank_stops_the_report_before_it_measures(tmp_path, monkeypatch):
    from benchmarks import node_report

    mpiexec = str(Runner(tmp_path, 60).mpiexec)
    assert world_check(mpiexec) is None  # the wheel's mpiexec and the MPICH mpi4py loads
    # a launcher of another MPI: it starts the processes, but mpi4py's MPI sees each alone
    other = tmp_path / "other-mpiexec"
    other.write_text('#!/bin/sh\nshift 2\n"$@" & "$@"\nwait\n')
    other.chmod(0o755)
    why = world_check(str(other), "HYDRA build details:\n    Version:       9.9\n    Release Date: x")
    assert why.startswith(f"`{other} -n 2` started 2 processes, but each is an MPI job of 1 rank")
    assert "mpi4py here loads MPICH" in why and "(MPICH's Hydra 9.9)" in why and "MPI4PY_LIBMPI" in why
    assert world_check(str(other), "mpiexec (OpenRTE) 4.1.6\n\nReport bugs").count("(mpiexec (OpenRTE) 4.1.6)") == 1
    broken = tmp_path / "broken-mpiexec"
    broken.write_text("#!/bin/sh\necho no such host >&2\nexit 3\n")
    broken.chmod(0o755)
    assert world_check(str(broken)) == f"`{broken} -n 2` ended with status 3, ranks seen []: no such host"
    assert world_check(str(tmp_path / "missing")).startswith(f"`{tmp_path / 'missing'} -n 2` did not run: ")
    # the report says why on stderr and in its summary, and measures nothing
    monkeypatch.setattr(node_report, "world_check", lambda mpiexec, version="": "each rank alone")
    assert node_report.main(["--out", str(tmp_path / "r"), "--quick", "--steps", "plan"]) == 2
    assert (tmp_path / "r" / "summary.md").read_text().endswith("Not run: each rank alone.\n")
    assert not (tmp_path / "r" / "report.json").exists() and not list((tmp_path / "r" / "raw").iterdir())


def _gpu_rows(times):
    return [{"size": s, "results": {k: {"avg": v} for k, v in t.items()}} for s, t in times.items()]


def test_the_machine_line_names_the_kernel_and_its_huge_pages(tmp_path):
    # the bracketed mode of the kernel's file, or "?" where there is none
    modes = tmp_path / "enabled"
    modes.write_text("always [madvise] never\n")
    assert huge_pages(str(modes)) == "madvise"
    modes.write_text("nothing chosen\n")
    assert huge_pages(str(modes)) == "?" and huge_pages(str(tmp_path / "missing")) == "?"
    m = machine()
    assert m["kernel"].split()[0] and m["huge_pages"] in ("always", "madvise", "never", "?")
    report = {"machine": m, "date": "2026-11-27 09:00", "seconds": 1.0, "budget": 10.0, "runs": [], "steps": []}
    assert f"{m['kernel']}, transparent huge pages {m['huge_pages']}; " in summarize(report)


def test_the_gpu_section_gives_the_staged_ipc_crossover_with_and_without_mps():
    no_mps = _gpu_rows(
        {4: {"ipc": 700, "staged": 300}, 65536: {"ipc": 710, "staged": 400}, 1 << 20: {"ipc": 720, "staged": 900}}
    )
    mps = _gpu_rows({4: {"ipc": 200, "staged": 300}, 65536: {"ipc": 210, "staged": 180}})
    assert crossover(no_mps) == 65536  # staged faster at 4 B and 64 KiB, not at 1 MiB
    assert crossover(mps) == 0  # ipc faster from the smallest size on
    assert crossover(no_mps[:2]) == 65536 and crossover([]) is None
    report = {
        "machine": {"host": "h", "cores": 16},
        "date": "2026-11-25 12:00",
        "seconds": 1.0,
        "budget": 10.0,
        "collectives": {},
        "small_calls": {},
        "tuner": {},
        "training": {},
        "pipeline": [],
        "gpu": {"np2": {"rows": no_mps}, "np2_mps": {"rows": mps}},
        "runs": [],
    }
    text = summarize(report)
    assert "without MPS: staged faster than ipc up to 64 KiB" in text
    assert "under MPS: staged faster than ipc up to no size" in text
    assert "| 1 MiB | 720.0 | 900.0 |" in text
    # a sweep cut off by its share of the budget gives the sizes it measured, and says so
    report["gpu"] = {"np2": {"rows": no_mps[:2], "complete": False}, "np2_mps": {"rows": mps, "complete": True}}
    text = summarize(report)
    assert "without MPS (cut off after 64 KiB): staged faster than ipc up to 64 KiB" in text
    assert "under MPS: staged faster" in text and "| 64 KiB | 710.0 | 400.0 |" in text


def test_the_small_calls_section_gives_each_rank_counts_cache_line_round_trips():
    row = {"collective": "allreduce", "size": 4, "total": 1.0, "python": 0.4, "step": 0.6, "wait": 0.6}
    row.update(barrier=2.0, mpi=1.5, waited=0.3, polls=0.5, sleeps=0.0, wakes=0.0)
    report = {
        "machine": {"host": "h", "cores": 16},
        "date": "2026-12-07 12:00",
        "seconds": 1.0,
        "budget": 10.0,
        "steps": ["small_calls"],
        "small_calls": {
            "2": {"rows": [row], "line_round_trip_s": {"before": [9.6e-8], "after": [5.1e-7]}},
            "4": {"rows": [row], "line_round_trip_s": {"before": [1e-7, 2e-7, 4e-7], "after": [1e-7, 2e-7, 3e-7]}},
            "16": {"rows": [row], "line_round_trip_s": {"before": None, "after": None}},
            "8": [row],  # a report.json from before the round trips: its table alone
        },
        "runs": [],
    }
    text = summarize(report)
    assert "- 2 ranks: a cache line's round trip between the two ranks: 96 ns before, 510 ns after" in text
    four = "100-400 (median 200) ns before, 100-300 (median 200) ns after"
    assert f"- 4 ranks: a cache line's round trip between rank 0 and each other rank: {four}" in text
    assert "- 16 ranks: a cache line's round trip between the ranks: not measured" in text
    assert "| 8 | allreduce | 4 | 1.00 |" in text and "- 8 ranks" not in text
    assert trips_text([1e-7], None) == trips_text(None, None)


def test_each_training_ratio_comes_with_its_rounds_one_by_one():
    rows = {"no communication": {"step_ms": 100.0, "round_ratios": [1.0, 1.0]}}
    rows["hpcdl DistributedOptimizer"] = {"step_ms": 108.0, "round_ratios": [1.05, 1.123]}
    rows["torch DDP (gloo)"] = {"step_ms": 150.0, "round_ratios": [1.5]}  # one round: nothing to add
    report = {"machine": {"host": "h"}, "date": "d", "seconds": 1.0, "budget": 2.0, "runs": [], "steps": ["training"]}
    report["training"] = {"2": [{"model": "mlp", "rows": rows}]}
    text = summarize(report)
    assert "- 2 ranks, mlp: hpcdl DistributedOptimizer 1.08 x (round by round 1.05, 1.12)\n" in text
    assert text.endswith("- 2 ranks, mlp: torch DDP (gloo) 1.50 x\n")


def test_the_gpu_sweeps_fit_their_iterations_to_their_share_of_the_budget():
    # OSU's 100 and 10 where the share holds them; fewer, by half a second an iteration, where not
    assert gpu_iterations(200) == (100, 10) and gpu_iterations(60) == (100, 10)
    assert gpu_iterations(33) == (46, 4) and gpu_iterations(5) == (10, 2)


def _one_f_one_b(
    p: int,
    m: int,
    fwd: list[float],
    bwd: list[float | list[float]],
    hop: float = 0.0,
    own: float = 0.0,
    lines: int = 1,
    ahead: int = 0,
) -> dict:
    """The spans of one 1F1B step of ``lines`` pipelines of ``p`` stages (rank
    ``s * lines + j``: stage s of pipeline j, as a grid numbers them) whose spans last
    ``fwd[s]`` and ``bwd[s]`` (a list: micro-batch i's backward ``bwd[s][i % len]``), run as
    the schedule runs them, ``ahead`` more warm-up forwards on all but the last stage: a span
    starts ``own`` after its stage's previous span and ``hop`` after its input was made."""
    from hpcdl.parallel.pipeline import one_f_one_b

    order = [one_f_one_b(p, s, m, ahead) for s in range(p)]
    end: dict[tuple[int, str, int], float] = {}
    free, at, spans = [0.0] * p, [0] * p, [[] for _ in range(p)]
    while any(at[s] < len(order[s]) for s in range(p)):
        for s in range(p):
            if at[s] == len(order[s]):
                continue
            kind, i = order[s][at[s]]
            dep = (s - 1, "F", i) if kind == "F" and s > 0 else (s + 1, "B", i) if kind == "B" and s < p - 1 else None
            if dep is not None and dep not in end:
                continue
            start = max(free[s] + (own if at[s] else 0.0), end[dep] + hop if dep else 0.0)
            back = bwd[s][i % len(bwd[s])] if isinstance(bwd[s], list) else bwd[s]
            dur = fwd[s] if kind == "F" else back
            end[(s, kind, i)] = free[s] = start + dur
            spans[s].append((start, kind, i, dur))
            at[s] += 1
    return {s * lines + j: (s, list(spans[s])) for s in range(p) for j in range(lines)}


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8)])
def test_the_bubble_of_equal_stages_is_the_formula_and_the_hops_and_unequal_stages_are_told_apart(p, m):
    from benchmarks.parallel_gpt import bubbles

    formula = (p - 1) / (m + p - 1)
    equal = bubbles([_one_f_one_b(p, m, [1.0] * p, [2.0] * p)])
    assert equal["mean"] == pytest.approx(formula) and equal["slowest"] == pytest.approx(formula)
    assert equal["replayed"] == pytest.approx(formula) and equal["hop_s"] == pytest.approx(0.0)
    # two pipelines side by side (dp = 2): each on its own, the same bubble
    assert bubbles([_one_f_one_b(p, m, [1.0] * p, [2.0] * p, lines=2)]) == pytest.approx(equal)
    # hops that cost 0.25 us each: the replay takes them out and tells their cost a micro-batch
    hops = bubbles([_one_f_one_b(p, m, [1.0] * p, [2.0] * p, hop=0.25)])
    assert hops["slowest"] > formula + 0.01 and hops["replayed_slowest"] == pytest.approx(formula)
    stretched = max(
        t + d for _, spans in _one_f_one_b(p, m, [1.0] * p, [2.0] * p, hop=0.25).values() for t, _, _, d in spans
    )
    assert hops["hop_s"] == pytest.approx((stretched - 3.0 * (m + p - 1)) / m * 1e-6)
    # the slowest stage (the last, with the loss) waits a hop each way between a backward and the next forward
    assert equal["between_s"] == pytest.approx(0.0) and hops["between_s"] > 0
    # a stage's own cost between its spans (its sends, receives and Python), where it waits for no one
    own = bubbles([_one_f_one_b(p, m, [1.0] * p, [2.0] * (p - 1) + [3.0], own=0.25)])
    assert equal["gap_s"] == pytest.approx(0.0) and own["gap_s"] == pytest.approx(0.25e-6)
    # a first stage whose backward is cheaper (no gradient of its input): it idles more, the
    # slowest stage no more than the formula
    cheap_first = bubbles([_one_f_one_b(p, m, [1.0] * p, [1.5] + [2.0] * (p - 1))])
    assert cheap_first["mean"] > formula + 0.01 and cheap_first["slowest"] <= formula + 1e-9
    assert bubbles([]) is None and bubbles([{0: (0, [])}]) is None
    # one more micro-batch in flight changes nothing for stages that never vary
    assert equal["replayed_ahead_slowest"] == pytest.approx(formula)


def test_the_bubble_tells_whether_one_more_micro_batch_in_flight_would_absorb_the_stages_variation():
    from benchmarks.parallel_gpt import bubbles
    from hpcdl.parallel.pipeline import one_f_one_b

    assert one_f_one_b(2, 0, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert one_f_one_b(2, 1, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert one_f_one_b(2, 0, 4, ahead=1)[:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]
    assert one_f_one_b(2, 1, 4, ahead=1) == one_f_one_b(2, 1, 4)  # the last stage warms up with none
    assert one_f_one_b(3, 0, 2, ahead=1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # no more than m
    # two stages of the same compute on average, the last's backward slow and fast by turns:
    # under 1F1B the first waits for each slow one, and the last then waits for the first
    m, formula = 8, 1 / 9
    varying = ([1.0, 1.0], [[2.0], [3.0, 1.0]])
    got = bubbles([_one_f_one_b(2, m, *varying)])
    assert got["replayed_slowest"] == pytest.approx(got["slowest"]) == pytest.approx(0.2)
    # with a micro-batch more in flight the first stage keeps ahead and the variation is
    # absorbed: the replay of the same spans says so, and it is what those stages give when
    # they run that schedule
    ahead = bubbles([_one_f_one_b(2, m, *varying, ahead=1)])
    assert ahead.get("replayed_ahead_slowest") is None  # no longer 1F1B's own order
    assert got["replayed_ahead_slowest"] == pytest.approx(ahead["slowest"]) == pytest.approx(formula)
    # with hops that cost something, the same: the replay takes them out
    hops = bubbles([_one_f_one_b(2, m, *varying, hop=0.25)])
    assert hops["replayed_ahead_slowest"] == pytest.approx(formula) and hops["slowest"] > got["slowest"]
    # GPipe's spans: nothing to compare, whether the caller says so or the order tells
    gpipe = {0: (0, [(0.0, "F", 0, 1.0), (1.0, "F", 1, 1.0), (4.0, "B", 0, 2.0), (8.0, "B", 1, 2.0)])}
    gpipe[1] = (1, [(1.0, "F", 0, 1.0), (2.0, "F", 1, 1.0), (3.0, "B", 0, 1.0), (6.0, "B", 1, 2.0)])
    for schedule in ("gpipe", "1f1b"):
        told = bubbles([gpipe], schedule)
        assert told is not None and "replayed_ahead_slowest" not in told and told["slowest"] > 0
    # with one micro-batch the two orders are the same: only the schedule says which it was
    single = _one_f_one_b(2, 1, [1.0, 1.0], [2.0, 2.0])
    assert "replayed_ahead_slowest" in bubbles([single]) and "replayed_ahead_slowest" not in bubbles([single], "gpipe")
    assert "gap_s" not in bubbles([single])  # no forward follows another span: no gap before one
    # the report's line gives it where there is one, and leaves it out where there is none
    row = {"grid": "1x1x2", "chunks": m, "bubble_formula": formula, "bubble": got["mean"], "hop_s": 1e-4}
    row.update(between_s=2e-4, gap_s=1e-4, bubble_slowest=got["slowest"], bubble_replayed=got["replayed"])
    row["bubble_replayed_slowest"] = got["replayed_slowest"]
    assert "in flight" not in bubble_line(row)
    row["bubble_replayed_ahead_slowest"] = got["replayed_ahead_slowest"]
    line = bubble_line(row)
    assert (
        f"its spans give 0.200, and {formula:.3f} with one more micro-batch in flight ahead of the last stage" in line
    )
    assert line.startswith("1x1x2, 8 micro-batches: the slowest stage's bubble measured 0.200") and "100 us a" in line
    assert "between its spans, typically 100 us before a forward. Mean" in line
    row["gap_s"] = None
    assert "between its spans. Mean over the stages" in bubble_line(row)


def test_the_node_tuning_file_merges_each_count_the_tuner_measured_into_the_packaged_table(tmp_path):
    (tmp_path / "raw").mkdir()
    assert node_tuning(tmp_path, [2, 4], "node") is None and not (tmp_path / "tuning.json").exists()
    # the parameter servers' own work alone (the hybrid's phases not fitted): the packaged table with it
    ps = {"runs": [], "ps_own": {"alpha": 1e-4, "beta": 2e9}, "ps_phases": None}
    assert node_tuning(tmp_path, [2, 4], "node", ps) == "tuning.json"
    owned = read_tuning_file(str(tmp_path / "tuning.json"))
    assert owned["ps_own"] == {"alpha": 1e-4, "beta": 2e9} and owned["tables"] == load_table()["tables"]
    assert "ps_phases" not in owned
    ps["ps_phases"] = {"alpha": 2e-3, "beta": 1e9}
    assert node_tuning(tmp_path, [2, 4], "node", ps) == "tuning.json"
    assert read_tuning_file(str(tmp_path / "tuning.json"))["ps_phases"] == {"alpha": 2e-3, "beta": 1e9}
    row = {"collective": "allgather", "nodes": 1, "rules": [[None, "ring"]], "oversubscribed": False}
    for n in (2, 4):
        new = {
            "tables": [{**row, "size": n}],
            "runs": [f"run {n}"],
            "node_paths": [{"size": n, "alpha": 1e-6, "beta": 1e9}],
        }
        (tmp_path / "raw" / f"tuner_np{n}.json").write_text(json.dumps(new))
    (tmp_path / "raw" / "tuner_np8.json").write_text("{cut off")  # a run that did not finish: left out
    assert node_tuning(tmp_path, [2, 4, 8], "16 cores (X), node report") == "tuning.json"
    tuned = read_tuning_file(str(tmp_path / "tuning.json"))
    packaged = load_table()
    assert rules(tuned, "allgather", 2, 1) == rules(tuned, "allgather", 4, 1) == [[None, "ring"]]
    assert rules(tuned, "allgather", 8, 1) == rules(packaged, "allgather", 8, 1)
    assert rules(tuned, "allreduce", 2, 1) == rules(packaged, "allreduce", 2, 1)
    assert [p["size"] for p in tuned["node_paths"]] == [2, 4] and tuned["runs"][-2:] == ["run 2", "run 4"]
    assert tuned["machine"].startswith("per entry: those labelled '16 cores (X), node report' measured here")
    assert {e["machine"] for e in tuned["tables"] if e["collective"] == "allgather" and e["size"] in (2, 4)} == {
        "16 cores (X), node report"
    }
