"""The training job's configuration: one dataclass, filled from (lowest to highest
precedence) its defaults, an optional TOML or YAML file, ``HPCDL_TRAIN_<FIELD>``
environment variables and command-line flags ``--<field-with-dashes>``.

The runtime's own configuration (:class:`hpcdl.Config`: fusion, buckets, cycle time,
stall inspector, ...) is the nested section ``runtime``: a ``[runtime]`` table in the
file, the runtime's ``HPCDL_<FIELD>`` variables, and a flag ``--<field-with-dashes>``
for each of its fields but ``timeline`` (the job's ``--timeline`` records the training).

Every value is checked before any rank starts work; a bad one raises :class:`ConfigError`
naming the field (or flag, variable, file key) and the values it accepts.
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
from typing import Any, Literal

from collectives.cli import ArgumentParser
from collectives.config import BOOLS, register_env_names
from collectives.config import load_config as collectives_config
from collectives.errors import ConfigError as CollectivesConfigError
from hpcdl.config import Config, load_config
from hpcdl.errors import HpcdlError

__all__ = ["TrainConfig", "ConfigError", "RunError", "Interrupted", "parse_config", "ENV_PREFIX"]

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


def _field(default: Any, help: str, **meta: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """Everything ``python -m hpcdl.train`` needs; ``--help`` lists the fields."""

    # what to train
    model: Literal["cnn", "mlp", "gpt"] = _field(
        "cnn",
        "cnn or mlp: classifiers of scikit-learn's handwritten digits; gpt: a byte-level decoder on "
        "the Python documentation text that ships with CPython (pydoc_data.topics)",
    )
    epochs: int = _field(20, "passes over the training split", min=1)
    max_steps: int = _field(0, "stop after this many optimizer steps (0: run every epoch)", min=0)
    batch_size: int = _field(32, "samples per rank per backward pass", min=1)
    grad_accum: int = _field(1, "backward passes per optimizer step (gradient accumulation)", min=1)
    # optimizer
    optimizer: Literal["sgd", "adam", "adamw"] = _field("adam", "the torch optimizer")
    lr: float = _field(2e-3, "learning rate for one rank (see lr_scaling)", gt=0.0)
    lr_scaling: Literal["linear", "none"] = _field("linear", "linear: the rate is lr x world size")
    warmup_steps: int = _field(20, "steps of linear warm-up from lr/steps to the full rate", min=0)
    lr_schedule: Literal["cosine", "constant"] = _field("cosine", "after warm-up: cosine decay to 0, or constant")
    momentum: float = _field(0.9, "SGD momentum", min=0.0)
    weight_decay: float = _field(0.0, "weight decay (decoupled for adamw)", min=0.0)
    zero: Literal[0, 1, 2] = _field(0, "0: DistributedOptimizer; 1 or 2: ZeroOptimizer of that stage")
    # data parallelism through parameter servers (HybridOptimizer)
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
    # model parallelism (gpt): a dp x tp x pp grid, dp = world size / (tp x pp)
    tp: int = _field(1, "gpt: tensor-parallel ranks (attention heads, MLP and vocabulary split over them)", min=1)
    pp: int = _field(1, "gpt: pipeline stages (the embeddings, blocks and head cut into pp stages)", min=1)
    pp_schedule: Literal["1f1b", "gpipe"] = _field("1f1b", "the pipeline's schedule")
    chunks: int = _field(1, "gpt: micro-batches per batch, pipelined over the stages when pp > 1", min=1)
    sequence_parallel: bool = _field(
        False, "gpt with tp > 1: layer norms and dropout on each TP rank's part of the sequence"
    )
    runtime: Config = dataclasses.field(
        default_factory=Config,
        metadata={"help": "the hpcdl runtime's configuration (hpcdl.Config: fusion, buckets, engine)"},
    )
    # where and how precisely
    device: Literal["auto", "cpu", "cuda"] = _field(
        "auto",
        "cuda: each rank trains on GPU local_rank % GPUs of its node; auto: cuda when torch sees a GPU, else cpu",
    )
    precision: Literal["fp32", "bf16", "fp16", "fp64"] = _field(
        "fp32",
        "bf16: autocast to bfloat16; fp16: autocast to float16 with dynamic loss scaling; fp64: float64 "
        "weights and arithmetic (to compare runs to rounding)",
    )
    activation_checkpointing: bool = _field(False, "recompute the transformer blocks in backward (gpt)")
    seed: int = _field(0, "seed of initial weights, data order and dropout", min=0)
    threads: int = _field(1, "torch intra-op threads per rank", min=1)
    # gpt size
    block_size: int = _field(64, "gpt: context length in bytes", min=2)
    n_layer: int = _field(2, "gpt: transformer blocks", min=1)
    n_head: int = _field(4, "gpt: attention heads", min=1)
    d_model: int = _field(128, "gpt: width (a multiple of n_head)", min=1)
    dropout: float = _field(0.0, "gpt: dropout probability", min=0.0, lt=1.0)
    # output, checkpoints
    run_dir: str = _field("", "where metrics, plot, summary and checkpoints go (empty: runs/<model>-<time>)")
    checkpoint_every: int = _field(50, "write a checkpoint every this many steps, and at the end (0: end only)", min=0)
    keep_checkpoints: int = _field(2, "checkpoints kept in run_dir/checkpoints", min=1)
    resume: bool = _field(False, "continue from the newest readable checkpoint in run_dir")
    overwrite: bool = _field(False, "start afresh in a run_dir that holds checkpoints, deleting them")
    timeline: str = _field("", "write hpcdl's Chrome-trace timeline to this file (empty: off)")
    progress: bool = _field(
        True, "a progress bar on rank 0 when its output reaches a terminal (never in a log file); epoch lines always"
    )
    dry_run: bool = _field(False, "print the resolved configuration and the rank layout, then exit")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type, range and choices, then the relations between them."""
        if not isinstance(self.runtime, Config):
            raise ConfigError(f"runtime={self.runtime!r} must be an hpcdl.Config")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = _HINTS[f.name]
            if kind is Config:
                continue
            if typing.get_origin(kind) is Literal:
                if value not in typing.get_args(kind) or type(value) is bool:
                    raise ConfigError(f"{f.name}={value!r} is not accepted; choose one of {_choices(kind)}")
                continue
            if kind is float and type(value) is int:
                value = float(value)
                setattr(self, f.name, value)
            if type(value) is not kind:
                raise ConfigError(f"{f.name}={value!r} must be {_kind_words(kind)}")
            if kind is float and not math.isfinite(value):
                raise ConfigError(f"{f.name}={value!r} must be a finite number")
            m = f.metadata
            if "min" in m and value < m["min"]:
                raise ConfigError(f"{f.name}={value!r} must be >= {m['min']}")
            if "gt" in m and not value > m["gt"]:
                raise ConfigError(f"{f.name}={value!r} must be > {m['gt']}")
            if "lt" in m and not value < m["lt"]:
                raise ConfigError(f"{f.name}={value!r} must be < {m['lt']}")
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model={self.d_model} must be a multiple of n_head={self.n_head}")
        if self.activation_checkpointing and self.model != "gpt":
            raise ConfigError(
                f"activation_checkpointing applies to the transformer blocks of model='gpt', not model={self.model!r}"
            )
        self._validate_grid()
        self._validate_ps()
        if self.precision == "fp16" and self.zero == 2:
            raise ConfigError(
                "precision='fp16' needs the full gradients to unscale them, which zero=2 does not keep; "
                "use zero=0 or 1, or precision='bf16'"
            )
        if self.device == "cuda" and not _cuda_available():
            raise ConfigError("device='cuda' but torch sees no CUDA device here; use device='cpu' or 'auto'")
        if self.resume and not self.run_dir:
            raise ConfigError("resume needs run_dir: the run directory whose newest checkpoint to continue from")
        if self.resume and self.overwrite:
            raise ConfigError("resume continues the run in run_dir and overwrite deletes its checkpoints: pass one")

    def _validate_ps(self) -> None:
        """The relations the parameter-server fields need (the world size is checked at start)."""
        if self.dp != "ps":
            if self.runtime.ps_servers:
                k = self.runtime.ps_servers
                raise ConfigError(f"ps_servers={k} dedicates ranks to parameter servers, which only dp='ps' uses")
            return
        if self.zero:
            raise ConfigError(f"dp='ps' sends gradients to parameter servers; zero={self.zero} shards them: use one")
        if self.tp * self.pp > 1 or self.chunks > 1:
            raise ConfigError("dp='ps' trains the whole model on each worker: it does not run on a tp/pp grid")
        if self.precision == "fp16" and self.ps_mode != "sync":
            raise ConfigError(
                f"precision='fp16' unscales the gradients on the workers, but ps_mode={self.ps_mode!r} steps on the "
                "servers: use ps_mode='sync', or precision='bf16'"
            )

    def _validate_grid(self) -> None:
        """The relations the model-parallel fields need (the world size is checked at start)."""
        split = self.tp * self.pp > 1
        if split and self.model != "gpt":
            raise ConfigError(f"tp and pp split the transformer of model='gpt', not model={self.model!r}")
        if (self.chunks > 1 or self.sequence_parallel) and self.model != "gpt":
            what = "chunks" if self.chunks > 1 else "sequence_parallel"
            raise ConfigError(f"{what} applies to model='gpt', not model={self.model!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel splits the sequence over the tensor-parallel ranks: it needs tp > 1")
        if self.model != "gpt":
            return
        for what, n in (("n_head", self.n_head), ("the vocabulary of 256 bytes", 256)):
            if n % self.tp:
                raise ConfigError(f"tp={self.tp} must divide {what} ({n})")
        if self.sequence_parallel and self.block_size % self.tp:
            raise ConfigError(f"sequence_parallel: tp={self.tp} must divide block_size={self.block_size}")
        if self.pp > self.n_layer + 2:
            raise ConfigError(
                f"pp={self.pp} stages need at least as many layers; the gpt has {self.n_layer + 2} "
                f"(embeddings, {self.n_layer} blocks, head)"
            )
        if self.chunks > self.batch_size:
            raise ConfigError(f"chunks={self.chunks} micro-batches need batch_size >= chunks, not {self.batch_size}")
        if split and self.precision == "fp16":
            raise ConfigError(
                "precision='fp16' skips steps whose gradients overflow, which each rank of a tp/pp grid would "
                "judge on its own parameters alone; use precision='bf16' or 'fp32' with tp or pp"
            )
        if self.sequence_parallel and self.zero == 2:
            raise ConfigError(
                "sequence_parallel sums the layer norms' gradients over the TP ranks after the data-parallel "
                "reduction, and zero=2 keeps only a shard of them; use zero=0 or 1"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _choices(kind: Any) -> str:
    return ", ".join(repr(c) for c in typing.get_args(kind))


def _kind_words(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[kind]


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "runtime"}
_HINTS = typing.get_type_hints(TrainConfig)
_RUNTIME_HINTS = typing.get_type_hints(Config)
_RUNTIME_DEFAULTS = Config()
_RUNTIME_FLAGS = [name for name in _RUNTIME_HINTS if name not in _FIELDS]
"""Runtime fields that have a flag of their own (``timeline`` is the job's)."""
register_env_names(ENV_PREFIX + name.upper() for name in _FIELDS)


def _convert(name: str, raw: Any, where: str, hints: Mapping[str, Any] = _HINTS) -> Any:
    """``raw`` (text from a flag or variable, or a value from a file) as field ``name``'s type
    (``hints``: the field types of :class:`TrainConfig`, or of the runtime section)."""
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
    for name, f in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kind = _HINTS[name]
        default = f.default
        text = f"{f.metadata['help']} (default: {default!r})".replace("%", "%%")  # argparse formats help with %
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
        return TrainConfig(**values)
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
