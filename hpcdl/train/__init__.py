"""``hpcdl.train``: the training job. ``python -m hpcdl.train --help`` lists its options;
:func:`run` runs one from Python with a :class:`TrainConfig` (its sections: the model, the
training, the optimizer, the parallelism, the checkpoints, the job's outputs, and the
runtime's :class:`hpcdl.Config`)."""

from .config import (
    CheckpointConfig,
    ConfigError,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainConfig,
    TrainingConfig,
    parse_config,
)
from .loop import Trainer, run

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "TrainingConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "CheckpointConfig",
    "JobConfig",
    "ConfigError",
    "parse_config",
    "run",
    "Trainer",
]
