"""Configuration of the torch runtime: one dataclass, read from ``HPCDL_*`` in one place.

Each field ``name`` has the environment mirror ``HPCDL_<NAME>`` (the names follow
Horovod's ``HOROVOD_*`` ones). Together with the collectives layer's names they are the
only valid ``HPCDL_*`` variables: any other is an error naming the closest valid one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from collectives.config import PREFIX, check_unknown, env_values, register_env_names

from .errors import HpcdlError

__all__ = ["Config", "load_config", "AGREED"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """Knobs of the background engine (defaults as in Horovod)."""

    fusion_threshold: int = 128 << 20
    """Bytes of small allreduce requests packed into one fusion buffer (0: no fusion)."""

    fusion_alone_bytes: int = 1 << 20
    """An allreduce tensor of at least this many bytes is reduced alone where it lies, not
    copied into the fusion buffer (fusion amortises the per-call cost of small tensors; a
    large one only pays the copies)."""

    bucket_bytes: int = 4 << 20
    """Bytes of gradients the optimizers (``DistributedOptimizer``, ``ZeroOptimizer``) put
    in one bucket, submitted as one grouped request as soon as all of them are ready."""

    first_bucket_bytes: int = 1 << 20
    """The first bucket's cap (the last layers' gradients, ready first): small, so that
    communication starts early in backward, as DDP's first bucket does."""

    device_path: bool = True
    """Keep CUDA tensors' allreduces on the device where CuPy is installed (the fusion
    buffer on the device too; ``collectives`` picks NCCL, CUDA IPC between ranks of a node,
    or a CUDA-aware MPI); False, or without CuPy: staged through pinned host memory."""

    check_missing_gradients: bool = False
    """Make a gradient missing on some ranks but not others an error on every rank, instead
    of reducing it with zeros where missing (Horovod's behaviour, the default)."""

    cycle_time: float = 1.0
    """Milliseconds the engine waits after one negotiation before the next, so requests
    submitted meanwhile are fused; a rank blocked on an unsent request starts at once."""

    cache_capacity: int = 1024
    """Request signatures remembered so that steady-state negotiation sends a bit each
    (0: off)."""

    stall_check_disable: bool = False
    """Turn the stall inspector off."""

    stall_check_time_seconds: float = 60.0
    """Seconds a request may wait for other ranks before its name and the missing ranks
    are logged."""

    stall_shutdown_time_seconds: float = 0.0
    """Seconds after which such a stall becomes an error on every rank (0: never)."""

    timeline: str = ""
    """Write a Chrome trace of every rank's requests to this file (empty: off)."""

    timeline_mark_cycles: bool = False
    """Mark each negotiation cycle in the timeline."""

    ps_servers: int = 0
    """Make the last this many ranks of ``MPI.COMM_WORLD`` parameter servers (``init`` serves
    on them, then ends the process); the others are the workers (0: no dedicated servers)."""

    shm_doorbell: bool = True
    """With every rank on one node (and Linux futexes), ring doorbells and let idle engines
    sleep through shared memory instead of polling for MPI messages (False: always MPI)."""

    def __post_init__(self) -> None:
        if self.fusion_threshold < 0:
            raise HpcdlError(f"fusion_threshold={self.fusion_threshold} must be >= 0 (0 turns fusion off)")
        for name in ("fusion_alone_bytes", "bucket_bytes", "first_bucket_bytes"):
            if getattr(self, name) <= 0:
                raise HpcdlError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.cycle_time <= 10_000:
            raise HpcdlError(f"cycle_time={self.cycle_time} ms must be in [0, 10000]")
        if self.cache_capacity < 0:
            raise HpcdlError(f"cache_capacity={self.cache_capacity} must be >= 0 (0 turns the cache off)")
        if self.ps_servers < 0:
            raise HpcdlError(f"ps_servers={self.ps_servers} must be >= 0 (0: no dedicated parameter servers)")
        if self.stall_check_time_seconds <= 0:
            raise HpcdlError(f"stall_check_time_seconds={self.stall_check_time_seconds} must be > 0")
        if self.stall_shutdown_time_seconds < 0:
            raise HpcdlError(
                f"stall_shutdown_time_seconds={self.stall_shutdown_time_seconds} must be >= 0 (0: never shut down)"
            )


AGREED = (
    "device_path",
    "fusion_threshold",
    "fusion_alone_bytes",
    "bucket_bytes",
    "first_bucket_bytes",
    "check_missing_gradients",
    "cache_capacity",
    "stall_check_disable",
    "stall_check_time_seconds",
    "stall_shutdown_time_seconds",
    "ps_servers",
)
"""Fields that steer decisions every rank must make alike (what is fused, how gradients are
bucketed, when a stall ends the job): ``init`` refuses ranks that differ in them."""

register_env_names(PREFIX + f.name.upper() for f in dataclasses.fields(Config))


def load_config(environ: Mapping[str, str] | None = None) -> Config:
    """Build a :class:`Config` from ``HPCDL_*`` variables (``os.environ`` by default); an
    unknown ``HPCDL_*`` name or a bad value raises on the spot."""
    env = os.environ if environ is None else environ
    try:
        check_unknown(env)
        return Config(**env_values(Config, env))
    except HpcdlError:
        raise
    except Exception as exc:  # ConfigError from the shared reader
        raise HpcdlError(str(exc)) from None
