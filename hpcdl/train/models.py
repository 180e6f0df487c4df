"""The models ``hpcdl.train`` trains: two digit classifiers and a small byte-level GPT."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["DigitsMLP", "DigitsCNN", "GPT"]


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
