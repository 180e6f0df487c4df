"""The timeline: a Chrome trace (Perfetto, ``chrome://tracing``) of every rank's requests.

Each rank records complete events (``"ph": "X"``) for the phases of its requests: QUEUE
(submitted, not yet sent to the other ranks), NEGOTIATE (sent, waiting for the other
ranks), MEMCPY_IN_FUSION_BUFFER, the collective itself (named after it, with the
algorithm in ``args``) and MEMCPY_OUT_FUSION_BUFFER. The process row is the rank
(``pid``); each tensor name gets its own thread row within it. When the timeline stops,
the engine gathers every rank's events on rank 0, which writes one JSON file.

Each rank's metadata also has a ``clock`` event whose ``perf_counter_at_ts0`` is that rank's
``time.perf_counter()`` at ``ts`` 0, so a script can place its own timestamps (say, the
backward pass) on the trace's time axis.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from collectives.cli import replace_file

__all__ = ["Timeline", "write_trace", "path_problem"]


def path_problem(path: str) -> str | None:
    """Why the timeline cannot be written to ``path`` (its directory is missing or not
    writable, or it names a directory), or None. Checked where a timeline starts, on the
    rank that writes it, so a bad path fails at once rather than when the trace is written."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return f"{path} is a directory; give a file name"
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        return f"its directory {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its directory {folder} is not writable"
    return None


class Timeline:
    """One rank's events, in microseconds since ``t0`` (a ``time.perf_counter`` value)."""

    def __init__(self, rank: int, path: str, t0: float, mark_cycles: bool = False) -> None:
        self.rank, self.path, self.t0, self.mark_cycles = rank, path, t0, mark_cycles
        self.events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}

    def _tid(self, name: str) -> int:
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids) + 1
        return tid

    def span(self, tensor: str, phase: str, start: float, end: float, **args: Any) -> None:
        """Record ``phase`` of ``tensor`` from ``start`` to ``end`` (perf_counter seconds)."""
        ev = {
            "name": phase,
            "cat": "hpcdl",
            "ph": "X",
            "ts": round((start - self.t0) * 1e6, 3),
            "dur": round(max(end - start, 0.0) * 1e6, 3),
            "pid": self.rank,
            "tid": self._tid(tensor),
            "args": {"tensor": tensor, **args},
        }
        self.events.append(ev)

    def cycle(self, number: int, at: float) -> None:
        """Mark the start of negotiation cycle ``number`` (only with ``mark_cycles``)."""
        if self.mark_cycles:
            self.events.append(
                {
                    "name": "CYCLE_START",
                    "cat": "hpcdl",
                    "ph": "i",
                    "s": "p",
                    "ts": round((at - self.t0) * 1e6, 3),
                    "pid": self.rank,
                    "tid": 0,
                    "args": {"cycle": number},
                }
            )

    def metadata(self) -> list[dict[str, Any]]:
        """Process and thread names for this rank's rows."""
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "cycles"}},
            {"name": "clock", "ph": "M", "pid": self.rank, "args": {"perf_counter_at_ts0": self.t0}},
        ]
        for name, tid in self._tids.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}})
        return meta

    def collect(self) -> list[dict[str, Any]]:
        """Everything this rank contributes to the trace."""
        return self.metadata() + self.events


def write_trace(path: str, per_rank: list[list[dict[str, Any]]]) -> None:
    """Write every rank's events as one Chrome trace JSON file (atomically)."""
    events = [ev for evs in per_rank for ev in evs]
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "hpcdl", "ranks": len(per_rank), "written": time.time()},
    }
    replace_file(path, lambda fh: json.dump(doc, fh, allow_nan=False))
