"""Inputs and numpy references shared by the single-process and multi-rank tests.

Every rank builds every rank's input from a shared seed, so the expected result is
computed locally, another way (float64 / sequential numpy), and compared.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]
OPS = ["sum", "avg", "min", "max", "prod"]
#: Counts from 0 up: 1, fewer than the ranks, not divisible by them, and larger.
COUNTS = [0, 1, 2, 3, 5, 17, 1001]

#: Float tolerance per dtype, in units of its machine epsilon, per rank reduced.
_EPS = {
    np.dtype(np.float16): float(np.finfo(np.float16).eps),
    np.dtype(ml_dtypes.bfloat16): float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps),
    np.dtype(np.float32): float(np.finfo(np.float32).eps),
    np.dtype(np.float64): float(np.finfo(np.float64).eps),
}


def make_input(rank: int, count: int, dtype, op: str, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: small floats, so products stay finite; integers whose 8-bit sums
    leave the dtype's range at 2 ranks already and wrap, as the library's do."""
    rng = np.random.default_rng([seed, rank, count])
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        lo, hi = (1, 4) if op == "prod" else ((0, 200) if dt.kind == "u" else (-100, 101))
        return rng.integers(lo, hi, size=count).astype(dt)
    if op == "prod":
        return rng.uniform(0.5, 1.5, size=count).astype(dt)
    return rng.uniform(-1, 1, size=count).astype(dt)


def expected(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """The reduction of ``inputs`` computed independently (float64 for floats).

    Integers follow the library's semantics, which are MPI's and Horovod's: sums and
    products wrap in the dtype (computed here exactly in int64, then taken modulo the
    dtype's range), and an average is that wrapped sum divided by the rank count,
    truncated toward zero.
    """
    dt = inputs[0].dtype
    n = len(inputs)
    if dt.kind in "iu":
        acc = inputs[0].astype(np.int64)
        for x in inputs[1:]:
            acc = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op](
                acc, x.astype(np.int64)
            )
        wrapped = acc.astype(dt)  # modulo 2**bits, two's complement for the signed types
        if op == "avg":
            wrapped = np.trunc(wrapped.astype(np.int64) / n).astype(dt)
        return wrapped
    wide = np.stack([x.astype(np.float64) for x in inputs])
    red = {"sum": wide.sum(0), "avg": wide.sum(0) / n, "min": wide.min(0), "max": wide.max(0), "prod": wide.prod(0)}
    return red[op]


def check_close(got: np.ndarray, want: np.ndarray, op: str, n: int, what: str) -> None:
    """Assert ``got`` equals ``want``: exactly for integers, min and max; within tolerance otherwise."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if got.dtype.kind in "iu":
        assert got.dtype == want.dtype and np.array_equal(got, want), f"{what}: integers differ"
        return
    if op in ("min", "max"):
        assert np.array_equal(got.astype(np.float64), want), f"{what}: {op} not exact"
        return
    eps = _EPS[got.dtype]
    tol = 4 * n * eps
    g = got.astype(np.float64)
    err = np.abs(g - want)
    bound = tol * (1 + np.abs(want))
    assert (err <= bound).all(), f"{what}: max error {err.max()} exceeds {tol} relative"


def digest(a: np.ndarray | None) -> str:
    """Hash of the array's bytes, to compare results bitwise across ranks."""
    if a is None:
        return "none"
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def rank_order(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """The reduction as a rank-order schedule must give it, bit for bit: left to right in
    rank order in the inputs' own dtype (numpy ufuncs), then avg's division."""
    from collectives.ops import finalize, ufunc

    acc = np.array(inputs[0], copy=True)
    for x in inputs[1:]:
        ufunc(op)(acc, x, out=acc)
    finalize(acc, op, len(inputs))
    return acc
