"""Point-to-point messages between neighbouring pipeline stages: tensors (activations
forward on the :data:`ACT` stream, their gradients backward on :data:`GRAD`) and the error
that stops a pipeline.

Each stream has three tags: DATA (a tensor's bytes alone), SHAPE (int64 words: the
micro-batch slot, the dtype's code, the shape) and ERROR (the UTF-8 text of a failure).
Shapes are agreed once, then reused: the sender records the dtype and shape it last sent
to each neighbour on each stream for each micro-batch slot, and sends a SHAPE message
before a tensor only when they differ. While the batch shape stays the same, every step
after the first sends DATA alone; micro-batches of different sizes (11 rows in 3) keep
their own records, so they do not send headers every step either.

The receiver keeps the same records. It probes the next message from the source with any
tag: messages from one source on one communicator are not overtaken by later ones, and a
stage receives a single stream from each neighbour (activations from the previous stage,
gradients from the next), so that message is the stream's. A SHAPE updates the record (it
names its slot, which must be the one expected), DATA lands in a new tensor of the
recorded dtype and shape (then moved to the receiving stage's device: the bytes travel
through host memory), an ERROR is raised as :class:`~hpcdl.errors.PipelineError`.

Sends, errors included, are nonblocking; a stage waits for them at the end of its
schedule. How a stage waits, for a message or for its sends, depends on whether its node's
ranks have a core each (``spin``): with one, in MPI's own blocking probe, which polls the
core; where they outnumber the cores, the stage it waits for is likely not running, and a
waiter that polled would only delay it, so it looks ``spin`` times, then sleeps between
looks. A stage that fails, or learns that a neighbour failed, sends the error on to
both neighbours, so a stage blocked on a receive always gets either its tensor or the
error, never waits for ever. After a failure every stage calls :meth:`Link.abandon`, which
moves to a fresh communicator and forgets both sides' records, so the next step starts
again with shapes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from collectives.link import testall, waitall

from ..errors import PipelineError

__all__ = ["Link", "ACT", "GRAD"]

ACT, GRAD = 1, 2
"""Streams: activations travel forward on ACT, their gradients backward on GRAD."""

_DATA, _SHAPE, _ERROR = 0, 1, 2  # the kinds of message on a stream
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
"""Each dtype's code in a SHAPE message."""


_DOZE = 50e-6
"""Seconds a polite wait (``Link.spin`` set) sleeps between looks: a few percent of a
micro-batch's compute on the smallest stages, so a hop wakes up late by little."""


def _tag(stream: int, kind: int) -> int:
    return 3 * stream + kind


class Link:
    """This stage's messages over ``comm`` (the pipeline's own communicator, ranks = stages).

    Attributes:
        comm: the communicator in use (a fresh one after :meth:`abandon`).
        spin: None to wait in MPI's blocking calls (a core per rank); else how many times
            a wait looks before it sleeps between looks (where ranks outnumber cores).
        headers_sent: SHAPE messages sent so far (over the link's whole life).
        messages_sent: tensors (DATA messages) sent so far.
    """

    def __init__(self, comm: MPI.Comm, spin: int | None = None) -> None:
        if spin is not None and spin < 0:
            raise ValueError(f"Link: spin={spin} must be None or >= 0")
        self.comm, self.spin = comm, spin
        self.pending: list[MPI.Request] = []
        self._keep: list[Any] = []  # buffers of sends in flight
        # (peer, stream, slot) -> the dtype and shape last sent to / received from the peer
        self._sent: dict[tuple[int, int, int], tuple[int, torch.Size]] = {}  # by the dtype's code
        self._received: dict[tuple[int, int, int], tuple[torch.dtype, tuple[int, ...], int]] = {}  # and its bytes
        self._status = MPI.Status()
        self.headers_sent = 0
        self.messages_sent = 0

    def send(self, t: torch.Tensor, dest: int, stream: int, slot: int = 0) -> None:
        """Start sending tensor ``t`` to stage ``dest`` on ``stream`` for micro-batch
        ``slot``, preceded by its dtype and shape when they differ from the last sent there."""
        code = _CODES.get(t.dtype)
        if code is None:
            raise TypeError(f"a pipeline stage can pass tensors of {_DTYPES}, not {t.dtype}")
        if not t.is_cpu:
            t = t.detach().cpu()
        elif not t.is_contiguous():
            t = t.detach().contiguous()
        key, shape = (dest, stream, slot), t.shape
        if self._sent.get(key) != (code, shape):
            head = np.array([slot, code, *shape], np.int64)
            self._keep.append(head)
            self.pending.append(self.comm.Isend([head, MPI.INT64_T], dest, _tag(stream, _SHAPE)))
            self._sent[key] = (code, shape)
            self.headers_sent += 1
        # the tensor's bytes where they lie: no numpy view, whose making costs more than the
        # send itself right after a stage's compute, when little of Python is in the caches
        self._keep.append(t)
        self.pending.append(self.comm.Isend(MPI.buffer.fromaddress(t.data_ptr(), t.nbytes), dest, _tag(stream, _DATA)))
        self.messages_sent += 1

    def recv(self, source: int, stream: int, slot: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
        """The next tensor from stage ``source`` on ``stream`` (micro-batch ``slot``), on
        ``device`` (the receiving stage's); :class:`~hpcdl.errors.PipelineError` (with the
        failed stage's text) if it sent an error."""
        status, data = self._status, _tag(stream, _DATA)
        while True:
            if self.spin is not None:
                self._await(lambda: self.comm.Iprobe(source, MPI.ANY_TAG))
            msg = self.comm.Mprobe(source, MPI.ANY_TAG, status)
            tag, size = status.tag, status.Get_count()
            if tag == data:
                break
            if tag == _tag(stream, _SHAPE):
                head = np.empty(size // 8, np.int64)
                msg.Recv([head, MPI.INT64_T])
                if int(head[0]) != slot:
                    raise RuntimeError(
                        f"stage {source} sent the shape of micro-batch {int(head[0])} where {slot} was due"
                    )
                dtype, shape = _DTYPES[int(head[1])], tuple(int(d) for d in head[2:])
                self._received[(source, stream, slot)] = (dtype, shape, math.prod(shape) * dtype.itemsize)
                continue
            text = bytearray(size)
            msg.Recv([text, MPI.BYTE])
            if tag == _tag(stream, _ERROR):
                raise PipelineError(text.decode(errors="replace"))
            raise RuntimeError(f"stage {source} sent a message with tag {tag}, not one of stream {stream}")
        known = self._received.get((source, stream, slot))
        if known is None or known[2] != size:
            msg.Recv([bytearray(size), MPI.BYTE])
            raise RuntimeError(
                f"stage {source} sent {size} bytes for micro-batch {slot} on stream {stream}, where the "
                f"shape agreed was {'none' if known is None else f'{known[0]} {list(known[1])}'}"
            )
        # straight into a tensor's memory (see send)
        out = torch.empty(known[1], dtype=known[0])
        msg.Recv(MPI.buffer.fromaddress(out.data_ptr(), size))
        return out if device == "cpu" or getattr(device, "type", None) == "cpu" else out.to(device)

    def send_error(self, text: str, dest: int, stream: int) -> None:
        """Tell stage ``dest`` (waiting on ``stream``, or later) that the pipeline failed."""
        raw = np.frombuffer(text.encode(), np.uint8)
        self._keep.append(raw)
        self.pending.append(self.comm.Isend([raw, MPI.BYTE], dest, _tag(stream, _ERROR)))

    def _await(self, ready: Any) -> None:
        """Return once ``ready()`` is true: ``spin`` looks, then a sleep between looks."""
        looks = 0
        while not ready():
            looks += 1
            if looks > self.spin:
                time.sleep(_DOZE)

    def finish(self) -> None:
        """Wait for every send of this schedule (all matched when no stage failed)."""
        if self.spin is not None:
            self._await(lambda: testall(self.pending))
        waitall(self.pending)
        self.pending, self._keep = [], []

    def abandon(self) -> MPI.Comm:
        """After a failure: drop the sends that may never be matched, forget the shapes
        sent and received, and move to a fresh communicator (collective over the pipeline's
        stages), so stale messages can never be taken for the next step's. Every stage
        calls it, so both ends of every link start again from no shapes."""
        self.pending, self._keep = [], []
        self._sent.clear()
        self._received.clear()
        self.comm = self.comm.Dup()
        return self.comm
