"""Requests that move no tensor: ``barrier``, ``join`` and the timeline."""

from __future__ import annotations

from .. import state
from ..engine import Submission, TimelineSig
from ..handles import control, request_name, submit, synchronize
from ..process_sets import ProcessSet, global_process_set, registered_id
from ..timeline import path_problem

__all__ = ["barrier", "join", "start_timeline", "stop_timeline"]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set has called barrier."""
    rt = state.running()
    sid = registered_id(process_set)
    synchronize(submit(rt, [Submission(request_name(rt, "barrier", sid, None), "barrier", sid, ())], lambda res: None))


def join(device: int = -1) -> int:
    """Declare that this rank has no more work: until every rank has joined, the others'
    allreduces proceed with this rank contributing the op's identity (any other
    collective raises on the ranks that submit it, as in Horovod). Returns the rank that
    joined last. ``device``: the GPU the identity is made on when the others reduce CUDA
    tensors on the device path (as Horovod's, -1 by default: then the GPU this rank last
    reduced on, else CuPy's current one)."""
    return state.running().engine.join(device)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording every rank's requests; rank 0's ``file_path`` receives the Chrome
    trace when :func:`stop_timeline` (or shutdown) is called. Collective over all ranks.
    A path rank 0 cannot write (a missing or read-only directory) raises
    :class:`~hpcdl.HpcdlArgumentError` on every rank, and nothing is recorded."""
    path = str(file_path)
    problem = path_problem(path) if state.running().rank == 0 else None
    if problem is not None:
        problem = f"start_timeline({path!r}): {problem}"
    control("start_timeline", TimelineSig(bool(mark_cycles)), var=path, error=problem)


def stop_timeline() -> None:
    """Stop recording and write the timeline file (collective over all ranks)."""
    control("stop_timeline", ())
