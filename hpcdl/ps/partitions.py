"""Where every gradient element goes in the parameter-server hybrid: shards and partitions.

Every role computes the same :class:`PartitionPlan` from the same description (bucket sizes, the
number of ranks a node reduces over, the servers and ``partition_bytes``), so workers and
servers agree on every message without exchanging its shape.

A bucket of ``n`` elements is padded to a multiple of ``node_ranks`` (L) and cut into L
equal shards: after the reduce-scatter inside a node, local rank ``l`` holds shard ``l``
summed over the node. Each shard is cut into partitions of at most ``partition_bytes``;
the partitions are spread over the servers by bytes, largest first onto the least-loaded
server (the longest-processing-time rule: no server carries more than the lightest one
plus the largest partition). A partition is the unit that a worker pushes, a server sums
(or steps) and a worker pulls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["Piece", "PartitionPlan"]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """One partition: elements ``[lo, hi)`` of shard ``shard`` of bucket ``bucket``, held by
    server ``server`` (an index into the servers, not a rank)."""

    index: int
    bucket: int
    shard: int
    lo: int
    hi: int
    server: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class PartitionPlan:
    """The shards and partitions of a model's gradient buckets.

    Args:
        bucket_numels: elements in each bucket, in submission order.
        itemsize: bytes per element on the wire.
        node_ranks: ranks that reduce-scatter a bucket inside a node before pushing (1: none).
        servers: number of servers.
        partition_bytes: the most bytes in one partition.
    """

    def __init__(
        self, bucket_numels: Sequence[int], itemsize: int, node_ranks: int, servers: int, partition_bytes: int
    ) -> None:
        if node_ranks < 1 or servers < 1 or partition_bytes < 1 or itemsize < 1:
            raise ValueError(f"bad partition plan: {node_ranks=} {servers=} {partition_bytes=} {itemsize=}")
        self.bucket_numels = list(bucket_numels)
        self.node_ranks = node_ranks
        self.servers = servers
        self.itemsize = itemsize
        self.shard_numels = [max(1, math.ceil(n / node_ranks)) for n in self.bucket_numels]
        per = max(1, partition_bytes // itemsize)
        cuts = []  # (bucket, shard, lo, hi)
        for b, m in enumerate(self.shard_numels):
            for s in range(node_ranks):
                for lo in range(0, m, per):
                    cuts.append((b, s, lo, min(m, lo + per)))
        load = [0] * servers
        owner = [0] * len(cuts)
        for i in sorted(range(len(cuts)), key=lambda i: (-(cuts[i][3] - cuts[i][2]), i)):
            s = min(range(servers), key=lambda j: (load[j], j))
            owner[i] = s
            load[s] += (cuts[i][3] - cuts[i][2]) * itemsize
        self.pieces = [Piece(i, *cut, owner[i]) for i, cut in enumerate(cuts)]
        self.server_bytes = load
        """Bytes of one full push that each server receives (its share of the partitions)."""

    def of_shard(self, shard: int) -> list[Piece]:
        """The partitions a rank of local rank ``shard`` pushes and pulls, in bucket order."""
        return [p for p in self.pieces if p.shard == shard]

    def of_bucket(self, bucket: int, shard: int) -> list[Piece]:
        """The partitions of one bucket's shard ``shard``."""
        return [p for p in self.pieces if p.bucket == bucket and p.shard == shard]

    def of_server(self, server: int) -> list[Piece]:
        """The partitions server ``server`` holds."""
        return [p for p in self.pieces if p.server == server]

    def padded(self, bucket: int) -> int:
        """Elements of bucket ``bucket`` padded to whole shards."""
        return self.shard_numels[bucket] * self.node_ranks
