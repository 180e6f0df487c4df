"""Two-level allreduce: inside each node, then across nodes.

With the same number of ranks on every node: ring reduce-scatter inside the node, an
allreduce of each rank's block across nodes among ranks of the same local rank, and a
ring allgather inside the node. With uneven nodes the blocks would not line up across
nodes, so the fallback reduces to each node's leader, allreduces among leaders and
broadcasts inside the node.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from ..blocks import block_counts, offsets
from . import recursive_doubling, ring, tree

Schedule = Generator[list, None, None]

#: Below this many bytes the cross-node step uses recursive doubling, above it the ring.
CROSS_RING_BYTES = 64 << 10


def cross_allreduce(ctx, t, buf: np.ndarray, op: str, tag: int) -> Schedule:
    """Allreduce among nodes, choosing the algorithm by message size."""
    if buf.nbytes < CROSS_RING_BYTES:
        yield from recursive_doubling.allreduce(ctx, t, buf, op, tag)
    else:
        yield from ring.allreduce(ctx, t, buf, op, tag)


def allreduce(ctx, t, buf: np.ndarray, op: str, tag: int) -> Schedule:
    """Reduce ``buf`` in place over all ranks, node by node."""
    lay = ctx.topology()
    node, cross = lay.node, lay.cross
    if not lay.homogeneous:
        yield from tree.reduce(ctx, node, buf, 0, op, tag)
        if node.rank == 0:
            yield from cross_allreduce(ctx, cross, buf, op, tag)
        yield from tree.broadcast(ctx, node, buf, 0, tag)
        return
    counts = block_counts(buf.size, node.size)
    off = offsets(counts)
    yield from ring.reduce_scatter(ctx, node, buf, counts, op, tag)
    yield from cross_allreduce(ctx, cross, buf[off[node.rank] : off[node.rank + 1]], op, tag)
    yield from ring.allgather(ctx, node, buf, counts, tag)
