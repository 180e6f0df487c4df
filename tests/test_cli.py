"""The command-line entry points: sizes with suffixes, usage errors that end every rank of a
job without a traceback, and an uncaught exception on one rank aborting the whole job."""

from __future__ import annotations

import os
import textwrap
import time

import pytest
from conftest import mpiexec_job

from collectives.cli import replace_file


def test_parse_size_reads_suffixes_and_names_bad_text():
    import argparse

    from collectives.cli import parse_size, parse_sizes

    assert [parse_size(t) for t in ("4", " 64k ", "16M", "1G")] == [4, 64 << 10, 16 << 20, 1 << 30]
    assert parse_sizes("4,1K,1M") == [4, 1024, 1 << 20]
    for bad in ("4Q", "", "M", "-4", "1.5M", "4KK"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"bad size {bad!r}"):
            parse_size(bad)


@pytest.mark.parametrize("binary, durable", [(False, False), (True, True)])
def test_replace_file_gives_the_whole_new_file_or_leaves_the_old_one(tmp_path, binary, durable):
    path = str(tmp_path / "f")
    old, new = ("old", "new\n") if not binary else (b"old", bytes(range(256)))
    replace_file(path, lambda fh: fh.write(old), binary=binary, durable=durable)

    def half(fh):
        fh.write(new[:2])
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_file(path, half, binary=binary, durable=durable)
    read = (lambda: open(path, "rb").read()) if binary else (lambda: open(path, encoding="utf-8").read())
    assert read() == old and os.listdir(tmp_path) == ["f"]  # the old file, no partial one beside it
    replace_file(path, lambda fh: fh.write(new), binary=binary, durable=durable)
    assert read() == new and os.listdir(tmp_path) == ["f"]


def test_an_output_that_could_not_be_written_is_refused_before_anything_runs(tmp_path, monkeypatch):
    import argparse

    from collectives import cli

    (tmp_path / "plain").write_text("kept")
    before = os.stat(tmp_path / "plain").st_mtime_ns
    assert cli.output_file(str(tmp_path / "plain")) == str(tmp_path / "plain")  # checked, not touched
    assert (tmp_path / "plain").read_text() == "kept" and os.stat(tmp_path / "plain").st_mtime_ns == before
    assert cli.output_file(str(tmp_path / "new.json")) and not (tmp_path / "new.json").exists()  # nothing made
    for bad, why in (
        (tmp_path / "missing" / "t.json", "No such file or directory"),
        (tmp_path, "Is a directory"),
        (tmp_path / "plain" / "t.json", "Not a directory"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=f"cannot write {bad}: {why}"):
            cli.output_file(str(bad))
    deep = tmp_path / "a" / "b"
    assert cli.output_dir(str(deep)) == str(deep) and deep.is_dir() and not list(deep.iterdir())
    with pytest.raises(argparse.ArgumentTypeError, match=f"cannot write in {tmp_path / 'plain' / 'd'}: "):
        cli.output_dir(str(tmp_path / "plain" / "d"))
    monkeypatch.setattr(cli, "world_rank", lambda: 1)  # only the rank that writes checks
    assert cli.output_file(str(tmp_path / "missing" / "t.json")) == str(tmp_path / "missing" / "t.json")
    assert not (tmp_path / "missing").exists()


def test_the_tuner_with_an_output_it_cannot_write_and_the_bars_with_an_unknown_collective_stop_at_once(tmp_path):
    tune = mpiexec_job(["-m", "collectives.tune", "--out", str(tmp_path / "missing" / "t.json")])
    bars = mpiexec_job(["-m", "benchmarks.bars", "--collectives", "allreduce,scan"])
    assert tune.returncode == 2 and bars.returncode == 2, (tune.stderr, bars.stderr)
    assert f"argument --out: cannot write {tmp_path / 'missing' / 't.json'}: No such file" in tune.stderr
    assert "--collectives: unknown scan; the collectives are allreduce, reduce_scatter" in bars.stderr
    assert "Traceback" not in tune.stderr + bars.stderr  # argument errors: before anything is measured


def test_a_bad_size_on_the_command_line_is_a_usage_error_on_every_rank_without_a_traceback():
    proc = mpiexec_job(["-m", "benchmarks.torch_allreduce", "--sizes", "4,1Q"])
    assert proc.returncode == 2, proc.stderr
    assert "torch_allreduce.py: error: argument --sizes: bad size '1Q'" in proc.stderr
    assert "exited with status 2: ending the job" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_torch_allreduce_benchmark_refuses_cuda_without_a_gpu_and_ends_the_job():
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    proc = mpiexec_job(["-m", "benchmarks.torch_allreduce", "--device", "cuda"])
    # every rank fails the same check before any MPI call; run_main aborts the job on the
    # first, which may stop the other before it prints
    assert proc.returncode == 2, proc.stderr
    assert "torch_allreduce.py: error: --device cuda: torch sees no CUDA device here" in proc.stderr


SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from mpi4py import MPI
    import collectives as C
    from collectives.cli import run_main

    def main():
        if MPI.COMM_WORLD.rank == 1:
            raise RuntimeError("rank one gives up")
        C.allreduce(np.ones(4))  # rank 0 would wait here forever

    run_main(main)
    """
)


def test_uncaught_exception_on_one_rank_aborts_the_whole_job(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    proc = mpiexec_job([str(script)])
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    assert "rank one gives up" in proc.stderr and "Traceback" in proc.stderr


ENTRY_POINTS = [
    "hpcdl.train",
    "collectives.tune",
    "benchmarks.bars",
    "benchmarks.profile",
    "benchmarks.torch_allreduce",
    "benchmarks.train_throughput",
    *(f"benchmarks.osu_{b}" for b in ("allgather", "allreduce", "bcast", "bw", "latency", "reduce", "reduce_scatter")),
]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_of_every_entry_point_prints_once_under_mpiexec(module):
    """``--help`` works (its text once formatted an unescaped % and crashed) and, under
    ``mpiexec -n 2``, is printed by one rank, not by each."""
    proc = mpiexec_job(["-m", module, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage:") == 1, proc.stdout
    assert "--help" in proc.stdout and "Traceback" not in proc.stderr


def test_sigterm_to_the_test_command_ends_its_children():
    """A CI runner or Slurm stops ``jobs/test.sh`` with SIGTERM: the test job it is running
    ends too, and the script exits 143, leaving no process of its session behind."""
    import contextlib
    import os
    import signal
    import subprocess

    from conftest import ROOT

    script = subprocess.Popen(
        ["bash", os.path.join(ROOT, "jobs", "test.sh")],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def session() -> list[str]:
        out = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(script.pid)], capture_output=True, text=True)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("pytest" in p for p in session()):
            time.sleep(0.2)
        assert any("pytest" in p for p in session()), "the test command never started pytest"
        script.send_signal(signal.SIGTERM)
        _, err = script.communicate(timeout=60)
        assert script.returncode == 143, err
        assert "stopped by signal" in err
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and session():
            time.sleep(0.2)
        assert session() == [], session()
    finally:
        for line in session():  # whatever is left, in any process group of the session
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        if script.poll() is None:
            script.communicate()
