"""Checkpoints of ``hpcdl.train``: one file per checkpoint, written atomically, read
with ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists and dicts only:
never arbitrary unpickling).

A crash at any moment leaves every earlier checkpoint intact: the file is written under a
temporary name, flushed to disk (fsync), renamed into place and the directory entry is
flushed; a reader only ever looks at complete ``step-*.pt`` names.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

__all__ = [
    "save_atomic",
    "latest",
    "load",
    "prune",
    "remove_partial",
    "remove_all",
    "path_for",
    "steps_in",
    "FORMAT",
]

FORMAT = "hpcdl.train.checkpoint/1"
_NAME = re.compile(r"^step-(\d{8})\.pt$")


def path_for(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}.pt")


def save_atomic(obj: dict[str, Any], path: str) -> None:
    """Write ``obj`` with ``torch.save`` so that ``path`` is either absent, the old file, or
    the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def steps_in(directory: str) -> list[int]:
    """Steps of the complete checkpoints in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(directory)) if m)


def latest(directory: str) -> str | None:
    steps = steps_in(directory)
    return path_for(directory, steps[-1]) if steps else None


def load(path: str) -> dict[str, Any]:
    """Read the checkpoint at ``path``; ``ValueError`` saying what is wrong with it when it
    is empty, cut short, or not a checkpoint of this format."""
    if os.path.getsize(path) == 0:
        raise ValueError("the file is empty")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's message for a truncated zip, a bare EOFError, ...
        raise ValueError(
            f"it does not load ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'cut short'})"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"it is not an hpcdl.train checkpoint (format {FORMAT!r})")
    return obj


def prune(directory: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for step in steps_in(directory)[:-keep]:
        os.unlink(path_for(directory, step))


def remove_all(directory: str) -> None:
    """Delete every checkpoint in ``directory`` (a run that starts afresh there)."""
    for step in steps_in(directory):
        os.unlink(path_for(directory, step))
    remove_partial(directory)


def remove_partial(directory: str) -> None:
    """Delete temporary files a killed writer left behind (call before the job writes)."""
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if ".pt.tmp-" in name:
                os.unlink(os.path.join(directory, name))
