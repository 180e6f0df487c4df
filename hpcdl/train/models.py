"""The models ``hpcdl.train`` trains: two digit classifiers and a small byte-level GPT, and
the GPT cut over a tensor- and pipeline-parallel grid (:func:`parallel_gpt`)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcdl.parallel import (
    ColumnParallelLinear,
    Grid,
    ParallelMLP,
    ParallelSelfAttention,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    scatter_seq_to_tp,
    vocab_parallel_cross_entropy,
)
from hpcdl.parallel.dense import Slice, tp_slices

__all__ = ["DigitsMLP", "DigitsCNN", "GPT", "parallel_gpt", "parallel_gpt_loss", "wide"]


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is half precision (losses are summed in float32 or wider)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class DigitsMLP(nn.Sequential):
    """64 pixels -> 256 -> 256 -> 10 classes."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


class DigitsCNN(nn.Sequential):
    """1x8x8 image -> two 3x3 convolutions (32, 64 channels) -> 2x2 pooling -> 128 -> 10."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x-wide GELU MLP."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A decoder-only transformer over bytes (vocabulary 256) with learned positions.

    ``activation_checkpointing`` recomputes each block's activations in backward instead of
    keeping them (less memory, one more forward per block).
    """

    def __init__(
        self,
        block_size: int,
        n_layer: int,
        n_head: int,
        d_model: int,
        dropout: float = 0.0,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.activation_checkpointing = activation_checkpointing
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln(x))

    @torch.no_grad()
    def generate(self, prompt: bytes, n: int) -> bytes:
        """Greedy continuation of ``prompt`` by ``n`` bytes."""
        idx = torch.tensor([list(prompt) or [10]], dtype=torch.long, device=self.head.weight.device)
        for _ in range(n):
            logits = self(idx[:, -self.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return bytes(idx[0, len(prompt) :].tolist())


# -- the GPT over a grid ------------------------------------------------------------------------
def _slices(module: nn.Module, local: str, dense: str) -> dict[str, Slice]:
    """The slices of submodule ``local`` (a prefix of its parameter names), cut from the
    dense GPT's module at ``dense`` (:func:`~hpcdl.parallel.dense.tp_slices`: a replicated
    module's parameters are whole)."""
    return {local + k: v for k, v in tp_slices(module, dense).items()}


class GPTInput(nn.Module):
    """The GPT's embeddings: the token table split by vocabulary over the TP ranks, the
    positions replicated (with sequence parallelism, the output is this rank's part of the
    sequence)."""

    def __init__(self, gpt: GPT, grid: Grid, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tok = VocabParallelEmbedding.from_dense(gpt.tok, grid=grid)
        self.pos = copy.deepcopy(gpt.pos)
        self.drop = nn.Dropout(gpt.drop.p)
        self.sequence_parallel, self.group = sequence_parallel, grid.tp_group

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        if self.sequence_parallel:
            x = scatter_seq_to_tp(x, self.group)
        return self.drop(x)

    def dense_slices(self) -> dict[str, Slice]:
        return {**_slices(self.tok, "tok.", "tok."), **_slices(self.pos, "pos.", "pos.")}


class ParallelBlock(nn.Module):
    """Transformer block ``index`` of the GPT with its attention heads and MLP split over
    the TP ranks (Megatron-LM): layer norms replicated (or, with sequence parallelism, run
    on this rank's part of the sequence), one allreduce after the attention and one after
    the MLP (a reduce-scatter each with sequence parallelism)."""

    def __init__(
        self, block: nn.Module, index: int, grid: Grid, sequence_parallel: bool = False, checkpointing: bool = False
    ) -> None:
        super().__init__()
        self.index, self.checkpointing = index, checkpointing
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        sp = {"sequence_parallel": True} if sequence_parallel else {}
        self.attn = ParallelSelfAttention.from_dense(block.qkv, block.proj, block.heads, block.dropout, grid=grid, **sp)
        self.mlp = ParallelMLP.from_dense(block.mlp, grid=grid, **sp)
        self.drop = nn.Dropout(block.dropout)
        if sequence_parallel:
            mark_sequence_parallel(self.ln1)
            mark_sequence_parallel(self.ln2)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and self.training:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def dense_slices(self) -> dict[str, Slice]:
        pre = f"blocks.{self.index}."
        return {
            **_slices(self.ln1, "ln1.", pre + "ln1."),
            **_slices(self.ln2, "ln2.", pre + "ln2."),
            **_slices(self.attn, "attn.", pre),  # qkv and proj sit in the block itself
            **_slices(self.mlp, "mlp.", pre + "mlp."),
        }


class GPTOutput(nn.Module):
    """The final layer norm and the output head, split by vocabulary over the TP ranks: the
    output is this rank's slice of the logits (for :func:`parallel_gpt_loss`)."""

    def __init__(self, gpt: GPT, grid: Grid, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.ln = copy.deepcopy(gpt.ln)
        sp = {"sequence_parallel": True} if sequence_parallel else {}
        self.head = ColumnParallelLinear.from_dense(gpt.head, grid=grid, **sp)
        if sequence_parallel:
            mark_sequence_parallel(self.ln)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))

    def dense_slices(self) -> dict[str, Slice]:
        return {**_slices(self.ln, "ln.", "ln."), **_slices(self.head, "head.", "head.")}


def parallel_gpt(
    gpt: GPT, grid: Grid, sequence_parallel: bool = False, activation_checkpointing: bool = False
) -> list[nn.Module]:
    """This rank's tensor-parallel slices of ``gpt`` as a list of layers (embeddings, each
    block, the head) for :class:`hpcdl.parallel.Pipeline`, which keeps the stage's share.
    Each layer's ``dense_slices()`` says where its parameters sit in ``gpt``, so
    :mod:`hpcdl.parallel.dense` consolidates them into ``gpt``'s ``state_dict`` format."""
    blocks = [ParallelBlock(b, i, grid, sequence_parallel, activation_checkpointing) for i, b in enumerate(gpt.blocks)]
    return [GPTInput(gpt, grid, sequence_parallel), *blocks, GPTOutput(gpt, grid, sequence_parallel)]


def parallel_gpt_loss(logits: torch.Tensor, targets: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The mean cross-entropy of ``targets`` under logits split by vocabulary over the TP
    ranks (equal to ``F.cross_entropy`` of the whole logits)."""
    return vocab_parallel_cross_entropy(wide(logits), targets, grid).mean()
