"""The dense twin of a model cut over a grid: where each of a rank's parameters sits in the
unsplit model, so that weights and optimizer state can be consolidated into the dense
model's own ``state_dict`` format (one file that loads on any grid, or on one rank with the
plain model) and cut again for another grid.

A :class:`Slice` names the dense parameter and the positions this rank holds along one
dimension. :func:`tp_slices` knows the tensor-parallel layers of :mod:`.tensor`; a model
describes itself by giving a module a ``dense_slices()`` method (its parameters' slices,
keyed by their names inside that module), and :func:`model_slices` collects them for a
whole model, a :class:`~hpcdl.parallel.Pipeline` stage included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import state
from ..errors import HpcdlArgumentError
from ..optim_state import copy_value, in_parameter_order, is_per_element, numbered_groups
from .grid import Grid
from .tensor import ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear, VocabParallelEmbedding

__all__ = [
    "Slice",
    "tp_slices",
    "model_slices",
    "gather_dense",
    "load_dense",
    "gather_dense_optimizer",
    "local_optimizer_state",
]


class Slice(NamedTuple):
    """Where a rank's parameter sits in the dense model: the dense parameter ``name`` and
    the positions ``index`` this rank holds along dimension ``dim`` (``dim`` None: the
    whole tensor, a replica)."""

    name: str
    dim: int | None = None
    index: torch.Tensor | None = None

    def take(self, dense: torch.Tensor) -> torch.Tensor:
        """This rank's part of the dense tensor ``dense`` (a copy)."""
        return dense.clone() if self.dim is None else dense.index_select(self.dim, self.index).clone()

    def put(self, dense: torch.Tensor, part: torch.Tensor) -> None:
        """Write this rank's ``part`` into its place in ``dense``."""
        if self.dim is None:
            dense.copy_(part)
        else:
            dense.index_copy_(self.dim, self.index, part.to(dense.dtype))


def tp_slices(layer: nn.Module, prefix: str = "") -> dict[str, Slice]:
    """The slices of ``layer``'s parameters, keyed by their names in ``layer``, with the
    dense names of the layer it was cut from (``from_dense``) under ``prefix``:

    - :class:`ColumnParallelLinear`: rows of ``weight`` and ``bias``;
    - :class:`RowParallelLinear`: columns of ``weight``, the whole ``bias``;
    - :class:`VocabParallelEmbedding`: rows of ``weight``;
    - :class:`ParallelSelfAttention`: its heads' rows of ``qkv.weight``/``qkv.bias``, and
      ``proj`` as a row-parallel layer;
    - :class:`ParallelMLP`: ``0.`` (column-parallel) and ``2.`` (row-parallel) of the dense
      ``nn.Sequential(nn.Linear, nn.GELU(), nn.Linear)``;
    - any other module: every parameter whole, under its own name.
    """
    if isinstance(layer, ColumnParallelLinear):
        rows = torch.arange(layer.start, layer.end)
        out = {"weight": Slice(prefix + "weight", 0, rows)}
        if layer.bias is not None:
            out["bias"] = Slice(prefix + "bias", 0, rows)
        return out
    if isinstance(layer, RowParallelLinear):
        out = {"weight": Slice(prefix + "weight", 1, torch.arange(layer.start, layer.end))}
        if layer.bias is not None:
            out["bias"] = Slice(prefix + "bias")
        return out
    if isinstance(layer, VocabParallelEmbedding):
        return {"weight": Slice(prefix + "weight", 0, torch.arange(layer.start, layer.end))}
    if isinstance(layer, ParallelSelfAttention):
        rows = layer.qkv_rows
        out = {"qkv_weight": Slice(prefix + "qkv.weight", 0, rows), "qkv_bias": Slice(prefix + "qkv.bias", 0, rows)}
        out.update({f"proj.{k}": v for k, v in tp_slices(layer.proj, prefix + "proj.").items()})
        return out
    if isinstance(layer, ParallelMLP):
        out = {f"fc1.{k}": v for k, v in tp_slices(layer.fc1, prefix + "0.").items()}
        out.update({f"fc2.{k}": v for k, v in tp_slices(layer.fc2, prefix + "2.").items()})
        return out
    return {name: Slice(prefix + name) for name, _ in layer.named_parameters()}


_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelSelfAttention, ParallelMLP)


def model_slices(model: nn.Module) -> dict[str, Slice]:
    """The slice of every parameter of ``model``, keyed by ``model.named_parameters()``
    names. A submodule with a ``dense_slices()`` method describes its own parameters (with
    their dense names); a tensor-parallel layer of :mod:`.tensor` is described by
    :func:`tp_slices` under its path; any other parameter is whole under its own name. A
    parameter that a ``dense_slices()`` leaves out is an
    :class:`~hpcdl.errors.HpcdlArgumentError`."""
    out: dict[str, Slice] = {}

    def walk(module: nn.Module, path: str) -> None:
        described = getattr(module, "dense_slices", None)
        if callable(described) or isinstance(module, _TP_LAYERS):
            mapping = described() if callable(described) else tp_slices(module, path)
            for name, _ in module.named_parameters():
                if name not in mapping:
                    raise HpcdlArgumentError(f"{path + name!r} is not described by its module's dense_slices()")
                out[path + name] = mapping[name]
            return
        for name, _ in module.named_parameters(recurse=False):
            out[path + name] = Slice(path + name)
        for name, child in module.named_children():
            walk(child, f"{path}{name}.")

    walk(model, "")
    return {n: out[n] for n, _ in model.named_parameters()}


def _holds_replica(grid: Grid) -> bool:
    """One copy of each part is enough: the first data-parallel replica's."""
    return grid.dp_rank == 0


def gather_dense(
    model: nn.Module, grid: Grid, shapes: Mapping[str, Sequence[int]], root: int = 0
) -> dict[str, torch.Tensor] | None:
    """The dense model's ``state_dict`` (parameters only, in the order of ``shapes``: the
    dense model's names and shapes), assembled on rank ``root`` from every rank's slices;
    None on the other ranks. Collective over the grid."""
    slices = model_slices(model)
    mine = []
    if _holds_replica(grid):
        mine = [(slices[n], p.detach().cpu()) for n, p in model.named_parameters()]
    every = state.running().comm.gather(mine, root=root)
    if every is None:
        return None
    return _assemble([item for part in every for item in part], shapes)


def _assemble(parts: list[tuple[Slice, torch.Tensor]], shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for sl, t in parts:
        if sl.name not in shapes:
            raise HpcdlArgumentError(f"a slice names {sl.name!r}, which the dense model does not have")
        if sl.name not in out:
            out[sl.name] = torch.zeros(tuple(shapes[sl.name]), dtype=t.dtype)
            seen[sl.name] = torch.zeros(tuple(shapes[sl.name]), dtype=torch.bool)
        sl.put(out[sl.name], t)
        sl.put(seen[sl.name], torch.ones_like(t, dtype=torch.bool))
    missing = [n for n in shapes if n not in seen or not bool(seen[n].all())]
    if missing:
        raise HpcdlArgumentError(f"the ranks' slices leave parts of {missing} uncovered")
    return {n: out[n] for n in shapes}


def load_dense(model: nn.Module, dense: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's slices of the dense ``state_dict`` ``dense`` into ``model``'s
    parameters; a missing name or a shape that does not fit is an
    :class:`~hpcdl.errors.HpcdlArgumentError` naming it."""
    slices = model_slices(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            sl = slices[name]
            if sl.name not in dense:
                raise HpcdlArgumentError(f"the dense state has no {sl.name!r} (for this rank's {name!r})")
            try:
                part = sl.take(dense[sl.name])
            except (IndexError, RuntimeError) as exc:
                raise HpcdlArgumentError(f"{sl.name!r} does not fit this rank's {name!r}: {exc}") from None
            if part.shape != p.shape:
                raise HpcdlArgumentError(
                    f"{sl.name!r} gives this rank's {name!r} the shape {tuple(part.shape)}, not {tuple(p.shape)}"
                )
            p.copy_(part)


def gather_dense_optimizer(
    model: nn.Module,
    optimizer_state: Mapping[str, Any],
    grid: Grid,
    shapes: Mapping[str, Sequence[int]],
    root: int = 0,
) -> dict[str, Any] | None:
    """The optimizer state of the dense model, in torch's ``state_dict`` format (parameter
    ids in the order of ``shapes``), assembled on rank ``root`` from every rank's
    ``optimizer_state`` (a ``state_dict()`` whose ids follow ``model.parameters()``, one
    parameter group); None on the other ranks. Entries shaped like their parameter (moments)
    are assembled like the parameters; the others (step counts) are taken whole. Collective
    over the grid."""
    groups = optimizer_state["param_groups"]
    if len(groups) != 1:
        raise HpcdlArgumentError(f"consolidating optimizer state needs one parameter group, not {len(groups)}")
    slices = model_slices(model)
    named = list(model.named_parameters())
    mine: list[tuple[Slice, str, Any, bool]] = []
    if _holds_replica(grid):
        for saved, (name, p) in zip(in_parameter_order(optimizer_state["state"], groups), named, strict=True):
            for key, value in (saved or {}).items():
                shaped = is_per_element(key, value, p.shape)
                mine.append((slices[name], key, value.detach().cpu() if torch.is_tensor(value) else value, shaped))
    every = state.running().comm.gather(mine, root=root)
    if every is None:
        return None
    ids = {n: i for i, n in enumerate(shapes)}
    out: dict[int, dict[str, Any]] = {}
    for sl, key, value, shaped in (item for part in every for item in part):
        entry = out.setdefault(ids[sl.name], {})
        if not shaped:
            entry.setdefault(key, value)
            continue
        if key not in entry:
            entry[key] = torch.zeros(tuple(shapes[sl.name]), dtype=value.dtype)
        sl.put(entry[key], value)
    return {
        "state": dict(sorted(out.items())),
        "param_groups": numbered_groups([{**groups[0], "params": list(shapes)}]),
    }


def local_optimizer_state(model: nn.Module, dense_state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """This rank's part of a dense optimizer ``state_dict`` (``names``: the dense model's
    parameter names in the order of its ids), with ids following ``model.parameters()``,
    ready for the local optimizer's ``load_state_dict``."""
    groups = dense_state["param_groups"]
    if len(groups) != 1:
        raise HpcdlArgumentError(f"the dense optimizer state has {len(groups)} parameter groups, not one")
    by_name = dict(zip(names, in_parameter_order(dense_state["state"], groups), strict=True))
    slices = model_slices(model)
    local: dict[int, dict[str, Any]] = {}
    for k, (name, p) in enumerate(model.named_parameters()):
        sl = slices[name]
        saved = by_name[sl.name]
        if saved is None:
            continue
        local[k] = {}
        for key, value in saved.items():
            if torch.is_tensor(value) and value.dim() > 0:  # shaped like the dense parameter
                value = sl.take(value)
                if value.shape != p.shape:
                    raise HpcdlArgumentError(
                        f"optimizer state {key!r} of {sl.name!r} does not fit this rank's {name!r}"
                    )
            else:
                value = copy_value(value)
            local[k][key] = value
    return {"state": local, "param_groups": numbered_groups([{**groups[0], "params": list(model.parameters())}])}
