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
    """Rank ``r``'s input: small values, exact in every dtype (sums of 4 stay in int8)."""
    g = torch.Generator().manual_seed(seed * 1000 + r)
    if dtype.is_floating_point:
        return torch.randint(-8, 9, shape, generator=g).to(dtype) / 4
    lo = 0 if dtype == torch.uint8 else -8
    return torch.randint(lo, 9, shape, generator=g).to(dtype)


def everyone(shape, dtype, seed=0):
    return [data(r, shape, dtype, seed) for r in range(hvd.size())]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    tol = TOL.get(a.dtype, 0)
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def expected_reduce(xs, op):
    stack = torch.stack([x.double() for x in xs])
    if op == hvd.Sum:
        out = stack.sum(0)
    elif op == hvd.Average:
        out = stack.sum(0) / len(xs)
        if not xs[0].dtype.is_floating_point:
            out = torch.trunc(out)
    elif op == hvd.Min:
        out = stack.min(0).values
    elif op == hvd.Max:
        out = stack.max(0).values
    else:
        out = stack.prod(0)
    return out.to(xs[0].dtype)
