"""``ZeroOptimizer``: data-parallel training with the optimizer state sharded over the ranks
(ZeRO stage 1) and, at stage 2, the reduced gradients too.

The gradient buckets are those of :func:`DistributedOptimizer` (one parameter group, one
dtype and one device each). Each bucket's parameters are moved into one flat buffer, padded
to a multiple of the rank count ``N`` and cut into ``N`` equal shards: ``p.data`` becomes a
view of that buffer (as with DeepSpeed's and FSDP's flat parameters), and rank ``r`` owns
shard ``r`` of every bucket. The wrapped optimizer's class steps the shards, which are views
of the parameters, so its state (momentum, Adam's moments) exists for ``1/N`` of the
elements on each rank and its update lands in the parameters without a copy. That is exact
for optimizers whose update is element-wise (SGD, Adam, AdamW, RMSprop, Adagrad, ...); ones
that look at whole tensors (LBFGS, Adafactor, SparseAdam, Muon) are refused.

One step:

- stage 1: each bucket's gradients are allreduced in place as soon as they are ready
  (overlapping backward), so ``p.grad`` holds the full reduced gradient as with
  ``DistributedOptimizer``; ``step()`` copies this rank's shard of it.
- stage 2: each ready bucket is reduce-scattered and its gradients released (``p.grad``
  becomes None), so a rank keeps only its shard of the reduced gradient. A bucket of one
  parameter is reduce-scattered from its gradient itself; a bucket of several is first
  copied into a flat staging buffer, kept from step to step.
- then the shards step, and every bucket's other shards are allgathered straight into the
  flat buffer (on CUDA, through host memory and one copy back), so parameters stay
  bitwise alike on every rank.

Parameters written in place between steps need nothing; a parameter whose tensor was
replaced (``p.data = ...``) is copied back into the flat buffer at the next step. One cast
or moved after the optimizer was built is refused.

``state_dict()`` (collective: call it on every rank of the process set) returns the state
consolidated into the wrapped optimizer's own format, as if one unsharded optimizer had
taken the steps; ``load_state_dict()`` accepts that format from any rank count, or from a
plain optimizer. The inner optimizer's state of a shard is this rank's slice of the bucket's
state in the flat form of :mod:`hpcdl.optim_state`, which converts it to and from torch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..compression import Compression, Compressor
from ..errors import HpcdlArgumentError, HpcdlError
from ..functions import empty
from ..ops import (
    Average,
    Max,
    ReduceOp,
    Sum,
    allgather_into_async,
    allreduce,
    grouped_allgather_async,
    reducescatter_into_async,
    synchronize,
)
from ..optim_state import (
    copy_value,
    flatten_state,
    hyperparameters,
    in_parameter_order,
    is_per_element,
    numbered_groups,
    unflatten_state,
)
from ..process_sets import ProcessSet, global_process_set
from .buckets import Bucket, Reducer, is_elementwise

__all__ = ["ZeroOptimizer"]


class _FlatShard:
    """Where a bucket's parameters sit in its flat, padded buffer, and this rank's shard.

    The parameters live in ``flat``: each ``p.data`` is a view of it (like DeepSpeed's and
    FSDP's flat parameters). So this rank's shard, ``shard``, is a view of the parameters
    themselves: the wrapped optimizer updates it in place, and the allgather writes the
    other ranks' shards straight into the parameters. ``grad`` is the shard's gradient,
    kept from step to step; ``staging`` (stage 2, buckets of several parameters) the
    bucket's gradients laid out flat for the reduce-scatter. On the CPU ``flat`` and
    ``staging`` live in the process set's node window (:func:`hpcdl.empty`), so the
    reduce-scatter and the allgather read every member's buffer in place."""

    __slots__ = ("offsets", "numel", "shard_numel", "lo", "flat", "shard", "grad", "staging", "ptrs", "process_set")

    def __init__(self, params: list[torch.nn.Parameter], n: int, r: int, process_set: ProcessSet) -> None:
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_numel = max(1, math.ceil(total / n))
        self.lo = r * self.shard_numel  # this rank's shard is [lo, lo + shard_numel) of the flat buffer
        p0 = params[0]
        self.process_set = process_set
        self.flat = self._zeros(n * self.shard_numel, p0)
        self.shard = self.flat[self.lo : self.lo + self.shard_numel]
        self.grad = torch.zeros_like(self.shard)
        self.staging: torch.Tensor | None = None
        self.ptrs: list[int] = []
        self.adopt(params)

    def _zeros(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed flat buffer of ``like``'s dtype on its device: on the CPU in the process
        set's node window, where the collectives read every member's buffer in place."""
        if like.device.type != "cpu":
            return torch.zeros(numel, dtype=like.dtype, device=like.device)
        return empty(numel, dtype=like.dtype, process_set=self.process_set).zero_()

    def adopt(self, params: list[torch.nn.Parameter]) -> None:
        """Copy each parameter into ``flat`` and make ``p.data`` its view there (a no-op for
        the parameters that already are)."""
        with torch.no_grad():
            for p, o in zip(params, self.offsets, strict=True):
                if (p.dtype, p.device) != (self.flat.dtype, self.flat.device):
                    raise HpcdlError(
                        f"ZeroOptimizer: a parameter became {p.dtype} on {p.device} after the optimizer was built "
                        f"on {self.flat.dtype} on {self.flat.device}; move or cast the model before building it"
                    )
                view = self.flat[o : o + p.numel()].view(p.shape)
                if p.data_ptr() != view.data_ptr() or p.stride() != view.stride():
                    view.copy_(p)
                    p.data = view
        self.ptrs = [p.data_ptr() for p in params]

    def check(self, params: list[torch.nn.Parameter]) -> None:
        """Adopt the parameters whose tensors were replaced since the last step
        (``p.data = ...``); in-place writes need nothing."""
        if [p.data_ptr() for p in params] != self.ptrs:
            self.adopt(params)

    def take_into(
        self, out: torch.Tensor, params: list[torch.nn.Parameter], tensors: list[torch.Tensor | None]
    ) -> torch.Tensor:
        """Write this rank's shard of the concatenation of ``tensors`` (shaped like
        ``params``; None reads as zeros) into ``out``; padding is left as it is."""
        hi = self.lo + self.shard_numel
        for p, o, t in zip(params, self.offsets, tensors, strict=True):
            a, b = max(o, self.lo), min(o + p.numel(), hi)
            if a < b:
                if t is None:
                    out[a - self.lo : b - self.lo].zero_()
                else:
                    out[a - self.lo : b - self.lo] = t.reshape(-1)[a - o : b - o]
        return out

    def grad_source(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The bucket's gradients as one flat tensor of ``n`` shards (zeros for the missing
        ones and the padding): a lone parameter's gradient itself when it needs no padding,
        else a copy into ``staging``."""
        if len(params) == 1 and self.numel == self.flat.numel():
            g = params[0].grad
            if g is not None and g.is_contiguous() and (g.dtype, g.device) == (self.flat.dtype, self.flat.device):
                return g.reshape(-1)
        if self.staging is None:
            self.staging = self._zeros(self.flat.numel(), self.flat)
        for p, o in zip(params, self.offsets, strict=True):
            seg = self.staging[o : o + p.numel()]
            if p.grad is None:
                seg.zero_()
            else:
                seg.copy_(p.grad.reshape(-1))
        return self.staging


class ZeroOptimizer(Reducer, torch.optim.Optimizer):
    """Shard ``optimizer``'s state (``stage=1``) and the reduced gradients (``stage=2``) over
    the ranks of ``process_set``; otherwise used like :func:`DistributedOptimizer`.

    ``param_groups`` are the wrapped optimizer's groups over the model's parameters (so
    learning-rate schedulers work); ``optim`` is the optimizer of the same class over this
    rank's shards. Existing state of ``optimizer`` is kept (sharded).

    Args:
        optimizer: the optimizer to shard (an element-wise one: SGD, Adam, AdamW, ...).
        stage: 1 (optimizer state) or 2 (also gradients).
        named_parameters, compression, backward_passes_per_step, op,
            gradient_predivide_factor, process_set, bucket_bytes: as for
            :func:`DistributedOptimizer`.
    """

    _kind = "ZeroOptimizer"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stage: int = 1,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        compression: type[Compressor] = Compression.none,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        gradient_predivide_factor: float = 1.0,
        process_set: ProcessSet = global_process_set,
        bucket_bytes: int | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise HpcdlArgumentError(f"ZeroOptimizer needs a torch.optim.Optimizer, not {type(optimizer).__name__}")
        if isinstance(optimizer, Reducer):
            raise HpcdlArgumentError(
                "ZeroOptimizer wraps a plain optimizer, not a DistributedOptimizer or ZeroOptimizer"
            )
        if stage not in (1, 2):
            raise HpcdlArgumentError(
                f"ZeroOptimizer: stage={stage!r} must be 1 (optimizer state) or 2 (also gradients)"
            )
        if not is_elementwise(type(optimizer)):
            raise HpcdlArgumentError(
                f"ZeroOptimizer cannot shard {type(optimizer).__name__}: its update of an element depends on "
                "other elements; use an element-wise optimizer (SGD, Adam, AdamW, RMSprop, ...) or "
                "DistributedOptimizer"
            )
        torch.optim.Optimizer.__init__(self, [dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.stage = stage
        self._hpcdl_setup(
            named_parameters,
            compression,
            backward_passes_per_step,
            op,
            gradient_predivide_factor,
            process_set,
            bucket_bytes,
        )
        self._check_agreement(type(optimizer).__name__)
        n, r = process_set.size(), process_set.rank()
        self._n = n
        for b in self._buckets:
            b.zero = _FlatShard(b.params, n, r, process_set)
        # the inner optimizer: one group per parameter group that has buckets, over the shards
        self._inner_group: dict[int, int] = {}
        groups = []
        for gi, g in enumerate(self.param_groups):
            shards = [b.zero.shard for b in self._buckets if b.group == gi]
            if shards:
                self._inner_group[gi] = len(groups)
                groups.append({**hyperparameters(g), "params": shards})
        if not groups:
            raise HpcdlArgumentError("ZeroOptimizer: no parameter requires a gradient")
        self.optim = type(optimizer)(groups)
        if optimizer.state:
            self.load_state_dict(optimizer.state_dict())

    def _check_agreement(self, optimizer: str) -> None:
        """Shards only line up when every rank cuts the same buckets: compare once, here
        (collective over the process set), and raise on every rank naming what differs."""
        mine = {
            "stage": self.stage,
            "optimizer": optimizer,
            "buckets": [[(tuple(p.shape), str(p.dtype)) for p in b.params] for b in self._buckets],
        }
        self._agree(mine)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, ranks={self._n}, optim={self.optim!r})"

    # -- the step --------------------------------------------------------------------------
    def step(self, closure: Any = None) -> Any:
        """Synchronize the gradients (unless already done or skipped), step this rank's
        shards with the wrapped optimizer, and allgather the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synchronized and not self._skip:
            self.synchronize()
        self._synchronized = False
        for gi, g in enumerate(self.param_groups):  # hyperparameters a scheduler may have changed
            if gi in self._inner_group:
                self.optim.param_groups[self._inner_group[gi]].update(hyperparameters(g))
        with torch.no_grad():
            for b in self._buckets:
                lay = b.zero
                lay.check(b.params)
                if self.stage == 1:
                    lay.shard.grad = lay.take_into(lay.grad, b.params, [p.grad for p in b.params])
        self.optim.step()  # updates this rank's shard of every bucket, in the parameters
        handles = [
            allgather_into_async(b.zero.shard, b.zero.flat, f"{self._prefix}.params{b.index}", self._process_set)
            for b in self._buckets
        ]
        for b, h in zip(self._buckets, handles, strict=True):
            synchronize(h)
            b.zero.shard.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the optimizer's, but refused while reductions are in flight; also clears the shards' gradients."""
        super().zero_grad(set_to_none=set_to_none)
        for b in self._buckets:
            b.zero.shard.grad = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradients so their total norm is at most ``max_norm`` (after
        :meth:`synchronize`, inside :meth:`skip_synchronize`); returns the total norm before
        clipping. At stage 2 the gradients exist only as shards, so this is the way to clip."""
        if not self._synchronized:
            raise HpcdlError("clip_grad_norm_() needs the reduced gradients: call synchronize() first")
        if self.stage == 1:  # every rank holds the whole reduced gradient
            params = [p for b in self._buckets for p in b.params]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        shards = [b.zero.shard.grad for b in self._buckets]
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max().double() for g in shards]).max().reshape(1)
            total = allreduce(local, name=f"{self._prefix}.norm", op=Max, process_set=self._process_set)[0]
        else:
            local = sum(g.double().abs().pow(norm_type).sum() for g in shards).reshape(1)
            total = allreduce(local, name=f"{self._prefix}.norm", op=Sum, process_set=self._process_set)[0]
            total = total ** (1.0 / norm_type)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for g in shards:
                g.mul_(coef)
        return total.to(shards[0].dtype)

    # -- gradients: per-bucket sending ---------------------------------------------------------
    def _refuse_sparse(self, b: Bucket) -> None:
        sparse = [self._names[p] for p in b.params if p.grad is not None and p.grad.is_sparse]
        if sparse:
            raise HpcdlArgumentError(
                f"ZeroOptimizer shards dense gradients only; {sparse} are sparse: build the embedding with "
                "sparse=False or use DistributedOptimizer"
            )

    def _submit(self, b: Bucket) -> None:
        if self.stage == 1:  # allreduce in place, as DistributedOptimizer
            self._refuse_sparse(b)
            super()._submit(b)
            return
        lay = b.zero
        self._refuse_sparse(b)
        flat = lay.grad_source(b.params)
        for p in b.params:  # this rank keeps only its shard of the reduced gradient
            p.grad = None
        t, ctx = self._compression.compress(flat)
        b.sent = [(t, ctx, None)]
        # reduced straight into the shard's gradient buffer where the engine can write it
        b.handle = reducescatter_into_async(t, lay.grad, **self._request_args(b))

    def _unpack(self, b: Bucket, result: Any) -> None:
        if self.stage == 1:
            super()._unpack(b, result)
            return
        b.zero.shard.grad = self._compression.decompress(result, b.sent[0][1]).to(b.zero.shard.dtype)

    # -- consolidated state ------------------------------------------------------------------
    def _all_params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """The state of every parameter, gathered from the shards into the wrapped optimizer's
        own format (as if one unsharded optimizer had stepped). Collective: call it on every
        rank of the process set; every rank gets the whole state."""
        inner = self.optim.state
        index = {p: i for i, p in enumerate(self._all_params())}
        state: dict[int, dict[str, Any]] = {}
        for b in self._buckets:
            lay = b.zero
            st = inner.get(lay.shard, {})
            if not st:
                continue
            elementwise = [k for k, v in st.items() if is_per_element(k, v, lay.shard.shape)]
            fulls: list[torch.Tensor] = []
            if elementwise:
                fulls = synchronize(
                    grouped_allgather_async(
                        [st[k].detach().reshape(-1) for k in elementwise],
                        name=f"{self._prefix}.state{b.index}",
                        process_set=self._process_set,
                    )
                )
            flat = {**st, **dict(zip(elementwise, fulls, strict=True))}  # the bucket's state, in flat form
            for p, pst in zip(b.params, unflatten_state(flat, b.params, lay.offsets, lay.flat.numel()), strict=True):
                state[index[p]] = pst
        return {"state": state, "param_groups": numbered_groups(self.param_groups)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (from :meth:`state_dict` on any rank count, or from the
        unsharded optimizer's ``state_dict()``); each rank keeps its shard of it."""
        if not isinstance(state_dict, dict) or set(state_dict) < {"state", "param_groups"}:
            raise HpcdlArgumentError("ZeroOptimizer.load_state_dict needs a dict with 'state' and 'param_groups'")
        saved = state_dict["param_groups"]
        ours = [len(g["params"]) for g in self.param_groups]
        theirs = [len(g["params"]) for g in saved]
        if ours != theirs:
            raise HpcdlArgumentError(
                f"ZeroOptimizer.load_state_dict: the saved parameter groups have {theirs} parameters, "
                f"this optimizer's have {ours}"
            )
        index = {p: i for i, p in enumerate(self._all_params())}
        saved_states = in_parameter_order(state_dict["state"], saved)
        names = {p: self._names.get(p, f"parameter {index[p]}") for p in index}
        for g, s in zip(self.param_groups, saved, strict=True):
            g.update(hyperparameters(s))
        inner_sd = self.optim.state_dict()
        inner_state: dict[int, dict[str, Any]] = {}
        for j, b in enumerate(self._buckets_in_inner_order()):
            sts = [saved_states[index[p]] for p in b.params]
            if all(s is None for s in sts):
                continue
            self._check_shared_shard(b, sts, [names[p] for p in b.params])
            lay = b.zero
            flat = flatten_state(sts, b.params, lay.offsets, lay.flat.numel(), lay.flat.device)
            hi = lay.lo + lay.shard_numel
            inner_state[j] = {  # this rank's shard of the per-element entries; the others whole
                k: v[lay.lo : hi].clone() if is_per_element(k, v, lay.flat.shape) else copy_value(v)
                for k, v in flat.items()
            }
        for gi, g in enumerate(self.param_groups):
            if gi in self._inner_group:
                inner_sd["param_groups"][self._inner_group[gi]].update(hyperparameters(g))
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_sd["param_groups"]})

    @staticmethod
    def _check_shared_shard(b: Bucket, sts: list[dict[str, Any] | None], names: list[str]) -> None:
        """Raise unless the saved states of bucket ``b``'s parameters, which share a shard,
        have the same entries, each per element for every parameter or equal for all."""
        if any(s is None for s in sts) or any(set(s) != set(sts[0]) for s in sts):
            raise HpcdlArgumentError(
                f"ZeroOptimizer.load_state_dict: parameters {names} share a shard "
                "but the saved state has different entries for them (some have no state?)"
            )
        for k, v0 in sts[0].items():
            if all(is_per_element(k, s[k], p.shape) for s, p in zip(sts, b.params, strict=True)):
                continue
            same = all(
                (torch.is_tensor(s[k]) and torch.is_tensor(v0) and torch.equal(s[k], v0)) or s[k] is v0 or s[k] == v0
                for s in sts
            )
            if not same:
                raise HpcdlArgumentError(
                    f"ZeroOptimizer.load_state_dict: {k!r} differs between {names}, which share a shard"
                )

    def _buckets_in_inner_order(self) -> list[Bucket]:
        """The buckets in the order of the inner optimizer's parameters (its state ids)."""
        shards = [p for g in self.optim.param_groups for p in g["params"]]
        by_shard = {b.zero.shard: b for b in self._buckets}
        return [by_shard[s] for s in shards]
