"""The response cache: descriptors every rank has seen, each with a bit position.

Once a request's descriptor is cached, negotiation announces it with one bit of a
fixed-size message instead of the pickled descriptor (Horovod's response cache). Every
rank inserts the same descriptors in the same order, so bit ``i`` means the same
descriptor everywhere; the negotiation checks that the caches' sizes agree.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ResponseCache"]


class ResponseCache:
    """Descriptors by bit position, up to ``capacity`` of them (0: off)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: list[tuple] = []
        self.ids: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def words(self) -> int:
        """int64 words of the bit vector that covers the cache."""
        return (len(self.entries) + 63) // 64

    def encode(self, descs: list[tuple], bits: np.ndarray) -> list[tuple]:
        """Set the bit of every cached descriptor of ``descs`` in ``bits`` (uint64 words);
        return the others, in order."""
        uncached = []
        for d in descs:
            cid = self.ids.get(d)
            if cid is None:
                uncached.append(d)
            else:
                bits[cid >> 6] |= np.uint64(1) << np.uint64(cid & 63)
        return uncached

    def decode(self, bits: np.ndarray) -> list[tuple]:
        """The descriptors whose bits are set in ``bits`` (int64 words), by position."""
        ids = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        return [self.entries[i] for i in ids]

    def remember(self, desc: tuple) -> None:
        """Give ``desc`` the next bit, unless it has one or the cache is full."""
        if desc not in self.ids and len(self.entries) < self.capacity:
            self.ids[desc] = len(self.entries)
            self.entries.append(desc)
