"""hpcdl.train under mpiexec -n 1..4: training equals one process on the concatenated
batches, evaluation is over the whole split, a resumed run ends bitwise where an
uninterrupted one does, and the run directory holds what the README says."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcdl as hvd
from hpcdl.train import TrainConfig, run
from hpcdl.train import checkpoint as ckpt
from hpcdl.train.data import ShardedOrder, digits
from hpcdl.train.loop import Trainer
from hpcdl.train.models import DigitsMLP

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240), pytest.mark.usefixtures("shutdown_after")]


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_training_equals_one_process_on_the_concatenated_batches(run_dir):
    """SGD with momentum, accumulation over 2 passes, an uneven split: the weights after 30
    steps equal one process stepping on every rank's batches at once."""
    cfg = TrainConfig.from_flat(
        model="mlp",
        device="cpu",  # the reference runs on the CPU (tests/test_device_cuda.py covers CUDA)
        optimizer="sgd",
        lr=0.05,
        lr_scaling="none",
        warmup_steps=3,
        batch_size=20,
        grad_accum=2,
        max_steps=30,
        checkpoint_every=0,
        progress=False,
        run_dir=run_dir,
    )
    hvd.init()
    trainer = Trainer(cfg)
    trainer.run(run_dir)
    n = hvd.size()
    # the reference: one process, the same initial weights, every rank's batches concatenated
    training = cfg.training
    torch.manual_seed(training.seed)
    ref = DigitsMLP()
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum)
    train, _ = digits(image=False)
    orders = [ShardedOrder(len(train), n, r, training.seed, training.batch_size) for r in range(n)]
    step, epoch = 0, 0
    while step < training.max_steps:
        per_rank = [o.batches(epoch) for o in orders]
        for g in range(0, len(per_rank[0]), training.grad_accum):
            if step == training.max_steps:
                break
            idx = torch.cat([torch.cat(b[g : g + training.grad_accum]) for b in per_rank])
            for group in opt.param_groups:
                group["lr"] = trainer.lr_at(step)
            opt.zero_grad()
            x, y = train.batch(idx)
            F.cross_entropy(ref(x), y).backward()
            opt.step()
            step += 1
        epoch += 1
    for got, want in zip(_weights(trainer.model), _weights(ref), strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (got - want).abs().max()
    # and every rank holds the same weights, bit for bit
    gathered = hvd.allgather_object([w.numpy().tobytes() for w in _weights(trainer.model)])
    assert all(g == gathered[0] for g in gathered)


def test_evaluation_covers_the_whole_split_whatever_the_rank_count(run_dir):
    hvd.init()
    trainer = Trainer(TrainConfig.from_flat(model="cnn", device="cpu", progress=False, run_dir=run_dir))
    got = trainer.evaluate()
    _, test = digits(image=True)
    with torch.no_grad():
        out = trainer.model(test.x)
    assert got["loss"] == pytest.approx(F.cross_entropy(out, test.y).item(), rel=1e-5)
    assert got["accuracy"] == (out.argmax(1) == test.y).sum().item() / len(test.y)


class _StopError(Exception):
    pass


@pytest.mark.parametrize(
    "kw",
    [
        # dropout draws from each rank's generator: the checkpoint must restore it
        dict(
            model="gpt",
            block_size=16,
            n_layer=1,
            n_head=2,
            d_model=32,
            dropout=0.1,
            batch_size=8,
            optimizer="adamw",
            weight_decay=0.01,
            max_steps=14,
        ),
        # ZeRO's consolidated optimizer state, accumulation, epochs crossed at the stop
        # (epochs enough for 14 steps at any rank count: 2 steps an epoch at 8 ranks)
        dict(model="cnn", optimizer="sgd", zero=2, grad_accum=2, batch_size=64, epochs=10, max_steps=14),
        dict(model="mlp", zero=1, precision="bf16", batch_size=100, epochs=10, max_steps=14),
    ],
    ids=["gpt-dropout", "cnn-zero2-accum", "mlp-zero1-bf16"],
)
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(run_dir, kw):
    base = dict(checkpoint_every=4, keep_checkpoints=1, progress=False, **kw)
    whole = run(TrainConfig.from_flat(run_dir=os.path.join(run_dir, "whole"), **base))
    w_whole = torch.load(whole["checkpoint"], weights_only=True)["model"] if hvd.rank() == 0 else None

    def stop_after_a_checkpoint(step):
        if step == 10:  # checkpoints at 4 and 8; steps 9 and 10 are lost
            raise _StopError

    parted = os.path.join(run_dir, "parted")
    with pytest.raises(_StopError):
        run(TrainConfig.from_flat(run_dir=parted, **base), on_step=stop_after_a_checkpoint)
    assert ckpt.steps_in(os.path.join(parted, "checkpoints")) == [8]
    resumed = run(TrainConfig.from_flat(run_dir=parted, resume=True, **base))
    assert resumed["resumed_from"].endswith("step-00000008.pt") and resumed["steps"] == whole["steps"]
    if hvd.rank() == 0:
        w_resumed = torch.load(resumed["checkpoint"], weights_only=True)["model"]
        for k, v in w_whole.items():
            if hvd.size() <= 2:  # a sum of two is the same in any order: bitwise
                assert torch.equal(w_resumed[k], v), k
            else:  # fusion can change the order of a sum of three or more floats
                assert torch.allclose(w_resumed[k], v, rtol=1e-4, atol=1e-6), k
        m_whole = [json.loads(x) for x in open(os.path.join(run_dir, "whole", "metrics.jsonl"))]
        m_parted = [json.loads(x) for x in open(os.path.join(parted, "metrics.jsonl"))]
        assert [(r["kind"], r["step"]) for r in m_parted] == [(r["kind"], r["step"]) for r in m_whole]


def test_the_run_directory_holds_what_the_readme_says(run_dir):
    timeline = os.path.join(run_dir, "timeline.json")
    cfg = TrainConfig.from_flat(
        model="cnn", epochs=2, run_dir=run_dir, progress=False, timeline=timeline, checkpoint_every=10
    )
    summary = run(cfg)
    n = hvd.size()
    if hvd.rank() == 0:
        assert json.load(open(os.path.join(run_dir, "config.json"))) == cfg.to_dict()
        ranks = json.load(open(os.path.join(run_dir, "ranks.json")))
        assert [r["rank"] for r in ranks["ranks"]] == list(range(n))
        assert len({r["pid"] for r in ranks["ranks"]}) == n
        recs = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
        steps_per_epoch = -(-((1437 + n - 1) // n) // 32)  # ceil(ceil(1437 / n) / 32)
        train = [r for r in recs if r["kind"] == "train"]
        assert [r["step"] for r in train] == list(range(1, 2 * steps_per_epoch + 1))
        assert [r["step"] for r in recs if r["kind"] == "eval"] == [steps_per_epoch, 2 * steps_per_epoch]
        assert all(r["loss"] > 0 and r["samples_per_s"] > 0 for r in train)
        saved = json.load(open(os.path.join(run_dir, "summary.json")))
        assert saved["steps"] == summary["steps"] == 2 * steps_per_epoch
        assert 0.5 < saved["final"]["accuracy"] <= 1.0 and 0.0 <= saved["exposed_comm_share"] < 1.0
        with open(os.path.join(run_dir, "curves.png"), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        assert len(ckpt.steps_in(os.path.join(run_dir, "checkpoints"))) == cfg.checkpoint.keep
        events = json.load(open(timeline))["traceEvents"]
        assert any(e.get("args", {}).get("tensor") == "train.loss" for e in events)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(run_dir, precision):
    # the MLP (the CNN's convolutions under autocast take 10 times as long on a CPU), about 46
    # steps whatever the rank count (23 per epoch at 2 ranks, 8 at 6)
    per_epoch = math.ceil(len(digits(image=True)[0]) / (32 * MPI.COMM_WORLD.size))
    epochs = max(2, math.ceil(46 / per_epoch))
    cfg = TrainConfig.from_flat(model="mlp", precision=precision, epochs=epochs, run_dir=run_dir, progress=False)
    summary = run(cfg)
    assert summary["final"]["accuracy"] > 0.8, summary
