"""Single-process tests: one-rank calls, argument checks, configuration, selection, abort."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from reference import DTYPES, OPS, digest, make_input

import collectives as C
from collectives.config import Config, load_config
from collectives.layout import Fold, block_counts
from collectives.ops import finalize
from collectives.select import _rules, choose


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_rank_calls_return_their_input(dtype):
    x = make_input(0, 11, dtype, "sum").reshape(11, 1)
    for op in OPS:
        for alg in C.algorithms("allreduce"):
            assert digest(C.allreduce(x, op=op, algorithm=alg)) == digest(x)
    assert digest(C.reduce_scatter(x)) == digest(x.reshape(-1))
    assert digest(C.allgather(x)) == digest(x)
    assert digest(C.broadcast(x)) == digest(x)
    assert digest(C.reduce(x)) == digest(x)
    assert digest(C.alltoall(x)) == digest(x)
    assert digest(C.iallreduce(x).wait()) == digest(x)
    assert C.iallgather(x).test()


@pytest.mark.parametrize(
    "exc, call",
    [
        (C.UnsupportedDtypeError, lambda: C.allreduce(np.zeros(3, np.complex128))),
        (C.UnsupportedDtypeError, lambda: C.allreduce(np.array(["a"]))),
        (C.UnsupportedOpError, lambda: C.allreduce(np.zeros(3), op="mean")),
        (C.UnknownAlgorithmError, lambda: C.allreduce(np.zeros(3), algorithm="butterfly")),
        (C.UnknownAlgorithmError, lambda: C.broadcast(np.zeros(3), algorithm="ring")),
        (C.InvalidRootError, lambda: C.broadcast(np.zeros(3), root=1)),
        (C.InvalidRootError, lambda: C.reduce(np.zeros(3), root=-1)),
        (C.OutputMismatchError, lambda: C.allreduce(np.zeros(3), out=np.zeros(4))),
        (C.OutputMismatchError, lambda: C.allreduce(np.zeros(3), out=np.zeros(3, np.float32))),
        (C.OutputMismatchError, lambda: C.allreduce(np.zeros((3, 2)), out=np.zeros((2, 3)).T)),
        (C.InvalidArgumentError, lambda: C.allgather(np.float64(1.0))),
        (C.InvalidArgumentError, lambda: C.alltoall(np.zeros(4), splits=[3])),
    ],
)
def test_bad_input_raises_specific_error(exc, call):
    with pytest.raises(exc):
        call()


def test_error_messages_say_what_to_do():
    with pytest.raises(C.UnsupportedOpError, match="sum, avg, min, max, prod"):
        C.allreduce(np.zeros(1), op="mean")
    with pytest.raises(C.UnknownAlgorithmError, match="ring"):
        C.allreduce(np.zeros(1), algorithm="rign")


def test_integer_average_truncates_toward_zero():
    buf = np.array([7, -7, 6, -6, 0], np.int32)
    finalize(buf, "avg", 4)
    assert buf.tolist() == [1, -1, 1, -1, 0]


def test_block_counts_follow_mpich():
    assert block_counts(10, 4) == (3, 3, 2, 2)
    assert block_counts(2, 3) == (1, 1, 0)
    assert block_counts(0, 2) == (0, 0)


@pytest.mark.parametrize("n", range(1, 12))
def test_fold_maps_every_rank_once(n):
    folds = [Fold(r, n) for r in range(n)]
    news = sorted(f.new for f in folds if f.new >= 0)
    assert news == list(range(folds[0].p))
    for f in folds:
        if f.new >= 0:
            assert f.actual(f.new) == f.rank
    assert [folds[0].first(k) for k in range(folds[0].p + 1)][-1] == n


def test_algorithms_list_native_and_auto():
    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"):
        names = C.algorithms(coll)
        assert "native" in names and names[-1] == "auto"
    assert {"ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical", "shm"} <= set(
        C.algorithms("allreduce")
    )
    with pytest.raises(ValueError):
        C.algorithms("scan")


def test_config_reads_env_and_rejects_unknown_names():
    cfg = load_config({"HPCDL_SEGMENT_BYTES": "4096", "HPCDL_RANKS_PER_NODE": "2", "PATH": "/bin"})
    assert cfg.segment_bytes == 4096 and cfg.ranks_per_node == 2
    with pytest.raises(C.ConfigError, match="did you mean HPCDL_RANKS_PER_NODE"):
        load_config({"HPCDL_RANK_PER_NODE": "2"})
    with pytest.raises(C.ConfigError, match="not an integer"):
        load_config({"HPCDL_SHM_BYTES": "lots"})
    with pytest.raises(C.ConfigError, match="ranks_per_node=-1"):
        Config(ranks_per_node=-1)
    with pytest.raises(C.ConfigError, match="does not exist"):
        Config(tuning_file="/nonexistent/table.json")


def test_tuning_rules_lookup_exact_then_nearest_then_default():
    table = {
        "tables": [
            {"collective": "allreduce", "size": 2, "nodes": 1, "rules": [[100, "tree"], [None, "ring"]]},
            {"collective": "allreduce", "size": 8, "nodes": 1, "rules": [[None, "rabenseifner"]]},
        ]
    }
    assert _rules(table, "allreduce", 2, 1)[0][1] == "tree"
    assert _rules(table, "allreduce", 3, 1)[0][1] == "tree"
    assert _rules(table, "allreduce", 7, 1)[0][1] == "rabenseifner"
    assert _rules(table, "allreduce", 4, 2)[0][1] == "recursive_doubling"  # no multi-node table: defaults


def test_shipped_table_names_only_registered_algorithms():
    from collectives.select import REGISTRY, load_table

    table = load_table()
    assert table["tables"], "the package must ship a measured tuning table"
    for entry in table["tables"]:
        for _limit, name in entry["rules"]:
            assert name in REGISTRY[entry["collective"]], entry


def test_auto_never_picks_native_without_mpi():
    class Fake:
        comm = None
        size = 2

    class Ctx:
        transport = Fake()

    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"):
        for nbytes in (4, 1 << 30):
            assert choose(Ctx(), coll, nbytes) != "native"


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
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    start = time.monotonic()
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    assert "rank one gives up" in proc.stderr and "Traceback" in proc.stderr


def test_parse_size_reads_suffixes_and_names_bad_text():
    import argparse

    from collectives.cli import parse_size, parse_sizes

    assert [parse_size(t) for t in ("4", " 64k ", "16M", "1G")] == [4, 64 << 10, 16 << 20, 1 << 30]
    assert parse_sizes("4,1K,1M") == [4, 1024, 1 << 20]
    for bad in ("4Q", "", "M", "-4", "1.5M", "4KK"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"bad size {bad!r}"):
            parse_size(bad)


def _torch_allreduce_job(*args: str) -> subprocess.CompletedProcess:
    """``mpiexec -n 2 python -m benchmarks.torch_allreduce ARGS`` from the repository root."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "benchmarks.torch_allreduce", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)


def test_a_bad_size_on_the_command_line_is_a_usage_error_on_every_rank_without_a_traceback():
    proc = _torch_allreduce_job("--sizes", "4,1Q")
    assert proc.returncode == 2, proc.stderr
    assert "torch_allreduce.py: error: argument --sizes: bad size '1Q'" in proc.stderr
    assert "exited with status 2: ending the job" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_torch_allreduce_benchmark_refuses_cuda_without_a_gpu_and_ends_the_job():
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    proc = _torch_allreduce_job("--device", "cuda")
    # every rank fails the same check before any MPI call; run_main aborts the job on the
    # first, which may stop the other before it prints
    assert proc.returncode == 2, proc.stderr
    assert "torch_allreduce.py: error: --device cuda: torch sees no CUDA device here" in proc.stderr


def test_waiting_ranks_sleep_soon_only_when_the_node_is_oversubscribed():
    from collectives import node

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert node._spin_budget(1) == node._SPIN
    assert node._spin_budget(cores) == node._SPIN
    assert node._spin_budget(cores + 1) == node._POLITE_SPIN < node._SPIN


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futexes are Linux's")
def test_futex_sleeps_until_woken_and_never_past_a_change():
    import threading

    from collectives import futex

    assert futex.OK
    word = np.zeros(1, np.int64)
    addr = word.ctypes.data
    t = time.perf_counter()
    futex.wait(addr, 7, 5.0)  # the word does not hold 7: back at once
    assert time.perf_counter() - t < 1.0
    t = time.perf_counter()
    futex.wait(addr, 0, 0.05)  # nobody wakes it: the timeout
    assert 0.04 < time.perf_counter() - t < 2.0
    # a high half that differs does not matter: the futex compares the low 32 bits it sees
    word[0] = 5 << 32
    t = time.perf_counter()
    futex.wait(addr, 0, 0.05)
    assert time.perf_counter() - t >= 0.04

    def bump() -> None:
        time.sleep(0.2)
        word[0] += 1
        futex.wake(addr)

    seen = int(word[0])
    th = threading.Thread(target=bump)
    th.start()
    t = time.perf_counter()
    cpu = time.thread_time()
    while word[0] == seen:
        futex.wait(addr, seen, 10.0)
    waited, spent = time.perf_counter() - t, time.thread_time() - cpu
    th.join()
    assert 0.15 < waited < 5.0  # woken by the change, long before the 10 s timeout
    assert spent < 0.5 * waited  # asleep, not spinning


def test_futex_fallback_sleeps_briefly(monkeypatch):
    from collectives import futex

    monkeypatch.setattr(futex, "_SYS", None)
    word = np.zeros(1, np.int64)
    t = time.perf_counter()
    futex.wait(word.ctypes.data, 0, 10.0)  # no futex: a short sleep, then the caller looks again
    assert time.perf_counter() - t < 1.0
    futex.wake(word.ctypes.data)  # a no-op


def test_hpcdl_basics_on_one_rank():
    import torch

    import hpcdl as hvd

    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()
    with pytest.raises(hvd.HpcdlError, match="list of ranks"):
        hvd.init(comm="world")
    with pytest.raises(hvd.HpcdlError, match=r"distinct world ranks in \[0, 1\)"):
        hvd.init([0, 1])
    hvd.init([0])
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.nccl_built() and not hvd.gloo_built()
    assert hvd.cuda_built() is (torch.version.cuda is not None)
    assert isinstance(hvd.mpi_threads_supported(), bool)
    assert hvd.HorovodInternalError is hvd.HpcdlError and issubclass(hvd.HpcdlError, RuntimeError)
    hvd.shutdown()
    hvd.init()
    assert hvd.size() == 1
    hvd.shutdown()
    assert not hvd.is_initialized()
