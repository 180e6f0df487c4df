"""Torch inputs and expectations shared by the hpcdl tests (the torch side of ``reference.py``).

Every rank builds every rank's input from a shared seed, so each expectation is computed
locally with plain torch, another way than the collective under test.
"""

from __future__ import annotations

import torch

import hpcdl as hvd

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def data(r: int, shape, dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``r``'s input: small floats, exact in every dtype; integers whose 8-bit sums and
    products leave the dtype's range at 2 ranks already and wrap, as the library's do."""
    g = torch.Generator().manual_seed(seed * 1000 + r)
    if dtype.is_floating_point:
        return torch.randint(-8, 9, shape, generator=g).to(dtype) / 4
    lo, hi = (0, 200) if dtype == torch.uint8 else (-100, 101)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def everyone(shape, dtype, seed=0):
    return [data(r, shape, dtype, seed) for r in range(hvd.size())]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    tol = TOL.get(a.dtype, 0)
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def expected_reduce(xs, op):
    """The reduction of ``xs`` computed another way: floats in float64; integers exactly in
    int64, then wrapped into the dtype (sums and products wrap, as in MPI and Horovod), an
    average being that wrapped sum divided by the rank count, truncated toward zero."""
    if not xs[0].dtype.is_floating_point:
        stack = torch.stack([x.long() for x in xs])
        if op in (hvd.Sum, hvd.Average):
            out = stack.sum(0).to(xs[0].dtype)
            if op == hvd.Average:
                out = torch.div(out.long(), len(xs), rounding_mode="trunc").to(xs[0].dtype)
            return out
        if op == hvd.Product:
            return stack.prod(0).to(xs[0].dtype)
        return (stack.min(0) if op == hvd.Min else stack.max(0)).values.to(xs[0].dtype)
    stack = torch.stack([x.double() for x in xs])
    if op in (hvd.Sum, hvd.Average):
        out = stack.sum(0)
        if op == hvd.Average:
            out = out / len(xs)
    elif op == hvd.Min:
        out = stack.min(0).values
    elif op == hvd.Max:
        out = stack.max(0).values
    else:
        out = stack.prod(0)
    return out.to(xs[0].dtype)


def autograd_through_allreduce_and_allgather(dev: torch.device) -> None:
    """Gradients through a Sum allreduce and an allgather on ``dev``, as Horovod gives them,
    on the input's device (test_ops runs it on the CPU, test_device_cuda on a GPU)."""
    r, n = hvd.rank(), hvd.size()
    x = data(r, (3,), torch.float32, seed=7).to(dev).requires_grad_()
    y = hvd.allreduce(x, op=hvd.Sum)
    (y * torch.arange(1.0, 4.0, device=dev)).sum().backward()
    # d/dx_r of sum_j w_j * sum_q x_qj is n * w (every rank's output depends on x_r)
    assert x.grad.device == dev and torch.equal(x.grad.cpu(), n * torch.arange(1.0, 4.0))
    z = data(r, (r + 1, 2), torch.float32, seed=8).to(dev).requires_grad_()
    hvd.allgather(z).sum().backward()
    # Horovod averages the output gradients over the ranks, then takes this rank's rows:
    # every rank's output gradient is ones, so their average is too
    assert z.grad.device == dev and torch.equal(z.grad.cpu(), torch.ones(r + 1, 2))
