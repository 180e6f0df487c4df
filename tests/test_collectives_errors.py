"""Bad input raises a specific error that says what to do; under mpiexec, mismatches between
ranks and bad input raise on every rank, quickly, and nothing hangs."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import collectives as C
from collectives.config import Config
from collectives.context import get_context

WORLD = MPI.COMM_WORLD


def still_usable():
    got = C.allreduce(np.ones(3, np.int64))
    assert np.array_equal(got, np.full(3, WORLD.size))


@pytest.mark.parametrize(
    "exc, call",
    [
        (C.UnsupportedDtypeError, lambda: C.allreduce(np.zeros(3, np.complex128))),
        (C.UnsupportedDtypeError, lambda: C.allreduce(np.array(["a"]))),
        (C.UnsupportedOpError, lambda: C.allreduce(np.zeros(3), op="mean")),
        (C.UnknownAlgorithmError, lambda: C.allreduce(np.zeros(3), algorithm="butterfly")),
        (C.UnknownAlgorithmError, lambda: C.broadcast(np.zeros(3), algorithm="ring")),
        (C.InvalidRootError, lambda: C.broadcast(np.zeros(3), root=1)),
        (C.InvalidRootError, lambda: C.reduce(np.zeros(3), root=-1)),
        (C.OutputMismatchError, lambda: C.allreduce(np.zeros(3), out=np.zeros(4))),
        (C.OutputMismatchError, lambda: C.allreduce(np.zeros(3), out=np.zeros(3, np.float32))),
        (C.OutputMismatchError, lambda: C.allreduce(np.zeros((3, 2)), out=np.zeros((2, 3)).T)),
        (C.InvalidArgumentError, lambda: C.allgather(np.float64(1.0))),
        (C.InvalidArgumentError, lambda: C.alltoall(np.zeros(4), splits=[3])),
        (C.UnsupportedOpError, lambda: C.allreduce(np.zeros(3), op=None)),
        (C.UnsupportedOpError, lambda: C.reduce_scatter(np.zeros(3), op=None)),
        (C.InvalidRootError, lambda: C.reduce(np.zeros(3), root=None)),
        (C.InvalidRootError, lambda: C.broadcast(np.zeros(3), root="0")),
        (C.InvalidArgumentError, lambda: C.alltoall(np.zeros(4), splits="ab")),
        (TypeError, lambda: C.allreduce(np.zeros(3), comm="world")),
        (TypeError, lambda: C.iallgather(np.zeros(3), comm=1)),
    ],
)
def test_bad_input_raises_specific_error(exc, call):
    with pytest.raises(exc):
        call()


def test_problems_of_several_ranks_read_as_one_message():
    from collectives.errors import combined_problem, rank_ranges

    assert combined_problem([None, None, None]) is None
    assert combined_problem(["full", "full"]) == "full"  # the same everywhere: said once
    assert combined_problem([None, "a", None, "a"]) == "rank 1: a; rank 3: a"
    assert combined_problem(["a", "b", None], ranks=[4, 6, 9]) == "rank 4: a; rank 6: b"
    with pytest.raises(ValueError):  # a rank list that does not fit the problems
        combined_problem(["a", None], ranks=[0])
    assert [rank_ranges(r) for r in ([], [3], [2, 0, 1, 5], [0, 2, 4, 5])] == ["", "3", "0-2,5", "0,2,4-5"]


def test_error_messages_say_what_to_do():
    with pytest.raises(C.UnsupportedOpError, match="sum, avg, min, max, prod"):
        C.allreduce(np.zeros(1), op="mean")
    with pytest.raises(C.UnknownAlgorithmError, match="ring"):
        C.allreduce(np.zeros(1), algorithm="rign")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "field, call",
    [
        ("count", lambda r: C.allreduce(np.zeros(4 + (r == 1), np.float32))),
        ("dtype", lambda r: C.allreduce(np.zeros(4, np.float32 if r != 1 else np.float64))),
        ("op", lambda r: C.allreduce(np.zeros(4, np.float32), op="sum" if r != 1 else "max")),
        ("algorithm", lambda r: C.allreduce(np.zeros(4, np.float32), algorithm="ring" if r != 1 else "tree")),
        ("root", lambda r: C.broadcast(np.zeros(4), root=0 if r != 1 else 1)),
        ("collective", lambda r: C.allreduce(np.zeros(4)) if r != 1 else C.reduce_scatter(np.zeros(4))),
        ("count", lambda r: C.reduce_scatter(np.zeros(9 + r))),
        ("item shape", lambda r: C.allgather(np.zeros((2, 3 + (r == 1))))),
        ("dtype", lambda r: C.allgather(np.zeros(2, np.int32 if r == 1 else np.int64))),
        ("count", lambda r: C.iallreduce(np.zeros(4 + (r == 1))).wait()),
    ],
)
def test_mismatch_raises_on_every_rank_naming_field_and_ranks(field, call):
    r = WORLD.rank
    with pytest.raises(C.CollectiveMismatchError) as info:
        call(r)
    assert info.value.field == field
    assert "rank 1" in str(info.value)
    assert "np.int64" not in str(info.value) and "shape#" not in str(info.value)
    if field == "item shape":  # the shapes themselves, not their hashes
        assert "passed (3,)" in str(info.value) and "rank 1 passed (4,)" in str(info.value), str(info.value)
    still_usable()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "exc, call",
    [
        (C.UnsupportedDtypeError, lambda bad: C.allreduce(np.zeros(4, np.complex64 if bad else np.float32))),
        (C.UnsupportedOpError, lambda bad: C.allreduce(np.zeros(4), op="mean" if bad else "sum")),
        (C.UnknownAlgorithmError, lambda bad: C.allreduce(np.zeros(4), algorithm="bogus" if bad else "ring")),
        (C.InvalidRootError, lambda bad: C.broadcast(np.zeros(4), root=WORLD.size if bad else 0)),
        (C.InvalidRootError, lambda bad: C.reduce(np.zeros(4), root=-1 if bad else 0)),
        (C.OutputMismatchError, lambda bad: C.allreduce(np.zeros(4), out=np.zeros(5 if bad else 4))),
        (
            C.OutputMismatchError,
            lambda bad: C.reduce_scatter(np.zeros(4 * WORLD.size), out=np.zeros(4, np.float32 if bad else np.float64)),
        ),
        (C.OutputMismatchError, lambda bad: C.allgather(np.zeros((2, 3)), out=np.zeros((2 * WORLD.size, 3 + bad)))),
        (
            C.InvalidArgumentError,
            lambda bad: C.alltoall(np.zeros(WORLD.size * 2), splits=[1] * WORLD.size if bad else None),
        ),
        (C.UnsupportedOpError, lambda bad: C.allreduce(np.zeros(4), op=None if bad else "sum")),
        (C.InvalidRootError, lambda bad: C.broadcast(np.zeros(4), root=None if bad else 0)),
        (C.InvalidArgumentError, lambda bad: C.alltoall(np.zeros(WORLD.size), splits="x" if bad else None)),
    ],
)
@pytest.mark.parametrize("everywhere", [False, True])
def test_bad_input_raises_on_every_rank(exc, call, everywhere):
    bad = everywhere or WORLD.rank == 1
    expect = exc if bad else C.PeerInputError
    with pytest.raises(expect) as info:
        call(bad)
    if not bad:
        assert "rank 1" in str(info.value)
    assert "np.int64" not in str(info.value)  # plain integers in messages
    still_usable()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows", [3, 100000])
def test_allgather_out_with_wrong_rows_raises_on_every_rank(rows):
    # the rows are only known after agreement: every rank checks every rank's out, whether
    # or not it passed one itself, small (one step) or large
    r, n = WORLD.rank, WORLD.size
    x = np.ones((rows + r, 2))
    total = sum(rows + q for q in range(n))
    out = np.zeros((total + (r == 1), 2)) if r % 2 else None
    with pytest.raises(C.OutputMismatchError, match=f"rank 1 passed {total + 1}"):
        C.allgather(x, out=out)
    still_usable()
    same = np.ones((rows, 2))
    out = np.zeros((rows * n - (r == 1), 2)) if r else np.zeros((rows * n, 2))
    with pytest.raises(C.OutputMismatchError, match=f"rank 1 passed {rows * n - 1}"):
        C.allgather(same, out=out)
    still_usable()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("coll", ["reduce_scatter", "allgather", "broadcast", "reduce"])
@pytest.mark.parametrize("everywhere", [False, True])
def test_shm_across_nodes_raises_on_every_rank(coll, everywhere):
    # one rank per (simulated) node: the shared-memory algorithms of these collectives need one node
    comm = WORLD.Dup()
    get_context(comm, Config(ranks_per_node=1))
    bad = everywhere or comm.rank == 1
    alg = "shm" if bad else "ring" if coll in ("reduce_scatter", "allgather") else "tree"
    calls = {
        "reduce_scatter": lambda: C.reduce_scatter(np.ones(8), algorithm=alg, comm=comm),
        "allgather": lambda: C.allgather(np.ones(8), algorithm=alg, comm=comm),
        "broadcast": lambda: C.broadcast(np.ones(8), 0, algorithm=alg, comm=comm),
        "reduce": lambda: C.reduce(np.ones(8), 0, algorithm=alg, comm=comm),
    }
    with pytest.raises(C.InvalidArgumentError if bad else C.PeerInputError, match="one node" if bad else "rank 1"):
        calls[coll]()
    assert np.array_equal(C.allreduce(np.ones(2), comm=comm), np.full(2, float(comm.size)))
    comm.Free()
    still_usable()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "where",
    [
        {"compiled_channel": True, "shm_spin": 0},  # the compiled loop, sleeping at once
        {"compiled_channel": True, "shm_spin": 10**9},  # the compiled loop, spinning throughout
        {"compiled_channel": False, "shm_spin": 0},  # the Python loop
        {"ranks_per_node": 1},  # no node channel: agreement through MPI
    ],
    ids=["compiled-sleep", "compiled-spin", "python", "mpi"],
)
def test_a_rank_that_skips_a_call_ends_in_a_stall_error_on_every_rank(where):
    """Rank 0 skips an allreduce the others make: they raise StallError naming rank 0 within
    the stall timeout, rank 0's next call raises too, every later call on the communicator
    raises, and after collectives.reset on every rank it works again."""
    comm = WORLD.Dup()
    sync = WORLD.Dup()  # where rank 0 waits meanwhile, outside the communicator under test
    timeout = 1.5
    get_context(comm, Config(stall_timeout=timeout, **where))
    n, r = comm.size, comm.rank
    assert np.array_equal(C.allreduce(np.ones(2), comm=comm), np.full(2, float(n)))
    if r != 0:
        t0 = MPI.Wtime()
        with pytest.raises(
            C.StallError, match=r"waited 1.5 s .* for (rank\(s\) \[0\]|the other ranks)|gave up"
        ) as info:
            C.allreduce(np.ones(2), comm=comm)
        assert MPI.Wtime() - t0 < timeout + 10, info.value
        assert "collectives.reset(comm)" in str(info.value)
    sync.Barrier()
    # rank 0's late call meets what the others abandoned, and raises; theirs raise at once
    with pytest.raises(C.StallError, match="gave up" if r == 0 else "stopped after a stall"):
        C.allreduce(np.ones(2), comm=comm)
    sync.Barrier()
    with pytest.raises(C.StallError, match="stopped after a stall"):
        C.broadcast(np.ones(2), comm=comm)
    sync.Barrier()
    C.reset(comm)
    get_context(comm, Config(stall_timeout=timeout, **where))
    for k in range(3):
        assert np.array_equal(C.allreduce(np.full(3, k + r, np.int64), comm=comm), np.full(3, n * k + n * (n - 1) // 2))
    comm.Free()
    sync.Free()


@pytest.mark.mpi(min_size=2)
def test_ranks_given_different_channel_settings_fail_alike_instead_of_waiting():
    # their windows and their choice of path would differ: every rank raises where the node
    # channel is made, naming the setting and each rank's value
    if get_context(WORLD).topology().nodes != 1:
        pytest.skip("ranks span nodes")
    comm = WORLD.Dup()
    try:
        with pytest.raises(C.ConfigError, match=r"shm_split_bytes differs .*rank 0: 0, rank 1: 1000"):
            get_context(comm, Config(shm_split_bytes=1000 * comm.rank))
        with pytest.raises(C.ConfigError, match=r"shm_single_copy_bytes differs .*rank 0: 1, rank 1: 2"):
            get_context(comm, Config(shm_single_copy_bytes=1 + comm.rank))
        with pytest.raises(C.ConfigError, match=r"shm_single_copy_broadcast_bytes differs .*rank 0: -1, rank 1: 0"):
            get_context(comm, Config(shm_single_copy_broadcast_bytes=-1 if comm.rank == 0 else 0))
        get_context(comm, Config())  # the same settings everywhere: it works
        assert np.array_equal(C.allreduce(np.ones(4), comm=comm), np.full(4, comm.size))
    finally:
        comm.Free()


def _next_call_raises_then_reset_recovers(comm, sync, cfg, said: str) -> None:
    """After a stall on ``comm``: this rank's next call raises the StallError ``said``
    names, and after collectives.reset on every rank (``sync`` keeps them in step) the
    communicator reduces again; then both are freed."""
    n, r = comm.size, comm.rank
    sync.Barrier()
    with pytest.raises(C.StallError, match=said):
        C.allreduce(np.ones(2), comm=comm)
    sync.Barrier()
    C.reset(comm)
    get_context(comm, cfg)
    assert np.array_equal(C.allreduce(np.full(3, r, np.int64), comm=comm), np.full(3, n * (n - 1) // 2))
    comm.Free()
    sync.Free()


def _single_copy_channel(stall_timeout: float):
    """A communicator (with a twin to synchronize on, and its config) whose node channel
    copies every agreed broadcast, allgather and reduce-scatter once, by cross-memory
    attach (staging slow: non-temporal stores), and ends a wait for a peer after
    ``stall_timeout`` seconds, and that channel; the test skips where the ranks span nodes
    or single copy is off."""
    if get_context(WORLD).topology().nodes != 1:
        pytest.skip("ranks span nodes")
    comm, sync = WORLD.Dup(), WORLD.Dup()
    single = {"shm_single_copy_bytes": 1, "shm_single_copy_broadcast_bytes": 1, "shm_nontemporal_bytes": 4096}
    cfg = Config(stall_timeout=stall_timeout, shm_single_copy_reduce_scatter_bytes=1, **single)
    ch = get_context(comm, cfg).channel()
    if not ch.single_copy_broadcast:
        comm.Free()
        sync.Free()
        pytest.skip("no single copy here: the Python loop, or the kernel refuses cross-memory attach")
    return comm, sync, cfg, ch


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", ["broadcast", "reduce_scatter"])
def test_a_read_the_kernel_refuses_mid_call_raises_there_and_stalls_nobody_forever(collective):
    """Rank 0 of an agreed single-copy broadcast (its root) or reduce-scatter offers an
    address its memory does not hold: every other rank raises OSError naming the read,
    rank 0, left waiting for them, raises StallError within the stall timeout, and
    collectives.reset makes the communicator usable again."""
    from collectives.node.channel import STREAM_SHIFT

    comm, sync, cfg, ch = _single_copy_channel(1.0)
    n, r = comm.size, comm.rank
    seq = ch.exchange(7, 7, 7)  # a call every rank agreed on
    if r == 0:  # offer an address no page of this process holds (a reduce-scatter's vote: yes)
        ch.slots[0][seq & 1][:32].view(np.int64)[[0, 3]] = (8, 1)
        ch._publish(ch.streams, ch._stream_addr, (seq << STREAM_SHIFT) + 1)
        with pytest.raises(C.StallError, match=r"rank\(s\) \[\d+(, \d+)*\] to reach the streamed pieces|gave up"):
            ch._wait_peers(ch._peer_takes, (seq << STREAM_SHIFT) + 1, 6)
    elif collective == "broadcast":
        with pytest.raises(OSError, match="cross-memory attach: reading 64 bytes of process"):
            ch.stream(seq, 0, np.zeros(64, np.uint8))
    else:  # each reads its 64-byte block of every rank's input, rank 0's too
        with pytest.raises(OSError, match="cross-memory attach: reading 64 bytes of process"):
            ch.reduce_scatter_read(seq, np.ones(16 * n, np.float32), (16,) * n, np.empty(16, np.float32), "sum")
    # the root gave up waiting: its next call says it stopped, the readers' that it gave up
    _next_call_raises_then_reset_recovers(comm, sync, cfg, "stopped after a stall" if r == 0 else "gave up")


@pytest.mark.mpi(min_size=2)
def test_a_reader_whose_read_fails_waits_for_the_roots_share_before_it_raises():
    """A single-copy broadcast's root in place writes the last bytes into every reader's
    buffer while the readers read the rest. Rank 0 offers an address its memory does not
    hold and a share of 64 bytes, and writes its share into each reader 0.2 s after the
    reader offered its buffer: each reader's read fails at once, but it raises OSError only
    once the root's share is in its buffer (never handing back memory still being
    written); rank 0, left waiting for the readers, raises StallError."""
    from collectives.node.channel import STREAM_SHIFT

    comm, sync, cfg, ch = _single_copy_channel(2.0)
    n, r = comm.size, comm.rank
    seq = ch.exchange(7, 7, 7)  # a call every rank agreed on
    base, share = seq << STREAM_SHIFT, 64
    got = None
    if r == 0:
        ch.slots[0][seq & 1][:16].view(np.int64)[:] = (8, share)  # an address no page holds
        ch._publish(ch.streams, ch._stream_addr, base + 1)
        tail = np.arange(share, dtype=np.uint8)
        for q in range(1, n):
            deadline = time.monotonic() + 30
            while ch.streams[q][0] < base + 1 and time.monotonic() < deadline:
                time.sleep(0.001)  # until reader q has offered its buffer
            time.sleep(0.2)  # its read has failed by now
            ch.core.cma_write(ch._pids[q], int(ch.slots[q][seq & 1][:8].view(np.int64)[0]) + share, tail)
        ch._publish(ch.streams, ch._stream_addr, base + 2)
        with pytest.raises(C.StallError, match=r"rank\(s\) \[\d+(, \d+)*\] to reach the streamed pieces|gave up"):
            ch._wait_peers(ch._peer_takes, base + 1, 6)
    else:
        buf = np.zeros(2 * share, np.uint8)
        with pytest.raises(OSError, match="cross-memory attach: reading 64 bytes of process"):
            ch.stream(seq, 0, buf)
        got = buf.copy()
    _next_call_raises_then_reset_recovers(comm, sync, cfg, "stopped after a stall" if r == 0 else "gave up")
    if got is not None:  # the share, nothing read (checked once every rank is past the call)
        assert np.array_equal(got, np.r_[np.zeros(share), np.arange(share)]), got


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("step", ["stream", "gather", "split", "single copy", "allreduce"])
def test_a_rank_that_never_sends_its_pieces_or_block_ends_in_a_stall_error_on_every_rank(step, compiled):
    """After an agreed call, rank 0 never streams its broadcast pieces, its allgather block or
    its reduced block, or never offers its data to be read (a broadcast's, or an allreduce's
    read by single copy): the others raise StallError
    within the stall timeout (naming rank 0 and the call, or the peer that gave up first),
    rank 0's next call raises too, and collectives.reset makes the communicator usable
    again."""
    if get_context(WORLD).topology().nodes != 1:
        pytest.skip("ranks span nodes")
    comm, sync = WORLD.Dup(), WORLD.Dup()
    reads = step in ("single copy", "allreduce")
    single = {"shm_single_copy_bytes": 1, "shm_single_copy_broadcast_bytes": 1} if reads else {}
    cfg = Config(stall_timeout=1.0, compiled_channel=compiled, **single)
    ch = get_context(comm, cfg).channel()
    if reads and not ch.single_copy_broadcast:
        comm.Free()
        sync.Free()
        pytest.skip("no single copy here: the Python loop, or the kernel refuses cross-memory attach")
    n, r = comm.size, comm.rank
    seq = ch.exchange(7, 7, 7)  # a call every rank agreed on
    if r != 0:
        buf = np.zeros(2 * ch.slot_bytes * n, np.uint8)
        with pytest.raises(
            C.StallError,
            match=rf"rank\(s\) \[0(, \d+)*\] to reach the (streamed pieces|reduced blocks) of call {seq}|gave up",
        ):
            if step == "allreduce":
                x = buf.view(np.float32)
                ch.allreduce_read(seq, x, np.empty_like(x), "sum")
            elif step in ("stream", "single copy"):
                ch.stream(seq, 0, buf)
            elif step == "gather":
                ch.gather(seq, buf, [k * 2 * ch.slot_bytes for k in range(n + 1)])
            else:
                ch.wait_done(seq)
    _next_call_raises_then_reset_recovers(comm, sync, cfg, "gave up" if r == 0 else "stopped after a stall")
