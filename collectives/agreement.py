"""Argument agreement: every call's arguments checked on every rank before data moves.

A :class:`Call` checks its arguments locally and keeps the first error; :meth:`Call.agree`
then exchanges a small signature (collective, algorithm, op, dtype, count, root, item
shape, error flag) with the other ranks, so that bad input on any rank, or ranks calling
with different arguments, raises on every rank, naming the field and the ranks, and the
communicator stays usable. On a single-node communicator the signature travels through
the node channel (:mod:`.node.channel`), folded into three int64 words (:func:`pack`); elsewhere
through a nonblocking all-gather.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

from .algorithms import recursive_doubling
from .context import Context
from .errors import (
    CollectiveError,
    CollectiveMismatchError,
    InvalidArgumentError,
    InvalidRootError,
    OutputMismatchError,
    PeerInputError,
    StallError,
    UnknownAlgorithmError,
)
from .ops import DTYPES, OPS, check_dtype, check_op, dtype_code
from .select import DEVICE, REGISTRY, choose

__all__ = [
    "Call",
    "pack",
    "unpack",
    "word",
    "check_out",
    "check_out_layout",
    "equal_counts",
    "within",
    "ROWS",
    "FIELDS",
]

COLLECTIVES = tuple(REGISTRY)
FIELDS = ("collective", "algorithm", "resolved", "op", "dtype", "count", "root", "item shape", "error", "memory")
FIELD_INDEX = {name: i for i, name in enumerate(FIELDS)}
COLL_CODES = {c: i for i, c in enumerate(COLLECTIVES)}
ALG_CODES = {c: {a: i for i, a in enumerate([*names, "auto", *DEVICE[c]])} for c, names in REGISTRY.items()}
"""Algorithm codes: the host algorithms, ``auto``, then the device-array ones."""
OP_CODES = {o: i for i, o in enumerate(OPS)}
#: fields that may differ between ranks, per collective
MAY_DIFFER = {"allgather": {"count"}, "alltoall": {"count"}}

_REDUCING = ("allreduce", "reduce_scatter", "reduce")
_ROOTED = ("broadcast", "reduce")

ROWS = 1 << 31
"""Allgather's count word carries this rank's rows plus ``(out rows + 1) * ROWS`` (0: no
``out``), so every rank can check every rank's ``out`` against the agreed total."""


class Call:
    """One call's arguments, checked; the first local error is kept, not raised yet."""

    def __init__(
        self,
        ctx: Context,
        collective: str,
        x: Any,
        algorithm: str,
        op: str | None = None,
        root: int | None = None,
        agreed: list[int] | None = None,
        device: bool = False,
    ) -> None:
        self.ctx = ctx
        self.agreed = agreed
        """Every rank's ``count``, when the caller agreed the arguments already (see
        :mod:`.unchecked`): then only a call finished in one step through the node channel
        posts its signature, since its data travels with it."""
        self.t = ctx.transport
        self.collective = collective
        self.error: CollectiveError | None = None
        self.x = x if isinstance(x, np.ndarray) else np.asarray(x)
        self.op = op
        self.root = root
        self.algorithm = algorithm
        self.resolved = algorithm
        self.device = device
        """True for a call on device arrays (``x`` is then a host stand-in of their shape)."""
        self.seq = 0
        self._counts: list[int] | None = None
        try:
            check_dtype(self.x.dtype)
            if op is not None or collective in _REDUCING:
                check_op(op)
            names = [*DEVICE[collective], "native"] if device else list(REGISTRY[collective])
            if algorithm != "auto" and algorithm not in names:
                if algorithm in ALG_CODES[collective]:
                    kind = "host (numpy) arrays" if device else "device arrays (CuPy arrays, CUDA tensors)"
                    raise UnknownAlgorithmError(
                        f"{collective}: algorithm {algorithm!r} takes {kind}; for these: {', '.join([*names, 'auto'])}"
                    )
                raise UnknownAlgorithmError(
                    f"{collective}: no algorithm {algorithm!r}; registered: {', '.join([*names, 'auto'])}"
                )
            if (root is not None or collective in _ROOTED) and not (
                isinstance(root, (int, np.integer)) and 0 <= root < self.t.size
            ):
                raise InvalidRootError(
                    f"{collective}: root={root!r} is not a rank of a {self.t.size}-rank communicator"
                )
            if algorithm == "native" and getattr(self.t, "comm", None) is None:
                raise InvalidArgumentError(f"{collective}: algorithm 'native' needs an MPI communicator")
            if algorithm == "shm" and collective != "allreduce" and ctx.topology().nodes > 1:
                raise InvalidArgumentError(f"{collective}: algorithm 'shm' needs every rank on one node")
        except CollectiveError as exc:
            self.error = exc

    def fail(self, exc: CollectiveError) -> None:
        if self.error is None:
            self.error = exc

    def resolve(self, nbytes: int) -> None:
        if self.error is None and self.algorithm == "auto":
            self.resolved = choose(self.ctx, self.collective, nbytes)

    def signature(self, count: int, item_shape: tuple[int, ...] = ()) -> list[int]:
        names = ALG_CODES[self.collective]
        return [
            COLL_CODES[self.collective],
            names.get(self.algorithm, -1),
            names.get(self.resolved, -1),
            OP_CODES.get(self.op, -1),  # type: ignore[arg-type]
            dtype_code(self.x.dtype),
            count,
            self.root if isinstance(self.root, (int, np.integer)) else -2,
            zlib.crc32(repr(tuple(item_shape)).encode()) if item_shape else 0,
            0 if self.error is None else 1,
            1 if self.device else 0,
        ]

    def agree(
        self,
        count: int,
        item_shape: tuple[int, ...] = (),
        payload: np.ndarray | None = None,
        one_step: bool = False,
        where: tuple[int, int] = (0, 0),
    ) -> None:
        """Check arguments on every rank; raise the same way everywhere on any problem.

        On a single-node communicator the signature (and ``payload``, a small message's
        data, when given, and ``where`` this rank's input and output lie in the node's
        arena) goes through the node channel; elsewhere through a nonblocking all-gather.
        Afterwards :meth:`counts` gives every rank's ``count`` and :meth:`inplace` says
        whether every rank's buffers lie in the arena. ``one_step`` (or a ``payload``)
        says the call finishes in one step through the node channel; an agreed call posts
        only then, or on one node (its buffers may lie in the arena).
        """
        if self.ctx.broken:
            raise StallError(
                f"this communicator's collectives stopped after a stall ({self.ctx.broken}); call "
                "collectives.reset(comm) on every rank to use it again"
            )
        t = self.t
        ch = self.ctx.chan
        posts = one_step or payload is not None or (ch is not None and self.algorithm in ("auto", "shm"))
        if t.size == 1 or (self.agreed is not None and not posts):
            if self.error is not None:
                raise self.error
            self._counts = [count] if t.size == 1 else self.agreed
            return
        sig = self.signature(count, item_shape)
        if ch is not None:
            a, b, c = pack(sig)
            seq = ch.exchange(
                a, b, c, payload if self.error is None else None, self.collective in MAY_DIFFER, where[0], where[1]
            )
            self.seq = abs(seq)
            if seq > 0:
                if self.error is not None:
                    raise self.error
                return
            seq = -seq
            table = np.array([unpack(w) for w in ch.words(seq)], np.int64)
        else:
            mine = np.array(sig, np.int64)
            k = mine.size
            table = np.empty((t.size, k), np.int64)
            comm = self.ctx.agree_comm
            if comm is not None:
                gone = self.ctx.gave_up()
                if gone >= 0:
                    raise StallError(
                        f"rank {gone} gave up on a collective after a stall (its error names the call), so "
                        f"this {self.collective} cannot complete; the communicator's collectives are stopped; "
                        "call collectives.reset(comm) on every rank to use it again"
                    )
                # nonblocking, whatever is in flight here: blocking and nonblocking collectives
                # never match, and what is in flight differs between ranks
                self.ctx.agree_calls += 1
                self.ctx.agree_width = k
                self.ctx.run(within(self.ctx, comm.Iallgather(mine, table), self.collective))
            else:
                flat = table.reshape(-1)
                flat[t.rank * k : (t.rank + 1) * k] = mine
                self.ctx.run(recursive_doubling.allgather(self.ctx, t, flat, (k,) * t.size, self.ctx.next_tag()))
        self._counts = [int(v) for v in table[:, FIELD_INDEX["count"]]]
        self._judge(table)

    def _judge(self, table: np.ndarray) -> None:
        differ = (table != table[0]).any(axis=0)
        if differ.any():
            if differ[FIELD_INDEX["memory"]]:  # explains every other difference
                raise _mismatch(table, "memory")
            if differ[FIELD_INDEX["error"]]:
                self._raise_input_errors(table)
            skip = MAY_DIFFER.get(self.collective, ())
            for name in FIELDS:
                if differ[FIELD_INDEX[name]] and name not in skip:
                    shown = None
                    if name == "item shape":  # the signature holds a hash: every rank says its shape
                        shown = [str(s) for s in self.t.allgather_obj(tuple(int(d) for d in self.x.shape[1:]))]
                    raise _mismatch(table, name, shown)
        if self.error is not None:
            raise self.error

    def mismatch_from_channel(self) -> None:
        """Raise the error for a posted call whose signatures differ between ranks."""
        table = np.array([unpack(w) for w in self.ctx.chan.words(self.seq)], np.int64)
        self._judge(table)
        raise AssertionError("signatures differ but no field does")  # pragma: no cover

    def counts(self) -> list[int]:
        """Every rank's ``count`` from the last :meth:`agree`, by rank."""
        if self._counts is None:
            self._counts = [w[1] for w in self.ctx.chan.words(self.seq)]
        return self._counts

    def inplace(self, output: bool, only: int | None = None, inputs: bool = True) -> list[tuple[int, int]] | None:
        """Every rank's arena words (input, output) when this call posted them and every
        rank's input (``only``: that rank's; ``output``: its output too; not ``inputs``: its
        output only) lies in the node's arena, else None. Every rank reads the same words,
        so every rank decides alike; they are read from the slot, so ask before this rank
        posts again."""
        ch = self.ctx.chan
        if self.seq == 0 or self.ctx.arena is None or ch is None:
            return None
        p = self.seq & 1
        for h in ch.heads if only is None else ch.heads[only : only + 1]:
            if (inputs and not h[p][3]) or (output and not h[p][4]):
                return None  # the common case, ordinary arrays: decided from the first word
        return ch.wheres(self.seq)

    def small(self, nbytes: int) -> bool:
        """True when this call finishes in one step through the node channel's slots."""
        ch = self.ctx.chan
        if ch is None or self.resolved != "shm" or self.error is not None:
            return False
        return ch.one_step(self.collective, nbytes)

    def _raise_input_errors(self, table: np.ndarray) -> None:
        # rare path: gather the messages so every rank can say what went wrong where
        msgs = self.t.allgather_obj(None if self.error is None else f"{type(self.error).__name__}: {self.error}")
        if self.error is not None:
            raise self.error
        bad = "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m is not None)
        raise PeerInputError(f"{self.collective} abandoned because of bad input on other ranks ({bad})")


def equal_counts(ctx: Context, x: Any) -> list[int]:
    """Every rank's count in an agreed call whose counts are equal (this rank's, n times)."""
    return [int(np.size(x))] * ctx.transport.size


def within(ctx: Context, req: Any, what: str):
    """A schedule that waits for the MPI request ``req`` and, past the stall timeout, gives
    the communicator up (every later call raises) and raises :class:`~.errors.StallError`."""
    timeout = ctx.config.stall_timeout
    if timeout <= 0:
        yield [req]
        return
    start = time.monotonic()
    polls = 0
    while not req.Test():
        polls += 1
        if polls > 4096:  # a long wait: poll gently
            time.sleep(50e-6)
            if time.monotonic() - start >= timeout:
                ctx.stalled_request = req  # completed by reset, which the other ranks catch up with
                ctx.tell_gave_up()
                ctx.broken = (
                    f"{what} stalled: waited {timeout:g} s (HPCDL_STALL_TIMEOUT) for the other ranks to reach "
                    "it; the ranks fell out of step (a rank raised, or skipped or reordered a collective)"
                )
                raise StallError(
                    f"{ctx.broken}. The communicator's collectives are stopped on this rank; call "
                    "collectives.reset(comm) on every rank to use it again"
                )
        yield []


def pack(sig: list[int]) -> tuple[int, int, int]:
    """Fold a signature into three int64 words: small fields, count, item-shape hash."""
    coll, alg, res, op, dt, count, root, shape, err, mem = sig
    a = 0
    for v in (coll, alg, res, op, dt):
        a = (a << 6) | (v + 2)
    a = (((((a << 1) | err) << 1) | mem) << 31) | (root + 2)
    return a, count, shape


def unpack(words: tuple[int, int, int]) -> list[int]:
    a, count, shape = words
    root = (a & 0x7FFFFFFF) - 2
    a >>= 31
    mem = a & 1
    a >>= 1
    err = a & 1
    a >>= 1
    small = []
    for _ in range(5):
        small.append((a & 63) - 2)
        a >>= 6
    coll, alg, res, op, dt = reversed(small)
    return [coll, alg, res, op, dt, count, root, shape, err, mem]


def _describe(table: np.ndarray, name: str, value: int) -> str:
    if name == "collective":
        return COLLECTIVES[value]
    coll = COLLECTIVES[int(table[0, FIELD_INDEX["collective"]])]
    if name in ("algorithm", "resolved"):
        names = list(ALG_CODES[coll])
        return names[value] if 0 <= value < len(names) else "?"
    if name == "op":
        return OPS[value] if 0 <= value < len(OPS) else "none"
    if name == "dtype":
        return str(DTYPES[value]) if 0 <= value < len(DTYPES) else "unsupported"
    if name == "root" and value == -2:
        return "none"
    if name == "memory":
        return "a device array" if value else "a host array"
    return str(value)


def _mismatch(table: np.ndarray, name: str, shown: list[str] | None = None) -> CollectiveMismatchError:
    """The error for ranks that differ in field ``name`` (``shown``: each rank's value as
    text, where the table holds only a hash of it)."""
    col = table[:, FIELD_INDEX[name]]
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(col):
        groups.setdefault(shown[r] if shown else _describe(table, name, int(v)), []).append(r)
    parts = "; ".join(
        f"ranks {rs} passed {v}" if len(rs) > 1 else f"rank {rs[0]} passed {v}" for v, rs in groups.items()
    )
    return CollectiveMismatchError(
        f"collective arguments differ between ranks in field {name!r}: {parts}", field=name, values=groups
    )


def check_out(call: Call, out: np.ndarray | None, shape: tuple[int, ...]) -> None:
    if out is None or call.error is not None:
        return
    if not isinstance(out, np.ndarray):
        call.fail(OutputMismatchError(f"{call.collective}: out must be a numpy array, not {type(out).__name__}"))
    else:
        check_out_layout(call, out, shape, call.x.dtype)


def check_out_layout(call: Call, out: Any, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Fail ``call`` unless ``out`` (a host or device array) has ``shape`` and ``dtype`` and
    is C-contiguous; True when it passes."""
    if out.shape != shape or out.dtype != dtype:
        call.fail(
            OutputMismatchError(
                f"{call.collective}: out has shape {out.shape} and dtype {out.dtype}; "
                f"expected shape {shape} and dtype {dtype}"
            )
        )
        return False
    if not out.flags.c_contiguous:
        call.fail(OutputMismatchError(f"{call.collective}: out must be C-contiguous"))
        return False
    return True


def word(collective: str, algorithm: str, resolved: str, op: str | None, dtype: np.dtype, root: int | None) -> int:
    """The first signature word a call with these arguments posts (see :meth:`Call.signature`)."""
    names = ALG_CODES[collective]
    sig = [
        COLL_CODES[collective],
        names[algorithm],
        names[resolved],
        OP_CODES.get(op, -1),  # type: ignore[arg-type]
        dtype_code(dtype),
        0,
        -2 if root is None else root,
        0,
        0,
        0,
    ]
    return pack(sig)[0]
