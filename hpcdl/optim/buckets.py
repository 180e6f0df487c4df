"""The bucket/reducer layer every optimizer of :mod:`hpcdl.optim` builds on.

A hook on every parameter fires when its gradient has been accumulated. Parameters are
grouped into buckets, size-capped (``bucket_bytes``; the first bucket, the last layers'
gradients, at ``first_bucket_bytes`` so that communication starts early in backward, as
DDP's first bucket does; both from :class:`hpcdl.Config`) and in reverse registration
order (about the order backward produces gradients), the same on every rank. As soon as
every gradient of a bucket is ready, the bucket is submitted to the engine as one grouped
request, so communication overlaps the rest of backward. ``step()`` (or
``synchronize()``) waits for the reductions and then runs the wrapped optimizer's own
``step``. Buckets whose hooks did not all fire (unused parameters) are submitted then,
with zeros for the missing gradients, so ranks never hang; a gradient missing on some
ranks but not others is an error naming the parameter, on every rank.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .. import state
from ..compression import Compressor
from ..errors import HpcdlError
from ..handles import request_name, synchronize
from ..ops import Average, ReduceOp, Sum, allreduce_async, grouped_allreduce_async_
from ..process_sets import ProcessSet, registered_id

__all__ = ["Bucket", "Reducer"]


class Bucket:
    """A group of parameters whose gradients are reduced together (one grouped request)."""

    __slots__ = ("index", "group", "params", "ready", "handle", "sent", "zero")

    def __init__(self, index: int, group: int) -> None:
        self.index = index
        self.group = group  # the parameter group its parameters belong to
        self.params: list[torch.nn.Parameter] = []
        self.ready = 0
        self.handle: int | None = None
        self.sent: list[tuple[torch.Tensor, Any, torch.nn.Parameter]] = []
        self.zero: Any = None  # ZeroOptimizer's shard layout


def _remove(hooks: list[Any]) -> None:
    for h in hooks:
        h.remove()


class Reducer:
    """The gradient side every optimizer of :mod:`hpcdl.optim` builds on: hooks, buckets,
    accumulation, the missing-gradient check and the step protocol.

    A subclass puts it in front of an optimizer class (plain ``super()`` reaches that
    class) and calls :meth:`_hpcdl_setup` once the parameter groups exist. By default each
    bucket's gradients are allreduced in place (``DistributedOptimizer``); a subclass
    changes how a bucket is sent (:meth:`_submit`) and its result put in place
    (:meth:`_unpack`), as ``ZeroOptimizer`` does. These two, :meth:`_request_args`,
    :attr:`_buckets` and :attr:`_prefix` are the interface for subclasses."""

    _kind = "DistributedOptimizer"

    def _hpcdl_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        process_set: ProcessSet,
        bucket_bytes: int | None,
    ) -> None:
        if op not in (Average, Sum):
            raise HpcdlError(f"{self._kind}: op must be hpcdl.Average or hpcdl.Sum, not {op!r}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise HpcdlError(f"{self._kind}: gradient_predivide_factor needs op=Average")
        rt = state.running()
        first_bytes = rt.config.first_bucket_bytes
        if bucket_bytes is None:
            bucket_bytes = rt.config.bucket_bytes
        elif bucket_bytes <= 0:
            raise HpcdlError(f"{self._kind}: bucket_bytes={bucket_bytes} must be > 0")
        params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            names = {p: f"param.{i}" for i, p in enumerate(params)}
        else:
            pairs = list(named_parameters)
            if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
                raise HpcdlError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
            dupes = sorted({n for n, _ in pairs if sum(1 for m, _ in pairs if m == n) > 1})
            if dupes:
                raise HpcdlError(f"named_parameters has duplicate names: {dupes}")
            names = {p: n for n, p in pairs}
            unnamed = [i for i, p in enumerate(params) if p not in names]
            if unnamed:
                raise HpcdlError(f"named_parameters misses optimizer parameters at positions {unnamed}")
        # requests are named per optimizer (numbered in construction order per process set,
        # alike on the set's ranks), so two wrapped optimizers can be in flight together
        self._prefix = request_name(rt, self._kind, registered_id(process_set), None)
        self._compression = compression
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._process_set = process_set
        self._passes_per_step = 0
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._passes: dict[torch.nn.Parameter, int] = {}
        self._bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        self._buckets: list[Bucket] = []
        self._synchronized = False
        self._skip = False
        self._sent = 0  # buckets submitted by hooks this step
        self._flags: int | None = None  # the missing-gradient check, when sent early
        size = 0
        # backward produces the last layers' gradients first; a bucket holds one group's
        # parameters of one dtype on one device (a flat shard for ZeroOptimizer)
        owned = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        for gi, p in reversed(owned):
            if not p.requires_grad:
                continue
            nbytes = p.numel() * p.element_size()
            last = self._buckets[-1] if self._buckets else None
            cap = min(bucket_bytes, first_bytes) if len(self._buckets) == 1 else bucket_bytes
            if (
                last is None
                or last.group != gi
                or (last.params[0].dtype, last.params[0].device) != (p.dtype, p.device)
                or size + nbytes > cap
            ):
                self._buckets.append(Bucket(len(self._buckets), gi))
                size = 0
            b = self._buckets[-1]
            b.params.append(p)
            size += nbytes
            self._bucket_of[p] = b
            self._passes[p] = 0
        self._index = {p: i for i, p in enumerate(self._bucket_of)}
        self._names = {p: names[p] for p in self._bucket_of}
        # the hooks reach the optimizer through a weak reference, so an optimizer the script
        # drops stops reducing (and is freed) instead of hooking its parameters for ever
        me = weakref.ref(self)

        def hook(p: torch.nn.Parameter) -> None:
            opt = me()
            if opt is not None:
                opt._hook(p)

        hooks = [p.register_post_accumulate_grad_hook(hook) for p in self._bucket_of]
        weakref.finalize(self, _remove, hooks)

    # -- the public additions ----------------------------------------------------------------
    def set_backward_passes_per_step(self, passes: int) -> None:
        """Communicate once every ``passes`` backward passes (gradient accumulation); the
        reduced gradient is the mean over the passes, so it equals one pass over a batch
        ``passes`` times larger."""
        if not isinstance(passes, int) or passes < 1:
            raise HpcdlError(f"backward_passes_per_step={passes!r} must be a positive integer")
        if self._in_flight():
            raise HpcdlError("set_backward_passes_per_step() while gradient reductions are in flight")
        self._passes_per_step = passes

    @property
    def name_prefix(self) -> str:
        """The prefix of this optimizer's request names (``<prefix>.bucket<i>`` in a timeline)."""
        return self._prefix

    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in submission order (each with its ``params``)."""
        return list(self._buckets)

    @property
    def backward_passes_per_step(self) -> int:
        return self._passes_per_step

    def synchronize(self) -> None:
        """Finish every gradient reduction of this step (submitting buckets whose hooks did not
        all fire, with zeros for missing gradients); afterwards ``p.grad`` holds the result."""
        h, self._flags = self._flags, None
        if h is None:
            missing: list[int] = []
            for b in self._buckets:
                if b.handle is None:
                    missing.extend(self._index[p] for p in b.params if p.grad is None)
                    self._submit(b)
            h = self._send_flags(missing)
        for b in self._buckets:
            self._finish(b)
        counts = synchronize(h)
        n = self._process_set.size()
        partial = [self._name_at(i) for i, c in enumerate(counts.tolist()) if 0 < c < n]
        for p in self._passes:
            self._passes[p] = 0
        self._sent = 0
        self._synchronized = True
        if partial:
            raise HpcdlError(
                f"gradients of {partial} are missing on some ranks but not others (a branch used by some "
                "ranks only?); they were reduced as zeros where missing"
            )

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize (call ``synchronize()`` first, e.g. to clip
        the reduced gradients in between)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure: Any = None) -> Any:
        """Synchronize the gradients (unless already done or skipped), then step."""
        if not self._synchronized and not self._skip:
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the optimizer's, but refused while reductions are in flight."""
        if self._in_flight():
            raise HpcdlError("zero_grad() while gradient reductions are in flight; call step() or synchronize() first")
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    # -- internals -----------------------------------------------------------------------------
    def _in_flight(self) -> bool:
        """True while a gradient reduction or the missing-gradient check is in flight."""
        flags = getattr(self, "_flags", None)  # set_backward_passes_per_step runs before setup ends
        return flags is not None or any(b.handle is not None for b in getattr(self, "_buckets", []))

    def _send_flags(self, missing: list[int]) -> int:
        """Start the reduction of which gradients were missing where: gradients missing on
        some ranks only would be silently zero there, so every rank checks."""
        flags = torch.zeros(len(self._bucket_of), dtype=torch.int32)
        flags[missing] = 1
        return allreduce_async(flags, name=f"{self._prefix}.missing", op=Sum, process_set=self._process_set)

    def _name_at(self, i: int) -> str:
        return self._names[list(self._bucket_of)[i]]

    def _hook(self, p: torch.nn.Parameter) -> None:
        self._passes[p] += 1
        k = self._passes[p]
        if k > self._passes_per_step:
            raise HpcdlError(
                f"the gradient of {self._names[p]} was computed "
                f"{k} times before step(); raise backward_passes_per_step ({self._passes_per_step}) or call step()"
            )
        if k == self._passes_per_step:
            b = self._bucket_of[p]
            b.ready += 1
            if b.ready == len(b.params) and b.handle is None:
                self._submit(b)
                self._sent += 1
                if self._sent == len(self._buckets):
                    # every hook fired, so nothing is missing here: send the check with the
                    # last bucket instead of in a cycle of its own at synchronize()
                    self._flags = self._send_flags([])

    def _request_args(self, b: Bucket) -> dict[str, Any]:
        """Name, op and scale factors of bucket ``b``'s reduction: the prescale averages over
        the accumulated passes (and predivides); Average divides by the ranks."""
        return {
            "name": f"{self._prefix}.bucket{b.index}",
            "op": self._op,
            "prescale_factor": 1.0 / (self._passes_per_step * self._predivide),
            "postscale_factor": self._predivide if self._op == Average else 1.0,
            "process_set": self._process_set,
        }

    def _submit(self, b: Bucket) -> None:
        """Start bucket ``b``'s reduction: by default, an in-place grouped allreduce of its
        gradients (zeros for the ones missing)."""
        sent = []
        for p in b.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            t, ctx = self._compression.compress(p.grad)
            sent.append((t, ctx, p))
        b.sent = sent
        b.handle = grouped_allreduce_async_([t for t, _, _ in sent], **self._request_args(b))

    def _finish(self, b: Bucket) -> None:
        """Wait for bucket ``b``'s reduction (if started) and put its result in place."""
        if b.handle is None:
            return
        h, b.handle = b.handle, None
        self._unpack(b, synchronize(h))
        b.sent = []
        b.ready = 0

    def _unpack(self, b: Bucket, result: Any) -> None:
        """Put the result of :meth:`_submit`'s request in place: by default, the reduced
        gradients back into ``p.grad`` (a no-op where they were reduced in place)."""
        for t, ctx, p in b.sent:
            if ctx is not None or t is not p.grad:
                p.grad.copy_(self._compression.decompress(t, ctx))
