"""The training job's configuration: :class:`TrainConfig`, in sections (``model``,
``training``, ``optimizer``, ``parallelism``, ``checkpoint``, ``job``, and ``runtime``: the
runtime's own :class:`hpcdl.Config`), filled from (lowest to highest precedence) its
defaults, an optional TOML or YAML file, ``HPCDL_TRAIN_<FIELD>`` environment variables and
command-line flags ``--<field-with-dashes>``.

Users name every setting of the job's own sections by one flat name, whatever section holds
it: the flag (``--lr``), the config-file key (``lr = 0.01``), the variable
(``HPCDL_TRAIN_LR``), the messages of :class:`ConfigError`, and the keys of
:meth:`TrainConfig.to_dict`, which is what a run directory's ``config.json`` and every
checkpoint store. A flat name is the attribute's name in its section but for four:
``model`` is ``model.name``, ``optimizer`` is ``optimizer.name``, ``checkpoint_every`` is
``checkpoint.every`` and ``keep_checkpoints`` is ``checkpoint.keep``.

The runtime's section is a ``[runtime]`` table in the file, the runtime's ``HPCDL_<FIELD>``
variables, and a flag ``--<field-with-dashes>`` for each of its fields but ``timeline``
(the job's ``--timeline`` records the training).

Every value is checked before any rank starts work; a bad one raises :class:`ConfigError`
naming the field (or flag, variable, file key) and the values it accepts. The sections are
plain records: :class:`TrainConfig` checks them all when it is made (:meth:`TrainConfig.validate`),
one setting after another in ``--help``'s order, then the relations between them, so the first
error named does not depend on which section holds a setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from collectives.cli import ArgumentParser
from collectives.config import BOOLS, register_env_names
from collectives.config import load_config as collectives_config
from collectives.errors import ConfigError as CollectivesConfigError
from hpcdl.config import Config, load_config
from hpcdl.errors import HpcdlError

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "TrainingConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "CheckpointConfig",
    "JobConfig",
    "ConfigError",
    "RunError",
    "Interrupted",
    "parse_config",
    "ENV_PREFIX",
]

ENV_PREFIX = "HPCDL_TRAIN_"


class ConfigError(ValueError):
    """A configuration value that the training job does not accept."""


class RunError(ConfigError):
    """A run directory or checkpoint the job cannot use (checkpoints of an earlier run, none
    to resume from, one that does not load): every rank raises it alike, and the job says
    why in one line and exits with status 2."""


class Interrupted(Exception):
    """The job was asked to stop (SIGINT or SIGTERM) and every rank stopped after step
    ``step`` (``apart``: ssp and async workers, each at its own step)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, apart: bool = False) -> None:
        import signal

        self.signum, self.step, self.checkpoint, self.apart = signum, step, checkpoint, apart
        self.code = 128 + signum
        what = "stopped by SIGTERM" if signum == signal.SIGTERM else "interrupted"
        if checkpoint:
            super().__init__(f"{what} at step {step}; newest checkpoint {checkpoint}; continue with --resume")
        else:
            super().__init__(f"{what} at step {step}, before the first checkpoint: start the run again")


def _field(default: Any, help: str, *, key: str | None = None, **limits: Any) -> Any:
    """A setting: its default, its ``--help`` line, its flat name where that is not the
    attribute's (``key``), and the bounds :meth:`TrainConfig.validate` checks."""
    meta = {"help": help, **limits} if key is None else {"help": help, "key": key, **limits}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(kw_only=True, slots=True)
class ModelConfig:
    """What to train: the model (which picks the data set too) and the GPT's size."""

    name: Literal["cnn", "mlp", "gpt"] = _field(
        "cnn",
        "cnn or mlp: classifiers of scikit-learn's handwritten digits; gpt: a byte-level decoder on "
        "the Python documentation text that ships with CPython (pydoc_data.topics)",
        key="model",
    )
    block_size: int = _field(64, "gpt: context length in bytes", min=2)
    n_layer: int = _field(2, "gpt: transformer blocks", min=1)
    n_head: int = _field(4, "gpt: attention heads", min=1)
    d_model: int = _field(128, "gpt: width (a multiple of n_head)", min=1)
    dropout: float = _field(0.0, "gpt: dropout probability", min=0.0, lt=1.0)
    activation_checkpointing: bool = _field(False, "recompute the transformer blocks in backward (gpt)")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """How long and how each rank trains: epochs and batches, the seed, the device, the
    arithmetic's precision and torch's threads."""

    epochs: int = _field(20, "passes over the training split", min=1)
    max_steps: int = _field(0, "stop after this many optimizer steps (0: run every epoch)", min=0)
    batch_size: int = _field(32, "samples per rank per backward pass", min=1)
    grad_accum: int = _field(1, "backward passes per optimizer step (gradient accumulation)", min=1)
    device: Literal["auto", "cpu", "cuda"] = _field(
        "auto",
        "cuda: each rank trains on GPU local_rank % GPUs of its node; auto: cuda when torch sees a GPU, else cpu",
    )
    precision: Literal["fp32", "bf16", "fp16", "fp64"] = _field(
        "fp32",
        "bf16: autocast to bfloat16; fp16: autocast to float16 with dynamic loss scaling; fp64: float64 "
        "weights and arithmetic (to compare runs to rounding)",
    )
    seed: int = _field(0, "seed of initial weights, data order and dropout", min=0)
    threads: int = _field(1, "torch intra-op threads per rank", min=1)


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer, its learning rate and schedule, and the wrapper that reduces its
    gradients (DistributedOptimizer, or ZeroOptimizer's stages)."""

    name: Literal["sgd", "adam", "adamw"] = _field("adam", "the torch optimizer", key="optimizer")
    lr: float = _field(2e-3, "learning rate for one rank (see lr_scaling)", gt=0.0)
    lr_scaling: Literal["linear", "none"] = _field("linear", "linear: the rate is lr x world size")
    warmup_steps: int = _field(20, "steps of linear warm-up from lr/steps to the full rate", min=0)
    lr_schedule: Literal["cosine", "constant"] = _field("cosine", "after warm-up: cosine decay to 0, or constant")
    momentum: float = _field(0.9, "SGD momentum", min=0.0)
    weight_decay: float = _field(0.0, "weight decay (decoupled for adamw)", min=0.0)
    zero: Literal[0, 1, 2] = _field(0, "0: DistributedOptimizer; 1 or 2: ZeroOptimizer of that stage")


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """How the ranks share the work: data parallelism by allreduce or through parameter
    servers (HybridOptimizer), and for the GPT a dp x tp x pp grid, dp = world size / (tp x pp)."""

    dp: Literal["allreduce", "ps"] = _field(
        "allreduce",
        "allreduce: gradients allreduced over the ranks; ps: through parameter servers (HybridOptimizer), the "
        "last --ps-servers ranks dedicated ones, or with --ps-servers 0 a server thread on every node leader",
    )
    ps_mode: Literal["sync", "ssp", "async"] = _field(
        "sync",
        "dp=ps: sync sums every worker each step; ssp lets a worker run up to --staleness steps ahead of the "
        "slowest (the update runs on the servers); async has no bound",
    )
    staleness: int = _field(4, "dp=ps, ps_mode=ssp: steps of the others' updates a worker's parameters may miss", min=0)
    ps_partition_bytes: int = _field(4 << 20, "dp=ps: the most bytes in one server partition", min=1)
    tp: int = _field(1, "gpt: tensor-parallel ranks (attention heads, MLP and vocabulary split over them)", min=1)
    pp: int = _field(1, "gpt: pipeline stages (the embeddings, blocks and head cut into pp stages)", min=1)
    pp_schedule: Literal["1f1b", "gpipe"] = _field("1f1b", "the pipeline's schedule")
    chunks: int = _field(1, "gpt: micro-batches per batch, pipelined over the stages when pp > 1", min=1)
    sequence_parallel: bool = _field(
        False, "gpt with tp > 1: layer norms and dropout on each TP rank's part of the sequence"
    )


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When checkpoints are written, how many are kept, and whether the run continues from
    the newest one or deletes them."""

    every: int = _field(
        50, "write a checkpoint every this many steps, and at the end (0: end only)", key="checkpoint_every", min=0
    )
    keep: int = _field(2, "checkpoints kept in run_dir/checkpoints", key="keep_checkpoints", min=1)
    resume: bool = _field(False, "continue from the newest readable checkpoint in run_dir")
    overwrite: bool = _field(False, "start afresh in a run_dir that holds checkpoints, deleting them")


@dataclasses.dataclass(kw_only=True, slots=True)
class JobConfig:
    """Where the job writes and what it shows: the run directory, the timeline, the progress
    bar, or only the resolved configuration (a dry run)."""

    run_dir: str = _field("", "where metrics, plot, summary and checkpoints go (empty: runs/<model>-<time>)")
    timeline: str = _field("", "write hpcdl's Chrome-trace timeline to this file (empty: off)")
    progress: bool = _field(
        True, "a progress bar on rank 0 when its output reaches a terminal (never in a log file); epoch lines always"
    )
    dry_run: bool = _field(False, "print the resolved configuration and the rank layout, then exit")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "parallelism": ParallelismConfig,
    "checkpoint": CheckpointConfig,
    "job": JobConfig,
}
"""TrainConfig's sections of the job's own settings, by attribute (``runtime`` is hpcdl's)."""

_FLAT_KEYS = (
    *("model", "epochs", "max_steps", "batch_size", "grad_accum"),
    *("optimizer", "lr", "lr_scaling", "warmup_steps", "lr_schedule", "momentum", "weight_decay", "zero"),
    *("dp", "ps_mode", "staleness", "ps_partition_bytes", "tp", "pp", "pp_schedule", "chunks", "sequence_parallel"),
    "runtime",
    *("device", "precision", "activation_checkpointing", "seed", "threads"),
    *("block_size", "n_layer", "n_head", "d_model", "dropout"),
    *("run_dir", "checkpoint_every", "keep_checkpoints", "resume", "overwrite", "timeline", "progress", "dry_run"),
)
"""Every setting's flat name (its flag without ``--``, config-file key, ``HPCDL_TRAIN_``
variable, key in ``config.json`` and checkpoints), in the order ``--help`` lists them and
:meth:`TrainConfig.to_dict` writes them."""


class _Setting(NamedTuple):
    """Where :class:`TrainConfig` holds a setting (``section``.``attr``), its type and field."""

    section: str
    attr: str
    kind: Any
    field: dataclasses.Field


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything ``python -m hpcdl.train`` needs, in sections; ``--help`` lists the settings
    by their flat names, which :meth:`from_flat` takes and :meth:`to_dict` gives back."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    job: JobConfig = dataclasses.field(default_factory=JobConfig)
    runtime: Config = dataclasses.field(
        default_factory=Config,
        metadata={"help": "the hpcdl runtime's configuration (hpcdl.Config: fusion, buckets, engine)"},
    )

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_flat(cls, **values: Any) -> TrainConfig:
        """Build from settings named as users name them (a flag without ``--`` and with
        underscores, a config-file key, a key of :meth:`to_dict`; ``runtime`` an
        :class:`hpcdl.Config`), the others at their defaults:
        ``TrainConfig.from_flat(model="gpt", lr=1e-3, checkpoint_every=0)``.

        Raises:
            TypeError: a name that is no setting.
            ConfigError: a value :meth:`validate` does not accept.
        """
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for key, value in values.items():
            if key == "runtime":
                top[key] = value
            elif key in _FIELDS:
                parts[_FIELDS[key].section][_FIELDS[key].attr] = value
            else:
                raise TypeError(f"TrainConfig.from_flat() got an unexpected setting {key!r}")
        return cls(**{name: _SECTIONS[name](**kw) for name, kw in parts.items()}, **top)

    def to_dict(self) -> dict[str, Any]:
        """The settings by their flat names, in ``--help``'s order, ``runtime`` as a dictionary:
        what ``config.json``, every checkpoint and a dry run hold, and what a resumed run
        compares with its checkpoint's."""
        flat: dict[str, Any] = {}
        for key in _FLAT_KEYS:
            if key == "runtime":
                flat[key] = dataclasses.asdict(self.runtime)
            else:
                flat[key] = getattr(getattr(self, _FIELDS[key].section), _FIELDS[key].attr)
        return flat

    def validate(self) -> None:
        """Check every setting's type, range and choices (in ``--help``'s order), then the
        relations between them; a :class:`ConfigError` names the first offending setting by
        its flat name."""
        if not isinstance(self.runtime, Config):
            raise ConfigError(f"runtime={self.runtime!r} must be an hpcdl.Config")
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} must be a {cls.__name__} "
                    "(TrainConfig.from_flat takes the settings by their flat names)"
                )
        for key, s in _FIELDS.items():
            section = getattr(self, s.section)
            setattr(section, s.attr, _checked(key, getattr(section, s.attr), s.kind, s.field.metadata))
        self._validate_model()
        self._validate_grid()
        self._validate_ps()
        self._validate_run()

    def _validate_model(self) -> None:
        """The relations within the model's section."""
        m = self.model
        if m.d_model % m.n_head:
            raise ConfigError(f"d_model={m.d_model} must be a multiple of n_head={m.n_head}")
        if m.activation_checkpointing and m.name != "gpt":
            raise ConfigError(
                f"activation_checkpointing applies to the transformer blocks of model='gpt', not model={m.name!r}"
            )

    def _validate_grid(self) -> None:
        """The relations the model-parallel settings need (the world size is checked at start)."""
        m, p, t = self.model, self.parallelism, self.training
        split = p.tp * p.pp > 1
        if split and m.name != "gpt":
            raise ConfigError(f"tp and pp split the transformer of model='gpt', not model={m.name!r}")
        if (p.chunks > 1 or p.sequence_parallel) and m.name != "gpt":
            what = "chunks" if p.chunks > 1 else "sequence_parallel"
            raise ConfigError(f"{what} applies to model='gpt', not model={m.name!r}")
        if p.sequence_parallel and p.tp == 1:
            raise ConfigError("sequence_parallel splits the sequence over the tensor-parallel ranks: it needs tp > 1")
        if m.name != "gpt":
            return
        for what, n in (("n_head", m.n_head), ("the vocabulary of 256 bytes", 256)):
            if n % p.tp:
                raise ConfigError(f"tp={p.tp} must divide {what} ({n})")
        if p.sequence_parallel and m.block_size % p.tp:
            raise ConfigError(f"sequence_parallel: tp={p.tp} must divide block_size={m.block_size}")
        if p.pp > m.n_layer + 2:
            raise ConfigError(
                f"pp={p.pp} stages need at least as many layers; the gpt has {m.n_layer + 2} "
                f"(embeddings, {m.n_layer} blocks, head)"
            )
        if p.chunks > t.batch_size:
            raise ConfigError(f"chunks={p.chunks} micro-batches need batch_size >= chunks, not {t.batch_size}")
        if split and t.precision == "fp16":
            raise ConfigError(
                "precision='fp16' skips steps whose gradients overflow, which each rank of a tp/pp grid would "
                "judge on its own parameters alone; use precision='bf16' or 'fp32' with tp or pp"
            )
        if p.sequence_parallel and self.optimizer.zero == 2:
            raise ConfigError(
                "sequence_parallel sums the layer norms' gradients over the TP ranks after the data-parallel "
                "reduction, and zero=2 keeps only a shard of them; use zero=0 or 1"
            )

    def _validate_ps(self) -> None:
        """The relations the parameter-server settings need (the world size is checked at start)."""
        p, zero, precision = self.parallelism, self.optimizer.zero, self.training.precision
        if p.dp != "ps":
            if self.runtime.ps_servers:
                k = self.runtime.ps_servers
                raise ConfigError(f"ps_servers={k} dedicates ranks to parameter servers, which only dp='ps' uses")
            return
        if zero:
            raise ConfigError(f"dp='ps' sends gradients to parameter servers; zero={zero} shards them: use one")
        if p.tp * p.pp > 1 or p.chunks > 1:
            raise ConfigError("dp='ps' trains the whole model on each worker: it does not run on a tp/pp grid")
        if precision == "fp16" and p.ps_mode != "sync":
            raise ConfigError(
                f"precision='fp16' unscales the gradients on the workers, but ps_mode={p.ps_mode!r} steps on the "
                "servers: use ps_mode='sync', or precision='bf16'"
            )

    def _validate_run(self) -> None:
        """The relations of precision, device and the run directory's checkpoints."""
        if self.training.precision == "fp16" and self.optimizer.zero == 2:
            raise ConfigError(
                "precision='fp16' needs the full gradients to unscale them, which zero=2 does not keep; "
                "use zero=0 or 1, or precision='bf16'"
            )
        if self.training.device == "cuda" and not _cuda_available():
            raise ConfigError("device='cuda' but torch sees no CUDA device here; use device='cpu' or 'auto'")
        ck = self.checkpoint
        if ck.resume and not self.job.run_dir:
            raise ConfigError("resume needs run_dir: the run directory whose newest checkpoint to continue from")
        if ck.resume and ck.overwrite:
            raise ConfigError("resume continues the run in run_dir and overwrite deletes its checkpoints: pass one")


def _checked(key: str, value: Any, kind: Any, limits: Mapping[str, Any]) -> Any:
    """``value`` of setting ``key`` if it is of type ``kind`` (an int where a float is wanted
    as that float) within the field's ``limits``, else a :class:`ConfigError` naming it."""
    if typing.get_origin(kind) is Literal:
        if value not in typing.get_args(kind) or type(value) is bool:
            raise ConfigError(f"{key}={value!r} is not accepted; choose one of {_choices(kind)}")
        return value
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise ConfigError(f"{key}={value!r} must be {_kind_words(kind)}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number")
    if "min" in limits and value < limits["min"]:
        raise ConfigError(f"{key}={value!r} must be >= {limits['min']}")
    if "gt" in limits and not value > limits["gt"]:
        raise ConfigError(f"{key}={value!r} must be > {limits['gt']}")
    if "lt" in limits and not value < limits["lt"]:
        raise ConfigError(f"{key}={value!r} must be < {limits['lt']}")
    return value


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _choices(kind: Any) -> str:
    return ", ".join(repr(c) for c in typing.get_args(kind))


def _kind_words(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[kind]


def _flat_fields() -> dict[str, _Setting]:
    """Every setting of the sections by its flat name, in :data:`_FLAT_KEYS`' order."""
    found = {}
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            found[f.metadata.get("key", f.name)] = _Setting(section, f.name, hints[f.name], f)
    if sorted([*found, "runtime"]) != sorted(_FLAT_KEYS):
        raise RuntimeError(f"the sections hold {sorted(found)}, _FLAT_KEYS lists {sorted(_FLAT_KEYS)}")
    return {key: found[key] for key in _FLAT_KEYS if key != "runtime"}


_FIELDS = _flat_fields()
_HINTS = {key: s.kind for key, s in _FIELDS.items()}
"""The settings' types by flat name."""
_RUNTIME_HINTS = typing.get_type_hints(Config)
_RUNTIME_DEFAULTS = Config()
_RUNTIME_FLAGS = [name for name in _RUNTIME_HINTS if name not in _FIELDS]
"""Runtime fields that have a flag of their own (``timeline`` is the job's)."""
register_env_names(ENV_PREFIX + name.upper() for name in _FIELDS)


def _convert(name: str, raw: Any, where: str, hints: Mapping[str, Any] = _HINTS) -> Any:
    """``raw`` (text from a flag or variable, or a value from a file) as setting ``name``'s type
    (``hints``: the settings' types by flat name, or the runtime section's field types)."""
    kind = hints[name]
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        for c in choices:
            if (raw == c and type(raw) is not bool) or (isinstance(raw, str) and raw.strip().lower() == str(c)):
                return c
        raise ConfigError(f"{where}={raw!r} is not accepted for {name}; choose one of {_choices(kind)}")
    if not isinstance(raw, str):
        if kind is float and type(raw) is int:
            return float(raw)
        if type(raw) is not kind:
            raise ConfigError(f"{where}={raw!r}: {name} must be {_kind_words(kind)}")
        return raw
    text = raw.strip()
    try:
        if kind is bool:
            return BOOLS[text.lower()]
        return kind(text)
    except (KeyError, ValueError):
        accepted = "one of " + ", ".join(sorted(BOOLS)) if kind is bool else _kind_words(kind)
        raise ConfigError(f"{where}={raw!r}: {name} must be {accepted}") from None


def _unknown(name: str, where: str, known: Sequence[str] = (*_FIELDS, "runtime")) -> ConfigError:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(sorted(known))}"
    return ConfigError(f"{where}: unknown field {name!r}{hint}")


def _read_file(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory; give a .toml, .yaml or .yml file")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            import tomllib

            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        elif ext in (".yaml", ".yml"):
            import yaml

            with open(path) as fh:
                data = yaml.safe_load(fh) or {}
        else:
            raise ConfigError(f"config file {path!r}: use a .toml, .yaml or .yml file")
    except ConfigError:
        raise
    except Exception as exc:  # the parser's own message says where
        raise ConfigError(f"config file {path!r} does not parse: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a table of field = value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m hpcdl.train",
        description="Train a model data-parallel over the ranks of an mpiexec or srun job.",
        epilog=f"Every field also reads {ENV_PREFIX}<FIELD> (e.g. {ENV_PREFIX}LR=0.01); flags win over "
        "variables, variables over the config file.",
        allow_abbrev=False,
    )
    p.add_argument("--config", metavar="FILE", help="a .toml or .yaml file of field = value")
    for name, setting in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kind, f = setting.kind, setting.field
        text = f"{f.metadata['help']} (default: {f.default!r})".replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            metavar = "{" + ",".join(str(c) for c in typing.get_args(kind)) + "}" if typing.get_origin(kind) else None
            p.add_argument(flag, dest=name, default=None, metavar=metavar, help=text)
    group = p.add_argument_group(
        "runtime", "hpcdl.Config, the runtime's section: also HPCDL_<FIELD> variables or a [runtime] table in --config"
    )
    for name in _RUNTIME_FLAGS:
        flag = "--" + name.replace("_", "-")
        text = f"HPCDL_{name.upper()} (default: {getattr(_RUNTIME_DEFAULTS, name)!r})"
        kw: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if _RUNTIME_HINTS[name] is bool else {}
        metavar = None if kw else name.upper()
        group.add_argument(flag, dest="runtime." + name, default=None, metavar=metavar, help=text, **kw)
    return p


class _Parser(ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> TrainConfig:
    """Resolve the configuration from defaults, ``--config`` file, ``HPCDL_TRAIN_*`` and flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    env = os.environ if environ is None else environ
    p = _parser()
    p.__class__ = _Parser  # errors raise ConfigError instead of exiting
    ns = p.parse_args(argv)
    values: dict[str, Any] = {}
    runtime: dict[str, Any] = {}
    if ns.config:
        for key, raw in _read_file(ns.config).items():
            if key == "runtime":
                runtime.update(_runtime_table(raw, ns.config))
                continue
            if key not in _FIELDS:
                raise _unknown(key, f"config file {ns.config!r}")
            values[key] = _convert(key, raw, f"{key} in {ns.config}")
    for key in sorted(env):
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name not in _FIELDS:
                raise _unknown(name, f"environment variable {key}")
            values[name] = _convert(name, env[key], key)
    for name in _FIELDS:
        raw = getattr(ns, name)
        if raw is not None:
            values[name] = _convert(name, raw, "--" + name.replace("_", "-"))
    try:
        from_env = load_config(env)  # the runtime's HPCDL_<FIELD> variables
    except HpcdlError as exc:
        raise ConfigError(_from_environment(exc, env)) from None
    try:  # the collectives' HPCDL_<FIELD> variables, read when the first communicator is used
        collectives_config(env)
    except CollectivesConfigError as exc:
        raise ConfigError(_from_environment(exc, env)) from None
    for name in _RUNTIME_HINTS:
        if getattr(from_env, name) != getattr(_RUNTIME_DEFAULTS, name):
            runtime[name] = getattr(from_env, name)
    for name in _RUNTIME_FLAGS:
        raw = getattr(ns, "runtime." + name)
        if raw is not None:
            runtime[name] = _convert(name, raw, "--" + name.replace("_", "-"), _RUNTIME_HINTS)
    try:
        values["runtime"] = Config(**runtime)
    except HpcdlError as exc:
        raise ConfigError(f"runtime: {exc}") from None
    try:
        return TrainConfig.from_flat(**values)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from {_origin(exc, values, ns, env)})") from None


def _from_environment(exc: Exception, env: Mapping[str, str]) -> str:
    """``exc``'s message, naming the environment variable that set the field it is about."""
    text = str(exc)
    var = "HPCDL_" + text.split("=", 1)[0].upper()
    if text.startswith("HPCDL_") or "=" not in text or var not in env:
        return text
    return f"environment variable {var}: {text}"


def _runtime_table(table: Any, path: str) -> dict[str, Any]:
    """The ``[runtime]`` table of a config file, converted to the runtime's field types."""
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path!r}: runtime must be a table of hpcdl.Config field = value")
    out = {}
    for key, raw in table.items():
        name = str(key).replace("-", "_")
        if name not in _RUNTIME_HINTS:
            raise _unknown(name, f"config file {path!r}, runtime table", list(_RUNTIME_HINTS))
        out[name] = _convert(name, raw, f"runtime.{name} in {path}", _RUNTIME_HINTS)
    return out


def _origin(exc: ConfigError, values: dict[str, Any], ns: argparse.Namespace, env: Mapping[str, str]) -> str:
    """Where the offending field's value came from, for the message."""
    name = str(exc).split("=", 1)[0]
    if name not in _FIELDS:
        return "the combination of fields"
    if getattr(ns, name) is not None:
        return "--" + name.replace("_", "-")
    if ENV_PREFIX + name.upper() in env:
        return f"environment variable {ENV_PREFIX}{name.upper()}"
    if name in values:
        return f"config file {ns.config!r}"
    return "the default"


def help_text() -> str:
    return _parser().format_help()
