"""Configuration from the environment: collectives' and hpcdl's Config name the bad variable
or value, suggest the name meant, and (hpcdl, under mpiexec) a bad configuration on one
rank fails init on every rank."""

from __future__ import annotations

import pytest
from mpi4py import MPI

import collectives as C
import hpcdl as hvd
from collectives.config import Config, load_config

WORLD = MPI.COMM_WORLD


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


@pytest.mark.parametrize(
    "text, problem",
    [
        ("root:x:0:0:root:/root:/bin/bash\n", "Expecting value: line 1 column 1"),
        ('{"machine": "x"}', 'it needs an object with a "tables" list'),
        ('{"tables": [{"collective": "allreduce", "size": 0, "nodes": 1, "rules": []}]}', 'tables[0] needs "size"'),
        ('{"tables": [{"collective": "allreduce", "size": 2, "nodes": 1, "rules": [[1, 2]]}]}', 'tables[0] needs "rules"'),
        ('{"tables": [], "node_paths": [{"size": 1, "alpha": 1e-6, "beta": 1e9}]}', 'node_paths[0] needs "size"'),
        ('{"tables": [], "node_paths": [{"size": 2, "alpha": 0, "beta": 1e9}]}', 'positive "alpha"'),
        ('{"tables": [], "node_paths": [{"size": 2, "alpha": 1e-6}]}', 'and "beta" (B/s)'),
        ('{"tables": [], "ps_own": {"alpha": 1e-4, "beta": 0}}', '"ps_own" needs "alpha"'),
        ('{"tables": [], "ps_own": {"alpha": -1, "beta": 1e9}}', 'a positive "beta" (B/s)'),
        ('{"tables": [], "ps_own": [1e-4, 1e9]}', '"ps_own" needs'),
        ('{"tables": [], "ps_phases": {"alpha": 1e-4}}', '"ps_phases" needs "alpha"'),
    ],
)
def test_a_tuning_file_that_is_not_a_tuning_table_is_named_with_what_is_wrong(tmp_path, text, problem):
    path = tmp_path / "table.json"
    path.write_text(text)
    with pytest.raises(C.ConfigError) as err:
        Config(tuning_file=str(path))
    assert str(err.value).startswith(f"tuning_file={str(path)!r} is not a tuning table"), err.value
    assert problem in str(err.value), err.value
    with pytest.raises(C.ConfigError, match="is a directory"):
        Config(tuning_file=str(tmp_path))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("clean_runtime")
def test_configuration_errors_are_specific():
    with pytest.raises(hvd.HpcdlError, match="did you mean HPCDL_FUSION_THRESHOLD"):
        hvd.config.load_config({"HPCDL_FUSION_THRESHOLDS": "1"})
    with pytest.raises(hvd.HpcdlError, match="HPCDL_CYCLE_TIME='fast' is not a float"):
        hvd.config.load_config({"HPCDL_CYCLE_TIME": "fast"})
    with pytest.raises(hvd.HpcdlError, match="HPCDL_STALL_CHECK_DISABLE='maybe' is not one of"):
        hvd.config.load_config({"HPCDL_STALL_CHECK_DISABLE": "maybe"})
    with pytest.raises(hvd.HpcdlError, match="stall_shutdown_time_seconds=-1"):
        hvd.Config(stall_shutdown_time_seconds=-1)
    cfg = hvd.config.load_config(
        {"HPCDL_CYCLE_TIME": "2.5", "HPCDL_TIMELINE": "/tmp/x.json", "HPCDL_RANKS_PER_NODE": "0"}
    )
    assert (cfg.cycle_time, cfg.timeline) == (2.5, "/tmp/x.json")
    # a bad environment on one rank only: every rank's init raises, naming it
    with pytest.raises(hvd.HpcdlError, match="rank 1: init"):
        hvd.init(config="not a config" if WORLD.rank == 1 else None)
    assert not hvd.is_initialized()
