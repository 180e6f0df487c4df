"""Block partitions and the power-of-two fold shared by several algorithms."""

from __future__ import annotations

from functools import lru_cache

__all__ = ["block_counts", "offsets", "Fold"]


@lru_cache(maxsize=1024)
def block_counts(count: int, n: int) -> tuple[int, ...]:
    """Split ``count`` elements into ``n`` blocks, MPICH style: the first ``count % n`` get one more."""
    q, r = divmod(count, n)
    return tuple(q + 1 if i < r else q for i in range(n))


@lru_cache(maxsize=1024)
def offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Return the start of each block (length ``len(counts) + 1``, last is the total)."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return tuple(out)


class Fold:
    """Reduce ``n`` ranks to the largest power of two ``p`` for recursive algorithms.

    The first ``2 * rem`` ranks (``rem = n - p``) pair up: each even rank hands its data to
    the odd rank above it and sits out; the odd rank becomes "new rank" ``r // 2``. Ranks at
    ``2 * rem`` and above become ``r - rem``. New rank ``k`` therefore stands for the
    contiguous actual ranks ``[first(k), first(k + 1))``.
    """

    __slots__ = ("n", "p", "rem", "rank", "new")

    def __init__(self, rank: int, n: int) -> None:
        p = 1
        while p * 2 <= n:
            p *= 2
        self.n, self.p, self.rem, self.rank = n, p, n - p, rank
        if rank < 2 * self.rem:
            self.new = rank // 2 if rank % 2 else -1
        else:
            self.new = rank - self.rem

    def actual(self, k: int) -> int:
        """Actual rank that acts for new rank ``k``."""
        return 2 * k + 1 if k < self.rem else k + self.rem

    def first(self, k: int) -> int:
        """First actual rank that new rank ``k`` stands for (``first(p) == n``)."""
        return 2 * k if k < self.rem else k + self.rem
