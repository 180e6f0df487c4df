"""``python -m hpcdl.plan``: which layout to train a GPT on ``N`` GPUs with, and how fast.

Given the model, the global batch, the GPUs and the links inside and between nodes, the
planner estimates every layout — data-parallel ``dp`` × tensor-parallel ``tp`` ×
pipeline ``pp`` stages, the micro-batch, the ZeRO stage, full activation recomputation and
the interleaved pipeline's chunks per stage — and ranks the ones that fit in memory by
step time. Each estimate splits the step into compute, the pipeline bubble, tensor-,
pipeline- and data-parallel communication, and counts the memory of parameters,
gradients, optimizer states and activations per GPU.

The model (Megatron-LM's, Narayanan et al., SC21, and Korthikanti et al., 2022):

- FLOPs per step as Megatron-LM reports them: ``96 B s l h² (1 + s / 6h + V / 16lh)`` with
  full recomputation (the recomputed forward counted), ``72 B s l h² (1 + s / 6h + V /
  12lh)`` without, and with selective recomputation (the attention core's alone, which
  Megatron-LM leaves out of its count, as Korthikanti et al.'s model FLOPs do). The GPU's
  matrix kernels run at ``efficiency`` × its peak; what moves through memory outside them
  (the attention scores' scale, mask, softmax and dropout; bias and GeLU; layer norms,
  dropouts and residual adds, split over ``tp`` with sequence parallelism) at its memory
  bandwidth; selective recomputation repeats the attention core in the backward.
- With flash attention (``--attention flash``) the attention core's scores never leave
  the chip: none of their memory traffic, none stored (each row's fp32 softmax statistic
  instead); its kernel skips the blocks the causal mask hides (half the core's FLOPs), and
  the backward computes ``QK^T`` again. The reported FLOPs are Megatron-LM's count, which
  leaves both out.
- Tensor parallelism: 4 allreduces of a micro-batch's activations per layer (6 with full
  recomputation), on the critical path; with sequence parallelism each is a reduce-scatter
  and an allgather, and the backward gathers its products' inputs again (the bytes of one
  allreduce more); pipeline: a send of ``1 / tp`` of them each way per
  micro-batch and chunk (Megatron's scatter/gather); bubble ``(pp - 1) / chunks`` stage
  times (1F1B); data parallelism: the gradients' allreduce after the pipeline drains, by
  the fastest algorithm :func:`collectives.cost.allreduce_times` predicts (ZeRO-2 reduces
  each micro-batch's gradients, ZeRO-3 also gathers the parameters for each micro-batch's
  forward and backward); then the optimizer step at the GPU's memory bandwidth.
- Communication times come from :mod:`collectives.cost` (α-β links, the model ``auto``
  chooses its allreduce by across links), which a node report's measurements calibrate
  (``--intra report.json``), or a tuning table's measured node path (``--intra T.json``).
- What matters only for small models on processor cores, measured by
  ``benchmarks.plan_check`` and zero for the GPU presets: a fixed ``overhead`` per layer
  pass beside its arithmetic (:func:`fit_compute`); a fixed ``call_overhead`` per call
  between ranks; and compute slowed by the ranks sharing a node's cores (where they
  outnumber them), caches and memory (``contention``).
- Memory per GPU on the heaviest stage: 16 bytes per parameter for mixed-precision Adam
  (2 parameters, 2 gradients, 12 fp32 states), divided over ``dp`` as the ZeRO stage says;
  activations per layer ``s b h (10 + 24 / tp + 5 a s / h tp)`` bytes (``34 s b h / tp``
  for all but the scores with sequence parallelism; no scores with selective
  recomputation), or ``2 s b h`` (over ``tp`` with sequence parallelism) with full
  recomputation, for the micro-batches 1F1B keeps in flight (``pp - i`` on stage ``i``,
  the most over the stages); fp32 logits on the last.
- Stages that do not divide the layers (:func:`stage_layers`): the last, then the first
  take one layer fewer; the slowest stage sets the step.
- Ranks in Megatron-LM's order (and :class:`hpcdl.parallel.Grid`'s): tensor-parallel
  fastest, then data-parallel, then pipeline stages. A tensor-parallel group talks over the
  link inside a node where its GPUs divide a node's, else over the nodes' ports; a
  replica's neighbours (``tp`` ranks apart) share a node as its GPUs allow; a pipeline's
  stages (``tp × dp`` ranks apart) talk inside a node only where the whole job is one.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NamedTuple

from collectives.cli import output_file
from collectives.cost import (
    LINKS,
    AlphaBeta,
    allreduce_times,
    link_from_allreduce,
    parse_link,
    ring_allreduce,
    send_time,
)
from collectives.select import node_path

__all__ = [
    "GPT",
    "GPU",
    "GPUS",
    "MEGATRON_RECOMPUTATION",
    "MEGATRON_WEAK_SCALING",
    "MODELS",
    "Cluster",
    "Estimate",
    "Layout",
    "Placement",
    "attention_core_pass",
    "calibrate",
    "estimate",
    "fit_compute",
    "layer_pass",
    "main",
    "placement",
    "plan",
    "published",
    "recomputation_name",
    "stage_layers",
    "train_days",
    "validate",
    "validate_recomputation",
]

GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class GPT:
    """A GPT: ``layers`` transformer layers of width ``hidden`` with ``heads`` attention
    heads, sequences of ``seq`` tokens, a vocabulary of ``vocab`` (tied input and output
    embeddings, learned positions)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")

    def layer_params(self) -> int:
        """Parameters of one layer: QKV, projection and the two MLP matrices with their
        biases (``12 h² + 9 h``), and two layer norms (``4 h``)."""
        h = self.hidden
        return 12 * h * h + 13 * h

    def params(self) -> int:
        """Parameters in all: the layers, the token and position embeddings, the final norm."""
        h = self.hidden
        return self.layers * self.layer_params() + (self.vocab + self.seq) * h + 2 * h

    def flops(self, batch: int, recompute: bool, selective: bool = False) -> float:
        """FLOPs of one step of ``batch`` sequences, counted as Megatron-LM counts them: with
        full ``recompute`` the recomputed forward included. With ``selective``, Korthikanti et
        al.'s hardware FLOPs of selective recomputation, ``72 B s l h² (1 + s / 3h + V /
        12lh)``: the attention core counted three times more, as their utilisation figures
        imply, where one recomputed forward of it is ``4 B s² h`` a layer."""
        s, h, v, ll = self.seq, self.hidden, self.vocab, self.layers
        if recompute:
            return 96 * batch * s * ll * h * h * (1 + s / (6 * h) + v / (16 * ll * h))
        scores = s / (3 * h) if selective else s / (6 * h)
        return 72 * batch * s * ll * h * h * (1 + scores + v / (12 * ll * h))


@dataclass(frozen=True, slots=True, kw_only=True)
class GPU:
    """A GPU: dense half-precision ``peak`` FLOP/s, ``memory`` bytes, ``hbm`` bytes/s, the
    link between the GPUs of a node it usually comes with, and ``overhead``: the seconds a
    layer's forward or backward pass spends beside its arithmetic and memory traffic (kernel
    launches, the framework's dispatch), which matters only for small layers. A processor
    core that trains on its own is described the same way, from its measured rates
    (:func:`fit_compute`)."""

    name: str
    peak: float
    memory: float
    hbm: float
    intra: str
    overhead: float = 0.0


GPUS: dict[str, GPU] = {
    "a100": GPU(name="A100 80GB", peak=312e12, memory=80 * GB, hbm=2.0e12, intra="nvlink3"),
    "a100-40gb": GPU(name="A100 40GB", peak=312e12, memory=40 * GB, hbm=1.555e12, intra="nvlink3"),
    "h100": GPU(name="H100 SXM", peak=989e12, memory=80 * GB, hbm=3.35e12, intra="nvlink4"),
}
"""GPUs by name: dense bf16 peak without sparsity, memory and its bandwidth."""

MODELS: dict[str, GPT] = {
    "gpt-1.7b": GPT(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200),
    "gpt-3.6b": GPT(layers=30, hidden=3072, heads=32, seq=2048, vocab=51200),
    "gpt-7.5b": GPT(layers=36, hidden=4096, heads=32, seq=2048, vocab=51200),
    "gpt-18b": GPT(layers=40, hidden=6144, heads=48, seq=2048, vocab=51200),
    "gpt-22b": GPT(layers=48, hidden=6144, heads=64, seq=2048, vocab=51200),
    "gpt-39b": GPT(layers=48, hidden=8192, heads=64, seq=2048, vocab=51200),
    "gpt-76b": GPT(layers=60, hidden=10240, heads=80, seq=2048, vocab=51200),
    "gpt-146b": GPT(layers=80, hidden=12288, heads=96, seq=2048, vocab=51200),
    "gpt3-175b": GPT(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200),
    "gpt-310b": GPT(layers=96, hidden=16384, heads=128, seq=2048, vocab=51200),
    "gpt-530b": GPT(layers=105, hidden=20480, heads=128, seq=2048, vocab=51200),
    "gpt-1t": GPT(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200),
}
"""GPTs by name: GPT-3 175B, the sizes of Megatron-LM's weak-scaling study and the 22B of
Korthikanti et al."""

MEGATRON_WEAK_SCALING: tuple[tuple[str, int, int, int, int, float], ...] = (
    ("gpt-1.7b", 1, 1, 32, 512, 137),
    ("gpt-3.6b", 2, 1, 64, 512, 138),
    ("gpt-7.5b", 4, 1, 128, 512, 142),
    ("gpt-18b", 8, 1, 256, 1024, 135),
    ("gpt-39b", 8, 2, 512, 1536, 138),
    ("gpt-76b", 8, 4, 1024, 1792, 140),
    ("gpt-146b", 8, 8, 1536, 2304, 148),
    ("gpt-310b", 8, 16, 1920, 2160, 155),
    ("gpt-530b", 8, 35, 2520, 2520, 163),
    ("gpt-1t", 8, 64, 3072, 3072, 163),
)
"""Megatron-LM's weak-scaling runs on Selene (DGX A100 80GB nodes of 8 GPUs, NVLink3
inside, 8 HDR InfiniBand ports each, Narayanan et al., SC21, table 1): model, tensor- and
pipeline-parallel size, GPUs, global batch and achieved TFLOP/s per GPU."""


MEGATRON_RECOMPUTATION: tuple[tuple[str, int, int, int, int, float, float], ...] = (
    ("gpt-22b", 8, 1, 8, 4, 1.42, 1.10),
    ("gpt3-175b", 8, 8, 64, 64, 18.13, 13.75),
    ("gpt-530b", 8, 35, 280, 280, 49.05, 37.83),
    ("gpt-1t", 8, 64, 512, 512, 94.42, 71.49),
)
"""Megatron-LM's runs with selective recomputation and sequence parallelism on A100 80GB
(Korthikanti et al., 2022, tables 3 and 5; one replica each): model, tensor- and
pipeline-parallel size, GPUs, global batch, and the seconds of a step with full
recomputation (no sequence parallelism) and with selective recomputation and sequence
parallelism. The second reaches 41.5, 51.4, 56.0 and 56.3 % of the GPU's peak in model
FLOPs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """``gpus`` GPUs of kind ``gpu``, ``gpus_per_node`` to a node joined by ``intra``; the
    nodes by ``inter`` ports, ``nics_per_node`` of them; the matrix kernels reach
    ``efficiency`` of the GPU's peak; activations and gradients travel in ``word`` bytes a
    value (2: the mixed precision Megatron-LM trains in; 4: fp32).

    Each call between ranks costs ``call_overhead`` seconds beside its link's time: the
    framework's own work for a call, the wait for the slower peer, and, where ranks share
    cores, the wait for a peer that was not running to be run again. Ranks that are
    processes on processor cores can outnumber the cores: with ``cores_per_node`` given
    and fewer than a node's ranks, the ranks share them; ranks that compute at once also
    share caches and memory bandwidth, ``contention`` times as slow as one alone (beyond
    sharing cores). Their compute takes :meth:`share` times as long, but for the
    pipeline's fill and drain: the stages idle there leave their cores to those computing
    (a waiting stage sleeps where ranks outnumber cores), which compute ``contention``
    times as long.
    ``benchmarks.plan_check`` measures these on a machine; the command leaves them out
    (GPUs, whose kernels, not their hosts, bound a large model's step)."""

    gpus: int
    gpu: GPU
    gpus_per_node: int = 8
    intra: AlphaBeta = LINKS["nvlink3"]
    inter: AlphaBeta = LINKS["ib-hdr"]
    nics_per_node: int = 8
    efficiency: float = 0.5
    word: int = 2
    cores_per_node: int | None = None
    contention: float = 1.0
    call_overhead: float = 0.0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1 or self.nics_per_node < 1:
            raise ValueError("gpus, gpus_per_node and nics_per_node must be positive")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency={self.efficiency} must lie in (0, 1]")
        if self.word not in (2, 4):
            raise ValueError(f"word={self.word} must be 2 or 4 bytes")
        if self.cores_per_node is not None and self.cores_per_node < 1:
            raise ValueError(f"cores_per_node={self.cores_per_node} must be positive")
        if self.contention < 1:
            raise ValueError(f"contention={self.contention} must be at least 1")
        if self.call_overhead < 0:
            raise ValueError(f"call_overhead={self.call_overhead} must not be negative")

    def share(self) -> float:
        """How many times as long compute takes because a node's ranks share its cores
        (``ranks / cores_per_node`` where more than 1) and the caches and memory behind them
        (``contention``); 1 for a processor per rank with nothing shared."""
        ranks = min(self.gpus, self.gpus_per_node)
        return self.contention * (max(1.0, ranks / self.cores_per_node) if self.cores_per_node else 1.0)

    def inter_per_gpu(self) -> AlphaBeta:
        """The share of the node's ports each GPU gets when all send at once."""
        share = min(1.0, self.nics_per_node / self.gpus_per_node)
        return AlphaBeta(self.inter.alpha, self.inter.beta * share)


_SELECTIVE_FLASH = "selective recomputation repeats nothing with flash attention (its backward recomputes the scores)"


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """``dp`` × ``tp`` × ``pp`` GPUs, ``micro_batch`` sequences per micro-batch, ZeRO stage
    ``zero`` (0: none), full activation ``recompute`` or ``selective`` recomputation (the
    attention core's alone: its scores, softmax and dropout, Korthikanti et al.),
    ``chunks`` model chunks per stage (the interleaved 1F1B schedule; 1: plain 1F1B), and
    ``sequence_parallel``: the layer norms, dropouts and residual adds split over the
    ``tp`` GPUs along the sequence, their allreduces each a reduce-scatter and an allgather
    (Megatron-LM's ``--sequence-parallel``; nothing to split with ``tp`` 1). With
    ``flash_attention`` the attention core runs as one kernel that keeps its scores on the
    chip (FlashAttention, Dao et al.): no scores in memory, none stored, and its backward
    computes them again, so selective recomputation has nothing left to repeat."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    zero: int = 0
    recompute: bool = True
    chunks: int = 1
    selective: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = False

    def __post_init__(self) -> None:
        if self.recompute and self.selective:
            raise ValueError("full and selective recomputation exclude each other")
        if self.selective and self.flash_attention:
            raise ValueError(_SELECTIVE_FLASH)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")

    def recomputation(self) -> str:
        """``full``, ``selective`` or ``none`` (:data:`RECOMPUTATION`)."""
        return recomputation_name(self.recompute, self.selective)

    def describe(self) -> str:
        """The layout in one line, as the command's flags name its parts."""
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp} micro_batch={self.micro_batch} zero={self.zero} "
            f"recompute={self.recomputation()} sequence_parallel={'yes' if self.sequence_parallel else 'no'} "
            f"chunks={self.chunks}" + (" attention=flash" if self.flash_attention else "")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """One layout's estimate: memory per GPU (bytes) and the step (seconds) by part;
    ``refused`` says why it cannot run (None: it can)."""

    layout: Layout
    micro_batches: int
    memory: dict[str, float]
    time: dict[str, float]
    step_s: float
    tflops_per_gpu: float
    refused: str | None

    def row(self) -> dict[str, Any]:
        """The layout, ``memory_gb``, ``step_s``, ``tflops_per_gpu`` and the parts (JSON)."""
        out: dict[str, Any] = asdict(self.layout)
        out["micro_batches"] = self.micro_batches
        out["memory_gb"] = round(sum(self.memory.values()) / GB, 3)
        out["memory_parts_gb"] = {k: round(v / GB, 3) for k, v in self.memory.items()}
        out["step_s"] = self.step_s
        out["time_parts_s"] = dict(self.time)
        out["tflops_per_gpu"] = round(self.tflops_per_gpu, 2)
        out["refused"] = self.refused
        return out


RESERVED = 2 * GB
"""Memory per GPU the planner leaves to the CUDA context, communication buffers and the
allocator's slack."""


def stage_layers(layers: int, pp: int) -> tuple[int, ...]:
    """The layers of each of ``pp`` pipeline stages, first to last: ``layers / pp`` each
    where that divides (Megatron-LM's split); else one more than ``layers // pp`` on every
    stage but as many as the remainder leaves short, which are the last stage (it also
    computes the logits), then the first (it holds the embedding), then those after it
    (they keep the most micro-batches in flight). BLOOM's 70 layers on 12 stages: 5, ten
    of 6, 5, as Megatron-LM's uneven first and last stages or DeepSpeed's split by
    parameters (the embeddings counted as layers) place them.

    Raises:
        ValueError: more stages than layers.
    """
    if not 1 <= pp <= layers:
        raise ValueError(f"{layers} layers do not fill pp={pp} stages")
    per, left = divmod(layers, pp)
    if not left:
        return (per,) * pp
    split = [per + 1] * pp
    for i in [pp - 1, *range(pp - 1)][: pp - left]:
        split[i] = per
    return tuple(split)


def _stage_params(model: GPT, lay: Layout, split: tuple[int, ...]) -> float:
    """Parameters one GPU of the heaviest stage holds (``split``: each stage's layers,
    :func:`stage_layers`): its layers' share, and the embeddings where the first stage holds
    them (the token embedding, its share, and the positions) and the last (the final norm,
    and the token embedding again where it is not the first: the output layer is tied to it)."""
    h = model.hidden
    layer = model.layer_params() / lay.tp
    tokens = model.vocab * h / lay.tp
    if lay.pp == 1:
        return split[0] * layer + tokens + model.seq * h + 2 * h
    return max(split[0] * layer + tokens + model.seq * h, split[-1] * layer + tokens + 2 * h, max(split) * layer)


def _states_bytes(phi: float, lay: Layout) -> dict[str, float]:
    d, z = lay.dp, lay.zero
    return {
        "parameters": 2 * phi / (d if z >= 3 else 1),
        "gradients": 2 * phi / (d if z >= 2 else 1),
        "optimizer": 12 * phi / (d if z >= 1 else 1),
    }


def _activation_bytes(model: GPT, lay: Layout, m: int, split: tuple[int, ...]) -> float:
    """Activation bytes one GPU of the heaviest stage keeps (Korthikanti et al., table 2): per
    layer and micro-batch ``s b h (10 + 24 / tp)`` for its linear layers, norms and dropouts
    (``34 s b h / tp`` split along the sequence) and ``5 a s² b / tp`` for the attention
    scores (none with selective recomputation; with flash attention only each row's fp32
    softmax statistic, ``4 a s b / tp``); ``2 s b h`` (over ``tp`` along the sequence) with
    full recomputation, and one layer's worth to recompute in."""
    s, b, h, a, t = model.seq, lay.micro_batch, model.hidden, model.heads, lay.tp
    linear = s * b * h * (34 / t if lay.sequence_parallel else 10 + 24 / t)
    scores = 4 * a * s * b / t if lay.flash_attention else 5 * a * s * s * b / t
    if lay.recompute:
        per_layer, working = 2 * s * b * h / (t if lay.sequence_parallel else 1), linear + scores
    else:
        per_layer, working = linear + (0 if lay.selective else scores), scores if lay.selective else 0
    p, v = lay.pp, lay.chunks
    if v > 1:  # equal chunks; the first stage keeps the most in flight
        kept = model.layers // p * min(m, p) * (1 + (p - 1) / (p * v))
    else:  # 1F1B: stage i keeps p - i micro-batches
        kept = max(n * min(m, p - i) for i, n in enumerate(split))
    logits = 2 * 4 * s * b * model.vocab / t  # fp32 logits and their gradient, last stage
    return kept * per_layer + working + logits


def _core_flops(model: GPT, micro_batch: int, tp: int) -> float:
    """FLOPs of one layer's attention core forward on one of ``tp`` GPUs: its two batched
    products, ``4 b s² h / tp``."""
    return 4 * micro_batch * model.seq * model.seq * model.hidden / tp


def _score_bytes(model: GPT, micro_batch: int, tp: int) -> float:
    """Bytes the attention scores' scale, mask, softmax and dropout move through memory in
    one layer's forward on one of ``tp`` GPUs: 9 a score."""
    return 9 * micro_batch * model.heads * model.seq * model.seq / tp


def _elementwise_bytes(
    model: GPT, micro_batch: int, tp: int, sequence_parallel: bool = False, flash_attention: bool = False
) -> float:
    """Bytes one layer's forward moves through memory on one GPU outside its matrix
    products: the attention scores' scale, mask, softmax and dropout (9 bytes per score,
    split over ``tp``; none with ``flash_attention``, whose kernel keeps them on the chip),
    bias and GeLU on the MLP's 4h (16 bytes per token and h, split), and the two layer
    norms, dropouts and residual adds (24, repeated on every ``tp`` rank but split along the
    sequence with ``sequence_parallel``)."""
    s, b, h, t = model.seq, micro_batch, model.hidden, tp
    scores = 0 if flash_attention else _score_bytes(model, b, t)
    return scores + b * s * h * (24 / (t if sequence_parallel else 1) + 16 / t)


def _layer_flops(model: GPT, micro_batch: int, tp: int, flash_attention: bool = False) -> float:
    """FLOPs of one layer's forward matrix products on one of ``tp`` GPUs:
    ``24 b s h² (1 + s / 6h) / tp``, of which the attention core's ``4 b s² h / tp``; flash
    attention's kernel skips the blocks the causal mask hides, half the core's."""
    core = _core_flops(model, micro_batch, tp)
    return 24 * micro_batch * model.seq * model.hidden**2 / tp + (core / 2 if flash_attention else core)


def layer_pass(
    model: GPT,
    micro_batch: int,
    tp: int,
    gpu: GPU,
    efficiency: float,
    sequence_parallel: bool = False,
    flash_attention: bool = False,
) -> float:
    """Seconds of one layer's forward on one of ``tp`` GPUs (a backward costs two): its
    matrix products, ``24 b s h² (1 + s / 6h) / tp`` FLOPs at ``efficiency`` of the GPU's
    peak (the attention core's causal half in flash attention's kernel), what moves through
    memory beside them at the GPU's memory bandwidth, and the GPU's ``overhead``."""
    flops = _layer_flops(model, micro_batch, tp, flash_attention)
    moved = _elementwise_bytes(model, micro_batch, tp, sequence_parallel, flash_attention)
    return flops / (efficiency * gpu.peak) + moved / gpu.hbm + gpu.overhead


def attention_core_pass(model: GPT, micro_batch: int, tp: int, gpu: GPU, efficiency: float) -> float:
    """Seconds of the attention core's forward on one of ``tp`` GPUs, which selective
    recomputation repeats: the two batched products ``4 b s² h / tp`` FLOPs and the scores'
    scale, mask, softmax and dropout (9 bytes per score)."""
    core = _core_flops(model, micro_batch, tp)
    return core / (efficiency * gpu.peak) + _score_bytes(model, micro_batch, tp) / gpu.hbm


def fit_compute(model: GPT, gpu: GPU, points: Sequence[tuple[int, int, float]]) -> GPU:
    """``gpu`` with the ``peak`` and ``overhead`` that make :func:`layer_pass` (at efficiency
    1) nearest the measured ``points``: ``(micro_batch, tp, seconds)`` of one layer's
    forward and backward on one GPU (or core), least squares in relative terms, as
    :func:`collectives.cost.fit` fits links. Its ``hbm`` is taken as given.

    Raises:
        ValueError: fewer than two points of different sizes, or a fit without a positive
            rate.
    """
    # seconds / 3 - elementwise / hbm = flops * (1 / peak) + overhead, each point weighed by 1 / seconds
    rows = []
    for b, t, seconds in points:
        flops = _layer_flops(model, b, t)
        rest = seconds / 3 - _elementwise_bytes(model, b, t) / gpu.hbm
        rows.append((flops / seconds, 1.0 / seconds, rest / seconds))
    if len({r[0] for r in rows}) < 2:
        raise ValueError("fit_compute needs points at two or more sizes")
    a11, a12, a22 = (sum(r[i] * r[j] for r in rows) for i, j in ((0, 0), (0, 1), (1, 1)))
    b1, b2 = (sum(r[i] * r[2] for r in rows) for i in (0, 1))
    det = a11 * a22 - a12 * a12
    inverse_peak, overhead = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if inverse_peak <= 0:
        raise ValueError(f"fit_compute: the points give no positive rate ({points})")
    return replace(gpu, peak=1.0 / inverse_peak, overhead=max(0.0, overhead))


class Placement(NamedTuple):
    """Where a layout's groups sit on nodes of ``gpus_per_node`` GPUs, ranks in Megatron-LM's
    order (tensor-parallel fastest, then data-parallel, then the pipeline's stages; as
    :class:`hpcdl.parallel.Grid` orders them): whether every tensor-parallel group is inside
    one node, the fewest ranks any data-parallel group has on a node it reaches, and
    whether every pipeline hop stays inside one node."""

    tp_inside: bool
    dp_per_node: int
    pp_inside: bool


@functools.lru_cache(maxsize=4096)
def placement(tp: int, dp: int, pp: int, gpus_per_node: int) -> Placement:
    """The :class:`Placement` of ``dp`` × ``tp`` × ``pp`` ranks on nodes of ``gpus_per_node``:
    a tensor-parallel group (consecutive ranks) stays inside a node where the whole job is
    one node or its size divides the node's; a pipeline hop (``tp × dp`` ranks) only where
    the whole job is one node; a data-parallel group (``tp`` ranks apart) counted rank by rank."""
    n, node = tp * dp * pp, gpus_per_node
    one = n <= node
    fewest = dp
    for first in range(0, n, tp * dp):  # each stage's block of ranks
        for lane in range(tp):
            counts = Counter((first + lane + tp * k) // node for k in range(dp))
            fewest = min(fewest, *counts.values())
    return Placement(tp_inside=one or node % tp == 0, dp_per_node=fewest, pp_inside=one)


def _dp_time(phi: float, lay: Layout, cl: Cluster, m: int, here: int) -> float:
    """The data-parallel traffic of a step: the gradients' allreduce over the ``dp``
    replicas once, by the fastest algorithm :func:`collectives.cost.allreduce_times` knows
    (the model ``auto`` chooses by across links), as ZeRO-1's reduce-scatter and allgather
    cost; ZeRO-2 reduce-scatters every micro-batch's gradients, and ZeRO-3 also allgathers
    the parameters for each micro-batch's forward and backward. ``here``: the fewest
    replicas of a group that share a node (:func:`placement`)."""
    d, nbytes = lay.dp, cl.word * phi
    if d < 2:
        return 0.0
    # the node's ports serve all its GPUs: this group gets its share of them
    ports = cl.nics_per_node * here / cl.gpus_per_node
    t = min(allreduce_times(nbytes, d, here, cl.intra, cl.inter, ports).values())
    halves = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[lay.zero]  # a reduce-scatter or allgather each
    return halves / 2 * (t + cl.call_overhead)


def estimate(model: GPT, batch: int, lay: Layout, cl: Cluster) -> Estimate:
    """Estimate ``lay`` for ``model`` at ``batch`` sequences per step on ``cl``.

    The pipeline's step is set by its slowest stage (the most layers, or the last one's
    fewer layers and the logits): its compute, tensor-parallel calls and sends, every
    micro-batch and again in the bubble.

    Raises:
        ValueError: a layout that does not divide the GPUs, the batch or the heads, with
            more stages than layers, or with chunks that do not split the layers evenly.
    """
    p, t, d, b, v = lay.pp, lay.tp, lay.dp, lay.micro_batch, lay.chunks
    if d * t * p != cl.gpus:
        raise ValueError(f"dp={d} x tp={t} x pp={p} = {d * t * p} != {cl.gpus} GPUs")
    if batch % (d * b):
        raise ValueError(f"batch {batch} is not a multiple of dp={d} x micro_batch={b}")
    if v > 1 and model.layers % (p * v):  # the interleaved schedule's chunks are equal
        raise ValueError(f"{model.layers} layers do not split into pp={p} x chunks={v}")
    if model.heads % t:
        raise ValueError(f"{model.heads} heads do not split over tp={t}")
    split = stage_layers(model.layers, p)
    m = batch // (d * b)
    s, h, gpu = model.seq, model.hidden, cl.gpu
    rate = cl.efficiency * gpu.peak
    share, call = cl.share(), cl.call_overhead
    sp = lay.sequence_parallel
    passes = 4 if lay.recompute else 3  # forward, (recomputed forward,) backward twice over
    one = passes * layer_pass(model, b, t, gpu, cl.efficiency, sp, lay.flash_attention)
    if lay.selective:
        one += attention_core_pass(model, b, t, gpu, cl.efficiency)
    if lay.flash_attention:  # its backward computes the scores again: QK^T's unmasked half
        one += _core_flops(model, b, t) / 4 / rate
    logits = 6 * b * s * h * model.vocab / t / rate
    slowest = max(range(p), key=lambda i: split[i] * one + (logits if i == p - 1 else 0.0))
    per, last = split[slowest], slowest == p - 1
    layers = per * one + (logits if last else 0.0)
    act = cl.word * b * s * h  # bytes of a micro-batch's activations
    where = placement(t, d, p, cl.gpus_per_node)
    tp_link = cl.intra if where.tp_inside else cl.inter_per_gpu()
    tp = 0.0
    if t > 1:  # each layer's; on the last stage the vocabulary-parallel head's input gradient and its loss's 3 sums
        # an allreduce, or along the sequence a reduce-scatter and an allgather: the same bytes in two calls,
        # and the backward gathers the two inputs of its column-parallel products again
        calls = (6 if lay.recompute else 4) + (1 if sp else 0)
        tp = per * calls * (ring_allreduce(tp_link, t, act) + (2 if sp else 1) * call)
        if last:
            tp += ring_allreduce(tp_link, t, act) + call + 3 * (ring_allreduce(tp_link, t, 4 * b * s) + call)
        if p == 1:  # and the vocabulary-parallel embedding's output, on the first stage
            tp += ring_allreduce(tp_link, t, act) + call
    pp_link = cl.intra if where.pp_inside else cl.inter_per_gpu()
    pp = 0.0 if p == 1 else 2 * v * (send_time(pp_link, act / t) + call)
    phi = _stage_params(model, lay, split)
    shard = phi / d if lay.zero >= 1 else phi
    optimizer = 28 * shard / gpu.hbm  # Adam: fp32 master, m, v and fp16 copies, read and written
    parts = {
        "compute": share * (m * layers + optimizer),
        "bubble": (p - 1) / v * (cl.contention * layers + tp + pp),
        "tp_comm": m * tp,
        "pp_comm": m * pp,
        "dp_comm": _dp_time(phi, lay, cl, m, where.dp_per_node),
    }
    step = sum(parts.values())
    memory = _states_bytes(phi, lay)
    memory["activations"] = _activation_bytes(model, lay, m, split)
    used = sum(memory.values())
    refused = None
    if used > gpu.memory - RESERVED:
        refused = f"out of memory: {used / GB:.1f} GB of {(gpu.memory - RESERVED) / GB:.0f} GB usable"
    elif m < p:
        refused = f"bubble: {m} micro-batches for {p} stages, the pipeline never fills"
    # Megatron-LM's count: the recomputed forward with full recomputation, nothing more with selective
    tflops = model.flops(batch, lay.recompute) / step / cl.gpus / 1e12
    return Estimate(
        layout=lay, micro_batches=m, memory=memory, time=parts, step_s=step, tflops_per_gpu=tflops, refused=refused
    )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


RECOMPUTATION = {"full": (True, False), "selective": (False, True), "none": (False, False)}
"""Activation recomputation by name: the ``(recompute, selective)`` of a :class:`Layout`."""


def recomputation_name(recompute: bool, selective: bool) -> str:
    """The name in :data:`RECOMPUTATION` of a layout's (or a ``--json`` row's) ``recompute``
    and ``selective``."""
    return next(k for k, v in RECOMPUTATION.items() if v == (recompute, selective))


def layouts(
    model: GPT,
    batch: int,
    cl: Cluster,
    *,
    tp: int | None = None,
    pp: int | None = None,
    micro_batch: int | None = None,
    zero: int | None = None,
    recompute: bool | str | None = None,
    chunks: int | None = None,
    sequence_parallel: bool | None = None,
    flash_attention: bool = False,
    skipped: list[str] | None = None,
) -> Iterator[Layout]:
    """Every layout that divides the GPUs, the batch and the heads, with no more pipeline
    stages than layers (where the stages do not divide the layers, some get one more:
    :func:`stage_layers`); the arguments given fix those parts (``recompute``: a name of
    :data:`RECOMPUTATION`, or True for full and False for none). ZeRO-2 and 3 only without
    pipeline stages (their gradients and parameters are sharded per micro-batch); chunks
    only where they split the layers evenly and the micro-batches are a multiple of the
    stages (Megatron-LM's conditions for its interleaved schedule); with and without
    sequence parallelism wherever ``tp`` > 1, unless ``sequence_parallel`` fixes it (with
    ``tp`` 1 there is nothing to split, as Megatron-LM turns it off); attention as
    ``flash_attention`` says, without selective recomputation. Where ``skipped`` is given,
    it gets why each combination tried does not divide or run."""
    skip = skipped.append if skipped is not None else (lambda _: None)
    if isinstance(recompute, bool):
        recompute = "full" if recompute else "none"
    if recompute is not None and recompute not in RECOMPUTATION:
        raise ValueError(f"recompute={recompute!r}: one of {', '.join(RECOMPUTATION)}")
    for t in [tp] if tp else [k for k in _divisors(cl.gpus) if model.heads % k == 0 and k <= 4 * cl.gpus_per_node]:
        if cl.gpus % t or model.heads % t:
            skip(f"tp={t} does not divide the {f'{cl.gpus} GPUs' if cl.gpus % t else f'{model.heads} heads'}")
            continue
        for p in [pp] if pp else [k for k in _divisors(cl.gpus // t) if k <= model.layers]:
            if cl.gpus % (t * p) or p > model.layers:
                skip(
                    f"tp={t} x pp={p} does not divide the {cl.gpus} GPUs"
                    if cl.gpus % (t * p)
                    else f"pp={p} stages for {model.layers} layers"
                )
                continue
            d = cl.gpus // (t * p)
            for b in [micro_batch] if micro_batch else [1, 2, 4, 8, 16]:
                if batch % (d * b):
                    skip(f"the batch of {batch} is not a multiple of dp={d} x micro_batch={b} (tp={t}, pp={p})")
                    continue
                for sp in [False] if t == 1 else [True, False] if sequence_parallel is None else [sequence_parallel]:
                    lay = Layout(dp=d, tp=t, pp=p, micro_batch=b, sequence_parallel=sp, flash_attention=flash_attention)
                    yield from _variants(model, lay, batch // (d * b), zero, recompute, chunks, skip)


def _variants(
    model: GPT,
    lay: Layout,
    m: int,
    zero: int | None,
    recompute: str | None,
    chunks: int | None,
    skip: Callable[[str], None],
) -> Iterator[Layout]:
    """``lay`` at each ZeRO stage, recomputation and chunks that run with ``m`` micro-batches
    (those given, or every one that does)."""
    p = lay.pp
    every = [1]
    if p > 1 and m % p == 0 and model.layers % p == 0:
        every += [v for v in _divisors(model.layers // p) if 1 < v <= 8]
    for z in [zero] if zero is not None else ([0, 1, 2, 3] if p == 1 else [0, 1]):
        for r, sel in [RECOMPUTATION[recompute]] if recompute is not None else RECOMPUTATION.values():
            if sel and lay.flash_attention:
                skip(_SELECTIVE_FLASH)
                continue
            for v in [chunks] if chunks else every:
                why = _chunks_refused(model, p, m, v)
                if why:
                    skip(why)
                    continue
                yield replace(lay, zero=z, recompute=r, selective=sel, chunks=v)


def _chunks_refused(model: GPT, p: int, m: int, v: int) -> str | None:
    """Why ``v`` chunks a stage cannot run (None: they can)."""
    if v == 1:
        return None
    if p == 1:
        return f"chunks={v} needs pipeline stages"
    if model.layers % (p * v):
        return f"pp={p} x chunks={v} does not divide the {model.layers} layers"
    if m % p:
        return f"chunks={v} needs micro-batches a multiple of pp={p}, not {m}"
    return None


def plan(model: GPT, batch: int, cl: Cluster, **fixed: Any) -> tuple[list[Estimate], list[Estimate]]:
    """(the layouts that fit, fastest first; the refused ones, fastest first)."""
    every = sorted((estimate(model, batch, lay, cl) for lay in layouts(model, batch, cl, **fixed)), key=_order)
    return [e for e in every if e.refused is None], [e for e in every if e.refused is not None]


def _order(e: Estimate) -> tuple[float, float]:
    return (e.step_s, sum(e.memory.values()))


def calibrate(model: GPT, batch: int, lay: Layout, cl: Cluster, tflops: float) -> float:
    """The compute efficiency at which ``lay`` runs at ``tflops`` per GPU on ``cl``.

    Raises:
        ValueError: not even matrix kernels at the GPU's peak reach ``tflops`` there.
    """

    def at(e: float) -> float:
        return estimate(model, batch, lay, replace(cl, efficiency=e)).tflops_per_gpu

    if at(1.0) < tflops:
        raise ValueError(f"{tflops} TFLOP/s per GPU is out of reach: at the GPU's peak the layout gives {at(1.0):.1f}")
    lo, hi = 1e-4, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < tflops else (lo, mid)
    return (lo + hi) / 2


def published(
    name: str,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    cl: Cluster,
    *,
    recompute: str = "full",
    sequence_parallel: bool = False,
) -> Estimate:
    """The estimate of a published run's layout (Megatron-LM's of 2021 by default: no ZeRO,
    full recomputation, no sequence parallelism) at the micro-batch and chunks that are
    fastest and fit, which the tables do not give.

    Raises:
        ValueError: no micro-batch and chunks fit.
    """
    ok, _ = plan(
        MODELS[name],
        batch,
        replace(cl, gpus=gpus),
        tp=tp,
        pp=pp,
        zero=0,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
    )
    if not ok:
        raise ValueError(f"{name}: no micro-batch fits tp={tp} pp={pp} on {gpus} GPUs with {recompute} recomputation")
    return ok[0]


def validate(anchor: str, cl: Cluster) -> list[dict[str, Any]]:
    """Megatron-LM's weak-scaling runs (:data:`MEGATRON_WEAK_SCALING`) against this model:
    calibrated on the run of model ``anchor``, each run's published and predicted TFLOP/s
    per GPU, and the step of the planner's own choice against the published layout's."""
    row = next((r for r in MEGATRON_WEAK_SCALING if r[0] == anchor), None)
    if row is None:
        raise ValueError(f"anchor {anchor!r}: one of {', '.join(r[0] for r in MEGATRON_WEAK_SCALING)}")
    name, tp, pp, gpus, batch, tflops = row
    cl = replace(
        cl, efficiency=calibrate(MODELS[name], batch, published(*row[:5], cl).layout, replace(cl, gpus=gpus), tflops)
    )
    out = []
    for name, tp, pp, gpus, batch, tflops in MEGATRON_WEAK_SCALING:
        theirs = published(name, tp, pp, gpus, batch, cl)
        ours = plan(MODELS[name], batch, replace(cl, gpus=gpus))[0][0]
        out.append(
            {
                "model": name,
                "efficiency": cl.efficiency,
                "published_tflops": tflops,
                "predicted_tflops": theirs.tflops_per_gpu,
                "error": theirs.tflops_per_gpu / tflops - 1,
                "published_step_s": theirs.step_s,
                "chosen": ours.row(),
            }
        )
    return out


def validate_recomputation(anchor: str, cl: Cluster) -> list[dict[str, Any]]:
    """Megatron-LM's runs with and without selective recomputation and sequence parallelism
    (:data:`MEGATRON_RECOMPUTATION`) against this model: calibrated on the selective run of
    model ``anchor``, each run's published and predicted step, both ways, at the micro-batch
    and chunks that are fastest and fit (the paper does not give them all)."""
    runs = {r[0]: r for r in MEGATRON_RECOMPUTATION}
    if anchor not in runs:
        raise ValueError(f"anchor {anchor!r}: one of {', '.join(runs)}")

    def fastest(name: str, way: str, at: Cluster) -> Estimate:  # both techniques, or neither
        return published(*runs[name][:5], at, recompute=way, sequence_parallel=way == "selective")

    name, _, _, gpus, batch, _, seconds = runs[anchor]
    tflops = MODELS[name].flops(batch, False) / seconds / gpus / 1e12
    lay = fastest(name, "selective", cl).layout
    cl = replace(cl, efficiency=calibrate(MODELS[name], batch, lay, replace(cl, gpus=gpus), tflops))
    out = []
    for name, *_, full_s, selective_s in MEGATRON_RECOMPUTATION:
        for way, seconds in (("full", full_s), ("selective", selective_s)):
            e = fastest(name, way, cl)
            out.append(
                {
                    "model": name,
                    "recompute": way,
                    "efficiency": cl.efficiency,
                    "published_step_s": seconds,
                    "predicted_step_s": e.step_s,
                    "error": e.step_s / seconds - 1,
                    "layout": e.row(),
                }
            )
    return out


# -- the command ---------------------------------------------------------------------------
def _link(text: str, what: str, ranks: int = 8) -> AlphaBeta:
    """A link by name or α-β; the link a node report's measured allreduce implies; or a
    tuning table's measured node path for ``ranks`` ranks (``python -m collectives.tune``)."""
    if text.endswith(".json"):
        with open(text) as fh:
            report = json.load(fh)
        if isinstance(report, dict) and report.get("node_paths"):
            return node_path(report, ranks)
        entries = report.get("pipeline") if isinstance(report, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            model = entry.get("tp_models", {}).get("allreduce") if isinstance(entry, dict) else None
            if model:  # measured on the tensor-parallel group of the grid dp x tp x pp
                ranks = int(str(entry.get("grid", "1x2x1")).split()[0].split("x")[1])
                return link_from_allreduce(AlphaBeta(model["alpha_s"], model["beta_Bps"]), ranks)
        raise ValueError(f"{what} {text}: the node report holds no measured allreduce (run its pipeline step)")
    return parse_link(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdl.plan",
        description="Rank the DP x TP x PP x ZeRO layouts of a GPT on N GPUs by estimated step time.",
    )
    p.add_argument("--model", choices=sorted(MODELS), help="a named GPT (or give its sizes below)")
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--global-batch", type=int, help="sequences per step")
    p.add_argument("--gpus", type=int)
    p.add_argument("--gpu", choices=sorted(GPUS), default="a100")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--intra",
        help="link inside a node: a name, 'latency=..,bandwidth=..', a node report's report.json or a tuning table "
        "(python -m collectives.tune --out T.json)",
    )
    p.add_argument("--inter", default="ib-hdr", help="port between nodes: a name or 'latency=..,bandwidth=..'")
    p.add_argument("--nics-per-node", type=int, help="ports per node (default: one per GPU)")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    p.add_argument(
        "--recompute",
        choices=["full", "selective", "none", "no", "yes"],
        help="activation recomputation: the whole forward (full, or yes), the attention core's alone (selective), "
        "none (or no)",
    )
    p.add_argument(
        "--sequence-parallel",
        choices=["yes", "no"],
        help="split the layer norms and dropouts along the sequence where tp > 1 (default: both are tried)",
    )
    p.add_argument("--chunks", type=int, help="model chunks per stage (the interleaved schedule; 1: plain 1F1B)")
    p.add_argument(
        "--attention",
        choices=["plain", "flash"],
        default="plain",
        help="the attention core: its scores through memory (plain), or kept on the chip (flash)",
    )
    p.add_argument("--compute-efficiency", type=float, default=0.5, help="fraction of peak the matrix kernels reach")
    p.add_argument("--measured-tflops", type=float, help="calibrate the efficiency on this layout's measured TFLOP/s")
    p.add_argument("--tokens", type=float, help="tokens to train on: each row also gives the days it takes")
    p.add_argument("--top", type=int, default=10, help="rows in the table")
    p.add_argument("--json", action="store_true", help="print the rows as JSON, best first")
    p.add_argument("--plot", type=output_file, help="write the step breakdown of the best rows to this SVG file")
    p.add_argument(
        "--validate",
        metavar="ANCHOR",
        nargs="?",
        const="gpt-146b",
        help="instead: calibrate on Megatron-LM's published run of model ANCHOR (default gpt-146b) and "
        "predict its other weak-scaling runs",
    )
    p.add_argument(
        "--validate-recompute",
        metavar="ANCHOR",
        nargs="?",
        const="gpt3-175b",
        help="instead: calibrate on Megatron-LM's run of model ANCHOR (default gpt3-175b) with selective "
        "recomputation and sequence parallelism, and predict its other runs with and without them",
    )
    return p


def _validation(anchor: str, as_json: bool, p: argparse.ArgumentParser, recomputation: bool = False) -> int:
    cl = Cluster(gpus=8, gpu=GPUS["a100"], intra=parse_link("nvlink3"), inter=parse_link("ib-hdr"))
    try:
        rows = (validate_recomputation if recomputation else validate)(anchor, cl)
    except ValueError as exc:
        p.error(str(exc))
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    if recomputation:
        print(f"# calibrated on {anchor}, selective: compute efficiency {rows[0]['efficiency']:.3f} of the A100's peak")
        print(
            f"{'model':<10} {'recompute':<9} {'published s':>11} {'predicted s':>11} {'error':>7}  micro_batch chunks"
        )
        for r in rows:
            c = r["layout"]
            print(
                f"{r['model']:<10} {r['recompute']:<9} {r['published_step_s']:>11.2f} {r['predicted_step_s']:>11.2f} "
                f"{r['error']:>+7.1%}  {c['micro_batch']:>11} {c['chunks']:>6}"
            )
        return 0
    print(f"# calibrated on {anchor}: compute efficiency {rows[0]['efficiency']:.3f} of the A100's peak")
    print(
        f"{'model':<10} {'published':>9} {'predicted':>9} {'error':>7}  "
        "planner's choice (its step / the published layout's)"
    )
    for r in rows:
        c = r["chosen"]
        print(
            f"{r['model']:<10} {r['published_tflops']:>9.0f} {r['predicted_tflops']:>9.1f} {r['error']:>+7.1%}  "
            f"{Layout(**{f.name: c[f.name] for f in fields(Layout)}).describe()} "
            f"({c['step_s'] / r['published_step_s']:.2f})"
        )
    return 0


def _model(a: argparse.Namespace, p: argparse.ArgumentParser) -> GPT:
    sizes = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "seq", "vocab")}
    base = MODELS[a.model] if a.model else None
    if base is None and None in sizes.values():
        p.error("give --model or all of --layers --hidden --heads --seq --vocab")
    given = {k: v for k, v in sizes.items() if v is not None}
    try:
        return replace(base, **given) if base else GPT(**given)
    except ValueError as exc:
        p.error(str(exc))
        raise


def train_days(step_s: float, batch: int, seq: int, tokens: float) -> float:
    """Days to train on ``tokens`` tokens at ``batch`` sequences of ``seq`` tokens a step of
    ``step_s`` seconds."""
    return tokens / (batch * seq) * step_s / 86400


def _table(rows: Sequence[Estimate], top: int, days: Callable[[float], float] | None = None) -> list[str]:
    days_head = "" if days is None else f" {'days':>7}"
    head = (
        f"{'dp':>4} {'tp':>3} {'pp':>3} {'mb':>3} {'m':>5} {'zero':>4} {'recompute':>9} {'sp':>3} {'chk':>3} "
        f"{'mem GB':>7} {'step s':>8} {'TFLOP/s':>8}{days_head}  {'compute':>7} {'bubble':>6} {'tp':>5} {'pp':>5} "
        f"{'dp':>5}"
    )
    lines = [head]
    for e in rows[:top]:
        lay, tm = e.layout, e.time
        share = {k: tm[k] / e.step_s for k in tm}
        lines.append(
            f"{lay.dp:>4} {lay.tp:>3} {lay.pp:>3} {lay.micro_batch:>3} {e.micro_batches:>5} {lay.zero:>4} "
            f"{lay.recomputation():>9} {'yes' if lay.sequence_parallel else 'no':>3} {lay.chunks:>3} "
            f"{sum(e.memory.values()) / GB:>7.1f} {e.step_s:>8.3f} {e.tflops_per_gpu:>8.1f}"
            f"{'' if days is None else f' {days(e.step_s):>7.1f}'}  {share['compute']:>7.0%} {share['bubble']:>6.0%} "
            f"{share['tp_comm']:>5.0%} {share['pp_comm']:>5.0%} {share['dp_comm']:>5.0%}"
        )
    return lines


def _short(lay: Layout) -> str:
    return {"full": "rc", "selective": "sel", "none": ""}[lay.recomputation()] + (
        " sp" if lay.sequence_parallel else ""
    )


def _svg(rows: Sequence[Estimate], path: str) -> None:
    parts = [("compute", "#4c72b0"), ("bubble", "#dd8452"), ("tp_comm", "#55a868"), ("pp_comm", "#8172b3")]
    parts.append(("dp_comm", "#c44e52"))
    width, bar, left = 720, 22, 210
    longest = max(e.step_s for e in rows)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{40 + bar * len(rows) + 30}" '
        'font-family="sans-serif" font-size="11">',
        '<text x="4" y="14">step time by part (s); best layouts first</text>',
    ]
    for i, e in enumerate(rows):
        y, x, lay = 24 + i * bar, float(left), e.layout
        label = f"dp{lay.dp} tp{lay.tp} pp{lay.pp} mb{lay.micro_batch} z{lay.zero} {_short(lay)}"
        out.append(f'<text x="4" y="{y + 15}">{label} v{lay.chunks}</text>')
        for name, color in parts:
            w = e.time[name] / longest * (width - left - 70)
            out.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{bar - 6}" fill="{color}"/>')
            x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + 15}">{e.step_s:.2f}</text>')
    y = 34 + bar * len(rows)
    for k, (name, color) in enumerate(parts):
        out.append(f'<rect x="{4 + k * 110}" y="{y}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{18 + k * 110}" y="{y + 9}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as fh:
        fh.write("\n".join(out) + "\n")


def _undivided(a: argparse.Namespace, skipped: list[str]) -> str:
    """Why no layout divides: the distinct reasons, the first five."""
    reasons = list(dict.fromkeys(skipped))
    more = f"; and {len(reasons) - 5} more" if len(reasons) > 5 else ""
    return (
        f"no layout divides the {a.gpus} GPUs, the batch of {a.global_batch} and the model's heads with the "
        f"parts given: {'; '.join(reasons[:5]) or 'none to try'}{more}"
    )


def _calibrated(a: argparse.Namespace, p: argparse.ArgumentParser, model: GPT, cl: Cluster, fixed: dict) -> Cluster:
    """``cl`` at the efficiency that gives ``--measured-tflops`` on the fastest layout that
    fits with the parts given (which must name the layout), said on stderr."""
    if None in (a.tp, a.pp, a.micro_batch):
        p.error("--measured-tflops needs the measured layout: --tp, --pp and --micro-batch")
    skipped: list[str] = []
    fits, refused = plan(model, a.global_batch, cl, skipped=skipped, **fixed)
    if not fits:
        p.error(f"--measured-tflops: {'no layout with the parts given fits' if refused else _undivided(a, skipped)}")
    try:
        cl = replace(cl, efficiency=calibrate(model, a.global_batch, fits[0].layout, cl, a.measured_tflops))
    except ValueError as exc:
        p.error(str(exc))
    lay = fits[0].layout
    print(
        f"# compute efficiency {cl.efficiency:.3f} of peak gives {a.measured_tflops} TFLOP/s per GPU "
        f"at {lay.describe()}",
        file=sys.stderr,
    )
    return cl


def _check_sizes(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Exit 2 with the reason on sizes that cannot be, and on flags that contradict each other."""
    if a.gpus < 1 or a.global_batch < 1 or a.gpus_per_node < 1:
        p.error("--gpus, --global-batch and --gpus-per-node must be positive")
    if a.tokens is not None and not (math.isfinite(a.tokens) and a.tokens > 0):
        p.error(f"--tokens {a.tokens:g}: must be a finite positive number")
    for name in ("tp", "pp", "micro_batch", "chunks", "nics_per_node", "top"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least 1")
    if not (math.isfinite(a.compute_efficiency) and 0 < a.compute_efficiency <= 1):
        p.error(f"--compute-efficiency {a.compute_efficiency:g}: must lie in (0, 1], a fraction of the GPU's peak")
    if a.sequence_parallel == "yes" and a.tp == 1:
        p.error("--sequence-parallel yes needs --tp > 1: with one rank a group there is nothing to split")


def main(argv: Sequence[str] | None = None) -> int:
    """The command: parse, plan, print (a table, or ``--json``); 0, or 2 on bad input."""
    p = _parser()
    a = p.parse_args(argv)
    if a.validate and a.validate_recompute:
        p.error("--validate and --validate-recompute: one at a time")
    if a.validate:
        return _validation(a.validate, a.json, p)
    if a.validate_recompute:
        return _validation(a.validate_recompute, a.json, p, recomputation=True)
    if a.global_batch is None or a.gpus is None:
        p.error("--global-batch and --gpus are required")
    model = _model(a, p)
    _check_sizes(a, p)
    gpu = GPUS[a.gpu]
    try:
        intra = _link(a.intra or gpu.intra, "--intra", a.gpus_per_node)
        inter = _link(a.inter, "--inter")
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    cl = Cluster(
        gpus=a.gpus,
        gpu=gpu,
        gpus_per_node=a.gpus_per_node,
        intra=intra,
        inter=inter,
        nics_per_node=a.nics_per_node or a.gpus_per_node,
        efficiency=a.compute_efficiency,
    )
    fixed: dict[str, Any] = {"tp": a.tp, "pp": a.pp, "micro_batch": a.micro_batch, "zero": a.zero}
    fixed["recompute"] = {"yes": "full", "no": "none"}.get(a.recompute, a.recompute)
    fixed["sequence_parallel"] = None if a.sequence_parallel is None else a.sequence_parallel == "yes"
    fixed["flash_attention"] = a.attention == "flash"
    fixed["chunks"] = a.chunks
    if a.measured_tflops is not None:
        cl = _calibrated(a, p, model, cl, fixed)
    skipped: list[str] = []
    ok, refused = plan(model, a.global_batch, cl, skipped=skipped, **fixed)
    if a.plot and ok:
        _svg(ok[: min(a.top, 12)], a.plot)
    days = None if a.tokens is None else (lambda step: train_days(step, a.global_batch, model.seq, a.tokens))
    if a.json:  # the rows on stdout; why none fits, if none does, on stderr
        if not ok:
            print("\n".join(_refusals(refused)) if refused else _undivided(a, skipped), file=sys.stderr)
        rows = [e.row() for e in ok]
        for r in rows if days else []:
            r["train_days"] = round(days(r["step_s"]), 3)
        print(json.dumps(rows, indent=1))
        return 0 if ok else 1
    print(
        f"# GPT of {model.params() / 1e9:.2f}B parameters ({model.layers} layers, hidden {model.hidden}, "
        f"{model.heads} heads, seq {model.seq}, vocab {model.vocab}), batch {a.global_batch}, {a.gpus} x {gpu.name}, "
        f"{cl.gpus_per_node} per node, efficiency {cl.efficiency:.3f}{', flash attention' * fixed['flash_attention']}"
    )
    if ok:
        print("\n".join(_table(ok, a.top, days)))
    if refused:
        print("\n".join(_refusals(refused, fits=bool(ok))))
    elif not ok:  # not one layout to estimate: say what does not divide
        print(_undivided(a, skipped))
    return 0 if ok else 1


def _refusals(refused: list[Estimate], fits: bool = False) -> list[str]:
    """Why the fastest refused layouts cannot run (after "no layout fits" where none does),
    and, where none fits, of those out of memory the one that comes closest (the least
    memory per GPU)."""
    shown = refused[:5]
    short = [e for e in refused if e.refused.startswith("out of memory")]
    closest = None if fits or not short else min(short, key=lambda e: sum(e.memory.values()))
    lines = [] if fits else ["no layout fits"]
    for e in shown + ([] if closest is None or any(e is closest for e in shown) else [closest]):
        lines.append(
            f"{'refused' if e is not closest else 'closest to fitting'} {e.layout.describe()} "
            f"({e.step_s:.3f} s): {e.refused}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
