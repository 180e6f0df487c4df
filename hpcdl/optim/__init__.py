"""Optimizers for distributed training: :func:`DistributedOptimizer` (data parallel) and
:class:`ZeroOptimizer` (data parallel with sharded optimizer state and gradients)."""

from __future__ import annotations

from .distributed import DistributedOptimizer
from .zero import ZeroOptimizer

__all__ = ["DistributedOptimizer", "ZeroOptimizer"]
