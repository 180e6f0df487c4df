"""Configuration of the collectives layer: one dataclass, read from ``HPCDL_*`` once.

Each field ``name`` has the environment mirror ``HPCDL_<NAME>``. Any other variable that
starts with ``HPCDL_`` is an error naming the closest valid one, so a typo never silently
falls back to a default. Layers above (``hpcdl``) add their own names with
:func:`register_env_names`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .cost import parse_link
from .errors import ConfigError

__all__ = [
    "Config",
    "load_config",
    "read_tuning_file",
    "register_env_names",
    "known_env_names",
    "check_unknown",
    "env_values",
    "BOOLS",
]

PREFIX = "HPCDL_"
_extra_names: set[str] = set()


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """Knobs of the collectives layer."""

    ranks_per_node: int = 0
    """Split each shared-memory node into simulated nodes of this many ranks (0: off)."""

    link: str = ""
    """Emulate this link between nodes (real, or simulated by ``ranks_per_node``): a name from
    :data:`.cost.LINKS` or ``"latency=5us,bandwidth=12.5GB/s"``; empty: off (see
    :mod:`.link`)."""

    tuning_file: str = ""
    """Tuning table for ``algorithm="auto"``; empty means the table shipped in the package."""

    segment_bytes: int = 1 << 20
    """Pipeline segment of the ring algorithms, in bytes."""

    shm_bytes: int = 16 << 20
    """Shared-memory window per rank of the ``shm`` allreduce across several nodes, in bytes."""

    shm_small_bytes: int = 64 << 10
    """Reductions up to this many bytes per rank finish in one step through the node's
    control slots (and beyond it those that read little: a reduce-scatter, or an allreduce
    of 2 ranks, up to a slot; an allreduce in two steps up to half of one: see
    ``shm_split_bytes``)."""

    shm_copy_small_bytes: int = 256 << 10
    """Broadcasts and allgathers up to this many bytes per rank finish in one step through
    the control slots too (each rank's data copied in and out once); a slot holds the
    larger of this and ``shm_small_bytes``."""

    shm_split_bytes: int = 4 << 10
    """From 3 ranks on a node, a one-step allreduce whose ``(ranks - 2) x bytes per rank``
    reaches this finishes in two steps: each rank reduces only its block, then copies every
    rank's (its memory traffic grows with 2, not with the ranks; 0: always one step)."""

    shm_nontemporal_bytes: int = -1
    """The compiled loop copies data into the node's shared window with non-temporal stores
    from this many bytes (0: never); -1: from 4 KiB for a broadcast's root on any node, and
    for every copy where the node's ranks may run on cores that share no last-level cache
    (:func:`.node.channel.nontemporal_bytes`, :func:`.node.channel.nontemporal_broadcast_bytes`)."""

    shm_nontemporal_out_bytes: int = -1
    """The compiled loop copies data out of the node's shared window into messages of at
    least this many bytes with non-temporal stores (0: never); -1: three quarters of a
    last-level cache's share per rank, where a message no longer stays in the cache
    (:func:`.node.channel.nontemporal_out_bytes`)."""

    shm_single_copy_bytes: int = 1 << 20
    """Allgathers of at least this many bytes per rank on one node are copied once, each
    rank reading the others' data out of their memory with cross-memory attach (Linux's
    ``process_vm_readv``), instead of twice through the shared window. A peer's data
    in the node's arena (:func:`collectives.empty`) is copied through the arena's mapping
    instead. Where the kernel refuses it (a strict ``ptrace_scope``, a container's seccomp
    profile) every rank keeps the window (0: never)."""

    shm_single_copy_broadcast_bytes: int = -1
    """Broadcasts of at least this many bytes on one node are copied once, each rank
    reading the root's data out of its memory with cross-memory attach (a root in place
    writes 1/n of it into each reader's memory meanwhile), where the kernel allows it (0:
    never); -1: from the size where the node's ranks measured it faster than the root's
    slot when the channel was made, or never where it was slower at every size measured
    (:func:`.node.channel.broadcast_single_copy_bytes`)."""

    shm_single_copy_reduce_scatter_bytes: int = 0
    """Reduce-scatters past the one-step size with at least this many bytes of input on one
    node skip the window where single copy is on (``shm_single_copy_bytes``; of 2 ranks, or
    of more where broadcasts are copied once too), every rank's output is apart from its
    input and staging is slow, as for ``shm_single_copy_allreduce_bytes``: each rank reads
    only its block of the others' inputs out of their memory and reduces it with its own
    (0: never, the default: on the 2-vCPU reference machine that took 1.0-1.3 x the staged
    time at 16 MiB on huge pages and 1.5-1.9 x on 4 KiB ones, where staging was slow too)."""

    shm_single_copy_allreduce_bytes: int = 4 << 20
    """Allreduces of at least this many bytes into a separate output on one node skip the
    window where single copy is on (``shm_single_copy_bytes``; of 2 ranks, or of more where
    broadcasts are copied once too) and staging is slow, its copies taking non-temporal
    stores (:meth:`.node.channel.Channel.staging_slow`): each rank reads its block of the
    others' inputs out of their memory and reduces it into its output, then reads the
    others' reduced blocks out of theirs, piece by piece, while they are in the caches (0:
    never). Each rank writes its output once, where staging through the window writes half
    the input into it and the whole result out of it. An allreduce in place stages: there
    a rank's reads of a peer's block would land in lines the peer has just read."""

    shm_chunk_bytes: int = 1 << 20
    """Pipeline chunk of the single-node ``shm`` algorithms (each rank holds two), in bytes."""

    shm_arena_bytes: int = 1 << 30
    """Shared window per rank for window-resident buffers (:func:`collectives.empty`), in
    bytes: address space reserved when a single-node communicator is first used, memory
    only once allocated from (0: none; ``empty`` then gives ordinary memory)."""

    compiled_channel: bool = True
    """Post, wait and finish one-step calls in the compiled loop (``collectives.node.cslots``)
    where it was built; False: the pure-Python loop (the same protocol, slower)."""

    device_window_bytes: int = 64 << 20
    """Device buffer per rank that the ``ipc`` algorithms on device arrays stage through
    (exported once per communicator with CUDA IPC); larger messages go through it in chunks."""

    device_staged_bytes: int = -1
    """Where ranks share a GPU and NCCL cannot run, ``auto`` sends device calls of up to
    this many bytes (per rank) through host memory (``staged``), and larger ones through
    ``ipc`` (0: always ``ipc``); -1 takes the crossover measured on an H100 shared by 2
    ranks: 1 MiB without MPS, 128 KiB under MPS (:func:`.device.arrays.mps_client`).
    Without MPS the GPU switches between the ranks' contexts at each of ``ipc``'s steps,
    about 900 µs a call at any size; ``benchmarks.node_report`` measures a node's crossover."""

    cuda_aware_mpi: str = "auto"
    """Whether the MPI library takes CUDA device pointers: ``auto`` asks it
    (``MPIX_Query_cuda_support``), ``1`` or ``0`` say so outright (for an MPI that cannot be
    asked, such as MVAPICH2-GDR). Where it does not, no device pointer is handed to MPI."""

    shm_spin: int = -1
    """Polls of a peer's counter before a waiting rank sleeps on it (0: sleep at once); -1
    decides by the cores the node's ranks may use together, so that ranks bound to a core
    each still spin (see :func:`.channel.spin_budget`). Tests set it to force the sleeping
    or the spinning wait whatever the machine."""

    stall_timeout: float = 600.0
    """Seconds a collective waits for another rank before it raises
    :class:`~.errors.StallError` on every rank (0: wait forever). A rank that raised, or skipped
    or reordered a collective, leaves the others waiting: this turns that hang into an error."""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 0:
            raise ConfigError(f"ranks_per_node={self.ranks_per_node} must be >= 0 (0 turns it off)")
        if self.link:
            try:
                parse_link(self.link)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.segment_bytes < 64:
            raise ConfigError(f"segment_bytes={self.segment_bytes} must be at least 64")
        if self.shm_bytes < 4096:
            raise ConfigError(f"shm_bytes={self.shm_bytes} must be at least 4096")
        if self.shm_small_bytes < 64:
            raise ConfigError(f"shm_small_bytes={self.shm_small_bytes} must be at least 64")
        if self.shm_copy_small_bytes < 64:
            raise ConfigError(f"shm_copy_small_bytes={self.shm_copy_small_bytes} must be at least 64")
        if self.shm_split_bytes < 0:
            raise ConfigError(f"shm_split_bytes={self.shm_split_bytes} must be >= 0 (0: always one step)")
        if self.shm_nontemporal_bytes < -1:
            raise ConfigError(
                f"shm_nontemporal_bytes={self.shm_nontemporal_bytes} must be >= 0 (0: never), or -1 (by the caches)"
            )
        if self.shm_nontemporal_out_bytes < -1:
            raise ConfigError(
                f"shm_nontemporal_out_bytes={self.shm_nontemporal_out_bytes} must be >= 0 (0: never), "
                "or -1 (by the caches)"
            )
        if self.shm_single_copy_bytes < 0:
            raise ConfigError(f"shm_single_copy_bytes={self.shm_single_copy_bytes} must be >= 0 (0: never)")
        if self.shm_single_copy_broadcast_bytes < -1:
            raise ConfigError(
                f"shm_single_copy_broadcast_bytes={self.shm_single_copy_broadcast_bytes} must be >= 0 "
                "(0: never), or -1 (measured)"
            )
        if self.shm_single_copy_reduce_scatter_bytes < 0:
            raise ConfigError(
                f"shm_single_copy_reduce_scatter_bytes={self.shm_single_copy_reduce_scatter_bytes} "
                "must be >= 0 (0: never)"
            )
        if self.shm_single_copy_allreduce_bytes < 0:
            raise ConfigError(
                f"shm_single_copy_allreduce_bytes={self.shm_single_copy_allreduce_bytes} must be >= 0 (0: never)"
            )
        if self.shm_chunk_bytes < 4096:
            raise ConfigError(f"shm_chunk_bytes={self.shm_chunk_bytes} must be at least 4096")
        if self.shm_arena_bytes < 0:
            raise ConfigError(f"shm_arena_bytes={self.shm_arena_bytes} must be >= 0 (0 turns it off)")
        if self.device_window_bytes < 4096:
            raise ConfigError(f"device_window_bytes={self.device_window_bytes} must be at least 4096")
        if self.device_staged_bytes < -1:
            raise ConfigError(
                f"device_staged_bytes={self.device_staged_bytes} must be >= 0 (0: always ipc), "
                "or -1 (measured defaults)"
            )
        if self.cuda_aware_mpi not in ("auto", "0", "1"):
            raise ConfigError(f"cuda_aware_mpi={self.cuda_aware_mpi!r} must be 'auto', '1' or '0'")
        if self.shm_spin < -1:
            raise ConfigError(f"shm_spin={self.shm_spin} must be >= 0, or -1 (decided by the cores)")
        if not self.stall_timeout >= 0:
            raise ConfigError(f"stall_timeout={self.stall_timeout} must be >= 0 seconds (0: wait forever)")
        if self.tuning_file:
            read_tuning_file(self.tuning_file)


def read_tuning_file(path: str) -> dict[str, Any]:
    """Read the tuning table at ``path`` (as ``python -m collectives.tune`` writes it) and
    check its form; a :class:`ConfigError` naming the file and what is wrong otherwise."""
    if not os.path.isfile(path):
        raise ConfigError(f"tuning_file={path!r} " + ("is a directory" if os.path.isdir(path) else "does not exist"))
    what = f"tuning_file={path!r} is not a tuning table (the JSON python -m collectives.tune writes)"
    try:
        with open(path, encoding="utf-8") as fh:
            table = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"tuning_file={path!r} cannot be read: {exc.strerror}") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ConfigError(f"{what}: {exc}") from None
    problem = _table_problem(table)
    if problem is not None:
        raise ConfigError(f"{what}: {problem}")
    return table


def _table_problem(table: Any) -> str | None:
    """What is wrong with the form of a tuning table, or None."""
    if not isinstance(table, dict) or not isinstance(table.get("tables"), list):
        return 'it needs an object with a "tables" list'
    for i, e in enumerate(table["tables"]):
        if not isinstance(e, dict) or not isinstance(e.get("collective"), str):
            return f'tables[{i}] needs a "collective" name'
        for key in ("size", "nodes"):
            v = e.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                return f'tables[{i}] needs "{key}", a count of at least 1, not {v!r}'
        rules = e.get("rules")
        ok = isinstance(rules, list) and all(
            isinstance(r, list) and len(r) == 2 and (r[0] is None or isinstance(r[0], int)) and isinstance(r[1], str)
            for r in rules
        )
        if not ok:
            return f'tables[{i}] needs "rules", a list of [max_bytes, algorithm] pairs (max_bytes null: any size)'
        if not isinstance(e.get("oversubscribed", False), bool):
            return f'tables[{i}]: "oversubscribed" is true or false, not {e["oversubscribed"]!r}'
    for i, e in enumerate(table.get("node_paths", [])):
        good = isinstance(e, dict) and isinstance(e.get("size"), int) and e["size"] >= 2
        if not good or not all(isinstance(e.get(k), (int, float)) and e[k] > 0 for k in ("alpha", "beta")):
            return f'node_paths[{i}] needs "size" (ranks, at least 2) and positive "alpha" (s) and "beta" (B/s)'
    for key in ("ps_own", "ps_phases"):
        own = table.get(key)
        if own is not None and not (
            isinstance(own, dict)
            and all(isinstance(own.get(k), (int, float)) and not isinstance(own[k], bool) for k in ("alpha", "beta"))
            and own["alpha"] >= 0
            and own["beta"] > 0
        ):
            return f'"{key}" needs "alpha" (s, at least 0) and a positive "beta" (B/s)'
    return None


def register_env_names(names: Iterable[str]) -> None:
    """Declare more valid ``HPCDL_*`` variable names (used by the layers above)."""
    _extra_names.update(names)


def known_env_names() -> set[str]:
    """Return every ``HPCDL_*`` name that some layer reads."""
    own = {PREFIX + f.name.upper() for f in dataclasses.fields(Config)}
    return own | _extra_names


def check_unknown(environ: Mapping[str, str]) -> None:
    """Raise :class:`ConfigError` for any ``HPCDL_*`` variable no layer reads."""
    known = known_env_names()
    for key in sorted(environ):
        if key.startswith(PREFIX) and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.0)
            raise ConfigError(f"unknown environment variable {key}; did you mean {close[0]}?")


def env_values(cls: type, environ: Mapping[str, str]) -> dict[str, object]:
    """Read the ``HPCDL_<FIELD>`` mirror of each field of the dataclass ``cls`` that is set
    in ``environ``, converted to the field's type (int, float, bool or str)."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        key = PREFIX + f.name.upper()
        if key not in environ:
            continue
        raw = environ[key].strip()
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        try:
            if kind == "bool":
                if raw.lower() not in BOOLS:
                    raise ValueError
                values[f.name] = BOOLS[raw.lower()]
            elif kind == "int":
                values[f.name] = int(raw)
            elif kind == "float":
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        except ValueError:
            if kind == "bool":
                accepted = "one of " + ", ".join(sorted(BOOLS))
            else:
                accepted = "an integer" if kind == "int" else f"a {kind}"
            raise ConfigError(f"{key}={raw!r} is not {accepted}") from None
    return values


# the spellings of true and false accepted from the environment (and by hpcdl.train)
BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def load_config(environ: Mapping[str, str] | None = None) -> Config:
    """Build a :class:`Config` from ``HPCDL_*`` variables (``os.environ`` by default)."""
    env = os.environ if environ is None else environ
    check_unknown(env)
    return Config(**env_values(Config, env))
