"""Checkpoints of ``hpcdl.train``: one file per checkpoint, written atomically, read
with ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists and dicts only:
never arbitrary unpickling).

A crash at any moment leaves every earlier checkpoint intact: the file is written under a
temporary name, flushed to disk (fsync), renamed into place and the directory entry is
flushed; a reader only ever looks at complete ``step-*.pt`` names.

Each checkpoint carries a SHA-256 digest of its content (:func:`content_digest`: every
key, number, string and tensor byte, in a fixed order), written with it and checked when
it is read: bytes that changed on disk after the write (a zeroed block, random bytes, a
copy cut short) make :func:`load` fail instead of resuming on wrong weights. The file
stays a plain ``torch.save`` dictionary (``torch.load`` reads it; the digest is its
``"sha256"`` entry).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from typing import Any

import torch

from collectives.cli import replace_file

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
    "content_digest",
]

FORMAT = "hpcdl.train.checkpoint/1"
_NAME = re.compile(r"^step-(\d{8})\.pt$")


def path_for(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}.pt")


def content_digest(obj: Any) -> str:
    """SHA-256 (hex) of ``obj``: dictionaries (keys in sorted order), lists and tuples,
    tensors (dtype, shape and bytes), strings, bytes, numbers, booleans and None, each
    tagged with its kind. Equal content gives an equal digest, whatever the memory layout
    of the tensors or the order the dictionaries were filled in; a ``TypeError`` names
    anything else."""
    h = hashlib.sha256()
    _digest_into(h, obj)
    return h.hexdigest()


def _digest_into(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(b"T" + f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(obj, dict):
        keys = sorted(obj, key=lambda k: (type(k).__name__, str(k)))
        h.update(b"D" + struct.pack("<q", len(keys)))
        for k in keys:
            _digest_into(h, k)
            _digest_into(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(b"L" + struct.pack("<q", len(obj)))
        for v in obj:
            _digest_into(h, v)
    elif obj is None or isinstance(obj, (bool, int, float)):
        text = repr(obj).encode()
        h.update(b"N" + type(obj).__name__.encode() + struct.pack("<q", len(text)) + text)
    elif isinstance(obj, (str, bytes)):
        raw = obj.encode() if isinstance(obj, str) else obj
        h.update((b"S" if isinstance(obj, str) else b"B") + struct.pack("<q", len(raw)) + raw)
    else:
        raise TypeError(f"a checkpoint holds tensors, numbers, strings, lists and dicts, not {type(obj).__name__}")


def save_atomic(obj: dict[str, Any], path: str) -> None:
    """Write ``obj`` with ``torch.save``, its content digest added as ``"sha256"``, so that
    ``path`` is either absent, the old file, or the complete new one."""
    obj = {k: v for k, v in obj.items() if k != "sha256"}
    obj["sha256"] = content_digest(obj)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    replace_file(path, lambda fh: torch.save(obj, fh), binary=True, durable=True)


def steps_in(directory: str) -> list[int]:
    """Steps of the complete checkpoints in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(directory)) if m)


def latest(directory: str) -> str | None:
    steps = steps_in(directory)
    return path_for(directory, steps[-1]) if steps else None


def load(path: str) -> dict[str, Any]:
    """Read the checkpoint at ``path`` and check its digest; ``ValueError`` saying what is
    wrong with it when it is empty, cut short, not a checkpoint of this format, or its
    content is not what was written."""
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
    written = obj.pop("sha256", None)
    if not isinstance(written, str):
        raise ValueError("it carries no checksum, so its content cannot be checked")
    try:
        now = content_digest(obj)
    except TypeError as exc:
        raise ValueError(f"it is corrupt ({exc})") from None
    if now != written:
        raise ValueError(f"it is corrupt: its content's SHA-256 is {now[:12]}..., written as {written[:12]}...")
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
