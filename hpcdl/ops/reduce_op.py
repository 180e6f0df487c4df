"""Horovod's reduction op constants and the checks of a reduction's arguments."""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "BadOp",
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "OP_NAMES",
    "resolve_op",
]


class ReduceOp(enum.IntEnum):
    """Reduction ops (Horovod's constants ``hvd.Average``, ``hvd.Sum``, ...)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)
OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod", Adasum: "adasum"}
OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod", Adasum: "adasum"}
"""Each supported op's name in :mod:`collectives`."""


class BadOp(str):
    """What is wrong with an op argument: sent with the request instead of the op, so that
    every rank raises, not only this one."""


def resolve_op(op: Any, average: bool | None) -> ReduceOp | BadOp:
    """The ReduceOp, or a :class:`BadOp` saying what is wrong with ``op``."""
    if isinstance(op, BadOp):  # resolved before
        return op
    if average is not None:
        if op is not None:
            return BadOp("pass op= or the deprecated average=, not both")
        return Average if average else Sum
    op = Average if op is None else op
    try:
        op = ReduceOp(op)
    except (ValueError, TypeError):
        return BadOp(f"op={op!r} is not one of hpcdl.Average, Sum, Adasum, Min, Max, Product")
    return op
