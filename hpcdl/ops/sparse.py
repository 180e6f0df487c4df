"""Sparse allreduce, as Horovod's: a sparse COO tensor reduced as allgathers of its indices
and values, which is what ``DistributedOptimizer`` does with sparse gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import HpcdlArgumentError
from ..handles import synchronize
from ..process_sets import ProcessSet, global_process_set
from .reduce_op import Average, ReduceOp, Sum, resolve_op
from .requests import start_allgather

__all__ = ["sparse_allreduce_async"]


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None, op: ReduceOp, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Start summing (``Sum``) or averaging (``Average``) the sparse COO ``tensor`` over the
    ranks: every rank's indices and values are allgathered. Returns, as Horovod does, a
    callable that waits and gives the result, a sparse tensor of ``tensor``'s size (its
    entries uncoalesced: one per rank that had it); ``hvd.synchronize`` takes it too."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async takes a sparse COO tensor, not {type(tensor).__name__}")
    op = resolve_op(op, None)
    if op not in (Average, Sum):
        raise HpcdlArgumentError(f"sparse_allreduce_async: op must be hpcdl.Average or hpcdl.Sum, not {op}")
    t = tensor.coalesce()
    # allgather concatenates along dimension 0: indices travel as (nnz, sparse dims)
    h = start_allgather([t.indices().transpose(0, 1).contiguous(), t.values()], name, process_set, False)
    n, size = process_set.size(), t.size()

    def result() -> torch.Tensor:
        indices, values = synchronize(h)
        if op == Average:
            values = values / n
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, size, check_invariants=True)

    return result
