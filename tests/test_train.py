"""hpcdl.train in one process, and whole jobs launched with mpiexec from here: the
configuration's sources and errors, data sharding, the learning-rate schedule, atomic
checkpoints, the models, and how a job ends when a rank fails or is killed."""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import MPIEXEC, ROOT, mpiexec_job, mpiexec_start

import hpcdl as hvd
from hpcdl.train import checkpoint as ckpt
from hpcdl.train.agreement import rank_ranges, settings
from hpcdl.train.config import ConfigError, TrainConfig, parse_config
from hpcdl.train.data import ShardedOrder, corpus, digits, eval_indices
from hpcdl.train.launch import check_world, launcher
from hpcdl.train.lock import LockHeld, RunLock
from hpcdl.train.models import GPT


# -- configuration -------------------------------------------------------------------------------
def test_precedence_defaults_file_environment_flags(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('model = "mlp"\nlr = 0.5\nepochs = 3\nzero = 1\nactivation-checkpointing = false\n')
    cfg = parse_config(["--config", str(toml)], environ={})
    assert (cfg.model.name, cfg.optimizer.lr, cfg.training.epochs, cfg.optimizer.zero) == ("mlp", 0.5, 3, 1)
    assert cfg.training.batch_size == 32
    env = {"HPCDL_TRAIN_LR": "0.25", "HPCDL_TRAIN_PROGRESS": "off", "HPCDL_TRAIN_ZERO": "2"}
    cfg = parse_config(["--config", str(toml)], environ=env)
    assert (cfg.optimizer.lr, cfg.job.progress, cfg.optimizer.zero, cfg.training.epochs) == (0.25, False, 2, 3)
    cfg = parse_config(["--config", str(toml), "--lr", "0.125", "--progress", "--zero", "0"], environ=env)
    assert (cfg.optimizer.lr, cfg.job.progress, cfg.optimizer.zero, cfg.model.name) == (0.125, True, 0, "mlp")
    yml = tmp_path / "c.yaml"
    yml.write_text("model: gpt\nn_layer: 3\nprecision: bf16\nlr: 1\n")
    cfg = parse_config(["--config", str(yml)], environ={})
    assert (cfg.model.name, cfg.model.n_layer, cfg.training.precision, cfg.optimizer.lr) == ("gpt", 3, "bf16", 1.0)
    assert cfg == TrainConfig.from_flat(model="gpt", n_layer=3, precision="bf16", lr=1.0)


STORED_KEYS = (
    "model epochs max_steps batch_size grad_accum optimizer lr lr_scaling warmup_steps lr_schedule momentum "
    "weight_decay zero dp ps_mode staleness ps_partition_bytes tp pp pp_schedule chunks sequence_parallel runtime "
    "device precision activation_checkpointing seed threads block_size n_layer n_head d_model dropout run_dir "
    "checkpoint_every keep_checkpoints resume overwrite timeline progress dry_run"
).split()
"""The keys, in order, of the configuration a run directory's config.json and every checkpoint hold."""


def test_the_sections_keep_the_flat_names_users_know():
    """The sections regroup the settings; flags, file keys and the stored configuration keep
    one flat name per setting, in the order --help lists them."""
    from hpcdl.train import CheckpointConfig, ModelConfig, OptimizerConfig, TrainingConfig
    from hpcdl.train.config import help_text

    cfg = TrainConfig.from_flat(model="gpt", optimizer="sgd", checkpoint_every=7, keep_checkpoints=3, lr=1, epochs=4)
    assert (cfg.model.name, cfg.optimizer.name, cfg.checkpoint.every, cfg.checkpoint.keep) == ("gpt", "sgd", 7, 3)
    assert cfg.optimizer.lr == 1.0 and type(cfg.optimizer.lr) is float and cfg.training.epochs == 4
    flat = cfg.to_dict()
    assert list(flat) == STORED_KEYS and flat["runtime"] == dataclasses.asdict(hvd.Config())
    assert (flat["model"], flat["optimizer"], flat["checkpoint_every"], flat["keep_checkpoints"]) == ("gpt", "sgd", 7, 3)
    flags = re.findall(r"^  --([a-z-]+)", help_text().split("\nruntime:")[0], re.M)
    assert [f.replace("-", "_") for f in flags] == ["config", *(k for k in STORED_KEYS if k != "runtime")]
    runtime = hvd.Config(**flat.pop("runtime"))
    assert TrainConfig.from_flat(**flat, runtime=runtime) == cfg
    by_section = TrainConfig(
        model=ModelConfig(name="gpt"),
        training=TrainingConfig(epochs=4),
        optimizer=OptimizerConfig(name="sgd", lr=1.0),
        checkpoint=CheckpointConfig(every=7, keep=3),
    )
    assert by_section == cfg
    with pytest.raises(ConfigError, match=r"^epochs=0 must be >= 1$"):
        TrainConfig(training=TrainingConfig(epochs=0))
    with pytest.raises(ConfigError, match=r"model='gpt' must be a ModelConfig \(TrainConfig.from_flat takes"):
        TrainConfig(model="gpt")
    with pytest.raises(TypeError, match=r"unexpected setting 'epochz'"):
        TrainConfig.from_flat(epochz=3)


def test_the_runtime_section_reads_file_environment_and_flags(tmp_path):
    """The runtime's hpcdl.Config is one nested section: [runtime] in the file, the
    runtime's own HPCDL_<FIELD> variables, then flags; a runtime field has no mirror here."""
    toml = tmp_path / "c.toml"
    toml.write_text("epochs = 2\n[runtime]\nfusion_threshold = 1000\nbucket-bytes = 2048\ncycle_time = 2\n")
    cfg = parse_config(["--config", str(toml)], environ={})
    assert cfg.runtime == hvd.Config(fusion_threshold=1000, bucket_bytes=2048, cycle_time=2.0)
    env = {"HPCDL_BUCKET_BYTES": "4096", "HPCDL_SHM_DOORBELL": "off"}
    cfg = parse_config(["--config", str(toml)], environ=env)
    assert (cfg.runtime.fusion_threshold, cfg.runtime.bucket_bytes, cfg.runtime.shm_doorbell) == (1000, 4096, False)
    cfg = parse_config(["--config", str(toml), "--bucket-bytes", "512", "--shm-doorbell"], environ=env)
    assert (cfg.runtime.bucket_bytes, cfg.runtime.shm_doorbell, cfg.training.epochs) == (512, True, 2)
    assert parse_config([], environ={}).runtime == hvd.Config()
    assert cfg.to_dict()["runtime"]["bucket_bytes"] == 512  # config.json holds the section
    with pytest.raises(ConfigError, match=r"bucket_bytes=0 must be > 0"):
        parse_config(["--bucket-bytes", "0"], environ={})
    with pytest.raises(ConfigError, match=r"unknown field 'fusion_treshold'; did you mean 'fusion_threshold'"):
        (tmp_path / "bad.toml").write_text("[runtime]\nfusion_treshold = 1\n")
        parse_config(["--config", str(tmp_path / "bad.toml")], environ={})
    with pytest.raises(ConfigError, match=r"HPCDL_FUSION_TRESHOLD"):
        parse_config([], environ={"HPCDL_FUSION_TRESHOLD": "1"})


@pytest.mark.parametrize(
    "argv, environ, text, pattern",
    [
        (
            ["--optimizer", "rmsprop"],
            {},
            None,
            r"--optimizer='rmsprop' is not accepted for optimizer; choose one of 'sgd', 'adam', 'adamw'",
        ),
        (["--batch-size", "0"], {}, None, r"batch_size=0 must be >= 1 \(from --batch-size\)"),
        (["--lr", "fast"], {}, None, r"--lr='fast': lr must be a number"),
        (["--lr", "inf"], {}, None, r"lr=inf must be a finite number"),
        ([], {"HPCDL_TRAIN_MOMENTUM": "nan"}, None, r"momentum=nan must be a finite number"),
        ([], {"HPCDL_TRAIN_EPOCHS": "0"}, None, r"epochs=0 must be >= 1 \(from environment variable HPCDL_TRAIN_EPOCHS\)$"),
        ([], {}, "epochs = 0\n", r"epochs=0 must be >= 1 \(from config file '.*'\)$"),
        (["--resume", "--overwrite", "--run-dir", "r"], {}, None, r"resume continues the run .* pass one"),
        ([], {"HPCDL_TRAIN_ZERO": "3"}, None, r"HPCDL_TRAIN_ZERO='3' is not accepted for zero; choose one of 0, 1, 2"),
        (
            [],
            {"HPCDL_TRAIN_EPOCHZ": "3"},
            None,
            r"environment variable HPCDL_TRAIN_EPOCHZ: unknown field 'epochz'; did you mean 'epochs'",
        ),
        ([], {}, 'modle = "cnn"\n', r"unknown field 'modle'; did you mean 'model'"),
        ([], {}, "epochs = 1.5\n", r"epochs must be an integer"),
        ([], {}, "epochs = [\n", r"does not parse"),
        (["--zero", "2", "--precision", "fp16"], {}, None, r"precision='fp16' needs the full gradients"),
        (["--d-model", "30", "--model", "gpt"], {}, None, r"d_model=30 must be a multiple of n_head=4"),
        (["--activation-checkpointing"], {}, None, r"activation_checkpointing applies to .*model='gpt'"),
        (["--resume"], {}, None, r"resume needs run_dir"),
        (["--dropout", "1"], {}, None, r"dropout=1.0 must be < 1.0"),
        (["--no-such-flag"], {}, None, r"unrecognized arguments: --no-such-flag"),
        # the collectives layer's variables, read only when a communicator is first used
        ([], {"HPCDL_SEGMENT_BYTES": "-1"}, None, r"^environment variable HPCDL_SEGMENT_BYTES: segment_bytes=-1 must"),
        ([], {"HPCDL_SHM_CHUNK_BYTES": "abc"}, None, r"^HPCDL_SHM_CHUNK_BYTES='abc' is not an integer$"),
        ([], {"HPCDL_SHM_CHUNK_BYTES": "0"}, None, r"^environment variable HPCDL_SHM_CHUNK_BYTES: shm_chunk_bytes=0"),
        ([], {"HPCDL_TUNING_FILE": "/no/such.json"}, None, r"HPCDL_TUNING_FILE: tuning_file='/no/such.json' does not"),
        ([], {"HPCDL_TUNING_FILE": os.path.join(ROOT, "README.md")}, None, r"HPCDL_TUNING_FILE: .* is not a tuning tab"),
        ([], {"HPCDL_FUSION_THRESHOLD": "-5"}, None, r"^environment variable HPCDL_FUSION_THRESHOLD: fusion_thr"),
        (
            ["--device", "gpu"],
            {},
            None,
            r"--device='gpu' is not accepted for device; choose one of 'auto', 'cpu', 'cuda'",
        ),
    ],
)
def test_bad_values_name_the_field_and_what_is_accepted(tmp_path, argv, environ, text, pattern):
    if text is not None:
        path = tmp_path / "bad.toml"
        path.write_text(text)
        argv = argv + ["--config", str(path)]
    with pytest.raises(ConfigError, match=pattern):
        parse_config(argv, environ=environ)


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA device here")
def test_device_cuda_without_a_gpu_is_refused_before_work():
    with pytest.raises(ConfigError, match="device='cuda' but torch sees no CUDA device here"):
        parse_config(["--device", "cuda"], environ={})
    assert parse_config([], environ={"HPCDL_TRAIN_DEVICE": "auto"}).training.device == "auto"


def test_config_file_must_exist_and_be_toml_or_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(["--config", str(tmp_path / "none.toml")], environ={})
    (tmp_path / "c.ini").write_text("x=1")
    with pytest.raises(ConfigError, match=r"use a \.toml, \.yaml or \.yml file"):
        parse_config(["--config", str(tmp_path / "c.ini")], environ={})
    with pytest.raises(ConfigError, match=r"is a directory; give a \.toml"):
        parse_config(["--config", str(tmp_path)], environ={})


def test_a_bad_value_stops_every_rank_before_work_with_one_message(tmp_path):
    run_dir = tmp_path / "run"
    proc = mpiexec_job(["-m", "hpcdl.train", "--optimizer", "rmsprop", "--run-dir", str(run_dir)])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcdl.train: error: --optimizer='rmsprop' is not accepted") == 1, proc.stderr
    assert not run_dir.exists()  # no rank started work


def test_settings_flatten_every_layer_and_ranks_read_as_ranges():
    flat = settings(TrainConfig.from_flat(lr=0.5), environ={"HPCDL_SEGMENT_BYTES": "4096"})
    assert flat["lr"] == 0.5 and flat["collectives.segment_bytes"] == 4096
    assert flat["runtime.fusion_threshold"] == hvd.Config().fusion_threshold and "runtime" not in flat
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and rank_ranges([3]) == "3"


@pytest.mark.parametrize(
    "theirs, env, text",
    [
        (["--epochs", "3"], {}, "epochs is 2 on ranks 0-1, 3 on rank 2"),
        (["--lr", "0.1"], {}, "lr is 0.002 on ranks 0-1, 0.1 on rank 2"),
        ([], {"HPCDL_SEGMENT_BYTES": "4096"}, "collectives.segment_bytes is 1048576 on ranks 0-1, 4096 on rank 2"),
        ([], {"HPCDL_TRAIN_SEED": "4"}, "seed is 0 on ranks 0-1, 4 on rank 2"),
    ],
)
def test_ranks_started_with_different_settings_all_stop_naming_the_field_and_ranks(tmp_path, theirs, env, text):
    """A rank with another --epochs used to hang the job, one with another --lr to diverge
    in silence; the whole job now ends at once, before any work, with one line."""
    args = ["-m", "hpcdl.train", "--model", "mlp", "--epochs", "2", "--no-progress", "--run-dir", str(tmp_path / "r")]
    odd = ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, *args, *theirs]
    cmd = [MPIEXEC, "-n", "2", sys.executable, *args, ":", "-n", "1", *odd]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and time.monotonic() - t0 < 60, proc.stderr
    assert proc.stderr.count("hpcdl.train: error: the ranks were started with different settings: ") == 1
    assert text in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()  # nothing written


def test_dry_run_prints_the_configuration_and_the_rank_layout():
    proc = mpiexec_job(["-m", "hpcdl.train", "--dry-run", "--model", "gpt", "--zero", "1"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    resolved = json.loads(out.split("# resolved configuration\n", 1)[1].split("# rank layout")[0])
    assert resolved == TrainConfig.from_flat(model="gpt", zero=1, dry_run=True).to_dict()
    assert "# rank layout: 2 ranks on 1 node(s), launcher mpiexec (MPICH hydra)" in out
    rows = [line.split() for line in out.splitlines()[-2:]]
    assert [r[:3] for r in rows] == [["0", "0/2", "0"], ["1", "1/2", "0"]]
    # device auto: GPU local_rank % GPUs where torch sees one, else the CPU
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert [r[6] for r in rows] == [f"cuda:{k % gpus}" if gpus else "cpu" for k in range(2)]
    assert "# grid: dp 2 x tp 1 x pp 1" in out and [r[3:6] for r in rows] == [["0", "0", "0"], ["1", "0", "0"]]


def test_dry_run_prints_the_grid_and_a_grid_that_does_not_fit_is_one_line_and_status_2():
    proc = mpiexec_job(["-m", "hpcdl.train", "--dry-run", "--model", "gpt", "--tp", "2"])
    assert proc.returncode == 0, proc.stderr
    assert "# grid: dp 1 x tp 2 x pp 1" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()[-2:]]
    assert [r[3:6] for r in rows] == [["0", "0", "0"], ["0", "1", "0"]]  # dp, tp, pp of ranks 0 and 1
    proc = mpiexec_job(["-m", "hpcdl.train", "--dry-run", "--model", "gpt", "--tp", "2", "--pp", "2"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcdl.train: error: --tp 2 --pp 2 on 2 ranks: Grid: ") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--tp", "2"], "tp and pp split the transformer of model='gpt', not model='cnn'"),
        (["--model", "gpt", "--tp", "3"], "tp=3 must divide n_head (4)"),
        (["--model", "gpt", "--pp", "5"], "pp=5 stages need at least as many layers; the gpt has 4"),
        (["--model", "gpt", "--sequence-parallel"], "sequence_parallel splits the sequence"),
        (["--model", "gpt", "--tp", "2", "--precision", "fp16"], "precision='fp16' skips steps"),
        (["--model", "gpt", "--chunks", "8", "--batch-size", "4"], "chunks=8 micro-batches need batch_size >= chunks"),
    ],
)
def test_grid_options_that_cannot_work_are_refused_before_work(argv, text):
    with pytest.raises(ConfigError, match=re.escape(text)):
        parse_config(argv)


def test_launcher_detection_and_the_srun_without_plugin_mistake():
    hydra = {"HYDI_CONTROL_FD": "7", "PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}
    assert launcher(hydra) == "mpiexec (MPICH hydra)"
    assert launcher({"OMPI_COMM_WORLD_RANK": "1"}) == "mpiexec (Open MPI)"
    # srun --mpi=pmi2 sets PMI_RANK too
    srun = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "PMI_RANK": "0", "PMI_FD": "11"}
    assert launcher(srun) == "srun (Slurm)"
    # hydra inside an allocation (its proxies are srun tasks): the ranks are hydra's
    assert launcher({**srun, **hydra}) == "mpiexec (MPICH hydra)"
    assert launcher({"PMI_RANK": "0"}) == "a PMI launcher"
    assert launcher({}) == "none (a single process)"
    with pytest.raises(RuntimeError, match=r"srun \(Slurm\) started 4 tasks, .*srun --mpi=pmi2"):
        check_world(1, srun)
    check_world(4, srun)
    check_world(1, {})


def test_srun_without_an_mpi_plugin_stops_every_task():
    """What each task sees under srun without --mpi: Slurm's variables for 2 tasks, and an
    MPI world of one. Both tasks stop with the hint, neither waits for the other."""
    tasks = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDI_", "MPI_LOCAL"))}
        env.update(SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID=str(rank), OMP_NUM_THREADS="1")
        tasks.append(
            subprocess.Popen(
                [sys.executable, "-m", "hpcdl.train", "--dry-run"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for t in tasks:
        _, err = t.communicate(timeout=120)
        assert t.returncode != 0
        assert "srun (Slurm) started 2 tasks, but MPI sees each as a separate 1-rank job" in err
        assert "srun --mpi=pmi2" in err


# -- data ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, world, batch", [(10, 3, 2), (1437, 2, 32), (7, 4, 3), (2, 3, 1)])
def test_sharded_order_covers_every_sample_with_equal_batch_counts(n, world, batch):
    orders = [ShardedOrder(n, world, r, seed=5, batch_size=batch) for r in range(world)]
    for epoch in range(3):
        parts = [o.indices(epoch) for o in orders]
        assert len({len(p) for p in parts}) == 1  # every rank the same number of samples...
        assert set(torch.cat(parts).tolist()) == set(range(n))  # ...and together all of them
        assert len(torch.cat(parts)) - n < world  # padding: less than one sample per rank
        counts = {len(o.batches(epoch)) for o in orders}
        assert counts == {orders[0].batches_per_epoch()}
        assert all(len(b) <= batch for o in orders for b in o.batches(epoch))
    # the same on every rank (a fresh object), different between epochs
    assert torch.equal(ShardedOrder(n, world, 0, 5, batch).permutation(1), orders[1].permutation(1))
    if n > 2:
        assert not torch.equal(orders[0].permutation(0), orders[0].permutation(1))


def test_eval_indices_partition_the_split():
    parts = [eval_indices(11, 3, r) for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(11))


def test_datasets_ship_with_installed_packages():
    train, test = digits(image=True)
    assert (len(train), len(test)) == (1437, 360) and train.x.shape[1:] == (1, 8, 8)
    assert 0.0 <= float(train.x.min()) and float(train.x.max()) == 1.0
    assert sorted(torch.bincount(test.y).tolist())[0] >= 35  # stratified: every class is there
    tr, te = corpus(64)
    x, y = tr.batch(torch.tensor([0, 5]))
    assert x.shape == y.shape == (2, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(tr) > 6000 and len(te) > 600


def test_the_digits_split_is_scikit_learns_stratified_split_read_without_importing_it():
    """The job reads the digits from scikit-learn's data file and takes the shipped split;
    both must equal what ``load_digits`` and ``train_test_split`` give."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    ref = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(ref.data, ref.target, test_size=0.2, stratify=ref.target, random_state=0)
    train, test = digits(image=False)
    assert torch.equal(train.x, torch.tensor(x_tr, dtype=torch.float32) / 16.0)
    assert torch.equal(test.x, torch.tensor(x_te, dtype=torch.float32) / 16.0)
    assert train.y.tolist() == y_tr.tolist() and test.y.tolist() == y_te.tolist()
    code = "import sys; from hpcdl.train.data import digits; digits(True); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


# -- schedule, checkpoints, models ------------------------------------------------------------------
def test_checkpoint_is_atomic_and_loads_without_unpickling_code(tmp_path, monkeypatch):
    d = str(tmp_path)
    good = {"format": ckpt.FORMAT, "step": 10, "w": torch.arange(4.0)}
    ckpt.save_atomic(good, ckpt.path_for(d, 10))
    real_save = torch.save

    def dies_halfway(obj, fh):  # a crash while writing the next one
        fh.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_atomic({**good, "step": 20}, ckpt.path_for(d, 20))
    monkeypatch.setattr(torch, "save", real_save)
    assert os.listdir(d) == ["step-00000010.pt"]  # no partial file under any name
    assert ckpt.latest(d) == ckpt.path_for(d, 10)
    assert torch.equal(ckpt.load(ckpt.latest(d))["w"], torch.arange(4.0))
    # a file left by a writer killed before its cleanup is ignored, then removed
    open(os.path.join(d, "step-00000030.pt.tmp-99"), "wb").close()
    assert ckpt.latest(d) == ckpt.path_for(d, 10)
    ckpt.remove_partial(d)
    assert os.listdir(d) == ["step-00000010.pt"]
    # objects that would run code when unpickled are refused
    torch.save({"format": ckpt.FORMAT, "evil": _Evil()}, os.path.join(d, "step-00000040.pt"))
    with pytest.raises(Exception, match="Weights only load failed"):
        ckpt.load(ckpt.latest(d))
    for step in (50, 60, 70):
        ckpt.save_atomic(good, ckpt.path_for(d, step))
    ckpt.prune(d, 2)
    assert ckpt.steps_in(d) == [60, 70]


def test_a_checkpoint_changed_on_disk_fails_its_checksum(tmp_path):
    """Zeroed blocks and random bytes anywhere in the file, which torch.load may well read
    without complaint, are refused with a ValueError; the digest itself is independent of
    memory layout and of the order a dictionary was filled in."""
    path = ckpt.path_for(str(tmp_path), 1)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 96)
    state = {"format": ckpt.FORMAT, "model": model.state_dict(), "step": 1, "config": {"lr": 0.1, "run_dir": ""}}
    ckpt.save_atomic(state, path)
    assert torch.equal(ckpt.load(path)["model"]["weight"], model.weight.detach())
    assert torch.load(path, weights_only=True)["sha256"] == ckpt.content_digest(state)  # a plain torch file
    raw = open(path, "rb").read()
    rng = random.Random(1)
    silent = 0
    for k in range(24):
        bad = bytearray(raw)
        at = rng.randrange(len(raw) - 512)
        bad[at : at + 512] = bytes(512) if k % 2 else rng.randbytes(512)
        with open(path, "wb") as fh:
            fh.write(bad)
        with pytest.raises(ValueError, match="it is corrupt|does not load|not an hpcdl.train checkpoint"):
            ckpt.load(path)
        try:  # how often torch alone would have taken the damaged file
            torch.load(path, weights_only=True)
            silent += 1
        except Exception:  # noqa: BLE001 - torch's own errors vary with what was hit
            pass
    assert silent > 0  # the checksum catches what torch.load does not
    w = torch.arange(6.0).reshape(2, 3)
    a = {"w": w.t().contiguous().t(), "n": 1}  # the same values, column-major
    b = {"n": 1, "w": w}
    assert ckpt.content_digest(a) == ckpt.content_digest(b)
    assert ckpt.content_digest({"n": 1, "w": w + 1}) != ckpt.content_digest(b)
    assert ckpt.content_digest({"n": 1.0, "w": w}) != ckpt.content_digest(b)
    with pytest.raises(TypeError, match="not set"):
        ckpt.content_digest({"x": {1, 2}})
    torch.save({"format": ckpt.FORMAT, "step": 1}, path)  # written without one
    with pytest.raises(ValueError, match="carries no checksum"):
        ckpt.load(path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_learning_rate_warm_up_then_cosine():
    from hpcdl.train.loop import Trainer

    t = Trainer.__new__(Trainer)
    t.cfg, t.base_lr, t.total_steps = TrainConfig.from_flat(warmup_steps=4), 0.8, 14
    assert [t.lr_at(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert t.lr_at(4) == pytest.approx(0.8) and t.lr_at(9) == pytest.approx(0.4) and t.lr_at(14) == pytest.approx(0.0)
    t.cfg = TrainConfig.from_flat(warmup_steps=0, lr_schedule="constant")
    assert t.lr_at(0) == t.lr_at(13) == 0.8


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (3, 16))
    grads = []
    for on in (False, True):
        torch.manual_seed(1)
        m = GPT(16, 2, 2, 32, activation_checkpointing=on)
        torch.nn.functional.cross_entropy(m(idx).reshape(-1, 256), idx.reshape(-1)).backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


# -- whole jobs: failures ------------------------------------------------------------------------
def test_an_exception_on_one_rank_ends_the_job_with_its_traceback(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import hpcdl as hvd
            from collectives.cli import run_main
            from hpcdl.train import parse_config, run

            def on_step(step):
                if hvd.rank() == 1 and step == 5:
                    raise RuntimeError("injected failure at step 5")

            cfg = parse_config(["--run-dir", {str(tmp_path / "run")!r}, "--no-progress", "--epochs", "50"])
            run_main(lambda: run(cfg, on_step=on_step))
            """
        )
    )
    t0 = time.monotonic()
    proc = mpiexec_job([str(script)])
    assert time.monotonic() - t0 < 60
    assert proc.returncode != 0
    assert "[rank 1] aborting the job after an uncaught exception" in proc.stderr
    assert "RuntimeError: injected failure at step 5" in proc.stderr
    assert "[rank 0] aborting" not in proc.stderr  # the other rank stays quiet


def test_a_rank_killed_mid_training_ends_the_job_and_the_checkpoint_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "-m",
        "hpcdl.train",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--epochs",
        "40",
        "--checkpoint-every",
        "20",
    ]
    job = mpiexec_start(args)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and job.poll() is None:
            if ckpt.steps_in(str(run_dir / "checkpoints")) and (run_dir / "ranks.json").exists():
                if ckpt.steps_in(str(run_dir / "checkpoints"))[-1] >= 60:
                    break
            time.sleep(0.02)
        assert job.poll() is None, "the job ended before it could be killed"
        pid = json.loads((run_dir / "ranks.json").read_text())["ranks"][1]["pid"]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        job.wait(timeout=60)  # raises if the job outlives the kill by 60 s
        ended = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()
    assert job.returncode != 0 and ended < 60
    steps = ckpt.steps_in(str(run_dir / "checkpoints"))
    assert steps and steps[-1] < 920
    last = ckpt.load(ckpt.latest(str(run_dir / "checkpoints")))  # intact
    assert last["step"] == steps[-1]
    left = json.loads((run_dir / ".lock").read_text())  # the killed job's lock file, its flock gone
    proc = mpiexec_job([*args, "--resume"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(f"taking over the lock of a job that ended without giving it back (pid {left['pid']}") == 1
    assert not (run_dir / ".lock").exists()  # given back at the end
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 920 and summary["resumed_from"].endswith(f"step-{steps[-1]:08d}.pt")
    assert summary["final"]["accuracy"] >= 0.9
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert train_steps == list(range(1, 921))  # the killed run's extra records were replaced


def test_the_run_directory_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    lock = RunLock(str(tmp_path))
    assert lock.acquire() is None and lock.held
    mine = json.loads((tmp_path / ".lock").read_text())
    assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
    with pytest.raises(LockHeld, match=rf"in use by the job of pid {os.getpid()} on host {socket.gethostname()}"):
        RunLock(str(tmp_path)).acquire()  # another open file: flock refuses it, also in this process
    lock.release()
    assert not (tmp_path / ".lock").exists() and not lock.held
    again = RunLock(str(tmp_path))
    assert again.acquire() is None
    again.release()
    # a job that dies holding it: the kernel drops the flock, the file still names the job
    code = f"from hpcdl.train.lock import RunLock; RunLock({str(tmp_path)!r}).acquire(); import os; os._exit(9)"
    dead = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert dead.returncode == 9 and (tmp_path / ".lock").exists()
    dead_pid = json.loads((tmp_path / ".lock").read_text())["pid"]
    taker = RunLock(str(tmp_path))
    warning = taker.acquire()
    assert warning and f"ended without giving it back (pid {dead_pid} on host" in warning
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    taker.release()


def test_a_second_job_into_a_run_directory_in_use_stops_at_once_and_loses_nothing(tmp_path):
    run_dir, go = tmp_path / "run", tmp_path / "go"
    base = ["--model", "mlp", "--no-progress", "--run-dir", str(run_dir)]
    script = tmp_path / "first.py"  # the first job waits at step 5 until the second has tried
    script.write_text(
        textwrap.dedent(
            f"""
            import os, time
            from collectives.cli import run_main
            from hpcdl.train import parse_config, run

            def on_step(step):
                while step == 5 and not os.path.exists({str(go)!r}):
                    time.sleep(0.05)

            run_main(lambda: run(parse_config({[*base, "--epochs", "2", "--seed", "1"]!r}), on_step=on_step))
            """
        )
    )
    first = mpiexec_start([str(script)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run_dir / "ranks.json").exists():
            time.sleep(0.05)
        holder = json.loads((run_dir / ".lock").read_text())
        t0 = time.monotonic()
        second = mpiexec_job(["-m", "hpcdl.train", *base, "--epochs", "1", "--seed", "2"])
        took = time.monotonic() - t0
        assert first.poll() is None, "the first job ended before the second started"
        go.touch()
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert second.returncode == 2 and took < 30, second.stderr
    text = f"run directory {run_dir} is in use by the job of pid {holder['pid']} on host {holder['host']}"
    assert second.stderr.count(text) == 1 and "Traceback" not in second.stderr, second.stderr
    assert first.returncode == 0, err
    assert json.loads((run_dir / "config.json").read_text())["seed"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["epochs"] == 2
    assert not (run_dir / ".lock").exists()


def test_more_parameter_servers_than_the_job_leaves_workers_is_one_line_and_status_2():
    proc = mpiexec_job(["-m", "hpcdl.train", "--dp", "ps", "--ps-servers", "2", "--epochs", "1"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcdl.train: error: ps_servers=2 leaves no worker: the job has 2 ranks") == 1
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_timeline_rank_0_cannot_write_is_one_line_and_status_2(tmp_path):
    """--timeline and HPCDL_TIMELINE in a directory that does not exist stop the job before
    its first step, naming the setting and why, instead of failing when the trace is due."""
    missing = tmp_path / "no" / "trace.json"
    base = ["-m", "hpcdl.train", "--model", "mlp", "--max-steps", "2", "--no-progress"]
    why = f"its directory {missing.parent} does not exist"
    cases = [
        ([*base, "--run-dir", str(tmp_path / "a"), "--timeline", str(missing)], {}, "hpcdl.train: error: --timeline: "),
        ([*base, "--run-dir", str(tmp_path / "b")], {"HPCDL_TIMELINE": str(missing)}, f"HPCDL_TIMELINE={str(missing)!r}"),
    ]
    for argv, env, text in cases:
        proc = mpiexec_job(argv, env=env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count(text) == 1 and proc.stderr.count(why) == 1, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_block_size_the_corpus_cannot_fill_is_one_line_and_status_2(tmp_path):
    proc = mpiexec_job(["-m", "hpcdl.train", "--model", "gpt", "--block-size", "100000", "--run-dir", str(tmp_path)])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "hpcdl.train: error: --block-size: block_size=100000 leaves no sample in the corpus"


def test_a_run_directory_that_cannot_be_made_is_one_line_and_status_2():
    proc = mpiexec_job(["-m", "hpcdl.train", "--run-dir", "/dev/null/x", "--epochs", "1"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcdl.train: error: run directory /dev/null/x cannot be used: Not a directory") == 1
    assert "Traceback" not in proc.stderr, proc.stderr


# -- Slurm -----------------------------------------------------------------------------------------
@pytest.mark.skipif(
    not (shutil.which("slurmctld", path=os.environ.get("PATH", "") + ":/usr/sbin") and os.geteuid() == 0),
    reason="needs root and Debian's slurm-wlm (jobs/slurm_local.sh --install)",
)
def test_the_training_job_runs_through_sbatch_and_srun_on_a_local_cluster(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "RUN_DIR": str(run_dir), "NTASKS": "2"}
    proc = subprocess.run(
        ["bash", "jobs/slurm_local.sh", "--epochs", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "COMPLETED, exit code 0:0" in proc.stdout
    ranks = json.loads((run_dir / "ranks.json").read_text())
    assert ranks["launcher"] == "srun (Slurm)" and [r["rank"] for r in ranks["ranks"]] == [0, 1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final"]["accuracy"] > 0.8


def test_run_directory_and_resume_problems_are_one_line_and_status_2(tmp_path):
    """An earlier run's checkpoints are not overwritten silently; resuming from a missing
    directory, an empty one or another model's checkpoint says so in one line with status
    2; a corrupt newest checkpoint (a block of it zeroed on disk) is skipped for the newest
    intact one, with a warning naming it and a line naming the one taken; with none intact
    the job says which it skipped."""
    run_dir = tmp_path / "run"
    ck_dir = run_dir / "checkpoints"
    base = ["-m", "hpcdl.train", "--model", "mlp", "--epochs", "1", "--no-progress", "--checkpoint-every", "3"]

    def job(*extra: str) -> subprocess.CompletedProcess:
        return mpiexec_job([*base, *extra])

    def refused(proc: subprocess.CompletedProcess, text: str) -> None:
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count(text) == 1 and "Traceback" not in proc.stderr, proc.stderr

    assert job("--max-steps", "6", "--run-dir", str(run_dir)).returncode == 0
    assert ckpt.steps_in(str(ck_dir)) == [3, 6]
    newest = ck_dir / "step-00000006.pt"
    stamp = newest.stat().st_mtime_ns
    refused(job("--max-steps", "6", "--run-dir", str(run_dir)), "holds checkpoints of an earlier run")
    assert newest.stat().st_mtime_ns == stamp  # untouched
    missing = tmp_path / "missing"
    refused(job("--resume", "--run-dir", str(missing)), f"resume: run directory {missing} does not exist")
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    refused(job("--resume", "--run-dir", str(tmp_path / "empty")), "resume: no checkpoint in")
    other = job("--resume", "--run-dir", str(run_dir), "--model", "cnn")
    refused(other, "was written for another model or optimizer: model='mlp' (this run: 'cnn')")
    # a block of the newest zeroed, where the weights are: it still unpickles, but its
    # checksum fails; the run resumes from step 3 and says which file it skipped and why
    raw = bytearray(newest.read_bytes())
    at = raw.index(b"data/0") + 4096
    raw[at : at + 1024] = bytes(1024)
    newest.write_bytes(bytes(raw))
    proc = job("--resume", "--max-steps", "9", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(f"warning: skipping checkpoint {newest}: it is corrupt") == 1, proc.stderr
    assert proc.stderr.count(f"resuming from {ck_dir / 'step-00000003.pt'}, the newest intact checkpoint") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 9 and summary["resumed_from"].endswith("step-00000003.pt"), summary
    for f in ck_dir.iterdir():
        f.write_bytes(b"")
    none = job("--resume", "--run-dir", str(run_dir))
    refused(none, "resume: no intact checkpoint in")
    assert none.stderr.count("(the file is empty)") == 2, none.stderr  # both named, with why
    fresh = job("--max-steps", "3", "--run-dir", str(run_dir), "--overwrite")
    assert fresh.returncode == 0, fresh.stderr
    assert ckpt.steps_in(str(ck_dir)) == [3] and ckpt.load(str(ck_dir / "step-00000003.pt"))["step"] == 3


def test_a_resume_with_another_batch_size_ends_after_the_same_epochs_and_reports_its_own_steps(tmp_path):
    """An epoch is one pass over the data whatever the step size: a run stopped 7 steps
    into its second epoch at batch 32 (23 steps per epoch at 2 ranks) resumes at batch 64
    (12 per epoch) 4 steps into that epoch, and ends with it; the result line gives this
    job's steps and throughput only."""
    run_dir = tmp_path / "run"
    base = ["-m", "hpcdl.train", "--model", "mlp", "--epochs", "2", "--no-progress", "--run-dir", str(run_dir)]
    first = mpiexec_job([*base, "--max-steps", "30", "--checkpoint-every", "10"])
    assert first.returncode == 0, first.stderr
    assert json.loads((run_dir / "summary.json").read_text())["epochs"] == 1
    proc = mpiexec_job([*base, "--resume", "--batch-size", "64"])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["steps"] == 30 + (12 - 4), summary
    assert summary["steps_this_job"] == 8 and summary["resumed_from_step"] == 30
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in recs if r["kind"] == "eval"] == [0, 1]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("hpcdl.train: resumed from step 30; 8 steps (31-38) on 2 ranks"), last


@pytest.mark.parametrize(
    "sig, code, said, n, layout",
    [
        (signal.SIGTERM, 143, "stopped by SIGTERM", 2, []),
        (signal.SIGINT, 130, "interrupted", 2, []),
        (signal.SIGTERM, 143, "stopped by SIGTERM", 3, ["--dp", "ps", "--ps-servers", "1"]),
    ],
    ids=["SIGTERM", "Ctrl-C", "SIGTERM, a dedicated parameter server"],
)
def test_sigterm_and_ctrl_c_stop_every_rank_after_a_step_in_one_line(tmp_path, sig, code, said, n, layout):
    """mpiexec passes SIGINT and SIGTERM to every rank; the ranks agree, with the step's
    loss, to stop after the same step. SIGTERM (Slurm's preemption) first writes a
    checkpoint of that step; Ctrl-C names the newest one. Either way one line, the shell's
    status for the signal, and a --resume that ends where an uninterrupted run does. A
    dedicated parameter server leaves SIGTERM to the workers, whose checkpoint takes its
    state: it used to die by it at once (status 15, no line, no checkpoint of the step)."""
    run_dir = tmp_path / "run"
    args = ["-m", "hpcdl.train", "--model", "mlp", "--epochs", "20", "--no-progress", "--run-dir", str(run_dir)]
    args += layout
    job = mpiexec_start([*args, "--checkpoint-every", "20"], n=n, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not ckpt.steps_in(str(run_dir / "checkpoints")):
            time.sleep(0.05)
        assert job.poll() is None, "the job ended before the signal"
        job.send_signal(sig)  # to mpiexec, as a terminal's Ctrl-C or Slurm would
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == code, err
    lines = [line for line in err.splitlines() if line.startswith("hpcdl.train")]
    assert len(lines) == 1 and lines[0].startswith(f"hpcdl.train: {said} at step "), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    step = int(re.search(r"at step (\d+);", lines[0]).group(1))
    newest = ckpt.latest(str(run_dir / "checkpoints"))
    assert f"newest checkpoint {newest}; continue with --resume" in lines[0]
    saved = ckpt.load(newest)["step"]
    assert saved == step if sig == signal.SIGTERM else saved <= step
    assert not (run_dir / ".lock").exists()
    done = mpiexec_job([*args, "--resume"], n=n)
    assert done.returncode == 0, done.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20 * 23


@pytest.mark.parametrize("after", [0.5, 1.5, 3.0])
def test_ctrl_c_while_the_job_is_starting_stops_it_after_one_step_in_one_line(tmp_path, after):
    """A Ctrl-C in the first seconds lands while the ranks import torch and start MPI, before
    the trainer handles signals, and not on every rank at the same point (one may be inside
    MPI_Init, waiting for the others). It is noted, every rank finishes starting, and the
    job stops after its first step: one line, status 130, no traceback, no rank left behind.
    On a machine that starts the job sooner than ``after`` (the trainer has written
    ``config.json``), the trainer's own handling stops it after a later step, in one line
    too; half a second is always too soon (importing torch alone takes longer)."""
    run_dir = tmp_path / "run"
    # epochs enough that the job is still training at ``after``: its default 20 train in
    # about a second where the job starts in two, so that at 3 s it was ending, not running
    args = ["-m", "hpcdl.train", "--model", "mlp", "--epochs", "2000", "--run-dir", str(run_dir)]
    job = mpiexec_start(args, text=True)
    try:
        time.sleep(after)
        assert job.poll() is None, "the job ended before the signal"
        started = (run_dir / "config.json").exists()
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 130, err
    assert not (run_dir / ".lock").exists()
    if started:
        assert after > 0.5, "the job started in half a second"
        ends = r"(; newest checkpoint \S+; continue with --resume|, before the first checkpoint: start the run again)"
        assert re.fullmatch(r"hpcdl\.train: interrupted at step \d+" + ends, err.strip()), err
        return
    assert err.strip() == "hpcdl.train: interrupted at step 1, before the first checkpoint: start the run again", err
    assert not ckpt.steps_in(str(run_dir / "checkpoints"))


@pytest.mark.parametrize(
    "sig, when",
    [(signal.SIGINT, "summary.json"), (signal.SIGINT, "summary line"), (signal.SIGTERM, "summary line")],
    ids=["SIGINT once summary.json is written", "SIGINT after the summary line", "SIGTERM after the summary line"],
)
def test_a_signal_after_the_last_step_lets_the_completed_job_end_normally(tmp_path, sig, when):
    """Once the last step is done the run is complete, and a Ctrl-C or SIGTERM is moot: the
    ranks finish writing and shutting down and the job ends with status 0. Python's own
    shutdown puts back the default action for the signals it handled, and a rank spends a
    while after that in C (MPI_Finalize waits for its peers), where a signal killed it:
    status 2 from mpiexec, for a job that had completed."""
    run_dir = tmp_path / "run"
    args = ["-m", "hpcdl.train", "--model", "mlp", "--epochs", "3", "--no-progress", "--run-dir", str(run_dir)]
    job = mpiexec_start(args, text=True)
    try:
        deadline = time.monotonic() + 90
        if when == "summary.json":  # rank 0 plots the curves next, while the other ranks shut down
            while time.monotonic() < deadline and not (run_dir / "summary.json").exists():
                time.sleep(0.002)
        else:
            line = job.stdout.readline()
            while line and not line.startswith("hpcdl.train:"):
                line = job.stdout.readline()
            assert line.startswith("hpcdl.train: 69 steps on 2 ranks"), line
        assert job.poll() is None, "the job ended before the signal"
        job.send_signal(sig)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, (out, err)
    assert "hpcdl.train" not in err and "TERMINATED" not in out + err and "Traceback" not in err, (out, err)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 69
    assert not (run_dir / ".lock").exists()


def test_a_run_stuck_at_chance_level_stops_naming_what_to_look_at():
    from types import SimpleNamespace

    from hpcdl.train.config import RunError
    from hpcdl.train.loop import Trainer

    cfg = TrainConfig.from_flat(model="mlp", dp="ps", ps_mode="ssp", staleness=4, warmup_steps=20)
    at = SimpleNamespace(cfg=cfg, epoch=1, step=46)
    chance = {"loss": 2.3025, "accuracy": 0.1028}
    with pytest.raises(RunError, match=r"stuck at chance level: after epoch 1 \(step 46\) the held-out loss is 2.3025"):
        Trainer._check_not_at_chance(at, chance)
    with pytest.raises(RunError, match=r"lower --lr, or --staleness \(now 4\), or use --ps-mode sync"):
        Trainer._check_not_at_chance(at, chance)
    Trainer._check_not_at_chance(SimpleNamespace(cfg=cfg, epoch=0, step=23), chance)  # the first epoch: too soon
    Trainer._check_not_at_chance(SimpleNamespace(cfg=cfg, epoch=3, step=19), chance)  # still warming up
    Trainer._check_not_at_chance(at, {"loss": 2.25, "accuracy": 0.15})  # learning, slowly
    Trainer._check_not_at_chance(at, {"loss": 2.30, "accuracy": 0.4})  # right more often than chance
    far = {"loss": 1011526.0889, "accuracy": 0.0972}  # --lr 1e6: worse than any guess, and finite
    with pytest.raises(RunError, match=r"training has diverged: after epoch 1 \(step 46\) the held-out loss is 101"):
        Trainer._check_not_at_chance(at, far)
    with pytest.raises(RunError, match=r"has diverged: .* loss is nan, worse than a uniform guess over 10 classes"):
        Trainer._check_not_at_chance(at, {"loss": float("nan"), "accuracy": 0.1})
    Trainer._check_not_at_chance(at, {"loss": 3.1, "accuracy": 0.9})  # overconfident, yet right: not diverged
    gpt = SimpleNamespace(cfg=TrainConfig.from_flat(model="gpt"), epoch=2, step=500)
    with pytest.raises(RunError, match=r"uniform guess over 256 classes \(ln 256 = 5.5452\); lower --lr;"):
        Trainer._check_not_at_chance(gpt, {"loss": 5.54, "perplexity": 254.7})


def test_a_diverging_run_stops_with_a_message_and_writes_only_valid_json(tmp_path):
    run_dir = tmp_path / "run"
    proc = mpiexec_job(
        ["-m", "hpcdl.train", "--model", "mlp", "--optimizer", "sgd", "--lr", "1e30", "--lr-scaling", "none"]
        + ["--warmup-steps", "0", "--epochs", "1", "--no-progress", "--run-dir", str(run_dir)]
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcdl.train: error: training diverged: the loss is") == 1, proc.stderr
    assert "Traceback" not in proc.stderr

    def strict(text: str) -> None:
        json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))

    for path in run_dir.rglob("*.json*"):
        for line in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
            strict(line)


def test_a_mistyped_hpcdl_variable_is_one_line_naming_the_closest_name():
    proc = mpiexec_job(["-m", "hpcdl.train", "--dry-run"], env={"HPCDL_FUSION_TRESHOLD": "1"})
    assert proc.returncode == 2, proc.stderr
    want = "unknown environment variable HPCDL_FUSION_TRESHOLD; did you mean HPCDL_FUSION_THRESHOLD?"
    assert proc.stderr.count(want) == 1 and "HPCDL_SHM_BYTES" not in proc.stderr, proc.stderr


def _render(text: str) -> list[str]:
    """What a terminal shows for ``text``: a carriage return moves back to column 0."""
    lines, cur, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(cur).rstrip())
            cur, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            cur[col : col + 1] = [ch]
            col += 1
    return [*lines, "".join(cur).rstrip()] if cur else lines


def _on_a_terminal(args: list[str]) -> tuple[int, str, str]:
    """Run ``mpiexec -n 2 python ARGS`` with its standard output on a pseudo-terminal (as
    from an interactive shell); its status, what the terminal got and its stderr."""
    cmd = [MPIEXEC, "-n", "2", sys.executable, *args]
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=slave, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "100"})
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    return proc.returncode, b"".join(chunks).decode().replace("\r\n", "\n"), err


def test_a_bar_only_on_a_terminal_and_epoch_lines_always(tmp_path):
    """On a terminal (mpiexec's own output, behind the proxies' pipes) rank 0 draws a bar,
    cleared before each epoch line and the result line; in a log (a pipe or a file all the
    way) there is no bar, only the lines; --no-progress hides the bar, not the lines."""
    args = ["-m", "hpcdl.train", "--model", "mlp", "--epochs", "2"]
    code, shown_raw, err = _on_a_terminal([*args, "--run-dir", str(tmp_path / "a")])
    assert code == 0, err
    assert "step/s" in shown_raw or "s/step" in shown_raw, shown_raw
    assert "\r" not in err and "step/s" not in err, err
    for raw, where in ((shown_raw, "terminal"),):
        shown = _render(raw)
        epochs = [line for line in shown if line.startswith("epoch") and "accuracy" in line]
        assert [line.split(":")[0] for line in epochs] == ["epoch 0", "epoch 1"], (where, shown)
        assert shown[-1].startswith("hpcdl.train: ") and "held-out" in shown[-1], shown
    logged = mpiexec_job([*args, "--run-dir", str(tmp_path / "b")])
    code, quiet, err = _on_a_terminal([*args, "--no-progress", "--run-dir", str(tmp_path / "c")])
    assert logged.returncode == 0 and code == 0, logged.stderr + err
    for out in (logged.stdout, quiet.replace("\r\n", "\n")):
        assert "\r" not in out and "step/s" not in out, out
        lines = out.splitlines()
        assert [line.split(":")[0] for line in lines[:2]] == ["epoch 0", "epoch 1"], lines
        assert len(lines) == 3 and lines[2].startswith("hpcdl.train: 46 steps on 2 ranks"), lines


def test_output_is_terminal_looks_through_the_launchers_pipes(tmp_path):
    code = "from hpcdl.train.launch import output_is_terminal; print(output_is_terminal())"
    through_pipe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert through_pipe.stdout.strip() == "False"  # this test's pipe leads to pytest, not a terminal
    log = tmp_path / "log"
    with open(log, "w") as fh:
        subprocess.run([sys.executable, "-c", code], stdout=fh, timeout=60)
    assert log.read_text().strip() == "False"
    status, shown, err = _on_a_terminal(["-c", code])
    # both ranks, behind hydra's pipes (whose lines may interleave: "TrueTrue" then the newlines)
    assert status == 0 and shown.count("True") == 2 and "False" not in shown, (shown, err)


def test_a_checkpoint_of_an_older_configuration_resumes_with_a_warning(tmp_path, capsys):
    """Fields a checkpoint's configuration has and this version's lacks (or the reverse) are
    named in the warning, not a KeyError."""
    from hpcdl.train.loop import _pick_checkpoint

    cfg = TrainConfig.from_flat(run_dir=str(tmp_path))
    old = {**cfg.to_dict(), "fusion_threshold": -1}
    old.pop("overwrite")
    ckpt.save_atomic({"format": ckpt.FORMAT, "config": old, "step": 3}, ckpt.path_for(str(tmp_path), 3))
    path, st, problem = _pick_checkpoint(str(tmp_path), cfg)
    assert problem is None and path == ckpt.path_for(str(tmp_path), 3) and st["step"] == 3
    err = capsys.readouterr().err
    assert "fusion_threshold=-1 (this run: None)" in err


def test_the_default_run_directories_are_ignored_by_git(tmp_path):
    """A run writes under runs/<model>-<time> by default (an empty --run-dir); git ignores all
    of it, so results never show up as changes to commit. Checked in a scratch repository
    with the project's .gitignore, so it holds in any checkout."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    shutil.copy(os.path.join(ROOT, ".gitignore"), tmp_path / ".gitignore")
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path)}
    subprocess.run([git, "init", "-q", str(tmp_path)], check=True, env=env)
    probe = tmp_path / "runs" / "cnn-20261125-120000" / "checkpoints" / "step-00000050.pt"
    probe.parent.mkdir(parents=True)
    probe.write_bytes(b"")
    status = subprocess.run(
        [git, "-C", str(tmp_path), "status", "--porcelain", "--untracked-files=all"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout
    assert status.splitlines() == ["?? .gitignore"], status
