"""Entry points for runtimes built on the collectives, such as hpcdl's engine: calls whose
arguments the caller agreed across ranks already, and the node channel's polite mode.

The public functions check every call's arguments on every rank before data moves (an
exchange of signatures). A runtime that negotiates its own requests first, as hpcdl's
engine does, would pay for that agreement twice; the functions here skip the second.
The caller promises that every rank passes the same dtype, shape, op and root (and, for
:func:`allgather`, knows every rank's rows), and that every rank runs with the same
configuration: :func:`fingerprint` is what to compare once, when the runtime starts.

On one node a call still posts its signature through the node channel: a small one
because its data travels with it, a larger one because it says where this rank's buffers
lie in the node's arena (when every rank's do, the peers read them in place). Across nodes
every call goes straight to the data.
Local argument errors (a bad ``out``) still raise, on this rank only: the caller has
already judged what the ranks passed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from .algorithms.adasum import allreduce as adasum_schedule
from .api import allgather_agreed as allgather
from .api import allreduce_agreed as allreduce
from .api import broadcast_agreed as broadcast
from .api import reduce_scatter_agreed as reduce_scatter
from .config import load_config
from .context import get_context
from .errors import InvalidArgumentError
from .ops import DTYPES
from .select import load_table

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "adasum", "fingerprint", "set_polite"]


def adasum(x: np.ndarray, *, out: np.ndarray | None = None, comm: Any = None) -> np.ndarray:
    """The Adasum of every rank's floating-point ``x`` (:mod:`collectives.algorithms.adasum`), in
    ``out`` when given. The number of ranks must be a power of two (an
    :class:`~collectives.InvalidArgumentError` otherwise, on every rank alike)."""
    ctx = get_context(comm)
    t = ctx.transport
    if t.size & (t.size - 1):
        raise InvalidArgumentError(f"Adasum needs a power-of-two number of ranks, not {t.size}")
    if np.dtype(x.dtype) not in DTYPES[:4]:  # float16, bfloat16, float32, float64
        raise InvalidArgumentError(f"Adasum combines floating-point tensors, not {x.dtype}")
    if out is None:
        out = np.empty(x.shape, x.dtype)
    if out is not x:
        np.copyto(out, x)
    flat = out.reshape(-1)
    if t.size > 1 and flat.size:
        tag, sum_tag = ctx.next_tag(), ctx.next_tag()
        ctx.run(adasum_schedule(ctx, t, flat, tag, sum_tag))
    return out


def fingerprint() -> str:
    """A digest of what steers this process's choices of algorithm and path (the
    collectives configuration from the environment, and its tuning table). Ranks that
    call the entry points here must have equal fingerprints: compare them once, when the
    runtime starts. Local: no communication."""
    cfg = load_config()
    text = json.dumps([dataclasses.asdict(cfg), load_table(cfg.tuning_file)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def set_polite(comm: Any, busy: Callable[[], bool] | None) -> None:
    """While ``busy()`` returns True, a rank waiting for a peer on ``comm``'s node channel
    polls only briefly before it sleeps (its process has other work on the same cores,
    e.g. a training thread); None restores full polling. Does nothing where ``comm`` has
    no node channel (several nodes, or one rank). Collective on the communicator's first use."""
    ch = get_context(comm).chan
    if ch is not None:
        ch.polite = busy
