"""The executors: one function per collective, running an agreed request (or a fused group
of allreduces) through :mod:`collectives` on the process set's communicator. Requests whose
signature says ``device`` memory carry CuPy views of CUDA tensors: they run with the
tensors' GPU current, after the events recorded when they were submitted, through the
collectives' device path, and the engine's stream is synchronized before they complete.

The engine has already agreed every argument across ranks, so the executors call
``collectives``' agreed entry points, which skip the collectives' own signature exchange.
A rank that joined runs an allreduce with the op's identity, its result discarded, so
the members' collectives always match (only allreduce runs while ranks have joined); for
device memory the identity is made on the GPU given to ``join`` (else the GPU this rank's
device requests last used).

Fusion: small allreduces of one group are packed into one persistent buffer per process
set (grown up to ``fusion_threshold`` bytes, in the set's node window where it has one, so
the collectives read it in place; on the GPU for device memory) and reduced with one call;
a tensor of ``fusion_alone_bytes`` or more is reduced alone where it lies, since fusion
would only copy it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import collectives
from collectives import unchecked
from collectives.blocks import block_counts, offsets
from collectives.context import get_context
from collectives.device.arrays import cupy_module
from collectives.errors import DeviceUnavailableError
from collectives.node.arena import allocate
from collectives.select import choose

from ..config import Config
from .request import DTYPES, Descriptor, ProcessSetInfo, Submission, identity

__all__ = ["Executors", "scale"]

Span = Callable[..., None]
"""``span(reqs, phase, t0, **args)``: a timeline span from ``t0`` to now for each request."""


def scale(x: np.ndarray, factor: float, out: np.ndarray) -> None:
    """``out = factor * x`` (numpy or CuPy arrays), as Horovod scales: an integer array in
    floating point, then truncated toward zero into its own dtype; a 16-bit float array in
    float32 (the factor rounded to float32), then rounded once into its own dtype."""
    if out.dtype.kind in "iu":
        out[...] = np.trunc(x * float(factor)).astype(out.dtype)
    elif out.dtype.itemsize == 2:  # float16, bfloat16
        out[...] = (x.astype(np.float32) * np.float32(factor)).astype(out.dtype)
    else:
        np.multiply(x, factor, out=out)


class Executors:
    """The data collectives of one rank's engine (each process set holds its fusion buffer)."""

    def __init__(self, config: Config, span: Span) -> None:
        self.cfg = config
        self.span = span
        self.algs: dict[tuple, str] = {}
        self.join_device = -1
        """The GPU a joined rank makes its identity tensors on for device allreduces (``join``'s
        ``device``; -1: the GPU of this rank's last device request)."""

    def algorithm(self, comm: Any, coll: str, nbytes: int, device: bool = False) -> str:
        """The algorithm ``collectives`` picks for ``coll`` of ``nbytes`` on ``comm`` (cached;
        for the timeline); ``"device"`` for device memory (the device path's own choice)."""
        if device:
            return "device"
        key = (id(comm), coll, nbytes)
        alg = self.algs.get(key)
        if alg is None:
            alg = "local" if comm.size == 1 else choose(get_context(comm), coll, nbytes)
            if len(self.algs) > 4096:
                self.algs.clear()
            self.algs[key] = alg
        return alg

    def run(self, kind: str, entries: list[Any], reqs: list[Submission | None], info: ProcessSetInfo, rank: int) -> Any:
        """Run the agreed data collective ``kind`` and return its result. ``entries``: the
        controller's entry of each request of the group (every rank's descriptor, by
        rank); ``reqs``: this rank's requests, None where it joined."""
        device = next(iter(entries[0].descs.values())).on_device
        with self._on_gpu(reqs, info) if device else contextlib.nullcontext() as cp:
            if kind == "allreduce":
                self._allreduce([next(iter(e.descs.values())) for e in entries], reqs, info, cp, device)
                return None
            return getattr(self, kind)(entries[0].descs, reqs[0], info, rank)

    @contextlib.contextmanager
    def _on_gpu(self, reqs: list[Submission | None], info: ProcessSetInfo) -> Iterator[Any]:
        """Run a group of device requests: after each tensor's ready event, with its GPU
        current, the stream synchronized at the end. Gives the CuPy module, or None on a
        joined rank without CuPy (whose host identity then fails the group on every rank)."""
        mine = [r for r in reqs if r is not None]
        for r in mine:  # wait for what writes each tensor, on whatever stream it was queued
            r.args["ready"].synchronize()
        try:
            cp = cupy_module()
        except DeviceUnavailableError:
            if mine:
                raise
            yield None
            return
        if mine:
            dev = mine[0].x.device.id
        elif self.join_device >= 0:
            dev = self.join_device
        else:
            dev = info.device_fusion.device.id if info.device_fusion is not None else cp.cuda.Device().id
        with cp.cuda.Device(dev):
            yield cp
            cp.cuda.get_current_stream().synchronize()

    def _allreduce(
        self, descs: list[Descriptor], reqs: list[Submission | None], info: ProcessSetInfo, cp: Any, device: bool
    ) -> None:
        """Reduce a group of agreed allreduces (``descs``: one descriptor of each), fusing
        the small ones; results land in each request's ``out``. ``cp``: the CuPy module for
        device memory; ``device`` without ``cp``: a joined rank that cannot make device
        arrays, whose host identity takes the agreeing path so every rank fails alike."""
        sig = descs[0].sig
        op, pre, post = sig.op, sig.prescale_factor, sig.postscale_factor
        dtype = DTYPES[sig.dtype]
        comm = info.comm
        xp = np if cp is None else cp
        reduce = collectives.allreduce if device and cp is None else unchecked.allreduce
        xs = []
        for d, req in zip(descs, reqs, strict=True):
            if req is not None:
                xs.append((req.x, req.out, req))
            else:  # joined: the op's identity, result discarded
                shape = d.sig.shape
                xs.append((xp.full(shape, identity(op, dtype), dtype), xp.empty(shape, dtype), None))
        limit = self.cfg.fusion_alone_bytes if op != "adasum" else 0  # adasum combines each tensor alone
        small = [e for e in xs if e[0].nbytes < limit]
        alone = [e for e in xs if e[0].nbytes >= limit]
        if len(small) == 1:
            alone, small = alone + small, []
        for x, out, req in alone:
            t0 = time.perf_counter()
            src = x
            if pre != 1.0:
                scale(x, pre, out)
                src = out
            if op == "adasum":
                unchecked.adasum(src, out=out, comm=comm)
            else:
                reduce(src, op=op, out=out, comm=comm)
            if post != 1.0:
                scale(out, post, out)
            alg = "adasum" if op == "adasum" else self.algorithm(comm, "allreduce", out.nbytes, device)
            self.span([req], "ALLREDUCE", t0, algorithm=alg, bytes=int(out.nbytes))
        if not small:
            return
        reqs = [req for _, _, req in small]
        total = sum(x.size for x, _, _ in small)
        nbytes = total * dtype.itemsize
        alg = self.algorithm(comm, "allreduce", nbytes, device)
        fusion = info.fusion if cp is None else info.device_fusion
        if cp is not None and fusion is not None and fusion.device.id != cp.cuda.Device().id:
            fusion = None  # made on another GPU: a new one on this rank's current one
        if fusion is None or fusion.nbytes < nbytes:
            grown = max(nbytes, min(2 * (0 if fusion is None else fusion.nbytes), self.cfg.fusion_threshold))
            if cp is None:
                fusion = info.fusion = self.fusion_buffer(info, grown)
            else:
                fusion = info.device_fusion = cp.empty(grown, np.uint8)  # on the current GPU
        buf = fusion[:nbytes].view(dtype)
        t0 = time.perf_counter()
        off = 0
        for x, _, _ in small:
            seg = buf[off : off + x.size]
            if pre != 1.0:
                scale(x.reshape(-1), pre, seg)
            else:
                seg[...] = x.reshape(-1)
            off += x.size
        t1 = time.perf_counter()
        self.span(reqs, "MEMCPY_IN_FUSION_BUFFER", t0)
        reduce(buf, op=op, out=buf, comm=comm)
        self.span(reqs, "ALLREDUCE", t1, algorithm=alg, bytes=int(nbytes), fused=len(small))
        t2 = time.perf_counter()
        off = 0
        for _, out, _ in small:
            seg = buf[off : off + out.size]
            if post != 1.0:
                scale(seg, post, out.reshape(-1))
            else:
                out.reshape(-1)[...] = seg
            off += out.size
        self.span(reqs, "MEMCPY_OUT_FUSION_BUFFER", t2)

    @staticmethod
    def fusion_buffer(info: ProcessSetInfo, nbytes: int) -> np.ndarray:
        """A fusion buffer of ``nbytes`` for ``info``'s set: in its node window where there is
        one with room (the collectives then read every rank's buffer in place), else
        ordinary memory."""
        return allocate(info.arena, nbytes, np.uint8)

    def allgather(self, descs: dict[int, Descriptor], req: Submission, info: ProcessSetInfo, rank: int) -> Any:
        rows = [descs[r].var for r in info.ranks]  # every member's, as its descriptor says
        t0 = time.perf_counter()
        # an ``out`` (ZeroOptimizer's flat parameters) holds this rank's block already
        res = unchecked.allgather(req.x, rows, comm=info.comm, out=req.out)
        alg = self.algorithm(info.comm, "allgather", res.nbytes, req.on_device)
        self.span([req], "ALLGATHER", t0, algorithm=alg, bytes=int(res.nbytes))
        return res

    def broadcast(self, descs: dict[int, Descriptor], req: Submission, info: ProcessSetInfo, rank: int) -> Any:
        root = req.sig.root_rank
        out = req.out
        src = req.x if rank == root else out
        t0 = time.perf_counter()
        unchecked.broadcast(src, info.ranks.index(root), out=out, comm=info.comm)
        alg = self.algorithm(info.comm, "broadcast", out.nbytes, req.on_device)
        self.span([req], "BROADCAST", t0, algorithm=alg, bytes=int(out.nbytes))
        return out

    def alltoall(self, descs: dict[int, Descriptor], req: Submission, info: ProcessSetInfo, rank: int) -> Any:
        n = len(info.ranks)
        splits = req.args.get("splits")
        rows = req.x.shape[0]
        send = np.asarray(splits if splits is not None else [rows // n] * n, np.int64)
        t0 = time.perf_counter()
        out = collectives.alltoall(req.x, None if splits is None else send, comm=info.comm)
        received = collectives.alltoall(send, comm=info.comm)
        self.span([req], "ALLTOALL", t0, algorithm="pairwise", bytes=int(out.nbytes))
        return out, received

    def reducescatter(self, descs: dict[int, Descriptor], req: Submission, info: ProcessSetInfo, rank: int) -> Any:
        sig = req.sig
        shape, op, pre, post = sig.shape, sig.op, sig.prescale_factor, sig.postscale_factor
        n, me = len(info.ranks), info.ranks.index(rank)
        x, out = req.x, req.out
        t0 = time.perf_counter()
        src = x
        if pre != 1.0:
            src = np.empty_like(x)
            scale(x, pre, src)
        rows = shape[0] if shape else 0
        if rows % n == 0 and x.size:
            unchecked.reduce_scatter(src, op=op, out=out.reshape(-1), comm=info.comm)
            alg = self.algorithm(info.comm, "reduce_scatter", x.nbytes, req.on_device)
        else:  # uneven rows: reduce everything, keep this rank's rows
            full = unchecked.allreduce(src, op=op, comm=info.comm)
            off = offsets(block_counts(rows, n))
            out[...] = full[off[me] : off[me + 1]]
            alg = "allreduce+slice"
        if post != 1.0:
            scale(out, post, out)
        self.span([req], "REDUCESCATTER", t0, algorithm=alg, bytes=int(x.nbytes))
        return out
