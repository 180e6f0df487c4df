"""Helpers built on the tensor collectives: broadcasting a model's parameters and an
optimizer's state from one rank, and moving arbitrary picklable objects."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import state
from .errors import HpcdlError
from .handles import request_name
from .ops import allgather, broadcast_, broadcast_async_, synchronize
from .process_sets import ProcessSet, global_process_set, registered_id

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


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
    parameter groups; state tensors end up as copies of the root's."""
    state = optimizer.state_dict()
    root_state = broadcast_object(state, root_rank, name="broadcast_optimizer_state", process_set=process_set)
    mine = [len(g["params"]) for g in state["param_groups"]]
    theirs = [len(g["params"]) for g in root_state["param_groups"]]
    if mine != theirs:
        raise HpcdlError(
            f"broadcast_optimizer_state: this rank's parameter groups hold {mine} parameters, "
            f"rank {root_rank}'s {theirs}"
        )
    optimizer.load_state_dict(root_state)


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


def _unnamed(kind: str, process_set: ProcessSet) -> str:
    return request_name(state.running(), kind, registered_id(process_set), None)
