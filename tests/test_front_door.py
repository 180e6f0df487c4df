"""A public collective's front door (``collectives.node.onestep.call_path``).

In one process: the compiled door (``cslots.Path``) and the Python one (``PythonPath``)
over a recording lookup, one-step function and general path: what each calls, with what,
and what it hands on; the compiled door's remembered call, which a change to any part of
the call, or ``forget()``, makes it look up again; errors and references.

Under mpiexec -n 2 and more: the public calls, whose doors remember the last call, against
numpy while every part of the call changes from one call to the next; a mismatch after a
remembered call; a freed communicator's call forgotten.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from mpi4py import MPI

import collectives as C
from collectives.context import get_context
from collectives.node import slots
from collectives.node.channel import forget_calls
from collectives.node.onestep import PythonPath, call_path

try:
    from collectives.node.cslots import Path
except ImportError:  # not built: only the Python door
    Path = None

WORLD = MPI.COMM_WORLD
SLOW, MISMATCH, UNEVEN = slots.SLOW, slots.MISMATCH, slots.UNEVEN
KINDS = ["python", pytest.param("compiled", marks=pytest.mark.skipif(Path is None, reason="cslots not built"))]


class Recorder:
    """A door of ``kind`` over a lookup, one-step function and general path that record
    their calls; the function returns ``self.result`` (its ``x`` doubled when that is None),
    and the lookup gives ``self.fn`` (False when the arg is ``"general"``)."""

    def __init__(self, kind: str) -> None:
        self.looked: list[tuple] = []
        self.stepped: list[tuple] = []
        self.handed: list[tuple] = []
        self.result = None
        self.fn = self.step
        self.door = (
            Path(*self._parts(), np.ndarray, SLOW, MISMATCH, UNEVEN)
            if kind == "compiled"
            else PythonPath(*self._parts())
        )

    def _parts(self):
        return "allreduce", self.lookup, self.general

    def lookup(self, name, x, arg, algorithm, comm):
        self.looked.append((name, x.dtype, x.shape, arg, algorithm, comm))
        return False if isinstance(arg, str) and arg == "general" else self.fn

    def step(self, x, *out):
        self.stepped.append((x, *out))
        return x * 2 if self.result is None else self.result

    def general(self, x, arg, algorithm, out, comm, agreed, why):
        self.handed.append((x, arg, algorithm, out, comm, agreed, why))
        return "general"


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_runs_its_one_step_function_with_out_only_where_given(kind):
    r = Recorder(kind)
    x, out = np.arange(4.0), np.empty(4)
    assert np.array_equal(r.door(x, "sum", "auto", None, None, None), x * 2)
    assert len(r.stepped[0]) == 1 and r.stepped[0][0] is x
    r.door(x, "sum", "auto", out, None, None)
    assert len(r.stepped[1]) == 2 and r.stepped[1][1] is out
    assert r.looked[0] == ("allreduce", x.dtype, x.shape, "sum", "auto", None)
    assert r.handed == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("why", ["slow", "mismatch", "uneven"])
def test_what_the_one_step_cannot_finish_is_handed_on_with_its_reason(kind, why):
    r = Recorder(kind)
    r.result = {"slow": SLOW, "mismatch": MISMATCH, "uneven": UNEVEN}[why]
    x, out, comm, agreed = np.ones(3, np.float32), np.empty(3, np.float32), object(), [3, 3]
    for _ in range(3):  # the compiled door's remembered call hands on the same
        assert r.door(x, "max", "shm", out, comm, agreed) == "general"
    assert r.handed == [(x, "max", "shm", out, comm, agreed, r.result)] * 3
    assert len(r.stepped) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_no_function_or_no_ndarray_goes_to_the_general_path_as_slow(kind):
    r = Recorder(kind)
    x = np.ones(2)

    class Sub(np.ndarray):
        pass

    assert r.door(x, "general", "auto", None, None, True) == "general"
    assert r.door([1.0, 2.0], "sum", "auto", None, None, None) == "general"
    assert r.door(x.view(Sub), "sum", "auto", None, None, None) == "general"
    assert [h[-1] for h in r.handed] == [SLOW] * 3 and r.handed[0][5] is True
    assert len(r.looked) == 1 and r.stepped == []  # only the ndarray was looked up


def test_the_python_door_looks_every_call_up():
    r = Recorder("python")
    x = np.ones(2)
    for _ in range(3):
        r.door(x, "sum", "auto", None, None, None)
    assert len(r.looked) == 3 and not r.door.remembered


@pytest.mark.skipif(Path is None, reason="cslots not built")
def test_the_compiled_door_remembers_the_last_call_while_every_part_is_alike():
    r = Recorder("compiled")
    comm = object()
    x = np.ones((2, 3), np.float32)
    call = [x, "sum", "auto", None, comm, None]
    r.door(*call)
    r.door(np.zeros((2, 3), np.float32), "sum", "auto", np.empty((2, 3), np.float32), comm, True)
    assert len(r.looked) == 1 and len(r.stepped) == 2 and r.door.remembered
    # a change to any one part of the call is looked up again, and then remembered
    changes = [
        ("comm", 4, object()),
        ("dtype", 0, np.ones((2, 3), np.float64)),
        ("shape", 0, np.ones(6, np.float32)),
        ("arg", 1, "max"),
        ("algorithm", 2, "shm"),
    ]
    for part, i, value in changes:
        before = len(r.looked)
        call[i] = value
        r.door(*call)
        r.door(*call)
        assert len(r.looked) == before + 1, part
    # equal parts are alike, as they are as a dict's key: 0, False and numpy's 0 as an arg
    call[1] = 0
    r.door(*call)
    before = len(r.looked)
    for arg in (False, np.int64(0), 0.0):
        call[1] = arg
        r.door(*call)
    assert len(r.looked) == before
    # an arg that cannot be compared is looked up every time (the lookup names the trouble)
    for _ in range(2):
        call[1] = np.arange(3)
        r.door(*call)
    assert len(r.looked) == before + 2
    # forgetting drops the call
    call[1] = "sum"
    r.door(*call)
    assert r.door.remembered
    forget_calls()
    assert not r.door.remembered
    r.door(*call)
    assert len(r.looked) == before + 4


@pytest.mark.skipif(Path is None, reason="cslots not built")
def test_a_remembered_false_skips_the_lookup_too():
    r = Recorder("compiled")
    x = np.ones(2)
    for _ in range(3):
        assert r.door(x, "general", "auto", None, None, None) == "general"
    assert len(r.looked) == 1 and r.stepped == []


@pytest.mark.parametrize("kind", KINDS)
def test_errors_of_the_lookup_and_the_function_reach_the_caller(kind):
    r = Recorder(kind)

    def broken_lookup(*args):
        raise TypeError("comm must be an mpi4py communicator")

    def broken_step(x, *out):
        raise RuntimeError("stalled")

    x = np.ones(2)
    door = (
        Path("allreduce", broken_lookup, r.general, np.ndarray, SLOW, MISMATCH, UNEVEN)
        if kind == "compiled"
        else PythonPath("allreduce", broken_lookup, r.general)
    )
    with pytest.raises(TypeError, match="mpi4py"):
        door(x, "sum", "auto", None, None, None)
    r.fn = broken_step
    for _ in range(2):
        with pytest.raises(RuntimeError, match="stalled"):
            r.door(x, "sum", "auto", None, None, None)
    with pytest.raises(TypeError):
        r.door(x, "sum", "auto", None, None)  # a door takes six arguments
    assert r.handed == []


@pytest.mark.skipif(Path is None, reason="cslots not built")
def test_the_compiled_door_keeps_no_references_of_its_own_once_it_forgets():
    r = Recorder("compiled")
    x, out, comm, arg = np.ones(4), np.empty(4), object(), ("sum", 1)
    r.door(x, arg, "auto", out, comm, None)
    r.stepped.clear()
    counts = [sys.getrefcount(o) for o in (x, out, comm, arg, r.step)]
    for _ in range(1000):
        r.door(x, arg, "auto", out, comm, None)
    r.result = SLOW
    for _ in range(1000):
        r.door(x, arg, "auto", out, comm, None)
    r.handed.clear()
    r.stepped.clear()
    assert [sys.getrefcount(o) for o in (x, out, comm, arg, r.step)] == counts
    held = sys.getrefcount(comm)
    forget_calls()
    assert sys.getrefcount(comm) == held - 1  # the door held it once, until it forgot


# -- the public calls, under mpiexec ------------------------------------------------------
def _fresh() -> MPI.Comm:
    comm = WORLD.Dup()
    get_context(comm)
    return comm


@pytest.mark.mpi(min_size=2)
def test_remembered_calls_follow_every_change_of_the_call():
    a, b = _fresh(), _fresh()
    n, me = a.size, a.rank
    for k in range(3):  # new data every time: a door remembers the function, not the result
        data = [np.arange(6, dtype=np.float32) * (q + 1) + k for q in range(n)]
        x = data[me]
        assert np.array_equal(C.broadcast(x, 0, comm=a), data[0])
        assert np.array_equal(C.broadcast(x, n - 1, comm=a), data[n - 1])  # root
        assert np.array_equal(C.allreduce(x, comm=a), sum(data))
        assert np.array_equal(C.allreduce(x, op="max", comm=a), data[n - 1])  # op
        assert np.array_equal(C.allreduce(x.astype(np.float64), comm=a), sum(data).astype(np.float64))  # dtype
        got = C.allreduce(x.reshape(2, 3), comm=a)  # shape
        assert got.shape == (2, 3) and np.array_equal(got, sum(data).reshape(2, 3))
        assert np.array_equal(C.allreduce(x, algorithm="ring", comm=a), sum(data))  # algorithm
        assert np.array_equal(C.allreduce(x + 1, comm=b), sum(data) + n)  # communicator
        assert np.array_equal(C.allreduce(x, comm=a), sum(data))
        out = np.empty(6 * n, np.float32)
        assert C.allgather(x, out=out, comm=a) is out and np.array_equal(out, np.concatenate(data))
        got = C.reduce(x, n - 1, comm=a)
        assert np.array_equal(got, sum(data)) if me == n - 1 else got is None
        got = C.reduce(x, 0, op="min", comm=a)
        assert np.array_equal(got, data[0]) if me == 0 else got is None
    a.Free()
    b.Free()


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_after_a_remembered_call_raises_on_every_rank():
    comm = _fresh()
    n, me = comm.size, comm.rank
    x = np.full(5, me, np.int32)
    for _ in range(2):
        assert np.array_equal(C.broadcast(x, 1, comm=comm), np.full(5, 1, np.int32))
    with pytest.raises(C.CollectiveMismatchError, match="root"):
        C.broadcast(x, 1 if me else 0, comm=comm)
    assert np.array_equal(C.broadcast(x, 1, comm=comm), np.full(5, 1, np.int32))
    with pytest.raises(C.CollectiveMismatchError, match="count"):
        C.allreduce(x if me else x[:4], comm=comm)
    assert np.array_equal(C.allreduce(x, comm=comm), np.full(5, n * (n - 1) // 2, np.int32))
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compiled", [True, False])
def test_a_freed_communicators_call_is_forgotten(compiled):
    door = call_path("allreduce", lambda *a: "general", compiled=compiled)
    comm = _fresh()
    x = np.arange(3, dtype=np.float32)
    for _ in range(2):
        assert np.array_equal(door(x, "sum", "auto", None, comm, None), x * comm.size)
    assert door.remembered == (compiled and Path is not None)
    assert door(x, "sum", "ring", None, comm, None) == "general"  # no one-step function for ring
    assert door(x, "sum", "auto", None, comm, None).sum() == 3 * comm.size
    comm.Free()  # frees its context, and with it the channel the function posts to
    assert not door.remembered
    C.reset()  # the same of COMM_WORLD's context
    assert np.array_equal(C.allreduce(x), x * WORLD.size)
    C.reset()
    assert np.array_equal(C.allreduce(x), x * WORLD.size)
