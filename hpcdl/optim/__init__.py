"""Optimizers for distributed training: :func:`DistributedOptimizer` (data parallel),
:class:`ZeroOptimizer` (data parallel with sharded optimizer state and gradients) and
:func:`HybridOptimizer` (data parallel through parameter servers, with bounded staleness)."""

from __future__ import annotations

from .distributed import DistributedOptimizer
from .hybrid import HybridOptimizer
from .zero import ZeroOptimizer

__all__ = ["DistributedOptimizer", "HybridOptimizer", "ZeroOptimizer"]
