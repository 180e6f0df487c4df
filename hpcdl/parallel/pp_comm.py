"""Point-to-point messages between neighbouring pipeline stages: tensors (activations
forward, their gradients backward) and the error that stops a pipeline.

Every message is a header of int64 words (status, dtype, rank of the shape, the shape)
followed by the tensor's bytes, or by the text of an error (status -1). Sends are
nonblocking; a stage waits for them at the end of its schedule. A stage that fails, or
learns that a neighbour failed, sends the error on to both neighbours, so a stage blocked
on a receive always gets either its tensor or the error, never waits for ever.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..errors import PipelineError

__all__ = ["Link", "ACT", "GRAD"]

ACT, GRAD = 1, 2
"""Tags: activations travel forward on ACT, their gradients backward on GRAD."""

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
_HEADER = 10  # status, dtype code, ndim, up to 7 dimensions


class Link:
    """This stage's messages over ``comm`` (the pipeline's own communicator, ranks = stages)."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.pending: list[MPI.Request] = []
        self._keep: list[Any] = []  # buffers of sends in flight

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        """Start sending tensor ``t`` to stage ``dest``."""
        if t.dtype not in _DTYPES or t.dim() > _HEADER - 3:
            raise TypeError(f"a pipeline stage can pass tensors of {_DTYPES} up to 7 dimensions, not {t.dtype}")
        data = t.detach().contiguous().cpu()
        head = np.zeros(_HEADER, np.int64)
        head[0], head[1], head[2] = 1, _DTYPES.index(t.dtype), t.dim()
        head[3 : 3 + t.dim()] = t.shape
        raw = data.reshape(-1).view(torch.uint8).numpy()
        self._keep += [head, raw, data]
        self.pending += [self.comm.Isend(head, dest, tag), self.comm.Isend(raw, dest, tag)]

    def recv(self, source: int, tag: int) -> torch.Tensor:
        """The next tensor from stage ``source``; :class:`~hpcdl.errors.PipelineError` (with
        the failed stage's text) if it sent an error."""
        head = np.empty(_HEADER, np.int64)
        self.comm.Recv(head, source, tag)
        if head[0] < 0:
            raise PipelineError(self.comm.recv(source=source, tag=tag))
        shape = tuple(int(d) for d in head[3 : 3 + head[2]])
        out = torch.empty(shape, dtype=_DTYPES[int(head[1])])
        self.comm.Recv(out.reshape(-1).view(torch.uint8).numpy(), source, tag)
        return out

    def send_error(self, text: str, dest: int, tag: int) -> None:
        """Tell stage ``dest`` (waiting on ``tag``, or later) that the pipeline failed."""
        head = np.zeros(_HEADER, np.int64)
        head[0] = -1
        self.comm.Send(head, dest, tag)  # small: completes without the receiver
        self.comm.send(text, dest=dest, tag=tag)

    def finish(self) -> None:
        """Wait for every send of this schedule (all matched when no stage failed)."""
        MPI.Request.Waitall(self.pending)
        self.pending, self._keep = [], []

    def abandon(self) -> MPI.Comm:
        """After a failure: drop the sends that may never be matched and move to a fresh
        communicator (collective over the pipeline's stages), so stale messages can never
        be taken for the next step's."""
        self.pending, self._keep = [], []
        self.comm = self.comm.Dup()
        return self.comm
