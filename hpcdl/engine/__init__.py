"""The background engine: one thread per rank does all of the runtime's communication.

Split by concern, as Horovod's core is: :mod:`.request` (what travels), :mod:`.queue`
(what user threads submit), :mod:`.controller` (negotiation and the plan),
:mod:`.response_cache`, :mod:`.stall_inspector`, :mod:`.executors` (one function per
collective, the fusion buffer), :mod:`.process_set_table`, :mod:`.doorbell` (how cycles
start and idle engines sleep) and :mod:`.loop` (the thread that ties them).
"""

from __future__ import annotations

from .loop import Engine
from .request import (
    BroadcastSig,
    Descriptor,
    GatherSig,
    ProcessSetInfo,
    ReduceSig,
    SetIdSig,
    SetSig,
    Submission,
    TimelineSig,
)

__all__ = [
    "Engine",
    "Submission",
    "Descriptor",
    "ReduceSig",
    "GatherSig",
    "BroadcastSig",
    "SetSig",
    "SetIdSig",
    "TimelineSig",
    "ProcessSetInfo",
]
