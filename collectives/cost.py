"""Cost models of communication: a call of ``S`` bytes takes ``alpha + S / beta`` seconds
(Hockney's α-β model), fitted to measured times, and the time of the algorithms over links
of such a cost.

:func:`fit` takes ``(bytes, seconds)`` points, as a benchmark or the node report measures
them for one collective on one communicator, and returns the :class:`AlphaBeta` that
predicts them best in relative terms (each point weighs by the inverse square of its own
time, so the latency of small calls and the bandwidth of large ones both count).

A link (one rank's port: an NVLink, a NIC) is an :class:`AlphaBeta` too: ``alpha`` per
message, ``beta`` bytes per second each way. :data:`LINKS` names common ones at their line
rates, :func:`parse_link` reads ``"latency=5us,bandwidth=12.5GB/s"`` or a name, and
:func:`link_from_allreduce` turns a measured allreduce model back into the link a ring
over ``n`` ranks implies. :func:`ring_allreduce`, :func:`ring_allgather`,
:func:`ring_reduce_scatter` and :func:`send_time` give the time of each over a link;
:func:`allreduce_times`, :func:`reduce_scatter_times` and :func:`allgather_times` that of
each algorithm over nodes joined by a link (what ``auto`` chooses by across emulated
links, :mod:`.link`), and :func:`ps_times` that of a push and pull through the parameter
servers (what ``HybridOptimizer(node_reduce="auto")`` chooses by), with their own work
fitted by :func:`fit_ps_own` and the hybrid's phases inside a node by :func:`fit_ps_phases`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

__all__ = [
    "LINKS",
    "COLLECTIVE_TIMES",
    "reduce_scatter_times",
    "allgather_times",
    "AlphaBeta",
    "allreduce_times",
    "fit",
    "link_from_allreduce",
    "parse_link",
    "ring_allgather",
    "ring_allreduce",
    "ring_reduce_scatter",
    "send_time",
    "ps_times",
    "ps_own_load",
    "fit_ps_own",
    "fit_ps_phases",
]


class AlphaBeta(NamedTuple):
    """``alpha`` seconds per call plus ``nbytes / beta`` (``beta`` in bytes per second)."""

    alpha: float
    beta: float

    def time(self, nbytes: float, calls: float = 1.0) -> float:
        """Seconds for ``calls`` calls carrying ``nbytes`` bytes in all."""
        return calls * self.alpha + nbytes / self.beta


def fit(points: Iterable[tuple[float, float]]) -> AlphaBeta:
    """The α-β model nearest ``points`` (``(bytes, seconds)``, at least two sizes) in
    relative error: least squares of ``(alpha + S / beta) / t - 1``. A negative intercept
    (the smallest calls cost nothing beyond bandwidth) is clamped to 0 and the bandwidth
    refitted alone; so is a bandwidth that comes out infinite or negative (every size took
    the same time), which leaves the latency alone.

    Raises:
        ValueError: fewer than two distinct sizes, or a time that is not positive.
    """
    pts = [(float(s), float(t)) for s, t in points]
    if len({s for s, _ in pts}) < 2:
        raise ValueError(f"fit: needs at least two distinct sizes, not {sorted({s for s, _ in pts})}")
    if any(not t > 0 or s < 0 for s, t in pts):
        raise ValueError("fit: every time must be positive and every size non-negative")
    # minimise sum((a / t + s / t * g - 1)^2) over a and g = 1 / beta: 2 x 2 normal equations
    xa = [1 / t for _, t in pts]
    xg = [s / t for s, t in pts]
    saa = sum(u * u for u in xa)
    sgg = sum(v * v for v in xg)
    sag = sum(u * v for u, v in zip(xa, xg, strict=True))
    sa, sg = sum(xa), sum(xg)
    det = saa * sgg - sag * sag
    a, g = ((sa * sgg - sg * sag) / det, (sg * saa - sa * sag) / det) if det > 0 else (-1.0, -1.0)
    if a < 0:
        a, g = 0.0, sg / sgg
    if g <= 0:
        a, g = sa / saa, 0.0
    return AlphaBeta(a, math.inf if g == 0 else 1 / g)


_GBIT = 1e9 / 8
LINKS: dict[str, AlphaBeta] = {
    # inside a node, per GPU and direction
    "nvlink3": AlphaBeta(2e-6, 300e9),  # A100: 12 links of 25 GB/s each way, through NVSwitch
    "nvlink4": AlphaBeta(2e-6, 450e9),  # H100: 18 links of 25 GB/s each way
    "pcie4": AlphaBeta(3e-6, 32e9),  # x16, through the host
    "pcie5": AlphaBeta(3e-6, 64e9),
    # between nodes, per port and direction
    "ib-edr": AlphaBeta(2e-6, 100 * _GBIT),
    "ib-hdr": AlphaBeta(2e-6, 200 * _GBIT),
    "ib-ndr": AlphaBeta(2e-6, 400 * _GBIT),
    "eth-10g": AlphaBeta(10e-6, 10 * _GBIT),
    "eth-25g": AlphaBeta(8e-6, 25 * _GBIT),
    "eth-100g": AlphaBeta(5e-6, 100 * _GBIT),
    "eth-200g": AlphaBeta(5e-6, 200 * _GBIT),
    "eth-400g": AlphaBeta(5e-6, 400 * _GBIT),
}
"""Links by name at their line rates: NVLink and PCIe per GPU, InfiniBand (EDR, HDR, NDR:
100, 200 and 400 Gbit/s) and Ethernet with RDMA per port; latency per message."""

_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_UNITS = {
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
    "kbit/s": 1e3 / 8,
    "mbit/s": 1e6 / 8,
    "gbit/s": 1e9 / 8,
    "tbit/s": 1e12 / 8,
}


def _quantity(text: str, units: dict[str, float], what: str) -> float:
    t = text.strip()
    for unit in sorted(units, key=len, reverse=True):
        if t.lower().endswith(unit.lower()):
            number = t[: len(t) - len(unit)].strip()
            try:
                v = float(number) * units[unit]
            except ValueError:
                break
            if not (math.isfinite(v) and v > 0):
                break
            return v
    raise ValueError(f"{what} {text!r}: a positive number with a unit, one of {', '.join(units)}")


def parse_link(text: str) -> AlphaBeta:
    """The link ``text`` names: a name from :data:`LINKS`, or
    ``"latency=5us,bandwidth=12.5GB/s"`` (latency in ns, us, ms or s; bandwidth in B/s, kB/s,
    MB/s, GB/s, TB/s or kbit/s ... Tbit/s, per direction; either part may come alone, the
    other then 0 latency or unlimited bandwidth).

    Raises:
        ValueError: an unknown name, key or unit, or a value that is not positive.
    """
    name = text.strip().lower()
    if name in LINKS:
        return LINKS[name]
    alpha, beta, seen = 0.0, math.inf, False
    for part in filter(None, (p.strip() for p in name.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in ("latency", "bandwidth"):
            raise ValueError(f"link {text!r}: expected one of {', '.join(LINKS)} or 'latency=5us,bandwidth=12.5GB/s'")
        if key.strip() == "latency":
            alpha = _quantity(value, _TIME_UNITS, "latency")
        else:
            beta = _quantity(value, _RATE_UNITS, "bandwidth")
        seen = True
    if not seen:
        raise ValueError(f"link {text!r}: expected one of {', '.join(LINKS)} or 'latency=5us,bandwidth=12.5GB/s'")
    return AlphaBeta(alpha, beta)


def link_from_allreduce(model: AlphaBeta, n: int) -> AlphaBeta:
    """The link a ring allreduce over ``n`` ranks implies, given its measured model per call
    (the inverse of :func:`ring_allreduce`: ``2 (n - 1)`` latencies and ``2 (n - 1) / n`` of
    the message over each link)."""
    if n < 2:
        raise ValueError(f"link_from_allreduce: n={n}: a ring needs two ranks")
    return AlphaBeta(model.alpha / (2 * (n - 1)), model.beta * 2 * (n - 1) / n)


def ring_allreduce(link: AlphaBeta, n: int, nbytes: float) -> float:
    """Seconds to allreduce ``nbytes`` over ``n`` ranks in a ring of ``link``: a
    reduce-scatter and an allgather, each ``n - 1`` steps of ``nbytes / n``."""
    return 0.0 if n < 2 else 2 * ring_reduce_scatter(link, n, nbytes)


def ring_reduce_scatter(link: AlphaBeta, n: int, nbytes: float) -> float:
    """Seconds to reduce-scatter ``nbytes`` (the whole input) over ``n`` ranks in a ring."""
    return 0.0 if n < 2 else (n - 1) * (link.alpha + nbytes / n / link.beta)


def ring_allgather(link: AlphaBeta, n: int, nbytes: float) -> float:
    """Seconds to allgather ``nbytes`` (the whole output) over ``n`` ranks in a ring."""
    return ring_reduce_scatter(link, n, nbytes)


def send_time(link: AlphaBeta, nbytes: float) -> float:
    """Seconds for one message of ``nbytes`` over ``link``."""
    return link.alpha + nbytes / link.beta


def _step(m: float, crosses: bool, flows: float, intra: AlphaBeta, inter: AlphaBeta) -> float:
    """One exchange of ``m`` bytes: inside a node, or across, ``flows`` messages sharing each
    port of a node at once."""
    return send_time(inter, flows * m) if crosses else send_time(intra, m)


def allreduce_times(
    nbytes: float, ranks: int, per_node: int, intra: AlphaBeta, inter: AlphaBeta, ports: float = 1.0
) -> dict[str, float]:
    """Seconds each allreduce algorithm of :mod:`collectives.algorithms` takes on ``ranks``
    ranks placed ``per_node`` to a node in rank order, messages inside a node over ``intra``
    and between nodes over ``inter``, through ``ports`` ports a node (a NIC each; a
    fraction: the share of the node's ports these ranks get), which the messages leaving
    the node at once share:

    - ``ring``: a block's way round the ring, twice: ``n - 1`` steps, each node's one
      crossing among them; or, if longer, the ``2 (n - 1)`` messages a node's last rank
      sends through its port;
    - ``recursive_doubling`` and ``rabenseifner``: an exchange at distance ``d`` crosses
      when ``d >= per_node``, all of a node's ranks at once; a rank count that is not a
      power of two folds first;
    - ``hierarchical``: a ring inside each node, then the nodes' allreduce of each rank's
      block (recursive doubling below 64 KiB, the algorithm's ``CROSS_RING_BYTES``, then
      ring), then a ring inside each node again.
    """
    n, k = ranks, max(1, min(per_node, ranks))
    nodes = -(-n // k)
    if n < 2:
        return dict.fromkeys(("ring", "recursive_doubling", "rabenseifner", "hierarchical"), 0.0)
    if not ports > 0:
        raise ValueError(f"allreduce_times: ports={ports} must be positive")
    share = k * min(ports, 1.0) / min(ports, k)  # k messages at once, against one alone
    inter = AlphaBeta(inter.alpha, inter.beta * min(ports, 1.0))  # what one message alone gets
    p = 1 << (n.bit_length() - 1)  # the power of two the others fold onto
    fold = 2 * _step(nbytes, k < 2, 1, intra, inter) if p < n else 0.0
    one = lambda m, d: _step(m, d >= k, share, intra, inter)  # noqa: E731 - an exchange at distance d
    masks = [1 << i for i in range(p.bit_length() - 1)]
    near = send_time(intra, nbytes / n)  # one ring step's message, inside a node
    far = send_time(inter, nbytes / n)  # and across
    crossings = 0 if nodes < 2 else nodes if k > 1 else n - 1  # on a path of n - 1 ring steps
    path = 2 * (crossings * far + (n - 1 - crossings) * near)  # a block's way round, twice
    port = 2 * (n - 1) * nbytes / n / inter.beta + inter.alpha if nodes > 1 else 0.0  # a node's last rank sends all
    times = {
        "ring": max(path, port),
        "recursive_doubling": fold + sum(one(nbytes, d) for d in masks),
        "rabenseifner": fold + 2 * sum(one(nbytes / (p // d), d) for d in masks),
    }
    inside = ring_reduce_scatter(intra, k, nbytes)  # and as long for the allgather after
    if nodes < 2:
        across = 0.0
    elif nbytes / k < 64 << 10:  # each of a node's k ranks sends its block at once
        q = 1 << (nodes.bit_length() - 1)
        across = (q.bit_length() - 1 + (2 if q < nodes else 0)) * _step(nbytes / k, True, share, intra, inter)
    else:
        across = 2 * (nodes - 1) * _step(nbytes / k / nodes, True, share, intra, inter)
    times["hierarchical"] = 2 * inside + across
    return times


def reduce_scatter_times(
    nbytes: float, ranks: int, per_node: int, intra: AlphaBeta, inter: AlphaBeta, ports: float = 1.0
) -> dict[str, float]:
    """Seconds each reduce-scatter of :mod:`collectives.algorithms` takes on ``nbytes`` (the
    whole input), placed as :func:`allreduce_times` places ranks: ``ring`` is the ring
    allreduce's first half, ``recursive_halving`` Rabenseifner's."""
    t = allreduce_times(nbytes, ranks, per_node, intra, inter, ports)
    return {"ring": t["ring"] / 2, "recursive_halving": t["rabenseifner"] / 2}


def allgather_times(
    nbytes: float, ranks: int, per_node: int, intra: AlphaBeta, inter: AlphaBeta, ports: float = 1.0
) -> dict[str, float]:
    """Seconds each allgather of :mod:`collectives.algorithms` takes on ``nbytes`` (the whole
    output), placed as :func:`allreduce_times` places ranks: ``ring`` is the ring
    allreduce's second half, ``recursive_doubling`` Rabenseifner's."""
    t = allreduce_times(nbytes, ranks, per_node, intra, inter, ports)
    return {"ring": t["ring"] / 2, "recursive_doubling": t["rabenseifner"] / 2}


COLLECTIVE_TIMES = {"allreduce": allreduce_times, "reduce_scatter": reduce_scatter_times, "allgather": allgather_times}
"""The collectives whose algorithms the model times, and the function that times them."""


def ps_times(
    nbytes: float,
    workers: int,
    per_node: int,
    intra: AlphaBeta,
    inter: AlphaBeta,
    servers: int = 0,
    piece: float = 4 << 20,
    servers_per_node: int = 0,
    own: AlphaBeta | None = None,
    phases: AlphaBeta | None = None,
) -> dict[str, float]:
    """Seconds one synchronous push and pull of ``nbytes`` of gradients takes through the
    parameter servers of :mod:`hpcdl.ps`, ``workers`` placed ``per_node`` to a node in
    rank order, with ``servers`` dedicated servers on nodes of their own after the workers'
    (``servers_per_node`` to a node, by default ``per_node``) or, with 0, a server on every
    node's first worker (co-located: its replies share the node's port with the pushes):

    - ``ps-sync``: every worker pushes its whole gradient and pulls the sum;
    - ``hybrid``: a ring reduce-scatter inside the node, then each worker pushes and pulls
      its shard (``nbytes / per_node``), then a ring allgather inside the node: each of
      their messages at ``intra`` (a node's message path), or with ``phases`` each of the
      two a call of ``phases.alpha`` plus the bytes a rank moves in it,
      ``nbytes (per_node - 1) / per_node``, at ``phases.beta`` (:func:`fit_ps_phases`).

    The pushed bytes are cut into partitions of at most ``piece`` bytes, spread over the
    servers as :class:`hpcdl.ps.PartitionPlan` spreads them (largest first onto the least
    loaded). A node's workers push together, sharing its port: their first partitions
    leave it first, then their second ones, and so on. A partition is summed once every
    worker's has arrived (a latency after leaving), and its server's node port then sends it
    to each worker in turn. The result is when the last reply has arrived.

    ``own`` is what the exchange costs the processes themselves, per contribution (one
    worker's partition): ``own.alpha`` plus its bytes at ``own.beta``, for the worker's
    packing and unpacking, the server's receive, sum and reply, the runtime's waits
    (:func:`fit_ps_own` fits it to exchanges timed without a link). The busiest server's
    share of it is added to the links' time: across emulated links the sum predicted the
    measured exchanges better than letting a server's work on one partition overlap the
    next one's arrival, which under-predicted them (``benchmarks/README.md``). Without
    ``own`` that work takes no time.
    """
    k = max(1, min(per_node, workers))
    times = {
        name: _ps_exchange(nbytes, workers, k, reduce, inter, servers, piece, servers_per_node or k)
        + (_own_work(own, nbytes, workers, k, reduce, servers, piece) if own is not None else 0.0)
        for name, reduce in (("ps-sync", False), ("hybrid", True))
    }
    if phases is not None and k > 1:
        times["hybrid"] += 2 * phases.time(nbytes * (k - 1) / k)
    else:
        times["hybrid"] += ring_reduce_scatter(intra, k, nbytes) + ring_allgather(intra, k, nbytes)
    return times


def _ps_cuts(
    nbytes: float, workers: int, k: int, reduce: bool, count: int, piece: float
) -> tuple[list[float], list[int], list[list[int]], int]:
    """The partitions of one exchange (:func:`ps_times`; ``reduce``: the hybrid's shards) over
    ``count`` servers: each cut's bytes, its server, the workers that push it, and how many
    cuts a shard has (cut ``s * m + j`` is partition ``j`` of shard ``s``)."""
    nodes = -(-workers // k)
    shards = k if reduce else 1
    shard = nbytes / shards
    m = max(1, math.ceil(shard / piece))
    sizes = [min(piece, shard - j * piece) for j in range(m)]
    cuts = [sizes[j] for _ in range(shards) for j in range(m)]
    load, owner = [0.0] * count, [0] * len(cuts)
    for i in sorted(range(len(cuts)), key=lambda i: (-cuts[i], i)):
        owner[i] = min(range(count), key=lambda j: (load[j], j))
        load[owner[i]] += cuts[i]
    pushers: list[list[int]] = [[] for _ in cuts]
    for node in range(nodes):
        for w in range(node * k, min(workers, (node + 1) * k)):
            for j in range(m):
                pushers[((w - node * k) if reduce else 0) * m + j].append(w)
    return cuts, owner, pushers, m


def _ps_exchange(
    nbytes: float, workers: int, k: int, reduce: bool, inter: AlphaBeta, servers: int, piece: float, spn: int
) -> float:
    """:func:`ps_times`' wire time of one path (``reduce``: the hybrid's shards)."""
    nodes = -(-workers // k)
    count = servers or nodes
    cuts, owner, pushers, m = _ps_cuts(nbytes, workers, k, reduce, count, piece)
    home = [nodes + s // spn for s in range(count)] if servers else list(range(count))
    free = [0.0] * (nodes + (-(-count // spn) if servers else 0))  # each node's port: busy until
    ready = [0.0] * len(cuts)
    for node in range(nodes):
        ranks = range(node * k, min(workers, (node + 1) * k))
        for j in range(m):  # the node's workers' partitions j leave together
            mine = [((w - node * k) if reduce else 0) * m + j for w in ranks]
            crossing = [i for i in mine if home[owner[i]] != node]
            free[node] += sum(cuts[i] for i in crossing) / inter.beta
            for i in crossing:
                ready[i] = max(ready[i], free[node] + inter.alpha)
    done = 0.0
    for i in sorted(range(len(cuts)), key=lambda i: (ready[i], i)):
        port = home[owner[i]]
        for w in pushers[i]:
            if w // k == port:  # a co-located server's own node: no port
                done = max(done, ready[i])
                continue
            free[port] = max(free[port], ready[i]) + cuts[i] / inter.beta
            done = max(done, free[port] + inter.alpha)
    return done


def _server_loads(
    nbytes: float, workers: int, k: int, reduce: bool, servers: int, piece: float
) -> list[tuple[int, float]]:
    """Each server's contributions in one exchange, and their bytes."""
    count = servers or -(-workers // k)
    cuts, owner, pushers, _ = _ps_cuts(nbytes, workers, k, reduce, count, piece)
    loads = [(0, 0.0)] * count
    for i, c in enumerate(cuts):
        calls, load = loads[owner[i]]
        loads[owner[i]] = (calls + len(pushers[i]), load + len(pushers[i]) * c)
    return loads


def _own_work(own: AlphaBeta, nbytes: float, workers: int, k: int, reduce: bool, servers: int, piece: float) -> float:
    """:func:`ps_times`' own work of one path: the busiest server's contributions at ``own``."""
    return max(own.time(load, calls) for calls, load in _server_loads(nbytes, workers, k, reduce, servers, piece))


def ps_own_load(
    nbytes: float, workers: int, per_node: int, servers: int = 0, piece: float = 4 << 20, reduce: bool = False
) -> tuple[int, float]:
    """The busiest server's share of one exchange (:func:`ps_times`' placement; ``reduce``:
    the hybrid's): its contributions and their bytes, the server with the most bytes (of
    those, the most contributions). :func:`ps_times` itself takes the server whose share
    costs the most at its ``own``, which is the same one where the partitions are even."""
    k = max(1, min(per_node, workers))
    return max(_server_loads(nbytes, workers, k, reduce, servers, piece), key=lambda cl: (cl[1], cl[0]))


def fit_ps_own(points: Iterable[tuple[float, float, int, int, int, float]]) -> AlphaBeta:
    """The parameter servers' own cost a contribution (:func:`ps_times`' ``own``) that
    predicts ``points`` best: each ``(seconds, nbytes, workers, per_node, servers, piece)``,
    one ``ps-sync`` exchange timed without a link, where the busiest server's work
    (:func:`ps_own_load`) is all its time. Relative least squares, as :func:`fit`.

    Raises:
        ValueError: fewer than two distinct partition sizes among the points, or a time
            that is not positive.
    """
    per_call = []
    for seconds, nbytes, workers, per_node, servers, piece in points:
        calls, load = ps_own_load(nbytes, workers, per_node, servers, piece)
        per_call.append((load / calls, seconds / calls))
    return fit(per_call)


def fit_ps_phases(points: Iterable[tuple[float, float, int, int, int, float]], own: AlphaBeta | None) -> AlphaBeta:
    """The cost of each of the hybrid's two calls inside a node, its reduce-scatter and its
    allgather (:func:`ps_times`' ``phases``: ``alpha`` a call, the bytes a rank moves in it
    at ``beta``), that predicts ``points`` best: each ``(seconds, nbytes, workers,
    per_node, servers, piece)``, one ``hybrid`` exchange timed without a link, less the
    servers' ``own`` work of it (:func:`fit_ps_own`; None: none). Those calls run through
    the runtime's collectives, whose negotiation a node's message path leaves out.
    Relative least squares, as :func:`fit`.

    Raises:
        ValueError: a layout of one worker a node (no phases inside it), fewer than two
            distinct sizes, or an exchange no longer than its servers' work.
    """
    per_call = []
    for seconds, nbytes, workers, per_node, servers, piece in points:
        k = max(1, min(per_node, workers))
        if k < 2:
            raise ValueError(f"fit_ps_phases: {workers} workers, {per_node} a node: no phases inside a node")
        left = seconds - (_own_work(own, nbytes, workers, k, True, servers, piece) if own is not None else 0.0)
        per_call.append((nbytes * (k - 1) / k, left / 2))
    return fit(per_call)
