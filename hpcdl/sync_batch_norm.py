"""Batch normalization with statistics over every rank's batch (a drop-in for
``torch.nn.BatchNorm1d/2d/3d``), as Horovod's ``SyncBatchNorm``.

In training, each rank allgathers its per-channel count, mean and sum of squared
deviations (float64), and every rank combines them with Chan et al.'s parallel variance
formula (no E[x^2] - E[x]^2 cancellation), so every rank normalizes with the mean and
variance of the global batch and updates the same running statistics. The backward pass reduces the two per-channel sums
the input gradient needs. In evaluation it is plain batch norm with the running stats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from . import state
from .ops import Sum, allgather_async, allreduce_async, synchronize
from .process_sets import ProcessSet, global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the whole distributed batch; arguments as ``torch.nn.BatchNorm2d``,
    plus ``process_set`` (the ranks whose batches are combined)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = global_process_set,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (got {input.dim()}-D)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or not self.track_running_stats
        if not use_batch or state.current().size == 1:
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                use_batch,
                factor,
                self.eps,
            )
        return _SyncBN.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, factor, self.process_set
        )


def _reduce(t: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    return synchronize(allreduce_async(t, op=Sum, process_set=process_set))


class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        k = x.numel() // c
        # on the input's device: the statistics computed from them must meet x there
        mine = torch.zeros(1, 2 * c + 1, dtype=torch.float64, device=x.device)
        mine[0, 0] = k
        if k:
            xd = xf.double()
            m = xd.mean(dims)
            mine[0, 1 : 1 + c] = m
            mine[0, 1 + c :] = ((xd - m.view(shape)) ** 2).sum(dims)
        rows = synchronize(allgather_async(mine, process_set=process_set))
        counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + c], rows[:, 1 + c :]
        n = float(counts.sum())
        if n <= 1:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel over all ranks, got {int(n)}")
        mean64 = (counts * means).sum(0) / n
        var64 = (m2s + counts * (means - mean64) ** 2).sum(0) / n
        mean, var = mean64.to(xf.dtype), var64.to(xf.dtype)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((var * n / (n - 1)).to(running_var.dtype), alpha=momentum)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape).to(xf.dtype) + bias.view(shape).to(xf.dtype)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.n, ctx.process_set, ctx.shape = n, process_set, shape
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight = ctx.saved_tensors
        shape, c = ctx.shape, xhat.shape[1]
        dims = [0] + list(range(2, xhat.dim()))
        dyf = dy.to(xhat.dtype)
        sum_dy = dyf.sum(dims)
        sum_dy_xhat = (dyf * xhat).sum(dims)
        dweight = sum_dy_xhat if weight is not None else None
        dbias = sum_dy if weight is not None else None
        both = _reduce(torch.cat([sum_dy, sum_dy_xhat]), ctx.process_set)
        g_sum, g_xhat = both[:c], both[c:]
        w = weight.view(shape).to(xhat.dtype) if weight is not None else 1.0
        dx = (dyf - (g_sum / ctx.n).view(shape) - xhat * (g_xhat / ctx.n).view(shape)) * invstd.view(shape) * w
        return dx.to(dy.dtype), dweight, dbias, None, None, None, None, None
