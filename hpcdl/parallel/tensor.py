"""Tensor-parallel layers, Megatron-LM style (Shoeybi et al., 2019), over a :class:`Grid`'s
TP group.

Each rank holds the contiguous slice of the dense weight its TP rank owns: rows of
``weight`` and ``bias`` for :class:`ColumnParallelLinear`, columns of ``weight`` for
:class:`RowParallelLinear` (whose ``bias`` is whole), rows of the table for
:class:`VocabParallelEmbedding`. A layer built from a seed draws the dense layer's initial
values with the same random numbers a dense ``nn.Linear``/``nn.Embedding`` would, then keeps
its slice, so a tensor-parallel model and its dense twin start equal; ``from_dense`` slices
an existing layer.

With ``sequence_parallel=True`` (Korthikanti et al., 2022) the linear layers, the MLP and
the attention take and give this rank's chunk of the sequence (dimension 1 of (batch,
sequence, features)) instead of the whole activation: a column-parallel input is gathered
along the sequence instead of copied, and a row-parallel output reduce-scattered along it
instead of summed, so the activations between the blocks (LayerNorm, residual) are split
over the TP ranks too. The parameters used on the chunks then get partial gradients: see
:func:`~hpcdl.parallel.allreduce_sequence_parallel_grads`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HpcdlArgumentError
from .grid import Grid, current_grid
from .tp_comm import (
    copy_to_tp,
    gather_from_tp,
    gather_seq_from_tp,
    reduce_from_tp,
    reduce_scatter_seq_to_tp,
    scatter_to_tp,
    tp_max,
    tp_sum,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "ParallelMLP",
    "ParallelSelfAttention",
]


def _share(total: int, grid: Grid, what: str) -> tuple[int, int]:
    """This TP rank's [start, end) of ``total`` items, which the TP size must divide."""
    if total % grid.tp:
        raise HpcdlArgumentError(f"{what}={total} must divide by the tensor-parallel size tp={grid.tp}")
    k = total // grid.tp
    return grid.tp_rank * k, (grid.tp_rank + 1) * k


def _bare(cls: type[nn.Module]) -> nn.Module:
    """An instance of ``cls`` with ``nn.Module``'s state set up but without running its
    ``__init__``, which would draw fresh weights: ``from_dense`` adopts existing ones."""
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    return obj


def _check_input_is_parallel(input_is_parallel: bool, sequence_parallel: bool) -> None:
    """A sequence-parallel :class:`RowParallelLinear` takes the features already split."""
    if sequence_parallel and not input_is_parallel:
        raise HpcdlArgumentError(
            "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True: its input is the "
            "tensor-parallel region's (the whole sequence, this rank's slice of the features, e.g. a "
            "ColumnParallelLinear's output), not a whole activation"
        )


def _check_gather_output(gather_output: bool, sequence_parallel: bool) -> None:
    """A sequence-parallel :class:`ColumnParallelLinear` keeps its output features split."""
    if gather_output and sequence_parallel:
        raise HpcdlArgumentError(
            "ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True: the "
            "output would be the whole sequence with every feature, the same on every rank, which is neither "
            "the tensor-parallel nor the sequence-parallel layout; follow the layer with a "
            "RowParallelLinear(sequence_parallel=True) instead"
        )


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s rows (the output features) split over the TP ranks.

    The input is whole on every rank; the output is this rank's slice of the features, or
    (``gather_output=True``) all of them. With ``sequence_parallel=True`` the input is this
    rank's chunk of the sequence, gathered along the sequence here; the output is the whole
    sequence with this rank's slice of the features.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        grid: Grid | None = None,
        dtype: torch.dtype | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        grid = grid or current_grid()
        _share(out_features, grid, "out_features")
        _check_gather_output(gather_output, sequence_parallel)
        self._adopt(
            nn.Linear(in_features, out_features, bias=bias, dtype=dtype), gather_output, grid, sequence_parallel
        )

    @classmethod
    def from_dense(
        cls, linear: nn.Linear, gather_output: bool = False, grid: Grid | None = None, sequence_parallel: bool = False
    ):
        """This rank's slice of ``linear``."""
        obj = _bare(cls)
        obj._adopt(linear, gather_output, grid or current_grid(), sequence_parallel)
        return obj

    def _adopt(self, dense: nn.Linear, gather_output: bool, grid: Grid, sequence_parallel: bool = False) -> None:
        _check_gather_output(gather_output, sequence_parallel)
        lo, hi = _share(dense.out_features, grid, "out_features")
        self.start, self.end = lo, hi  # the output features this rank holds
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.gather_output, self.group = gather_output, grid.tp_group
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(dense.weight.detach()[lo:hi].clone())
        self.bias = nn.Parameter(dense.bias.detach()[lo:hi].clone()) if dense.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_seq_from_tp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s columns (the input features) split over the TP ranks:
    each rank multiplies its slice of the input and the partial results are summed; the
    bias, whole on every rank, is added after the sum.

    The input is this rank's slice of the features (``input_is_parallel=True``, e.g. a
    :class:`ColumnParallelLinear`'s output) or whole (then split here). With
    ``sequence_parallel=True`` (which needs ``input_is_parallel=True``) the partial results
    are reduce-scattered along the sequence instead of summed, so the output is this rank's
    chunk of the sequence, and the bias, added to the chunk, is marked ``sequence_parallel``
    (its gradient is partial: see :func:`~hpcdl.parallel.allreduce_sequence_parallel_grads`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        grid: Grid | None = None,
        dtype: torch.dtype | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        grid = grid or current_grid()
        _share(in_features, grid, "in_features")
        _check_input_is_parallel(input_is_parallel, sequence_parallel)
        self._adopt(
            nn.Linear(in_features, out_features, bias=bias, dtype=dtype), input_is_parallel, grid, sequence_parallel
        )

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        input_is_parallel: bool = True,
        grid: Grid | None = None,
        sequence_parallel: bool = False,
    ):
        """This rank's slice of ``linear``."""
        obj = _bare(cls)
        obj._adopt(linear, input_is_parallel, grid or current_grid(), sequence_parallel)
        return obj

    def _adopt(self, dense: nn.Linear, input_is_parallel: bool, grid: Grid, sequence_parallel: bool = False) -> None:
        _check_input_is_parallel(input_is_parallel, sequence_parallel)
        lo, hi = _share(dense.in_features, grid, "in_features")
        self.start, self.end = lo, hi  # the input features this rank holds
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.input_is_parallel, self.group = input_is_parallel, grid.tp_group
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(dense.weight.detach()[:, lo:hi].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone()) if dense.bias is not None else None
        if sequence_parallel and self.bias is not None:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = reduce_scatter_seq_to_tp(F.linear(x, self.weight), self.group)
            return y + self.bias if self.bias is not None else y
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split over the TP ranks: each rank
    looks up the ids in its range (zeros for the others) and the ranks' rows are summed."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, grid: Grid | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        grid = grid or current_grid()
        _share(num_embeddings, grid, "num_embeddings")
        self._adopt(nn.Embedding(num_embeddings, embedding_dim, dtype=dtype), grid)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, grid: Grid | None = None):
        """This rank's rows of ``embedding``."""
        obj = _bare(cls)
        obj._adopt(embedding, grid or current_grid())
        return obj

    def _adopt(self, dense: nn.Embedding, grid: Grid) -> None:
        self.start, self.end = _share(dense.num_embeddings, grid, "num_embeddings")
        self.num_embeddings, self.embedding_dim = dense.num_embeddings, dense.embedding_dim
        self.group = grid.tp_group
        self.weight = nn.Parameter(dense.weight.detach()[self.start : self.end].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.start)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary: the maximum, the target's logit
    and the sum of exponentials are reduced over the TP ranks as three small allreduces, so
    no rank ever holds the full logits."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        shifted = logits - tp_max(logits.max(dim=-1).values, group).unsqueeze(-1)
        vocab = logits.shape[-1]
        outside = (target < start) | (target >= start + vocab)
        local = torch.where(outside, torch.zeros_like(target), target - start)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = tp_sum(picked, group)
        exp = shifted.exp()
        total = tp_sum(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        hit = (~outside).to(g.dtype)
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, grid: Grid | None = None) -> torch.Tensor:
    """The per-item cross-entropy of ``target`` (vocabulary ids) under ``logits`` whose last
    dimension is this TP rank's slice of the vocabulary (a :class:`ColumnParallelLinear`
    head without ``gather_output``); equal to ``F.cross_entropy(full_logits, target,
    reduction="none")``."""
    grid = grid or current_grid()
    start = grid.tp_rank * logits.shape[-1]
    if grid.tp == 1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(
            target.shape
        )
    return _VocabParallelCrossEntropy.apply(logits, target, start, grid.tp_group)


class ParallelMLP(nn.Module):
    """A transformer's MLP, ``fc2(gelu(fc1(x)))``: ``fc1`` column-parallel, ``fc2``
    row-parallel, so the hidden activations never leave their rank and one allreduce
    finishes the block. With ``sequence_parallel=True`` the input and the output are this
    rank's chunk of the sequence (an allgather starts the block, a reduce-scatter ends it)."""

    def __init__(
        self,
        d_model: int,
        hidden: int | None = None,
        grid: Grid | None = None,
        dtype: torch.dtype | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        grid = grid or current_grid()
        hidden = hidden or 4 * d_model
        sp = sequence_parallel
        self.fc1 = ColumnParallelLinear(d_model, hidden, grid=grid, dtype=dtype, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(hidden, d_model, grid=grid, dtype=dtype, sequence_parallel=sp)

    @classmethod
    def from_dense(cls, mlp: nn.Sequential, grid: Grid | None = None, sequence_parallel: bool = False):
        """This rank's part of ``nn.Sequential(nn.Linear, nn.GELU(), nn.Linear)``."""
        first, act, second = list(mlp)
        if not (isinstance(first, nn.Linear) and isinstance(act, nn.GELU) and isinstance(second, nn.Linear)):
            raise HpcdlArgumentError("ParallelMLP.from_dense takes nn.Sequential(nn.Linear, nn.GELU(), nn.Linear)")
        obj = _bare(cls)
        obj.fc1 = ColumnParallelLinear.from_dense(first, grid=grid, sequence_parallel=sequence_parallel)
        obj.fc2 = RowParallelLinear.from_dense(second, grid=grid, sequence_parallel=sequence_parallel)
        return obj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with the heads split over the TP ranks: the fused
    ``qkv`` projection is column-parallel by head (each rank keeps the query, key and value
    rows of its heads), attention runs on the local heads, and the output projection is
    row-parallel, so one allreduce finishes the block.

    The dense layout it slices is ``hpcdl.train``'s GPT block's: ``qkv`` (``d -> 3d``,
    output viewed as (3, heads, head size)) and ``proj`` (``d -> d``).

    With ``sequence_parallel=True`` the input and the output are this rank's chunk of the
    sequence: the input is gathered along the sequence (attention needs all of it) and the
    output projection reduce-scatters its result along it.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        dropout: float = 0.0,
        grid: Grid | None = None,
        dtype: torch.dtype | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        qkv = nn.Linear(d_model, 3 * d_model, dtype=dtype)
        proj = nn.Linear(d_model, d_model, dtype=dtype)
        self._adopt(qkv, proj, n_head, dropout, grid or current_grid(), sequence_parallel)

    @classmethod
    def from_dense(
        cls,
        qkv: nn.Linear,
        proj: nn.Linear,
        n_head: int,
        dropout: float = 0.0,
        grid: Grid | None = None,
        sequence_parallel: bool = False,
    ):
        """This rank's heads of the dense ``qkv`` and ``proj`` projections."""
        obj = _bare(cls)
        obj._adopt(qkv, proj, n_head, dropout, grid or current_grid(), sequence_parallel)
        return obj

    def _adopt(
        self,
        qkv: nn.Linear,
        proj: nn.Linear,
        n_head: int,
        dropout: float,
        grid: Grid,
        sequence_parallel: bool = False,
    ) -> None:
        d = proj.in_features
        if d % n_head:
            raise HpcdlArgumentError(f"d_model={d} must divide by n_head={n_head}")
        h0, h1 = _share(n_head, grid, "n_head")
        hd = d // n_head
        rows = torch.cat([torch.arange(p * d + h0 * hd, p * d + h1 * hd) for p in range(3)])
        self.qkv_rows = rows  # the rows of the dense qkv projection this rank holds
        self.local_heads, self.head_size, self.dropout = h1 - h0, hd, dropout
        self.group, self.sequence_parallel = grid.tp_group, sequence_parallel
        self.qkv_weight = nn.Parameter(qkv.weight.detach()[rows].clone())
        self.qkv_bias = nn.Parameter(qkv.bias.detach()[rows].clone())
        # the attention output's features are head-major, so this rank's heads are its
        # contiguous slice of proj's input columns
        self.proj = RowParallelLinear.from_dense(proj, grid=grid, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_seq_from_tp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        b, t, _ = x.shape
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.view(b, t, 3, self.local_heads, self.head_size).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(a.transpose(1, 2).reshape(b, t, self.local_heads * self.head_size))
