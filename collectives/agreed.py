"""Entry points for runtimes built on the collectives, such as hpcdl's engine: calls whose
arguments the caller agreed across ranks already, and the node channel's polite mode.

The public functions check every call's arguments on every rank before data moves (an
exchange of signatures). A runtime that negotiates its own requests first, as hpcdl's
engine does, would pay for that agreement twice; the functions here skip the second.
The caller promises that every rank passes the same dtype, shape, op and root (and, for
:func:`allgather`, knows every rank's rows), and that every rank runs with the same
configuration: :func:`fingerprint` is what to compare once, when the runtime starts.

A call small enough to finish in one step through the node channel still posts its
signature, since its data travels with it; everything else goes straight to the data.
Local argument errors (a bad ``out``) still raise, on this rank only: the caller has
already judged what the ranks passed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

from .api import allgather_agreed as allgather
from .api import allreduce_agreed as allreduce
from .api import broadcast_agreed as broadcast
from .api import reduce_scatter_agreed as reduce_scatter
from .config import load_config
from .context import get_context
from .select import load_table

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "fingerprint", "set_polite"]


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
