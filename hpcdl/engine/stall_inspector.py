"""The stall inspector: requests that some ranks submitted and others did not.

It reads the controller's table each cycle. A request waiting longer than
``stall_check_time_seconds`` is logged on rank 0 with the ranks it waits for; one
waiting longer than ``stall_shutdown_time_seconds`` (when set) becomes an error on every
rank and the engine stops. Ages are measured on rank 0's clock, which every cycle
message carries, so every rank decides alike.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from ..config import Config
from ..errors import HpcdlError

__all__ = ["StallInspector"]

log = logging.getLogger("hpcdl")


class StallInspector:
    """Stall warnings and the stall shutdown of one rank's engine."""

    def __init__(self, config: Config, rank: int) -> None:
        self.cfg = config
        self.rank = rank
        self.last_warn = -math.inf
        self.period = math.inf
        """Seconds between looks while requests wait (inf: the inspector is off)."""
        if not config.stall_check_disable or config.stall_shutdown_time_seconds > 0:
            limit = config.stall_check_time_seconds
            if config.stall_shutdown_time_seconds > 0:
                limit = min(limit, config.stall_shutdown_time_seconds)
            self.period = min(max(limit / 10, 0.01), 1.0)

    def check(self, waiting: dict, now_ref: int, missing: Callable[[object], list[int]]) -> HpcdlError | None:
        """Look at ``waiting`` ((process set id, name) -> entry with ``first``, rank 0's clock in us when it
        was first announced) at rank 0's time ``now_ref`` (us); ``missing(entry)`` lists
        the ranks it waits for. Return the error that stops the engine, if it is due."""
        cfg = self.cfg
        if not waiting or (cfg.stall_check_disable and cfg.stall_shutdown_time_seconds <= 0):
            return None
        stalled = []
        for (sid, name), ent in waiting.items():
            age = (now_ref - ent.first) / 1e6
            if age >= min(cfg.stall_check_time_seconds, cfg.stall_shutdown_time_seconds or math.inf):
                have = sorted(ent.descs)
                where = f" (process set {sid})" if sid else ""
                stalled.append((age, f"'{name}'{where} submitted by ranks {have}, missing on ranks {missing(ent)}"))
        if not stalled:
            return None
        text = "; ".join(s for _, s in stalled)
        worst = max(a for a, _ in stalled)
        if cfg.stall_shutdown_time_seconds > 0 and worst >= cfg.stall_shutdown_time_seconds:
            err = HpcdlError(
                f"stalled for more than {cfg.stall_shutdown_time_seconds:g} s "
                f"(HPCDL_STALL_SHUTDOWN_TIME_SECONDS), shutting down: {text}"
            )
            if self.rank == 0:
                log.error("hpcdl: %s", err)
            return err
        warn_due = now_ref / 1e6 - self.last_warn >= cfg.stall_check_time_seconds
        if not cfg.stall_check_disable and self.rank == 0 and warn_due:
            self.last_warn = now_ref / 1e6
            log.warning(
                "hpcdl: requests waited more than %g s for other ranks (a rank skipped a call or named it "
                "differently): %s",
                cfg.stall_check_time_seconds,
                text,
            )
        return None
