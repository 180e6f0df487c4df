"""Reduction ops and the dtype table, with the one reduction kernel ``reduce_into`` and the
rank-order reducer the node engine uses (:func:`rank_order_reducer`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from .errors import UnsupportedDtypeError, UnsupportedOpError

__all__ = [
    "OPS",
    "DTYPES",
    "check_dtype",
    "check_op",
    "reduce_into",
    "ufunc",
    "finalize",
    "dtype_code",
    "rank_order_reducer",
]

#: Reduction ops by name. ``avg`` reduces as ``sum`` and divides once at the end.
OPS: tuple[str, ...] = ("sum", "avg", "min", "max", "prod")

#: Supported dtypes, in a fixed order: the index is the dtype's code on the wire.
DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d)
    for d in (
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.float64,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
    )
)
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
_UFUNC = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def dtype_code(dtype: np.dtype) -> int:
    """Return the wire code of ``dtype``, or -1 if it is unsupported."""
    return _DTYPE_CODE.get(dtype, -1)


def check_dtype(dtype: np.dtype) -> np.dtype:
    """Return ``dtype`` if supported, else raise :class:`UnsupportedDtypeError`."""
    if dtype not in _DTYPE_CODE:
        names = ", ".join(str(d) for d in DTYPES)
        raise UnsupportedDtypeError(f"dtype {dtype} is not supported; use one of: {names}")
    return dtype


def check_op(op: str) -> str:
    """Return ``op`` if it names a reduction, else raise :class:`UnsupportedOpError`."""
    if op not in _UFUNC:
        raise UnsupportedOpError(f"op {op!r} is not supported; use one of: {', '.join(OPS)}")
    return op


def ufunc(op: str) -> np.ufunc:
    """Return the numpy ufunc that combines two arrays for ``op``."""
    return _UFUNC[op]


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str) -> None:
    """Combine ``src`` into ``dst`` elementwise in place (``dst = dst op src``)."""
    _UFUNC[op](dst, src, out=dst)


def finalize(buf: np.ndarray, op: str, size: int) -> None:
    """Apply the post-reduction step of ``op`` to ``buf`` in place (avg: divide by size).

    Integer averages truncate toward zero, as C integer division does.
    """
    if op != "avg" or size == 1 or buf.size == 0:
        return
    if buf.dtype.kind in "iu":
        q = np.floor_divide(buf, size)
        # floor rounds negative quotients down; C (and torch) truncate toward zero
        fix = (buf < 0) & (q * size != buf)
        q[fix] += 1
        buf[...] = q
    else:
        np.divide(buf, buf.dtype.type(size), out=buf)


def rank_order_reducer(op: str, n: int) -> Callable[[Sequence[np.ndarray], np.ndarray], None]:
    """``red(views, out)``: ``out = views[0] op views[1] op ...`` in rank order (so every rank
    gets the same bits), then the op's final step (the average's division)."""
    f = ufunc(op)
    if op in ("min", "max"):  # numpy wants their out= by keyword; add/multiply are quicker without
        g = f
        f = lambda a, b, out: g(a, b, out=out)  # noqa: E731
    avg = op == "avg"

    def red(v: Sequence[np.ndarray], out: np.ndarray) -> None:
        f(v[0], v[1], out)
        for w in v[2:]:
            f(out, w, out)
        if avg:
            finalize(out, op, n)

    return red
