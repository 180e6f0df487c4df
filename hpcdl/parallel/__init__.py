"""Model parallelism on a DP x TP x PP rank grid: :class:`Grid`, the tensor-parallel layers
(Megatron-LM style, with optional sequence parallelism) and :class:`Pipeline` (GPipe and
1F1B schedules)."""

from __future__ import annotations

from .grid import Grid, current_grid
from .pipeline import Pipeline, balance_by_parameters, balance_by_time
from .tensor import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from .tp_comm import (
    allreduce_sequence_parallel_grads,
    copy_to_tp,
    gather_from_tp,
    gather_seq_from_tp,
    mark_sequence_parallel,
    reduce_from_tp,
    reduce_scatter_seq_to_tp,
    scatter_seq_to_tp,
    scatter_to_tp,
)

__all__ = [
    "Grid",
    "current_grid",
    "Pipeline",
    "balance_by_parameters",
    "balance_by_time",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "ParallelMLP",
    "ParallelSelfAttention",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "scatter_seq_to_tp",
    "gather_seq_from_tp",
    "reduce_scatter_seq_to_tp",
    "mark_sequence_parallel",
    "allreduce_sequence_parallel_grads",
]
