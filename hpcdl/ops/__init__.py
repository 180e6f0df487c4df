"""Horovod's collectives on torch tensors, one module per collective, each in its forms:
``op`` (an autograd function), ``op_`` (in place), ``op_async`` and ``op_async_``
(return a handle for :func:`synchronize`/:func:`poll`), plus the grouped variants.

:mod:`.requests` holds the primitives they share (building and submitting the engine's
requests), including the optimizers' in-place entry points
:func:`~.requests.allgather_into_async` and :func:`~.requests.reducescatter_into_async`.
"""

from __future__ import annotations

from ..handles import poll, synchronize
from .allgather import allgather, allgather_async, grouped_allgather, grouped_allgather_async
from .allreduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from .alltoall import alltoall, alltoall_async
from .broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_
from .control import barrier, join, start_timeline, stop_timeline
from .reduce_op import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .reducescatter import grouped_reducescatter, grouped_reducescatter_async, reducescatter, reducescatter_async
from .requests import allgather_into_async, reducescatter_into_async
from .sparse import sparse_allreduce_async

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "poll",
    "synchronize",
    "barrier",
    "join",
    "start_timeline",
    "stop_timeline",
    "allgather_into_async",
    "reducescatter_into_async",
]
