"""Every rank of a training job must run with the same settings.

A rank started with a different ``--epochs`` leaves the others waiting in a collective it
never calls; one with a different ``--lr`` trains a different model and the replicas drift
apart without a word. Before the first step the ranks compare a digest of everything that
configures the run (the training fields, the runtime section, and the collectives'
``HPCDL_*`` settings from the environment); on a difference every rank raises the same
:class:`~.config.RunError`, naming each field that differs and which ranks hold which value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from mpi4py import MPI

import hpcdl as hvd
from collectives.config import load_config as collectives_config
from collectives.errors import rank_ranges

from .config import RunError, TrainConfig

__all__ = ["settings", "check_same_settings", "rank_ranges"]


def settings(cfg: TrainConfig, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This rank's settings as one flat dictionary: the training fields by name, the runtime
    section's as ``runtime.<field>``, the collectives' as ``collectives.<field>``."""
    flat = {k: v for k, v in cfg.to_dict().items() if k != "runtime"}
    flat.update({f"runtime.{k}": v for k, v in dataclasses.asdict(cfg.runtime).items()})
    flat.update({f"collectives.{k}": v for k, v in dataclasses.asdict(collectives_config(environ)).items()})
    return flat


def check_same_settings(cfg: TrainConfig) -> None:
    """Collective: return when every rank's :func:`settings` are the same, else raise
    :class:`RunError` on every rank naming the fields that differ. Before the runtime
    starts (the command line) every process of the job takes part, the parameter servers
    too; once it runs (a script that called ``hvd.init``) its ranks do, the servers being
    busy serving."""
    if hvd.is_initialized():

        def gather(obj: Any) -> list[Any]:
            return hvd.allgather_object(obj, name="train.settings")
    else:
        gather = MPI.COMM_WORLD.allgather
    mine = settings(cfg)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True, default=repr).encode()).hexdigest()
    if len(set(gather(digest))) == 1:
        return
    every = gather(mine)
    differ = []
    for key in sorted(set().union(*every)):
        holders: dict[str, list[int]] = {}
        for rank, values in enumerate(every):
            holders.setdefault(repr(values.get(key)), []).append(rank)
        if len(holders) > 1:
            on = [f"{v} on rank{'s' if len(r) > 1 else ''} {rank_ranges(r)}" for v, r in holders.items()]
            differ.append(f"{key} is " + ", ".join(on))
    raise RunError(
        "the ranks were started with different settings: " + "; ".join(differ) + " (give every rank the same "
        "flags, config file and HPCDL_* variables)"
    )
