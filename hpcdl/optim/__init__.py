"""Optimizers for distributed training: :func:`DistributedOptimizer` (data parallel)."""

from __future__ import annotations

from .distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
