"""The training run: build the model, data and optimizer from a :class:`TrainConfig`, train
data-parallel over the world (or, for the GPT with ``tp``/``pp``/``chunks``, over a DP x TP x
PP grid), evaluate, checkpoint, and write the run directory.

A checkpoint always holds the dense model's ``state_dict`` and its optimizer's state in the
plain optimizer's format: a grid's slices are consolidated on rank 0, so a checkpoint of
one grid resumes on another grid, or on one rank, and the other way round."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import hpcdl as hvd
from hpcdl.functions import check_on_every_rank
from hpcdl.parallel import Grid, Pipeline, allreduce_sequence_parallel_grads
from hpcdl.parallel.dense import gather_dense, gather_dense_optimizer, load_dense, local_optimizer_state
from hpcdl.startup import ignore_signals_while_ending, signal_while_starting

from . import checkpoint as ckpt
from .agreement import check_same_settings
from .config import Interrupted, RunError, TrainConfig
from .data import ShardedOrder, Split, corpus, digits, eval_indices
from .launch import launcher, output_is_terminal, pick_device, rank_placement, servers
from .lock import LockHeld, RunLock
from .models import GPT, DigitsCNN, DigitsMLP, parallel_gpt, parallel_gpt_loss, wide
from .report import Metrics, plot, write_json

__all__ = ["run", "Trainer"]

_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def init_runtime(cfg: TrainConfig) -> None:
    """Start hpcdl with the job's runtime section (which checks that MPI sees the launcher's
    tasks as one job), after checking that every rank has the same settings (a
    :class:`RunError` on every rank if not)."""
    check_same_settings(cfg)
    try:
        hvd.init(config=cfg.runtime)
    except hvd.HpcdlError as exc:  # a runtime section that does not fit the world: every rank alike
        raise RunError(str(exc)) from None


def uses_grid(cfg: TrainConfig) -> bool:
    """Whether the run splits the GPT over a grid (tp or pp > 1, or micro-batches)."""
    p = cfg.parallelism
    return cfg.model.name == "gpt" and (p.tp * p.pp > 1 or p.chunks > 1)


def build_grid(cfg: TrainConfig) -> Grid | None:
    """The run's DP x TP x PP grid (dp inferred), or None for a data-parallel run; a grid
    that does not fit the world is a :class:`RunError` on every rank (collective)."""
    if not uses_grid(cfg):
        return None
    try:
        return Grid(dp=-1, tp=cfg.parallelism.tp, pp=cfg.parallelism.pp)
    except hvd.HpcdlArgumentError as exc:
        tp, pp = cfg.parallelism.tp, cfg.parallelism.pp
        raise RunError(f"--tp {tp} --pp {pp} on {hvd.size()} ranks: {exc}") from None


def _resolve_run_dir(cfg: TrainConfig) -> tuple[str, RunLock | None]:
    """Rank 0 picks (and creates) the run directory and takes its lock; every rank gets its
    absolute path (rank 0 the held lock too), or the same :class:`RunError`: a directory
    that cannot be made, one another job holds, a directory to resume that does not exist,
    or checkpoints of an earlier run where this one would start afresh without
    ``overwrite``."""
    answer: tuple[str | None, str | None] = (None, None)
    lock = None
    if hvd.rank() == 0:
        path = cfg.job.run_dir or os.path.join("runs", f"{cfg.model.name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        path = os.path.abspath(path)
        ck_dir = os.path.join(path, "checkpoints")
        problem = None
        if cfg.checkpoint.resume and not os.path.isdir(path):
            problem = f"resume: run directory {path} does not exist"
        else:
            try:
                os.makedirs(path, exist_ok=True)
                lock = RunLock(path)
                warning = lock.acquire()
                if warning:
                    print(f"hpcdl.train: warning: {path}: {warning}", file=sys.stderr, flush=True)
            except LockHeld as exc:
                problem, lock = str(exc), None
            except OSError as exc:
                problem, lock = f"run directory {path} cannot be used: {exc.strerror or exc}", None
        earlier = ckpt.steps_in(ck_dir) if problem is None else []
        if earlier and not cfg.checkpoint.resume and not cfg.checkpoint.overwrite:
            problem = (
                f"run directory {path} holds checkpoints of an earlier run (newest "
                f"{ckpt.path_for(ck_dir, earlier[-1])}); pass --resume to continue it or --overwrite to start afresh"
            )
        elif problem is None:
            try:
                if cfg.checkpoint.overwrite:
                    ckpt.remove_all(ck_dir)
                os.makedirs(ck_dir, exist_ok=True)
            except OSError as exc:
                problem = f"run directory {path} cannot be used: {exc.strerror or exc}"
        if problem is not None and lock is not None:
            lock.release()
            lock = None
        answer = (path, problem)
    path, problem = hvd.broadcast_object(answer, root_rank=0, name="train.run_dir")
    if problem is not None:
        raise RunError(problem)
    return path, lock


_SAME_MODEL = ("model", "block_size", "n_layer", "n_head", "d_model", "optimizer")
"""Fields a checkpoint must share with the run that resumes it: its weights and optimizer
state only load into the same model and optimizer."""
_PER_RUN = ("epochs", "max_steps", "run_dir", "resume", "overwrite", "progress", "checkpoint_every")
_PER_RUN += ("keep_checkpoints", "timeline", "dry_run", "threads", "device", "runtime")
_PER_RUN += ("tp", "pp", "pp_schedule", "chunks", "sequence_parallel")
"""Fields a resumed run may change without comment (a checkpoint holds the dense model, so
it resumes on any grid)."""


def _differences(saved: dict[str, Any], cfg: TrainConfig, fields: Any) -> list[str]:
    now = cfg.to_dict()  # a field one of them lacks (a checkpoint of another version) shows as None
    return [f"{k}={saved.get(k)!r} (this run: {now.get(k)!r})" for k in fields if saved.get(k) != now.get(k)]


def _pick_checkpoint(ck_dir: str, cfg: TrainConfig) -> tuple[str | None, dict | None, str | None]:
    """Rank 0's choice of the checkpoint to resume from: the newest intact one (each newer
    one that does not load or fails its checksum is skipped with a warning naming it and
    why, and the one taken is named), as (path, its contents, None), or (None, None, the
    problem)."""
    steps = ckpt.steps_in(ck_dir)
    if not steps:
        return None, None, f"resume: no checkpoint in {ck_dir}"
    skipped = []
    for step in reversed(steps):
        path = ckpt.path_for(ck_dir, step)
        try:
            st = ckpt.load(path)
        except ValueError as exc:
            skipped.append(f"{path} ({exc})")
            print(f"hpcdl.train: warning: skipping checkpoint {path}: {exc}", file=sys.stderr, flush=True)
            continue
        saved = st.get("config", {})
        bad = _differences(saved, cfg, _SAME_MODEL)
        if bad:
            return None, None, f"resume: {path} was written for another model or optimizer: " + ", ".join(bad)
        other = _differences(saved, cfg, [k for k in saved if k not in _SAME_MODEL and k not in _PER_RUN])
        if other:
            print(
                f"hpcdl.train: warning: resuming {path} with changed " + ", ".join(other), file=sys.stderr, flush=True
            )
        if skipped:
            print(f"hpcdl.train: resuming from {path}, the newest intact checkpoint", file=sys.stderr, flush=True)
        return path, st, None
    return None, None, "resume: no intact checkpoint in " + ck_dir + "; skipped " + "; ".join(skipped)


@dataclasses.dataclass
class _RunState:
    """What one call of :meth:`Trainer.run` (this job) keeps while it trains: where it writes,
    what it holds open, the figures it started from (a resumed run's counters hold the
    earlier jobs' too), the last evaluation and the step of the last checkpoint."""

    run_dir: str
    resumed_from: str | None
    t_start: float
    start_step: int
    start_samples: int
    start_train_s: float
    start_sync_s: float
    metrics: Metrics | None = None
    bar: Any = None
    """Rank 0's progress bar, where its output reaches a terminal."""
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    last_saved: int = -1
    """The step of the newest checkpoint this job wrote or resumed from (-1: none)."""

    @property
    def ck_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")


class Trainer:
    """One training run. ``run()`` does it all; the pieces are methods so tests can use them."""

    def __init__(self, cfg: TrainConfig, on_step: Callable[[int], None] | None = None) -> None:
        """Build the run on this rank from ``cfg``, one step after another: the device, the
        data, the grid, the model (the same initial weights on every rank) cut over the
        grid, the distributed optimizer, and the position at step 0 (collective: the
        initial weights are broadcast, the grid and the optimizer make process sets).
        ``on_step(step)`` is called after each optimizer step."""
        self.cfg, self.on_step = cfg, on_step
        self.rank, self.world = hvd.rank(), hvd.size()
        self.device = self._set_up_device()
        self.train_set, self.test_set = self._load_data()
        self._place_on_grid()
        self.model: torch.nn.Module = self._build_model()
        self._build_optimizer()
        self._start_at_step_zero()
        self.signal: int | None = None
        """The first of SIGINT or SIGTERM this rank received during the run (None: none)."""
        self.stop_asked: int | None = None
        """The signal the ranks agreed, with the last step's loss, to stop for."""

    def _set_up_device(self) -> torch.device:
        """This rank's torch threads and training device (deterministic kernels on a GPU)."""
        torch.set_num_threads(self.cfg.training.threads)
        device = pick_device(self.cfg.training.device, hvd.local_rank())
        if device.type == "cuda":  # bitwise-reproducible runs (and --resume), as on the CPU
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        return device

    def _load_data(self) -> tuple[Split, Split]:
        """The training and held-out splits of the model's data set, on the training device
        (a block size the corpus cannot fill is a :class:`RunError` on every rank)."""
        model = self.cfg.model
        if model.name == "gpt":
            try:
                train_set, test_set = corpus(model.block_size)
            except ValueError as exc:  # every rank alike: the corpus is the same everywhere
                raise RunError(f"--block-size: {exc}") from None
        else:
            train_set, test_set = digits(image=model.name == "cnn")
        if self.cfg.training.precision == "fp64" and model.name != "gpt":  # the images in float64 as the weights
            train_set, test_set = (Split(s.x.double(), s.y) for s in (train_set, test_set))
        return train_set.to(self.device), test_set.to(self.device)

    def _place_on_grid(self) -> None:
        """The grid: data-parallel replicas of a model cut over tp x pp ranks (a grid of
        world x 1 x 1 without one); the ranks of a replica read the same samples."""
        self.grid = build_grid(self.cfg)
        self.shape = (self.grid.dp, self.grid.tp, self.grid.pp) if self.grid else (self.world, 1, 1)
        self.replicas = self.shape[0]
        self.replica = self.grid.dp_rank if self.grid else self.rank
        training = self.cfg.training
        self.order = ShardedOrder(len(self.train_set), self.replicas, self.replica, training.seed, training.batch_size)

    def _build_model(self) -> torch.nn.Module:
        """The model: the same initial weights on every rank (seeded, then broadcast from
        rank 0), on a grid this rank's slices of its stage; then seed the dropout."""
        m, seed = self.cfg.model, self.cfg.training.seed
        torch.manual_seed(seed)
        if m.name == "gpt":
            dense: torch.nn.Module = GPT(
                m.block_size, m.n_layer, m.n_head, m.d_model, m.dropout, m.activation_checkpointing
            )
        else:
            dense = DigitsCNN() if m.name == "cnn" else DigitsMLP()
        dense.to(self.device, torch.float64 if self.cfg.training.precision == "fp64" else None)
        hvd.broadcast_parameters(dense.state_dict(), root_rank=0)
        self.dense_shapes = {n: tuple(p.shape) for n, p in dense.named_parameters()}
        """The dense model's parameter names (in its optimizer's order) and shapes."""
        model = dense
        if self.grid:  # this rank's slices of this rank's stage
            p = self.cfg.parallelism
            layers = parallel_gpt(dense, self.grid, p.sequence_parallel, m.activation_checkpointing)
            model = Pipeline(layers, self.grid, chunks=p.chunks, schedule=p.pp_schedule)
            del dense, layers
        # each rank its own dropout stream but the ranks of a TP group one stream (their
        # replicated activations must drop alike); manual_seed seeds the CUDA generators too
        torch.manual_seed(seed * 1_000_003 + 7919 * (self.rank // self.shape[1] + 1))
        return model

    def _build_optimizer(self) -> None:
        """The torch optimizer at the scaled learning rate, wrapped as --dp and --zero say,
        and fp16's loss scaler."""
        o, p = self.cfg.optimizer, self.cfg.parallelism
        self.base_lr = o.lr * (self.replicas if o.lr_scaling == "linear" else 1)
        kwargs: dict[str, Any] = {"lr": self.base_lr, "weight_decay": o.weight_decay}
        if o.name == "sgd":
            kwargs["momentum"] = o.momentum
        inner = _OPTIMIZERS[o.name](self.model.parameters(), **kwargs)
        self.passes = self.cfg.training.grad_accum * (p.chunks if self.grid else 1)
        """Backward passes per step through each parameter: one per micro-batch."""
        common = dict(named_parameters=self.model.named_parameters(), backward_passes_per_step=self.passes)
        if self.grid:
            common["process_set"] = self.grid.dp_group
        # ssp and async workers run apart: no collective may tie their steps together
        self.apart = p.dp == "ps" and p.ps_mode != "sync"
        if p.dp == "ps":
            self.opt = hvd.HybridOptimizer(
                inner, mode=p.ps_mode, staleness=p.staleness, partition_bytes=p.ps_partition_bytes, **common
            )
        elif o.zero:
            self.opt = hvd.ZeroOptimizer(inner, stage=o.zero, **common)
        else:
            self.opt = hvd.DistributedOptimizer(inner, **common)
        # fp16's dynamic loss scaling: the scaler unscales the reduced gradients, which are
        # the same on every rank, so every rank finds the same inf/nan and skips the same steps
        precision = self.cfg.training.precision
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def _start_at_step_zero(self) -> None:
        """The position in the data and the counters of a fresh run (:meth:`restore` moves them)."""
        batches = self.order.batches_per_epoch()
        self.steps_per_epoch = math.ceil(batches / self.cfg.training.grad_accum)
        self.step = 0
        self.epoch = 0
        self.step_in_epoch = 0  # optimizer steps already taken in self.epoch
        self.sync_s = 0.0
        self.train_s = 0.0
        self.samples = 0
        self._plan_steps()

    def _plan_steps(self) -> None:
        """``total_steps``: the step at which the run ends, --epochs passes over the data
        from the current position (whatever batch size earlier steps had), or --max-steps."""
        training = self.cfg.training
        left = (training.epochs - self.epoch) * self.steps_per_epoch - self.step_in_epoch
        self.total_steps = self.step + max(0, left)
        if training.max_steps:
            self.total_steps = min(self.total_steps, training.max_steps)

    # -- the pieces ---------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then constant
        or a cosine decay that reaches 0 after the last step."""
        w = self.cfg.optimizer.warmup_steps
        if step < w:
            return self.base_lr * (step + 1) / w
        if self.cfg.optimizer.lr_schedule == "constant":
            return self.base_lr
        return self.base_lr * 0.5 * (1.0 + math.cos(math.pi * (step - w) / max(1, self.total_steps - w)))

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            out = self.model(x)
            return F.cross_entropy(wide(out.reshape(-1, out.shape[-1])), y.reshape(-1))

    def _chunks(self, batch: int) -> int:
        """Micro-batches of a batch of ``batch`` samples (fewer for a short last batch)."""
        return min(self.cfg.parallelism.chunks, batch)

    def train_step(self, group: list[torch.Tensor]) -> float:
        """One optimizer step over the batches in ``group`` (gradient accumulation: their
        mean loss, weighted by batch size); returns the loss averaged over the ranks."""
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        passes = sum(self._chunks(len(b)) for b in group) if self.grid else len(group)
        if self.opt.backward_passes_per_step != passes:  # a short last group of the epoch
            self.opt.set_backward_passes_per_step(passes)
        self.opt.zero_grad()
        total = sum(len(b) for b in group)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.model.train()
        for idx in group:
            x, y = self.train_set.batch(idx)
            # the passes' gradients add up (as in Horovod): weighting each pass by its share of
            # the group's samples makes the sum their mean, also when batch sizes differ
            share = len(idx) / total
            if self.grid:
                loss = self._pipeline_step(x, y, share)
            else:
                loss = self.loss(x, y)
                scaled = loss * share
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach().double() * len(idx)
        # the ranks of a replica agree on its loss: the world's average is the replicas' (ssp
        # and async workers log their own, which averaging would hold in step)
        # with the loss, whether any rank was asked to stop (SIGINT, SIGTERM): every rank
        # learns it at the same step (ssp and async workers, apart, stop on their own)
        asked = [float(self.signal == signal.SIGINT), float(self.signal == signal.SIGTERM)]
        mean = None
        if not self.apart:
            sent = torch.cat([(loss_sum / total).reshape(1).cpu(), torch.tensor(asked, dtype=torch.float64)])
            mean = hvd.allreduce_async(sent, op=hvd.Average, name="train.loss")
        t = time.perf_counter()
        self.opt.synchronize()
        if self.cfg.parallelism.sequence_parallel:  # the layer norms saw this rank's part of the sequence
            allreduce_sequence_parallel_grads(self.model, self.grid.tp_group)
        self.sync_s += time.perf_counter() - t
        with self.opt.skip_synchronize():
            if self.scaler:
                self.scaler.unscale_(self.opt)
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
        if self.opt.backward_passes_per_step != self.passes:
            self.opt.set_backward_passes_per_step(self.passes)
        self.samples += total * self.replicas
        if mean is None:
            self.stop_asked = self.signal
            return float(loss_sum / total)
        got = hvd.synchronize(mean).tolist()
        self.stop_asked = signal.SIGTERM if got[2] > 0 else signal.SIGINT if got[1] > 0 else None
        return got[0]

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor, share: float) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline, its gradients weighted by
        ``share``; the batch's mean loss (every stage gets it)."""
        self.model.chunks = self._chunks(len(x))
        with self._autocast():
            loss = self.model.train_step(x, y, lambda out, t: parallel_gpt_loss(out, t, self.grid) * share)
        return torch.tensor(loss / share, dtype=torch.float64)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (and accuracy for digits) over the whole held-out split, shared by the ranks
        (with ssp or async, of the servers' newest parameters)."""
        if self.apart:
            self.opt.refresh()
        self.model.eval()
        idx = eval_indices(len(self.test_set), self.replicas, self.replica)
        sums = torch.zeros(3, dtype=torch.float64)  # loss x targets, correct, targets
        for part in torch.split(idx, 256):
            x, y = self.test_set.batch(part)
            with self._autocast():
                if self.grid:
                    self.model.chunks = self._chunks(len(part))
                    sums += self.model.evaluate(x, y, self._pipeline_sums).cpu()
                    continue
                out = wide(self.model(x))
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
            sums += torch.tensor(
                [F.cross_entropy(out, y, reduction="sum").item(), (out.argmax(-1) == y).sum().item(), len(y)],
                dtype=torch.float64,
            )
        # the ranks of a replica hold the same sums: add up the replicas'
        group = self.grid.dp_group if self.grid else hvd.global_process_set
        loss_sum, correct, n = hvd.allreduce(sums, op=hvd.Sum, name="train.eval", process_set=group).tolist()
        res = {"loss": loss_sum / n}
        if self.cfg.model.name == "gpt":
            res["perplexity"] = math.exp(res["loss"])
        else:
            res["accuracy"] = correct / n
        return res

    def _pipeline_sums(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The summed loss and the target count of a micro-batch on the last stage (the
        GPT's accuracy is not reported, so its count of correct bytes is left at 0)."""
        loss = parallel_gpt_loss(logits, y, self.grid).double() * y.numel()
        return torch.stack([loss, torch.zeros_like(loss), torch.full_like(loss, y.numel())])

    # -- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """The checkpoint (collective: ZeroOptimizer consolidates its shards, a grid its
        slices); None off rank 0."""
        opt_state = self.opt.state_dict()
        if self.grid:  # the dense model's weights and optimizer state, from every rank's slices
            model_state = gather_dense(self.model, self.grid, self.dense_shapes)
            opt_state = gather_dense_optimizer(self.model, opt_state, self.grid, self.dense_shapes)
        else:
            model_state = self.model.state_dict()
        rngs = hvd.allgather_object(torch.get_rng_state(), name="train.rng")
        cuda_rngs = None
        if self.device.type == "cuda":
            cuda_rngs = hvd.allgather_object(torch.cuda.get_rng_state(self.device), name="train.cuda_rng")
        if self.rank != 0:
            return None
        return {
            "format": ckpt.FORMAT,
            "step": self.step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "steps_per_epoch": self.steps_per_epoch,
            "world_size": self.world,
            "grid": list(self.shape),
            "model": model_state,
            "optimizer": opt_state,
            "scaler": self.scaler.state_dict() if self.scaler else {},
            "rng": rngs,
            "cuda_rng": cuda_rngs,
            "config": self.cfg.to_dict(),
            "counters": {"samples": self.samples, "train_s": self.train_s, "sync_s": self.sync_s},
        }

    def save(self, directory: str) -> str:
        state = self.state()
        path = ckpt.path_for(directory, self.step)
        if self.rank == 0:
            ckpt.save_atomic(state, path)
            ckpt.prune(directory, self.cfg.checkpoint.keep)
        return path

    def restore(self, path: str, st: dict[str, Any] | None = None) -> None:
        """Continue from the checkpoint at ``path`` (``st``: its contents, when read already);
        a checkpoint that does not fit this run is a :class:`RunError` on every rank."""
        problem = None
        try:
            st = ckpt.load(path) if st is None else st
            opt_state = st["optimizer"]
            if self.grid:  # this rank's slices of the dense model and of its optimizer state
                load_dense(self.model, st["model"])
                opt_state = local_optimizer_state(self.model, opt_state, list(self.dense_shapes))
            else:
                self.model.load_state_dict(st["model"])
        except (ValueError, RuntimeError, KeyError) as exc:
            problem = f"resume: {path} does not fit this run: {str(exc).splitlines()[0]}"
        check_on_every_rank(problem, RunError, name="train.restore")
        self.opt.load_state_dict(opt_state)
        if self.scaler and st["scaler"]:
            self.scaler.load_state_dict(st["scaler"])
        if st["world_size"] == self.world and st.get("grid", [self.world, 1, 1]) == list(self.shape):
            torch.set_rng_state(st["rng"][self.rank])
            if self.device.type == "cuda" and st.get("cuda_rng"):
                torch.cuda.set_rng_state(st["cuda_rng"][self.rank], self.device)
        self.step, self.epoch, self.step_in_epoch = st["step"], st["epoch"], st["step_in_epoch"]
        saved_per_epoch = st.get("steps_per_epoch", self.steps_per_epoch)
        if saved_per_epoch != self.steps_per_epoch:  # another batch size or rank count: the same share of the epoch
            self.step_in_epoch = min(
                self.steps_per_epoch, round(self.step_in_epoch * self.steps_per_epoch / saved_per_epoch)
            )
        self._plan_steps()
        c = st["counters"]
        self.samples, self.train_s, self.sync_s = c["samples"], c["train_s"], c["sync_s"]

    # -- the run ------------------------------------------------------------------------------
    def run(self, run_dir: str) -> dict[str, Any]:
        """Train to the end in ``run_dir`` (with --resume, first from its newest intact
        checkpoint), in steps: open the outputs, train, close them, summarize. Returns the
        summary, the same on every rank but for ``checkpoint`` (collective)."""
        t_start = time.perf_counter()
        ck_dir = os.path.join(run_dir, "checkpoints")
        resumed_from = self._resume_newest(ck_dir) if self.cfg.checkpoint.resume else None
        state = _RunState(run_dir, resumed_from, t_start, self.step, self.samples, self.train_s, self.sync_s)
        if resumed_from:  # its checkpoint holds this step
            state.last_saved = self.step
        self._open_outputs(state)
        # held until the summary is written: a signal after the last step is moot (the run
        # is complete), a second one still stops at once, and none kills a rank mid-write
        handlers = self._catch_signals()
        try:
            try:
                self._train(state)
            finally:
                self._close_outputs(state)
            summary = self._summary(state)
            if self.rank == 0:
                write_json(os.path.join(run_dir, "summary.json"), summary)
                plot(
                    os.path.join(run_dir, "metrics.jsonl"),
                    os.path.join(run_dir, "curves.png"),
                    f"hpcdl.train: {self.cfg.model.name}, {self.world} ranks",
                )
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            ignore_signals_while_ending()  # settled; the default action would kill a rank closing its groups
        return summary

    def _resume_newest(self, ck_dir: str) -> str:
        """Restore the checkpoint rank 0 picks in ``ck_dir`` and return its path; none to
        pick is a :class:`RunError` on every rank (collective)."""
        path, st, problem = _pick_checkpoint(ck_dir, self.cfg) if self.rank == 0 else (None, None, None)
        path, problem = hvd.broadcast_object((path, problem), 0, name="train.resume")
        if problem is not None:
            raise RunError(problem)
        self.restore(path, st)
        return path

    def _open_outputs(self, state: _RunState) -> None:
        """Rank 0 writes ``config.json`` and ``ranks.json`` and opens the metrics; every rank
        starts the timeline (with --timeline), rank 0 the progress bar (collective: the
        ranks' placement is gathered)."""
        ranks = rank_placement(hvd, self.device)
        if self.rank == 0:
            ckpt.remove_partial(state.ck_dir)
            write_json(os.path.join(state.run_dir, "config.json"), self.cfg.to_dict())
            placement = {"launcher": launcher(), "ranks": ranks, **servers(hvd)}
            write_json(os.path.join(state.run_dir, "ranks.json"), placement)
            resume_step = self.step if state.resumed_from else None
            state.metrics = Metrics(os.path.join(state.run_dir, "metrics.jsonl"), resume_step)
        if self.cfg.job.timeline:
            try:
                hvd.start_timeline(self.cfg.job.timeline)
            except hvd.HpcdlArgumentError as exc:  # every rank alike: rank 0 cannot write there
                raise RunError(f"--timeline: {exc}") from None
        state.bar = self._progress(state.resumed_from)

    def _close_outputs(self, state: _RunState) -> None:
        """Close the bar, stop the timeline and close the metrics (also when training failed)."""
        if state.bar is not None:
            state.bar.close()
        if self.cfg.job.timeline:
            hvd.stop_timeline()
        if state.metrics:
            state.metrics.close()

    def _train(self, state: _RunState) -> None:
        """Train from the current position to ``total_steps``: evaluate after each epoch (and
        at the end, when it comes inside an epoch), checkpoint every --checkpoint-every steps
        and at the end."""
        accum = self.cfg.training.grad_accum
        while self.step < self.total_steps:
            batches = self.order.batches(self.epoch)
            groups = [batches[i : i + accum] for i in range(0, len(batches), accum)]
            while self.step_in_epoch < len(groups) and self.step < self.total_steps:
                self._take_step(state, groups[self.step_in_epoch])
                self._checkpoint_or_stop(state)
            if self.step_in_epoch >= len(groups):  # the epoch is complete
                self._end_epoch(state)
        if not state.last_eval:  # stopped by max_steps inside an epoch
            state.last_eval = self.evaluate()
            if state.metrics:
                state.metrics.write({"kind": "eval", "step": self.step, "epoch": self.epoch, **state.last_eval})
        if state.last_saved != self.step:
            self.save(state.ck_dir)

    def _take_step(self, state: _RunState, group: list[torch.Tensor]) -> None:
        """One optimizer step over ``group``, logged to the metrics and the bar; a loss that
        is not finite is a :class:`RunError` on every rank."""
        t0 = time.perf_counter()
        loss = self.train_step(group)
        if not math.isfinite(loss):  # averaged over the ranks: every rank stops here
            raise RunError(
                f"training diverged: the loss is {loss} at step {self.step + 1} "
                f"(learning rate {self.lr_at(self.step):g}); lower --lr"
            )
        dt = time.perf_counter() - t0
        self.train_s += dt
        self.step += 1
        self.step_in_epoch += 1
        samples_s = sum(len(b) for b in group) * self.world / dt
        if state.metrics:
            state.metrics.write(
                {
                    "kind": "train",
                    "step": self.step,
                    "epoch": self.epoch,
                    "loss": loss,
                    "lr": self.lr_at(self.step - 1),
                    "samples_per_s": samples_s,
                    "step_s": dt,
                }
            )
        if state.bar is not None:
            state.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_s:.0f}", refresh=False)
            state.bar.update(1)
        if self.on_step:
            self.on_step(self.step)

    def _checkpoint_or_stop(self, state: _RunState) -> None:
        """After a step: the checkpoint --checkpoint-every asks for, and when the ranks agreed
        to stop, :class:`Interrupted` (after a checkpoint of this step, for SIGTERM)."""
        every = self.cfg.checkpoint.every
        if every and self.step % every == 0:
            self.save(state.ck_dir)
            state.last_saved = self.step
        if self.stop_asked is not None:
            if self.stop_asked == signal.SIGTERM and not self.apart and state.last_saved != self.step:
                self.save(state.ck_dir)  # preempted: keep this step's work
                state.last_saved = self.step
            raise Interrupted(self.stop_asked, self.step, ckpt.latest(state.ck_dir), self.apart)

    def _end_epoch(self, state: _RunState) -> None:
        """Evaluate the complete epoch, log it (a line per epoch even without a bar), check
        that training makes progress, and move to the next epoch."""
        state.last_eval = self.evaluate()
        if state.metrics:
            state.metrics.write({"kind": "eval", "step": self.step, "epoch": self.epoch, **state.last_eval})
        self._check_not_at_chance(state.last_eval)
        line = f"epoch {self.epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in state.last_eval.items())
        if state.bar is not None:
            state.bar.write(line)
        elif self.rank == 0:  # a log without a bar still gets one line per epoch
            print(line, flush=True)
        self.epoch += 1
        self.step_in_epoch = 0

    def _summary(self, state: _RunState) -> dict[str, Any]:
        """The run's result and this job's own figures (collective: the gpt's sample)."""
        cfg = self.cfg
        train_s = self.train_s - state.start_train_s
        summary = {
            "model": cfg.model.name,
            "world_size": self.world,
            "device": str(self.device),
            "precision": cfg.training.precision,
            "steps": self.step,
            "epochs": self.epoch,
            "final": state.last_eval,
            "steps_this_job": self.step - state.start_step,
            "wall_time_s": time.perf_counter() - state.t_start,
            "train_time_s": train_s,
            "samples_per_s": (self.samples - state.start_samples) / train_s if train_s else 0.0,
            "exposed_comm_share": (self.sync_s - state.start_sync_s) / train_s if train_s else 0.0,
            "resumed_from": state.resumed_from,
            "resumed_from_step": state.start_step if state.resumed_from else None,
            "checkpoint": ckpt.latest(state.ck_dir) if self.rank == 0 else None,
            "parameters": sum(math.prod(s) for s in self.dense_shapes.values()),
            "grid": dict(zip(("dp", "tp", "pp"), self.shape, strict=True)),
            "dp": cfg.parallelism.dp if cfg.parallelism.dp == "allreduce" else f"ps {cfg.parallelism.ps_mode}",
        }
        if self.apart:
            summary["staleness"] = self.opt.ps_stats_summary()
        if cfg.model.name == "gpt":  # what the model learned to write
            summary["sample"] = self._sample(b"The ", 120)
        return summary

    def _catch_signals(self) -> dict[int, Any]:
        """Note SIGINT (Ctrl-C, which mpiexec passes to every rank) and SIGTERM (Slurm's
        preemption, ``scancel``) instead of dying mid-step: the ranks agree to stop after
        the step, SIGTERM after a checkpoint. A second signal ends the job at once. Returns
        the handlers to put back (none off the main thread, where Python allows none)."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def note(signum: int, frame: Any) -> None:
            if self.signal is not None:  # asked twice: stop now
                raise KeyboardInterrupt
            self.signal = signum

        if self.signal is None:  # a Ctrl-C while the job was starting: stop after the first step
            self.signal = signal_while_starting()
        return {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}

    def _check_not_at_chance(self, held_out: dict[str, float]) -> None:
        """A :class:`RunError` when, from the second epoch on and past warm-up, the held-out
        loss is still that of a uniform guess (ln of the class count), or worse, or not a
        number, and the accuracy no better than a guess: training has made no progress, or
        lost what it made (a learning rate too high, staleness too large)."""
        classes = 256 if self.cfg.model.name == "gpt" else 10
        chance = math.log(classes)
        if self.epoch < 1 or self.step <= self.cfg.optimizer.warmup_steps:
            return
        loss = held_out["loss"]
        if held_out.get("accuracy", 0.0) > 2.0 / classes:  # right more often than a guess
            return
        if math.isfinite(loss) and loss < chance * 0.99:  # learning
            return
        hint = "lower --lr"
        p = self.cfg.parallelism
        if p.dp == "ps" and p.ps_mode != "sync":
            hint += f", or --staleness (now {p.staleness}), or use --ps-mode sync"
        stuck = abs(loss - chance) <= 0.01 * chance  # else worse than chance, or nan
        what, than = ("is stuck at chance level", "that of") if stuck else ("has diverged", "worse than")
        raise RunError(
            f"training {what}: after epoch {self.epoch} (step {self.step}) the held-out loss is {loss:.4f}, "
            f"{than} a uniform guess over {classes} classes (ln {classes} = {chance:.4f}); "
            f"{hint}; the checkpoints in the run directory hold the run up to here"
        )

    def close(self) -> None:
        """Free the pipeline's communicator and the grid's process sets, or the parameter
        servers' tables (collective)."""
        if self.cfg.parallelism.dp == "ps":
            self.opt.close()
        if self.grid:
            self.model.close()
            self.grid.close()

    def _sample(self, prompt: bytes, n: int) -> str:
        """The GPT's greedy continuation of ``prompt`` (collective; on a grid, rank 0 writes
        it with the consolidated dense model)."""
        if not self.grid:
            return (prompt + self.model.generate(prompt, n)).decode("utf-8", "replace")
        weights = gather_dense(self.model, self.grid, self.dense_shapes)
        text = None
        if self.rank == 0:
            m = self.cfg.model
            gpt = GPT(m.block_size, m.n_layer, m.n_head, m.d_model).to(self.device)
            gpt.load_state_dict({k: v.float() for k, v in weights.items()})
            text = (prompt + gpt.eval().generate(prompt, n)).decode("utf-8", "replace")
        return hvd.broadcast_object(text, 0, name="train.sample")

    def _progress(self, resumed_from: str | None) -> Any:
        """Rank 0's progress bar, where its output reaches a terminal and --progress is on (a
        bar in a log file or a Slurm ``.out`` is a flood of redrawn lines)."""
        if self.rank != 0 or not self.cfg.job.progress or not output_is_terminal():
            return None
        from tqdm import tqdm

        # on stdout, the stream of the epoch lines (bar.write) and the result line: mpiexec
        # forwards stdout and stderr separately, so a bar on stderr would interleave with them
        return tqdm(
            file=sys.stdout,
            total=self.total_steps,
            initial=self.step,
            unit="step",
            mininterval=0.5,
            dynamic_ncols=True,
            desc=f"{self.cfg.model.name} x{self.world}"
            + (" ({}x{}x{})".format(*self.shape) if self.grid else "")
            + (" (resumed)" if resumed_from else ""),
        )


def run(cfg: TrainConfig, on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says over the world (initializing hpcdl if needed); returns the
    summary (the same on every rank but for ``checkpoint``)."""
    init_runtime(cfg)
    run_dir, lock = _resolve_run_dir(cfg)
    try:
        trainer = Trainer(cfg, on_step)
        summary = trainer.run(run_dir)
        trainer.close()  # collective: not after a failure, which ends the job (or is every rank's RunError)
    finally:
        if lock is not None:
            lock.release()
    summary["run_dir"] = run_dir
    return summary
