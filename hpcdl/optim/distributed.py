"""``DistributedOptimizer``: data-parallel training by wrapping the optimizer a script has.

The factory puts one of two reducers in front of the optimizer's class, as Horovod does:

- :class:`DistributedReducer` (``op=Average`` or ``Sum``): the gradients are bucketed and
  allreduced in place while backward runs (:mod:`hpcdl.optim.buckets`); ``step()`` waits
  for them and runs the optimizer's own step.
- :class:`AdasumReducer` (``op=Adasum``, Horovod's delta optimizer): each bucket's
  parameters take the optimizer's own step locally as soon as their gradients are ready;
  the changes are combined over the ranks with Adasum and added to the values they started
  from, and ``step()`` only waits for that. It needs a power-of-two number of ranks.

A rank that passes a registered process set it is not in takes no part, as in Horovod:
its ``step()`` is the optimizer's own, on its local gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..compression import Compression, Compressor
from ..errors import HpcdlArgumentError
from ..ops import Adasum, Average, ReduceOp, Sum, grouped_allreduce_async_
from ..process_sets import ProcessSet, global_process_set
from .buckets import Bucket, Reducer

__all__ = ["AdasumReducer", "DistributedOptimizer", "DistributedReducer"]


class DistributedReducer(Reducer):
    """The reducer :func:`DistributedOptimizer` puts in front of the optimizer's class: the
    buckets' gradients are allreduced in place (:class:`hpcdl.optim.buckets.Reducer`'s
    default), with ``Average`` or ``Sum``."""

    _kind = "DistributedOptimizer"
    _ops = (Average, Sum, Adasum)  # Adasum: the factory picks AdasumReducer for it

    def _takes_part(self, process_set: ProcessSet) -> bool:
        """As in Horovod, a rank outside a registered process set other than the global one
        takes no part (no hooks, no reductions; ``step()`` is the optimizer's own)."""
        return not (getattr(process_set, "process_set_id", None) and not process_set.included())

    def _alone(self) -> bool:
        """True where reducing changes nothing: the process set is this rank alone, with
        ``Average`` or ``Sum``, no compression and no predivide (each scales by one). A
        pipeline or tensor-parallel job with one data-parallel replica is such a case."""
        return (
            self._process_set.size() == 1
            and self._op in (Average, Sum)
            and self._compression is Compression.none
            and self._predivide == 1.0
        )

    def _submit(self, b: Bucket) -> None:
        """Start bucket ``b``'s reduction; where it would change nothing (:meth:`_alone`),
        only put zeros for the missing gradients, as a reduction would, and send nothing
        (the engine would copy each gradient twice inside the backward pass). Sparse
        gradients take the reduction all the same (it coalesces them)."""
        if self._alone() and not any(p.grad is not None and p.grad.is_sparse for p in b.params):
            for p in b.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            b.sent, b.sparse, b.handle = [], [], 0
            return
        super()._submit(b)

    def _send_flags(self, missing: list[int]) -> Any:
        """The missing-gradient check; on this rank alone (:meth:`_alone`), its counts
        themselves, with nothing sent."""
        return self._missing_flags(missing) if self._alone() else super()._send_flags(missing)


class AdasumReducer(DistributedReducer):
    """:func:`DistributedOptimizer` with ``op=Adasum``, Horovod's delta optimizer
    (``_DistributedAdasumOptimizer``): each bucket's parameters step locally when their
    gradients are ready (:meth:`_submit`), and the changes, combined over the ranks with
    Adasum, are added to the values they started from (:meth:`_unpack`). Needs a
    power-of-two number of ranks."""

    def _check_op(self, op: ReduceOp, process_set: ProcessSet) -> None:
        """Also refuse a process set whose size is not a power of two."""
        super()._check_op(op, process_set)
        n = process_set.size()
        if n & (n - 1):
            raise HpcdlArgumentError(f"{self._kind}(op=Adasum) needs a power-of-two number of ranks, not {n}")

    def step(self, closure: Any = None) -> Any:
        """Each parameter has taken its local step already, when its gradient was ready:
        wait for the combined updates (unless :meth:`synchronize` did). A rank that takes no
        part steps as :class:`hpcdl.optim.buckets.Reducer` does."""
        if not self._member:
            return super().step(closure)
        loss = closure() if closure is not None else None
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return loss

    def _submit(self, b: Bucket) -> None:
        """The wrapped optimizer steps ``b``'s parameters alone, here and now; the change
        each made is sent to be combined over the ranks with Adasum. A parameter without a
        gradient is not stepped, so its change is zero."""
        b.starts = {p: p.detach().clone() for p in b.params}
        ids = {id(p) for p in b.params}
        stashed = [g["params"] for g in self.param_groups]
        for g in self.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in ids]
        try:
            self._wrapped_step()
        finally:
            for g, params in zip(self.param_groups, stashed, strict=True):
                g["params"] = params
        sent = []
        for p in b.params:
            t, ctx = self._compression.compress(p.detach() - b.starts[p])
            sent.append((t, ctx, p))
        b.sent = sent
        args = {**self._request_args(b), "prescale_factor": 1.0, "postscale_factor": 1.0}
        b.handle = grouped_allreduce_async_([t for t, _, _ in sent], **args)

    def _unpack(self, b: Bucket, result: Any) -> None:
        """Put the starting values plus the combined changes into the parameters."""
        with torch.no_grad():
            for t, ctx, p in b.sent:
                p.copy_(b.starts[p] + self._compression.decompress(t, ctx))
        b.starts = {}


def DistributedOptimizer(  # noqa: N802 - Horovod's name: a factory that looks like a class
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    *,
    bucket_bytes: int | None = None,
    check_missing_gradients: bool | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` for data-parallel training (Horovod's arguments, in Horovod's order).

    Returns an instance of a subclass of the optimizer's class (``isinstance`` holds, its own
    ``step`` runs after the gradients are reduced) over the same parameter groups, keeping
    the optimizer's existing state.

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: ``model.named_parameters()``, so requests carry parameter names
            (None: names made up from the parameters' positions).
        compression: ``Compression.none``, ``fp16`` or ``bf16`` on the wire.
        backward_passes_per_step: communicate once every this many backward passes; the
            passes' gradients add up, as in Horovod (divide the loss by it to average).
        op: ``Average`` (default) or ``Sum`` over ranks, or ``Adasum`` (Horovod's delta
            optimizer: see :class:`AdasumReducer`).
        gradient_predivide_factor: divide by this before the sum and by ``size / factor``
            after it (``Average`` only).
        num_groups, groups: Horovod's grouping of tensors into fused requests; accepted,
            and changing no result: hpcdl groups gradients into buckets of ``bucket_bytes``.
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
            tensors instead of allgathering their indices and values.
        process_set: the ranks that train together (each rank passes a set it belongs to).
        bucket_bytes: the most gradient bytes in one bucket (default: the runtime's
            ``Config.bucket_bytes``, ``HPCDL_BUCKET_BYTES``).
        check_missing_gradients: make a gradient that is missing on some ranks but not on
            others an error on every rank, instead of reducing it with zeros where missing
            as Horovod does (default: ``Config.check_missing_gradients``).
    """
    if not isinstance(num_groups, int) or num_groups < 0:
        raise HpcdlArgumentError(f"num_groups={num_groups!r} must be a non-negative integer")
    listed = isinstance(groups, (list, tuple)) and all(
        isinstance(g, (list, tuple)) and all(isinstance(p, torch.Tensor) for p in g) for g in groups
    )
    if groups is not None and not listed and not (isinstance(groups, int) and groups >= 0):
        raise HpcdlArgumentError(
            f"groups={groups!r} must be a non-negative integer or a list of lists of parameters, as in Horovod"
        )
    base = type(optimizer)
    reducer = AdasumReducer if op == Adasum else DistributedReducer
    cls = type(base.__name__, (reducer, base), {"__module__": base.__module__})
    obj = cls(optimizer.param_groups)
    if optimizer.state:
        obj.load_state_dict(optimizer.state_dict())
    obj._hpcdl_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        process_set,
        bucket_bytes,
        sparse_as_dense,
        check_missing_gradients,
    )
    return obj
