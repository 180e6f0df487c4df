"""Optimizer state in torch's ``state_dict`` format, per parameter, and flat.

torch's format is ``{"state": {id: {key: value}}, "param_groups": [{..., "params": [id,
...]}]}``: the ids of a group's parameters stand in its ``params``, numbered 0, 1, ... over
the groups in order when torch writes them. The optimizers that consolidate a state they
hold in pieces (sharded, on parameter servers, cut over a grid) read and write this format
with the functions here:

- :func:`in_parameter_order` reads a saved table (``state``, or any table keyed by the same
  ids) in the order of the parameters; :func:`numbered_groups` writes the groups back with
  the ids numbered as torch numbers them; :func:`hyperparameters` is a group less its
  ``params``.
- An entry of a parameter's state is *per element* when it holds one value for each element
  of the parameter (momentum, Adam's moments): a tensor shaped like the parameter, under any
  key but ``step``. Every other entry (Adam's ``step``, even as a tensor) is *per tensor*.
  :func:`is_per_element` is that rule, for a parameter's shape or a flat run's ``(length,)``.
- The flat form of parameters laid end to end (parameter ``j`` at ``offsets[j]`` of a run of
  ``length`` elements, the rest padding) holds each per-element entry as one 1-D tensor of
  ``length`` elements and each per-tensor entry once. :func:`flatten_state` makes it from the
  parameters' states and :func:`unflatten_state` cuts it back: for states whose per-element
  entries are in the parameters' dtype, ``unflatten_state(flatten_state(states))`` equals
  ``states`` (copies, never views), and a per-tensor entry comes back as the first parameter's
  value. Element-wise optimizers (SGD, Adam, ...) stepping the flat run hold its flat form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "copy_value",
    "flatten_state",
    "hyperparameters",
    "in_parameter_order",
    "is_per_element",
    "numbered_groups",
    "unflatten_state",
]


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """Return a parameter group's settings: everything but its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


def numbered_groups(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return ``groups`` as torch's ``state_dict`` writes them: each group's settings, with
    its parameters replaced by their ids, numbered 0, 1, ... over the groups in order."""
    out, start = [], 0
    for g in groups:
        out.append({**hyperparameters(g), "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return out


def in_parameter_order(table: Mapping[int, Any], groups: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Return the entries of ``table`` (keyed by the ids that the saved ``groups`` list) in
    the order of the groups' parameters; None for a parameter the table lacks."""
    return [table.get(i) for g in groups for i in g["params"]]


def is_per_element(key: str, value: Any, shape: Sequence[int]) -> bool:
    """Whether state entry ``key`` holds one value per element of a parameter of ``shape``
    (or of a flat run, ``shape=(length,)``): a tensor of that shape, under any key but
    ``step``."""
    return key != "step" and torch.is_tensor(value) and value.shape == tuple(shape)


def copy_value(value: Any) -> Any:
    """Return a copy of a tensor, or any other value as it is."""
    return value.clone() if torch.is_tensor(value) else value


def flatten_state(
    states: Sequence[Mapping[str, Any] | None],
    params: Sequence[torch.Tensor],
    offsets: Sequence[int],
    length: int,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Return the flat form of the states of ``params`` (``states[j]`` is ``params[j]``'s;
    None: it has none), the parameters laid end to end at ``offsets`` in a run of ``length``.

    Every key any parameter has, in the order first met: when every parameter that has it
    holds a per-element value (:func:`is_per_element`), one 1-D tensor of ``length`` elements
    in ``params[0]``'s dtype on ``device``, each parameter's values at its offset and zeros
    for the others and the padding; otherwise the first parameter's value, not copied.
    """
    have = [(p, st) for p, st in zip(params, states, strict=True) if st]
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for _, st in have for k in st):
        with_k = [(p, st[k]) for p, st in have if k in st]
        if not all(is_per_element(k, v, p.shape) for p, v in with_k):
            out[k] = with_k[0][1]
            continue
        flat = torch.zeros(length, dtype=params[0].dtype, device=device)
        for p, o, st in zip(params, offsets, states, strict=True):
            if st and k in st:
                flat[o : o + p.numel()] = st[k].reshape(-1)
        out[k] = flat
    return out


def unflatten_state(
    flat: Mapping[str, Any], params: Sequence[torch.Tensor], offsets: Sequence[int], length: int
) -> list[dict[str, Any]]:
    """Return each parameter's state cut from the flat form ``flat`` of a run of ``length``
    elements (parameter ``j`` at ``offsets[j]``): per-element entries (1-D tensors of
    ``length`` elements, :func:`is_per_element`) cut to the parameter's shape, other entries
    whole; copies throughout."""
    cut = {k: is_per_element(k, v, (length,)) for k, v in flat.items()}
    return [
        {k: v[o : o + p.numel()].view_as(p).clone() if cut[k] else copy_value(v) for k, v in flat.items()}
        for p, o in zip(params, offsets, strict=True)
    ]
