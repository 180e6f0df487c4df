"""``hpcdl.train``: the training job. ``python -m hpcdl.train --help`` lists its options;
:func:`run` runs one from Python with a :class:`TrainConfig`."""

from .config import ConfigError, TrainConfig, parse_config
from .loop import Trainer, run

__all__ = ["TrainConfig", "ConfigError", "parse_config", "run", "Trainer"]
