"""Helpers built on the tensor collectives: broadcasting a model's parameters and an
optimizer's state from one rank, moving arbitrary picklable objects, and tensors in the
node window that the collectives read in place (:func:`empty`)."""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from collectives.errors import combined_problem
from collectives.node.arena import allocate

from . import state
from .errors import HpcdlError
from .handles import request_name
from .ops import allgather, broadcast_, broadcast_async_, synchronize
from .process_sets import ProcessSet, global_process_set, registered_id

__all__ = [
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
    "check_on_every_rank",
]


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Overwrite every tensor of ``params`` in place with ``root_rank``'s.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()`` (names must be the
            same on every rank; they name the requests).
        root_rank: the rank whose values everyone gets.
        process_set: the ranks that take part.
    """
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    handles = []
    for name, p in items:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor")
        with torch.no_grad():
            h = broadcast_async_(p.data, root_rank, name=f"broadcast_parameters.{name}", process_set=process_set)
        handles.append(h)
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Make every rank's ``optimizer`` state and hyper-parameters (learning rates, momenta,
    step counts) equal to ``root_rank``'s. Every rank's optimizer must hold the same
    parameter groups. The root's state may lack parameters (no gradient yet) and hold any
    picklable entries (tensors, numbers, strings, lists); the other ranks end with copies
    of it, tensors on their parameters' devices, and nothing else.

    As in Horovod, an optimizer without any state yet (before its first step) gets it
    first, on every rank: each parameter that requires grad and has no state is given a
    zero gradient, and the optimizer steps once on them without reducing anything (the
    wrapped optimizer's own step, inside ``skip_synchronize()`` for hpcdl's optimizers)."""
    mine = optimizer.state_dict()
    if not mine["state"]:
        _initialize_state(optimizer)
        mine = optimizer.state_dict()
    root_state = broadcast_object(
        mine, root_rank, name=_unnamed("broadcast_optimizer_state", process_set), process_set=process_set
    )
    ours = [len(g["params"]) for g in mine["param_groups"]]
    theirs = [len(g["params"]) for g in root_state["param_groups"]]
    if ours != theirs:
        raise HpcdlError(
            f"broadcast_optimizer_state: this rank's parameter groups hold {ours} parameters, "
            f"rank {root_rank}'s {theirs}"
        )
    if state.current().rank != root_rank:  # the root's own state is the root's already
        _load_state(optimizer, root_state)


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's state initialization: zero gradients where parameters that require grad
    have no state, then one local step."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p not in optimizer.state:
                g = torch.zeros_like(p)
                p.grad = g.to_sparse() if sparse else g
    local = getattr(optimizer, "skip_synchronize", None)
    if local is None:
        optimizer.step()
        return
    with local():
        optimizer.step()


def _load_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Replace ``optimizer``'s state and hyper-parameters by ``saved`` (a ``state_dict()``
    of an optimizer over the same parameter groups). Unlike ``load_state_dict``, entries
    that are strings or other iterables are kept as they are (torch rebuilds them element
    by element, which turns a string into the text of a generator)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    by_id = dict(zip(ids, params, strict=True))
    optimizer.state.clear()
    for i, entries in saved["state"].items():
        p = by_id[i]
        optimizer.state[p] = {key: _placed(value, p, key) for key, value in entries.items()}
    for g, s in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        g.update({k: copy.deepcopy(v) for k, v in s.items() if k != "params"})


def _placed(value: Any, p: torch.Tensor, key: str) -> Any:
    """A state entry for parameter ``p``: a floating tensor in ``p``'s dtype and on its device
    (``step`` counters keep theirs, as torch does), any other tensor on ``p``'s device, and
    anything else a copy."""
    if torch.is_tensor(value):
        if key != "step" and value.is_floating_point():
            return value.to(dtype=p.dtype, device=p.device).clone()
        return value.clone() if key == "step" else value.to(device=p.device).clone()
    return copy.deepcopy(value)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled there, unpickled everywhere) on every rank.
    Unnamed calls are numbered in call order (not named after the object's type, which
    differs when the other ranks pass None)."""
    name = name or _unnamed("broadcast_object", process_set)
    if state.current().rank == root_rank:  # roots are global ranks, as in Horovod
        buf = io.BytesIO()
        torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
        data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        data, size = None, torch.zeros(1, dtype=torch.int64)
    broadcast_(size, root_rank, name=f"{name}.size", process_set=process_set)
    if data is None:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    broadcast_(data, root_rank, name=f"{name}.data", process_set=process_set)
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return the list of every rank's ``obj``, in rank order, on every rank."""
    name = name or _unnamed("allgather_object", process_set)
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sizes", process_set=process_set)
    blob = allgather(data, name=f"{name}.data", process_set=process_set).numpy().tobytes()
    out, off = [], 0
    for n in sizes.tolist():
        out.append(torch.load(io.BytesIO(blob[off : off + n]), weights_only=False))
        off += n
    return out


def check_on_every_rank(
    problem: str | None,
    error: type[Exception] = HpcdlError,
    payload: Any = None,
    *,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """Collective: raise ``error`` on every rank of ``process_set`` when any rank found a
    ``problem`` (its text; None for none), else return every rank's ``payload`` in rank
    order. The message is :func:`collectives.errors.combined_problem`'s, the same on every
    rank. A check that only one rank can make (of its input, a file, a server's reply) must
    end this way: raised on that rank alone, it would leave the others waiting in their
    next collective."""
    said = allgather_object((problem, payload), name=name, process_set=process_set)
    text = combined_problem([p for p, _ in said], process_set.ranks)
    if text is not None:
        raise error(text)
    return [x for _, x in said]


def _unnamed(kind: str, process_set: ProcessSet) -> str:
    return request_name(state.running(), kind, registered_id(process_set), None)


def empty(
    *size: int | Iterable[int], dtype: torch.dtype = torch.float32, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """An uninitialised CPU tensor in this rank's part of the process set's node window
    (the torch counterpart of ``collectives.empty``).

    Gradients, buckets or any tensor reduced often can live there: when every member's
    tensor does, the engine's collectives read them in place instead of staging a copy
    (``ZeroOptimizer``'s flat buffers and the engine's fusion buffer are allocated there).
    Allocation is local, not collective; the memory returns to the window when the tensor
    is freed. Where the set's ranks span nodes or its window is full, the tensor is
    ordinary memory.

    Args:
        size: the shape, as ints or one sequence (like ``torch.empty``).
        dtype: the tensor's dtype.
        process_set: the set whose collectives the tensor will take part in.
    """
    shape = tuple(int(d) for d in (size[0] if len(size) == 1 and not isinstance(size[0], int) else size))
    sid = registered_id(process_set)
    engine = state.current().engine
    info = engine.sets.get(sid) if engine is not None else None
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    flat = torch.from_numpy(allocate(None if info is None else info.arena, nbytes, np.uint8))
    return flat.view(dtype).view(shape)
