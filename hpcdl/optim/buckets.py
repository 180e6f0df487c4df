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
with zeros for the missing gradients, so ranks never hang; as in Horovod, a gradient
missing on some ranks only is reduced with zeros there (``check_missing_gradients`` makes
it an error naming the parameter, on every rank). Sparse gradients (``nn.Embedding(sparse=
True)``) are reduced as allgathers of their indices and values, or densified first with
``sparse_as_dense``.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .. import state
from ..compression import Compressor
from ..errors import HpcdlArgumentError, HpcdlError
from ..functions import allgather_object
from ..handles import request_name, synchronize
from ..ops import Average, ReduceOp, Sum, allreduce_async, grouped_allreduce_async_, sparse_allreduce_async
from ..process_sets import ProcessSet, registered_id

__all__ = ["Bucket", "Reducer", "is_elementwise"]

_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


def is_elementwise(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` updates each element from that element alone, so that it
    may step pieces of the parameters (shards, partitions) and give the same result: not
    LBFGS, SparseAdam, Adafactor or Muon, whose update of an element depends on others."""
    return optimizer_class.__name__ not in _NOT_ELEMENTWISE


class Bucket:
    """A group of parameters whose gradients are reduced together (one grouped request)."""

    __slots__ = ("index", "group", "params", "ready", "handle", "sent", "sparse", "starts", "zero")

    def __init__(self, index: int, group: int) -> None:
        self.index = index
        self.group = group  # the parameter group its parameters belong to
        self.params: list[torch.nn.Parameter] = []
        self.ready = 0
        self.handle: int | None = None  # its reduction in flight (0: none of its gradients is dense)
        self.sent: list[tuple[torch.Tensor, Any, torch.nn.Parameter]] = []
        self.sparse: list[tuple[torch.nn.Parameter, Any]] = []  # sparse gradients' reductions
        self.starts: dict[torch.nn.Parameter, torch.Tensor] = {}  # Adasum: the values before the local step
        self.zero: Any = None  # ZeroOptimizer's flat buffer and this rank's shard of it


def _remove(hooks: list[Any]) -> None:
    for h in hooks:
        h.remove()


class Reducer:
    """The gradient side every optimizer of :mod:`hpcdl.optim` builds on: hooks, buckets,
    accumulation, the missing-gradient check and the step protocol.

    A subclass puts it in front of an optimizer class (plain ``super()`` reaches that
    class), names itself in :attr:`_kind` and calls :meth:`_hpcdl_setup` once the parameter
    groups exist. By default each bucket's gradients are allreduced in place, and ``step()``
    waits for them and runs the optimizer's own step. A subclass changes:

    - which reduction ops it accepts (:attr:`_ops`, :meth:`_check_op`);
    - whether this rank takes part at all (:meth:`_takes_part`);
    - how a bucket is sent (:meth:`_submit`) and its result put in place (:meth:`_unpack`);
    - what ``step()`` does (:meth:`step`; :meth:`_wrapped_step` runs the optimizer's own).

    :meth:`_request_args`, :meth:`_agree`, :attr:`_buckets` and :attr:`_prefix` are there
    for subclasses to use."""

    _kind = "Reducer"
    """The optimizer's name in messages and request names: each subclass sets its own."""

    _ops: tuple[ReduceOp, ...] = (Average, Sum)
    """The reduction ops over the ranks that ``op`` may be."""

    def _hpcdl_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        process_set: ProcessSet,
        bucket_bytes: int | None,
        sparse_as_dense: bool = False,
        check_missing_gradients: bool | None = None,
    ) -> None:
        """Check the arguments, then cut the parameters into buckets and hook them (the
        arguments as documented at :func:`hpcdl.DistributedOptimizer`). Raises
        :class:`HpcdlArgumentError` naming the first bad argument, before any hook exists."""
        self._check_op(op, process_set)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise HpcdlArgumentError(f"{self._kind}: gradient_predivide_factor needs op=Average")
        rt = state.running()
        if bucket_bytes is None:
            bucket_bytes = rt.config.bucket_bytes
        elif bucket_bytes <= 0:
            raise HpcdlArgumentError(f"{self._kind}: bucket_bytes={bucket_bytes} must be > 0")
        names = self._name_parameters(named_parameters)
        self._member = self._takes_part(process_set)
        """False where this rank takes no part (:meth:`_takes_part`): no hooks, no
        reductions, and ``step()`` is the optimizer's own, on local gradients."""
        self._store_settings(
            rt,
            compression,
            backward_passes_per_step,
            op,
            gradient_predivide_factor,
            process_set,
            sparse_as_dense,
            check_missing_gradients,
        )
        self._cut_buckets(bucket_bytes, rt.config.first_bucket_bytes)
        self._index = {p: i for i, p in enumerate(self._bucket_of)}
        self._names = {p: names[p] for p in self._bucket_of}
        self._parameter_names = names  # Horovod's attribute name
        self._hook_parameters()

    def _check_op(self, op: ReduceOp, process_set: ProcessSet) -> None:
        """Raise :class:`HpcdlArgumentError` unless ``op`` is one of :attr:`_ops`; a subclass
        adds what its op needs of ``process_set``."""
        if op not in self._ops:
            names = ", ".join(f"hpcdl.{o.name}" for o in self._ops)
            raise HpcdlArgumentError(f"{self._kind}: op must be one of {names}, not {op!r}")

    def _takes_part(self, process_set: ProcessSet) -> bool:
        """Whether this rank takes part in the reductions over ``process_set``: by default,
        every rank that builds the optimizer does."""
        return True

    def _name_parameters(
        self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None
    ) -> dict[torch.nn.Parameter, str]:
        """Every parameter of the optimizer's groups -> its name: from ``named_parameters``
        (which must name each of them once), or made up from its position when None."""
        params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            return {p: f"param.{i}" for i, p in enumerate(params)}
        pairs = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
            raise HpcdlArgumentError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
        dupes = sorted({n for n, _ in pairs if sum(1 for m, _ in pairs if m == n) > 1})
        if dupes:
            raise HpcdlArgumentError(f"named_parameters has duplicate names: {dupes}")
        names = {p: n for n, p in pairs}
        unnamed = [i for i, p in enumerate(params) if p not in names]
        if unnamed:
            raise HpcdlArgumentError(f"named_parameters misses optimizer parameters at positions {unnamed}")
        return {p: names[p] for p in params}

    def _store_settings(
        self,
        rt: state.Runtime,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        process_set: ProcessSet,
        sparse_as_dense: bool,
        check_missing_gradients: bool | None,
    ) -> None:
        """Keep the settings (also under Horovod's attribute names) and start the step's
        bookkeeping empty; name this optimizer's requests."""
        # requests are named per optimizer (numbered in construction order per process set,
        # alike on the set's ranks), so two wrapped optimizers can be in flight together
        self._prefix = request_name(rt, self._kind, registered_id(process_set), None) if self._member else ""
        self._compression = compression
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._process_set = process_set
        self._sparse_as_dense = bool(sparse_as_dense)
        self._strict = rt.config.check_missing_gradients if check_missing_gradients is None else check_missing_gradients
        # what Horovod's optimizer carries, for code that inspects it
        self.op, self.gradient_predivide_factor, self.process_set = op, self._predivide, process_set
        self.sparse_as_dense = self._sparse_as_dense
        self._passes_per_step = 0
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._synchronized = False
        self._skip = False
        self._sent = 0  # buckets submitted by hooks this step
        self._flags: Any = None  # the missing-gradient check, when sent early

    def _cut_buckets(self, bucket_bytes: int, first_bytes: int) -> None:
        """Group the parameters that need a gradient into buckets of at most ``bucket_bytes``
        (the first, whose gradients backward produces first, of at most ``first_bytes`` too).
        A rank that takes no part has no buckets."""
        self._passes: dict[torch.nn.Parameter, int] = {}
        self._bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        self._buckets: list[Bucket] = []
        size = 0
        # backward produces the last layers' gradients first; a bucket holds one group's
        # parameters of one dtype on one device
        owned = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]] if self._member else []
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

    def _hook_parameters(self) -> None:
        """Register the hook that counts each bucketed parameter's gradient as ready."""
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
        """Communicate once every ``passes`` backward passes (gradient accumulation). As in
        Horovod, the passes' gradients add up locally (autograd accumulates them) and are
        averaged over the ranks: divide each pass's loss by ``passes`` to train as on one
        batch ``passes`` times larger."""
        if not isinstance(passes, int) or passes < 1:
            raise HpcdlArgumentError(f"backward_passes_per_step={passes!r} must be a positive integer")
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
        if not self._member:
            return
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
        counts = (h if isinstance(h, torch.Tensor) else synchronize(h)).tolist()  # a tensor: counted here
        n = self._process_set.size()
        strict = counts.pop()  # ranks that asked for the check
        partial = [self._name_at(i) for i, c in enumerate(counts) if 0 < c < n]
        for p in self._passes:
            self._passes[p] = 0
        self._sent = 0
        self._synchronized = True
        if 0 < strict < n:
            raise HpcdlError(f"{self._kind}: check_missing_gradients is set on {strict} of {n} ranks; set it alike")
        if partial and strict:
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
        """Synchronize the gradients (unless skipped), then step. After an explicit
        ``synchronize()`` outside ``skip_synchronize()`` it warns, as Horovod does, and steps
        with the gradients already reduced."""
        if not self._skip:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(); the gradients are not reduced again. Use "
                    "optimizer.skip_synchronize() when you call optimizer.synchronize() yourself.",
                    UserWarning,
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the optimizer's, but refused while reductions are in flight."""
        if self._in_flight():
            raise HpcdlError("zero_grad() while gradient reductions are in flight; call step() or synchronize() first")
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    # -- internals -----------------------------------------------------------------------------
    def _wrapped_step(self) -> Any:
        """Run the wrapped optimizer's own ``step()`` and nothing else: no reduction, no
        waiting (for a subclass whose ranks step before they communicate)."""
        return super().step()  # type: ignore[misc]

    def _in_flight(self) -> bool:
        """True while a gradient reduction or the missing-gradient check is in flight."""
        flags = getattr(self, "_flags", None)  # set_backward_passes_per_step runs before setup ends
        return flags is not None or any(b.handle is not None for b in getattr(self, "_buckets", []))

    def _send_flags(self, missing: list[int]) -> Any:
        """Start the reduction of which gradients were missing where (they are zero there),
        and of which ranks want that to be an error, so that every rank decides alike: its
        handle, or (where a subclass needs no reduction) the counts themselves."""
        flags = self._missing_flags(missing)
        return allreduce_async(flags, name=f"{self._prefix}.missing", op=Sum, process_set=self._process_set)

    def _missing_flags(self, missing: list[int]) -> torch.Tensor:
        """This rank's part of the missing-gradient check: 1 for each gradient in ``missing``
        (by index), and last, 1 where this rank wants that to be an error."""
        flags = torch.zeros(len(self._bucket_of) + 1, dtype=torch.int32)
        flags[missing] = 1
        flags[-1] = int(bool(self._strict))
        return flags

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

    def _agree(self, mine: dict[str, Any]) -> None:
        """Compare ``mine`` (what every rank of the process set must have alike; ``buckets``:
        the parameters' shapes and dtypes per bucket) across the ranks, once, and raise on
        every rank naming the key that differs (collective over the process set)."""
        every = allgather_object(mine, name=f"{self._prefix}.layout", process_set=self._process_set)
        for key in mine:
            values = [e[key] for e in every]
            if any(v != values[0] for v in values):
                ranks = self._process_set.ranks
                if key == "buckets":
                    shown = {
                        ranks[i]: f"{len(v)} buckets of {[len(b) for b in v]} parameters" for i, v in enumerate(values)
                    }
                    why = " (the models or bucket_bytes differ)"
                else:
                    shown, why = {ranks[i]: v for i, v in enumerate(values)}, ""
                raise HpcdlError(f"{self._kind}: ranks disagree on {key}{why}: {shown}")

    def _request_args(self, b: Bucket) -> dict[str, Any]:
        """Name, op and scale factors of bucket ``b``'s reduction: the prescale predivides
        (Horovod's gradient_predivide_factor); Average divides by the ranks. Accumulated
        passes are summed, as Horovod sums them."""
        return {
            "name": f"{self._prefix}.bucket{b.index}",
            "op": self._op,
            "prescale_factor": 1.0 / self._predivide,
            "postscale_factor": self._predivide if self._op == Average else 1.0,
            "process_set": self._process_set,
        }

    def _submit(self, b: Bucket) -> None:
        """Start bucket ``b``'s reduction: by default, an in-place grouped allreduce of its
        dense gradients (zeros for the ones missing), and for each sparse gradient an
        allgather of its indices and values (or, with ``sparse_as_dense``, its dense form
        in the grouped allreduce)."""
        sent, sparse = [], []
        args = self._request_args(b)
        for p in b.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            if g.is_sparse:
                if not self._sparse_as_dense:
                    name = f"{args['name']}.sparse.{self._index[p]}"
                    sparse.append((p, sparse_allreduce_async(g, name, self._op, self._process_set)))
                    continue
                g = g.to_dense()
            t, ctx = self._compression.compress(g)
            sent.append((t, ctx, p))
        b.sent, b.sparse = sent, sparse
        b.handle = grouped_allreduce_async_([t for t, _, _ in sent], **args) if sent else 0

    def _finish(self, b: Bucket) -> None:
        """Wait for bucket ``b``'s reduction (if started) and put its result in place."""
        if b.handle is None:
            return
        h, b.handle = b.handle, None
        self._unpack(b, synchronize(h) if h else [])
        for p, fetch in b.sparse:
            p.grad.zero_().add_(fetch())  # sparse gradients take no set_
        b.sent, b.sparse = [], []
        b.ready = 0

    def _unpack(self, b: Bucket, result: Any) -> None:
        """Put the result of :meth:`_submit`'s request in place: by default, the reduced
        gradients back into ``p.grad`` (a no-op where they were reduced in place; a sparse
        gradient sent dense is made sparse again)."""
        for t, ctx, p in b.sent:
            if p.grad.is_sparse:
                p.grad.zero_().add_(self._compression.decompress(t, ctx).to_sparse())
            elif ctx is not None or t is not p.grad:
                p.grad.copy_(self._compression.decompress(t, ctx))
