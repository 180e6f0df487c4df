"""The handle table: naming requests, submitting them, and ``poll``/``synchronize``.

Every call becomes a named request to the background engine; unnamed calls are numbered
per kind and process set, so ranks calling in the same order match. ``*_async`` returns
a handle number; :func:`synchronize` waits for its requests and turns their results into
what the call returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import state
from .engine import Submission
from .errors import HpcdlError
from .staging import home
from .state import Runtime

__all__ = ["Handle", "request_name", "submit", "poll", "synchronize", "control", "tensor_results"]


def request_name(rt: Runtime, kind: str, sid: int, name: str | None) -> str:
    """``name``, or the next number of unnamed ``kind`` requests on process set ``sid``."""
    if name is not None:
        return str(name)
    key = (kind, sid)
    k = rt.counters.get(key, 0)
    rt.counters[key] = k + 1
    return f"{kind}.noname.{sid}.{k}" if sid else f"{kind}.noname.{k}"


class Handle:
    """What a handle number stands for: engine requests and how to turn their results
    into what :func:`synchronize` returns."""

    __slots__ = ("reqs", "post")

    def __init__(self, reqs: list[Submission], post: Callable[[list[Any]], Any]) -> None:
        self.reqs, self.post = reqs, post


def submit(rt: Runtime, reqs: list[Submission], post: Callable[[list[Any]], Any]) -> int:
    """Submit ``reqs`` to the engine together; return the handle number for them."""
    rt.engine.submit_many(reqs)
    h = rt.next_handle
    rt.next_handle += 1
    rt.handles[h] = Handle(reqs, post)
    return h


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished (synchronize will not block)."""
    rt = state.running()
    hd = rt.handles.get(handle)
    if hd is None:
        raise HpcdlError(f"unknown handle {handle!r} (already synchronized?)")
    return all(r.event.is_set() for r in hd.reqs)


def synchronize(handle: int | Callable[[], Any]) -> Any:
    """Wait for the operation behind ``handle`` and return its output (tensor, or a list for
    grouped operations); raise :class:`HpcdlError` if it failed on this or another rank.
    A callable handle (``sparse_allreduce_async``'s, as Horovod returns one) is called."""
    if callable(handle):
        return handle()
    rt = state.current()
    hd = rt.handles.pop(handle, None)
    if hd is None:
        raise HpcdlError(f"unknown handle {handle!r} (already synchronized?)")
    results = []
    for req in hd.reqs:
        results.append(rt.engine.wait(req) if rt.engine is not None else req.result)
    return hd.post(results)


def control(kind: str, sig: tuple, *, var: Any = None, error: str | None = None) -> Any:
    """Run a negotiated control request (process sets, timeline) and return its result."""
    rt = state.running()
    req = Submission(request_name(rt, kind, 0, None), kind, 0, sig, var=var, error=error)
    return synchronize(submit(rt, [req], lambda res: res[0]))


def tensor_results(
    outs: list[torch.Tensor], fixups: list[Callable[[], None]], single: bool, devices: list[torch.device]
) -> Callable[[list], Any]:
    """A handle's ``post``: ``outs`` (after ``fixups``, the copies back into in-place
    tensors), each on the device in ``devices`` of the tensor it answers; one tensor when
    ``single``, else the list."""

    def post(_: list) -> Any:
        for f in fixups:
            f()
        res = [home(o, d) for o, d in zip(outs, devices, strict=True)]
        return res[0] if single else res

    return post
