"""The compiled node-channel loop (``collectives.node.cslots``) against the pure-Python one.

Under mpiexec -n 2, 3, 4: every one-step collective, dtype and op on a communicator whose
channel runs the compiled loop and on one whose channel runs Python's, against a numpy
reference and bitwise equal to each other (the compiled kernels give numpy's bits) and
across ranks; ranks of one communicator mixing the two loops; mismatches and bad ``out``
through the compiled calls; the polite hint reaching the compiled waits.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sysconfig
import time

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from reference import OPS, check_close, digest, expected, make_input

import collectives as C
from collectives.blocks import block_counts, offsets
from collectives.config import Config
from collectives.context import get_context
from collectives.errors import CollectiveMismatchError
from collectives.node import futex
from collectives.node.channel import (
    HEAD,
    HEAD_DATA,
    LINE,
    POSTED,
    last_level_caches,
    nontemporal_bytes,
    nontemporal_out_bytes,
)

WORLD = MPI.COMM_WORLD
N, ME = WORLD.size, WORLD.rank
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]
COUNTS = [1, 3, 17, 1001]
#: where the compiled loop reduces itself (elsewhere numpy reduces after its exchange)
KERNELS = {np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8}
#: single copy on for allgathers and broadcasts of any size, and staging slow (non-temporal
#: stores into the window), as the large reductions' single copy asks
SINGLE_COPY_STAGING_SLOW = {
    "shm_single_copy_bytes": 1,
    "shm_single_copy_broadcast_bytes": 1,
    "shm_nontemporal_bytes": 4096,
}


def _compiler() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None


try:
    from collectives.node.cslots import Core
except ImportError:
    Core = None

needs_core = pytest.mark.skipif(Core is None, reason="collectives.node.cslots is not built (no C compiler)")


def test_the_extension_is_built_where_a_compiler_is():
    # the install builds it whenever it can; a silent build failure would cost every small call
    if not _compiler():
        pytest.skip("no C compiler: the pure-Python loop is the one in use")
    assert Core is not None, "collectives.node.cslots did not build: reinstall with `pip install -e .` and read its log"


@needs_core
def test_the_step_kinds_are_the_compiled_loops():
    from collectives.node import cslots, slots

    kinds = ("STEP_REDUCE", "STEP_BROADCAST", "STEP_ALLGATHER")
    assert [getattr(slots, k) for k in kinds] == [getattr(cslots, k) for k in kinds]
    from collectives.node import channel  # a reduce-scatter read by single copy: the same pieces on both loops

    assert cslots.REDUCE_PIECE == channel.REDUCE_READ_PIECE
    assert cslots.NONTEMPORAL_BYTES == channel.NONTEMPORAL  # measured stores start where set ones do


@pytest.fixture(scope="module")
def comms():
    """A communicator on the compiled loop and one on Python's, both on one node."""
    fast, slow = WORLD.Dup(), WORLD.Dup()
    cf = get_context(fast, config=Config())
    cs = get_context(slow, config=Config(compiled_channel=False))
    if cf.chan is None:
        pytest.skip("ranks span nodes: no node channel")
    assert cs.chan.core is None
    yield fast, slow
    fast.Free()
    slow.Free()


@pytest.fixture(scope="module")
def mixed():
    """A communicator whose even ranks run the compiled loop and odd ranks Python's."""
    comm = WORLD.Dup()
    get_context(comm, config=Config(compiled_channel=ME % 2 == 0))
    yield comm
    comm.Free()


def _inputs(count, dtype, op, seed=0):
    return [make_input(r, count, dtype, op, seed) for r in range(N)]


def _same_everywhere(a) -> None:
    d = WORLD.allgather(digest(a))
    assert len(set(d)) == 1, "results differ across ranks"


def _kind_of(comm, key) -> str:
    return type(get_context(comm).fast.get(key)).__name__


@pytest.mark.mpi(min_size=2)
@needs_core
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
def test_reductions_compiled_equal_python_and_numpy(comms, dtype, op):
    fast, slow = comms
    dt = np.dtype(dtype)
    for count in COUNTS:
        xs = _inputs(count, dt, op, seed=count)
        x, want = xs[ME], expected(xs, op)
        counts = block_counts(count, N)
        off = offsets(counts)
        got = {}
        for name, comm in (("compiled", fast), ("python", slow)):
            ar = C.allreduce(x, op=op, comm=comm)
            out = np.empty_like(x)
            ar_out = C.allreduce(x, op=op, out=out, comm=comm)
            inplace = x.copy()
            C.allreduce(inplace, op=op, out=inplace, comm=comm)
            rs = C.reduce_scatter(x, op=op, comm=comm)
            red = C.reduce(x, op=op, root=N - 1, comm=comm)
            check_close(ar, want.astype(np.float64) if dt.kind == "f" else want, op, N, f"{name} allreduce")
            assert ar_out is out and np.array_equal(ar, out, equal_nan=True) and digest(inplace) == digest(ar)
            check_close(rs, (want.astype(np.float64) if dt.kind == "f" else want)[off[ME] : off[ME + 1]], op, N, name)
            assert (red is None) == (ME != N - 1)
            got[name] = (ar, rs, red)
        ar, rs, red = got["compiled"]
        assert digest(ar) == digest(got["python"][0]), f"{dt} {op} {count}: compiled allreduce bits differ"
        assert digest(rs) == digest(got["python"][1]), f"{dt} {op} {count}: compiled reduce_scatter bits differ"
        assert digest(red) == digest(got["python"][2])
        _same_everywhere(ar)
    key = ("allreduce", dt, (COUNTS[-1],), op, "auto")
    C.allreduce(x, op=op, comm=fast)  # its one-step function is cached now (the cache is bounded)
    C.allreduce(x, op=op, comm=slow)
    compiled_kernel = dtype in KERNELS and not (dt.kind == "f" and op in ("min", "max"))
    assert _kind_of(fast, key) == ("Step" if compiled_kernel else "function")
    assert _kind_of(slow, key) == "function"


@pytest.mark.mpi(min_size=2)
@needs_core
def test_broadcasts_past_the_small_size_stream_through_the_roots_slot(comms, mixed):
    # the root copies piece after piece into its slot while the others copy them out; past a
    # slot the pieces wrap around it, the root waiting for the readers; on the compiled loop,
    # on Python's and with ranks mixing the two, blocking and not, from a strided input
    from collectives.node import channel, cslots

    assert cslots.STREAM_SHIFT == channel.STREAM_SHIFT
    fast, slow = comms
    ch = get_context(fast).chan
    for nbytes in (
        ch.small + 8,
        ch.slot_bytes,
        ch.slot_bytes + 8,
        3 * ch.slot_bytes + 5 * ch.piece + 24,
    ):
        count = nbytes // 8
        for root in range(N):
            want = np.arange(count, dtype=np.float64) * (root + 1) + 0.5
            for comm in (fast, slow, mixed):
                x = np.repeat(want, 2)[::2].copy() if ME == root else np.zeros(count)
                what = f"{nbytes} B from {root}"
                assert digest(C.broadcast(x, root=root, comm=comm)) == digest(want), what
                c = get_context(comm).chan
                assert c.streams[root][0] >> channel.STREAM_SHIFT == c.seq, "not streamed"
                strided = np.repeat(x, 2)[::2]  # not contiguous: the root's copy in out streams
                assert digest(C.broadcast(strided, root=root, comm=comm)) == digest(want), what
                assert digest(C.ibroadcast(x, root=root, comm=comm).wait()) == digest(want), what
                C.broadcast(x, root=root, out=x, comm=comm)
                assert digest(x) == digest(want), what + " in place"


@pytest.mark.mpi(min_size=2)
@needs_core
def test_allgathers_past_the_one_step_size_stream_through_every_ranks_slot(comms, mixed):
    # each rank copies its block into its slot piece by piece while copying the others' out;
    # blocks past a slot wrap it; uneven and empty blocks; compiled, Python and mixed ranks
    # (shm named: the packaged table may give MPI some of these sizes at some rank counts)
    from collectives.node.channel import STREAM_SHIFT

    fast, slow = comms
    ch = get_context(fast).chan
    big = ch.copy_small // 8 + 1  # rows of two float32: past the one-step size
    for rows_of in (lambda r: big, lambda r: big + 3001 * r, lambda r: 3 * big if r == N - 1 else r):
        rows = [rows_of(r) for r in range(N)]
        xs = [make_input(r, rows[r] * 2, np.float32, "sum", seed=9).reshape(rows[r], 2) for r in range(N)]
        want = np.concatenate(xs)
        for comm in (fast, slow, mixed):
            got = C.allgather(xs[ME], algorithm="shm", comm=comm)
            assert digest(got) == digest(want), f"rows {rows}"
            c = get_context(comm).chan
            streamed = [r for r in range(N) if rows[r] and c.streams[r][0] >> STREAM_SHIFT == c.seq]
            assert streamed == [r for r in range(N) if rows[r]], "not streamed"
            out = np.empty_like(want)
            assert C.allgather(xs[ME], algorithm="shm", out=out, comm=comm) is out and digest(out) == digest(want)
            assert digest(C.iallgather(xs[ME], algorithm="shm", comm=comm).wait()) == digest(want)


@pytest.mark.mpi(min_size=2)
@needs_core
def test_non_temporal_stores_move_the_same_bytes(comms):
    # every copy into the window through non-temporal stores (even ranks from 1 byte, odd
    # from 4 KiB), and out of it into any message on even ranks: the one-step posts, the
    # streamed broadcast and allgather, the chunked paths' staging and copies out; odd byte
    # counts for the unaligned ends; bfloat16 (no buffer format)
    fast, _ = comms
    nt = WORLD.Dup()
    try:
        even = ME % 2 == 0
        cfg = Config(shm_nontemporal_bytes=1 if even else 4096, shm_nontemporal_out_bytes=1 if even else 0)
        ch = get_context(nt, config=cfg).channel()
        assert ch.core.nontemporal == ch.nontemporal == (1 if even else 4096)
        assert ch.core.nontemporal_broadcast == ch.nontemporal_broadcast == ch.nontemporal
        assert ch.core.nontemporal_out == ch.nontemporal_out == (1 if even else 0)
        plain = get_context(fast).chan
        assert plain.nontemporal == nontemporal_bytes(-1, [last_level_caches()] * N)
        assert plain.core.nontemporal_broadcast == plain.nontemporal_broadcast == 4096  # any node
        assert plain.nontemporal_out == nontemporal_out_bytes(-1, [last_level_caches()] * N)
        mine = ch.buf_views(0, np.dtype(np.uint8))[ME]
        for n, at in ((5000, 0), (5000, 3), (100, 1), (70001, 7)):
            src = (np.arange(n) % 251).astype(np.uint8)
            mine[: at + n + 64] = 0
            ch.put(mine[at : at + n], src)
            assert np.array_equal(mine[at : at + n], src) and not mine[:at].any() and not mine[at + n :][:64].any()
            back = np.zeros(n + at + 64, np.uint8)
            ch.take(back[at : at + n], mine[at : at + n], n)
            assert np.array_equal(back[at : at + n], src) and not back[:at].any() and not back[at + n :].any()
        big = 2 * ch.chunk + 4099  # past a slot: the chunked paths, the broadcast's ring
        for dt, count in ((np.int8, 17), (np.int8, ch.small + 3), (np.int8, big), (ml_dtypes.bfloat16, big // 2)):
            xs = _inputs(count, np.dtype(dt), "sum", seed=count)
            for name, call in (
                ("allreduce", lambda x, c: C.allreduce(x, comm=c)),
                ("reduce_scatter", lambda x, c: C.reduce_scatter(x, comm=c)),
                ("reduce", lambda x, c: C.reduce(x, root=N - 1, comm=c)),
                ("broadcast", lambda x, c: C.broadcast(x, root=1, comm=c)),
                ("allgather", lambda x, c: C.allgather(x, algorithm="shm", comm=c)),
            ):
                got, want = call(xs[ME].copy(), nt), call(xs[ME].copy(), fast)
                assert digest(got) == digest(want), f"{name} of {count} {np.dtype(dt)}"
            assert digest(C.broadcast(xs[ME].copy(), root=1, comm=nt)) == digest(xs[1])
            assert digest(C.allgather(xs[ME], algorithm="shm", comm=nt)) == digest(np.concatenate(xs))
    finally:
        nt.Free()


def _note_everywhere(core, plain, nt, rank=None, staged=False) -> None:
    """``rank`` (every rank where None) notes a probe's times into the slots (``staged``: the
    chunk buffers); then every rank reads the ranks' calls again."""
    WORLD.Barrier()
    if rank is None or ME == rank:
        core.note_stores(plain, nt, staged)
    WORLD.Barrier()
    core.note_stores(0, 0)
    WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
@needs_core
def test_measured_stores_turn_non_temporal_on_every_rank_once_one_rank_measures_plain_slow(comms):
    fast, slow = comms
    ch = get_context(fast).chan
    assert ch.measured_stores == (ch.nontemporal == 0)  # by default, unless the caches call for them
    ch.core.measured = True
    try:
        for _ in range(3):  # the last three probes: plain and non-temporal equally fast
            _note_everywhere(ch.core, 1.0, 1.0)
        assert not ch.core.stores[0] and abs(ch.core.stores[1] - 1.0) < 0.01
        last = N - 1
        _note_everywhere(ch.core, 1000.0, 1.0, rank=last)  # one disturbed probe: the median stays
        assert not ch.core.stores[0]
        _note_everywhere(ch.core, 10.0, 1.0, rank=last)  # two of three: plain 10 times as slow
        assert ch.core.stores[0], "every rank takes non-temporal stores once one calls for them"
        if ME == last:
            assert abs(ch.core.stores[1] - 10.0) < 0.01
        for _ in range(3):  # between the two bounds: the choice stands
            _note_everywhere(ch.core, 4.0, 1.0, rank=last)
        assert ch.core.stores[0]
        if ME == last:
            assert abs(ch.core.stores[1] - 4.0) < 0.01
        # the copies move the same bytes with either stores, whatever the probes inside them say
        big = 2 * ch.chunk + 4099
        for count in (17, ch.small // 4 + 3, big // 4):
            xs = _inputs(count, np.dtype(np.float32), "sum", seed=count)
            got = C.allreduce(xs[ME], comm=fast)
            check_close(got, expected(xs, "sum"), "sum", N, f"allreduce of {count}")
            assert digest(got) == digest(C.allreduce(xs[ME], comm=slow))  # Python's loop: numpy's bits
            assert digest(C.broadcast(xs[ME].copy(), root=last, comm=fast)) == digest(xs[last])
            assert digest(C.allgather(xs[ME], algorithm="shm", comm=fast)) == digest(np.concatenate(xs))
        for _ in range(3):
            _note_everywhere(ch.core, 1.0, 1.0)
        assert not ch.core.stores[0], "plain again below the lower bound"
        # the chunk buffers are measured apart, with their own, lower bounds (2 and 1.6)
        for _ in range(3):  # the allreduces above probed them: plain, whatever those measured
            _note_everywhere(ch.core, 1.0, 1.0, staged=True)
        staged = ch.core.staged_stores
        for _ in range(3):
            _note_everywhere(ch.core, 2.5, 1.0)
        assert not ch.core.stores[0] and not ch.core.staged_stores[0], "2.5 x is no call for the slots'"
        for _ in range(2):
            _note_everywhere(ch.core, 2.5, 1.0, rank=last, staged=True)
        assert ch.core.staged_stores[0] and not ch.core.stores[0], "nor is the chunk buffers' call the slots'"
        if ME == last:
            assert abs(ch.core.staged_stores[1] - 2.5) < 0.01 and ch.core.staged_stores[2] == staged[2] + 2
        for _ in range(3):  # between the two bounds: the choice stands
            _note_everywhere(ch.core, 1.8, 1.0, rank=last, staged=True)
        assert ch.core.staged_stores[0]
        got = C.allreduce(xs[ME], comm=fast)  # staged through the chunk buffers non-temporally
        assert digest(got) == digest(C.allreduce(xs[ME], comm=slow))
        for _ in range(3):
            _note_everywhere(ch.core, 1.0, 1.0, staged=True)
        assert not ch.core.staged_stores[0], "plain again below the chunk buffers' lower bound"
        # a chunked allreduce (in place: one into another array reads its peers' memory from
        # 4 MiB) probes its staging, one probe a MiB of copies of 32 KiB or more
        before = ch.core.staged_stores[2]
        for _ in range(4):
            x = np.ones(4 * ch.chunk // 4, np.float32)
            C.allreduce(x, out=x, algorithm="shm", comm=fast)  # shm: auto may choose another from 5 ranks
        assert ch.core.staged_stores[2] > before or ch.region < 32 << 10
        ch.core.measured = False
        _note_everywhere(ch.core, 100.0, 1.0)
        _note_everywhere(ch.core, 100.0, 1.0)
        assert not ch.core.stores[0], "only where measured"
    finally:
        for _ in range(3):
            _note_everywhere(ch.core, 1.0, 1.0)
            _note_everywhere(ch.core, 1.0, 1.0, staged=True)
        ch.core.measured = ch.measured_stores


@pytest.mark.mpi(min_size=2)
@needs_core
def test_measured_stores_only_where_the_setting_leaves_them_to_the_caches():
    set_ = WORLD.Dup()
    try:
        ch = get_context(set_, config=Config(shm_nontemporal_bytes=0)).channel()
        assert not ch.measured_stores and not ch.core.measured
    finally:
        set_.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
def test_large_broadcasts_and_allgathers_read_the_senders_memory_once(comms, mixed):
    # from shm_single_copy_bytes per rank every receiver of an allgather reads the sender's
    # data straight out of its memory (cross-memory attach), and of a broadcast from
    # shm_single_copy_broadcast_bytes (by default from where the ranks measured it faster
    # than the root's slot, when not oversubscribed), a root in place also writing a share
    # of it into every reader's memory: roots, in place, a strided input,
    # nonblocking, within the one-step size too; even, uneven and empty blocks; the same
    # bytes as through the slots. Ranks mixing the compiled loop with Python's keep the
    # slots, all of them
    from collectives.node.channel import STREAM_SHIFT, broadcast_single_copy_bytes

    fast, _ = comms
    plain = get_context(fast).chan
    if plain.single_copy == 0:
        pytest.skip("the kernel refuses cross-memory attach here")
    assert get_context(mixed).chan.single_copy == get_context(mixed).chan.single_copy_broadcast == 0
    assert plain.single_copy == Config().shm_single_copy_bytes
    times = plain.broadcast_times
    if len(os.sched_getaffinity(0)) < N:  # oversubscribed here: not measured, never
        assert plain.single_copy_broadcast == 0 and times == {}
    else:
        assert plain.single_copy_broadcast == broadcast_single_copy_bytes(times["slots"], times["single"])
    if not 0 < plain.single_copy_broadcast <= plain.single_copy:  # through the root's slot
        C.broadcast(np.zeros(plain.single_copy // 8), root=0, algorithm="shm", comm=fast)
        assert plain.streams[0][0] == (plain.seq << STREAM_SHIFT) + plain.single_copy // plain.piece
    one = WORLD.Dup()
    try:
        ch = get_context(one, config=Config(shm_single_copy_bytes=1, shm_single_copy_broadcast_bytes=1)).channel()
        assert ch.single_copy == ch.single_copy_broadcast == 1 and ch.broadcast_times == {}

        def read_once(c, senders):  # the senders offered this call; this rank took it (and a
            # sender returns only once every receiver has)
            done = (c.seq << STREAM_SHIFT) + 1
            receivers = [r for r in range(N) if r not in senders or len(senders) > 1]
            took = receivers if ME in senders else [ME]
            return all(c.streams[r][0] == done for r in senders) and all(c.takes[r][0] == done for r in took)

        def broadcast_once(c, root, share):  # the root offered its data and `share`; this rank
            # offered its buffer and read all but the last `share` bytes, which the root wrote
            # into it, publishing | 2 once done (a root returns once every reader has read)
            base = c.seq << STREAM_SHIFT
            took = [r for r in range(N) if r != root] if ME == root else [ME]
            wrote = c.streams[root][0] == base + 2 if share or ME == root else c.streams[root][0] > base
            published = int(c.slots[root][c.seq & 1][8:16].view(np.int64)[0])
            return wrote and published == share and all(c.streams[r][0] == c.takes[r][0] == base + 1 for r in took)

        # past the one-step size, and within it (the compiled one-step call, streamed), down
        # to within the reductions' one-step size, whose broadcasts otherwise go with the call
        sizes = [(ch.copy_small // 8 + 3, r) for r in range(N)] + [(ch.small // 8 + 8, N - 1), (ch.small // 16, 0)]
        for count, root in sizes + [(3, N - 1)]:
            want = np.arange(count, dtype=np.float64) * (root + 1) + 0.5
            x = np.repeat(want, 2)[::2].copy() if ME == root else np.zeros(count)
            assert digest(C.broadcast(x, root=root, comm=one)) == digest(want), root
            assert broadcast_once(ch, root, 0)  # the root copies x into its output: no share
            strided = np.repeat(x, 2)[::2]
            assert digest(C.broadcast(strided, root=root, comm=one)) == digest(want)
            assert digest(C.ibroadcast(x, root=root, comm=one).wait()) == digest(want)
            C.broadcast(x, root=root, out=x, comm=one)  # in place: the root writes a share of
            # whole cache lines into every reader, while they read the rest
            assert digest(x) == digest(want) and broadcast_once(ch, root, x.nbytes // N // 64 * 64)
            y = x.copy() if ME == root else np.full(count, -1.0)
            assert digest(C.ibroadcast(y, root=root, out=y, comm=one).wait()) == digest(want)
        big = ch.copy_small // 8 + 1
        for rows_of in (lambda r: big, lambda r: big + 3001 * r, lambda r: 3 * big if r == N - 1 else r):
            rows = [rows_of(r) for r in range(N)]
            xs = [make_input(r, rows[r] * 2, np.float32, "sum", seed=3).reshape(rows[r], 2) for r in range(N)]
            want = np.concatenate(xs)
            got = C.allgather(xs[ME], algorithm="shm", comm=one)
            assert digest(got) == digest(want) and read_once(ch, [r for r in range(N) if rows[r]]), f"rows {rows}"
            if len(set(rows)) == 1:  # equal blocks: the compiled one-step call reads them
                assert _kind_of(one, ("allgather", np.dtype(np.float32), (big, 2), None, "shm")) == "Step"
            out = np.empty_like(want)
            assert C.allgather(xs[ME], algorithm="shm", out=out, comm=one) is out and digest(out) == digest(want)
            assert digest(C.iallgather(xs[ME], algorithm="shm", comm=one).wait()) == digest(want)
            assert digest(got) == digest(C.allgather(xs[ME], algorithm="shm", comm=fast))  # through the slots
        # an output from 4 MiB: each rank offers its own block of the output, copied in first,
        # where its copies out go past the caches (non-temporal), or, of 2 ranks whose waits
        # spin, where a cache line's round trip to the other (timed in the first such call
        # and every 64th after) says their cores share a cache; else its source
        rows = (4 << 20) // (8 * N) + 5
        xs = [make_input(r, rows * 2, np.float32, "sum", seed=5).reshape(rows, 2) for r in range(N)]
        want = np.concatenate(xs)
        calls = ch.core.offers[3]
        past_caches = 0 < ch.core.nontemporal_out <= want.nbytes
        timed = not past_caches and N == 2 and ch.core.spin > 64  # 2 ranks whose waits spin
        for k in range(2 + 3 * 64 * timed):  # where timed, up to three checks until one succeeds
            out = np.empty_like(want) if k % 2 else None
            got = C.allgather(xs[ME], algorithm="shm", out=out, comm=one)
            assert digest(got) == digest(want) and read_once(ch, list(range(N)))
            offered = int(ch.slots[ME][ch.seq & 1][0:8].view(np.int64)[0])
            block, src = got.ctypes.data + ME * xs[ME].nbytes, xs[ME].ctypes.data
            near, trip, checks, counted = ch.core.offers
            assert offered == (block if past_caches or near else src), (offered, block, src, near, trip)
            assert counted == calls + (k + 1 if not past_caches and N == 2 else 0)
            assert len(set(WORLD.allgather(counted))) == 1  # counted alike on every rank
            assert (checks == 0 or timed) and (checks == 0) == (trip == 0), (checks, trip)
            if checks:  # below 300 ns the block
                assert near == (trip < 300), (trip, near)
            if k >= 1 and all(WORLD.allgather(bool(checks) or not timed)):  # every rank alike
                break
        assert checks or not timed, "three round trips to the other rank, none answered within 1 ms"
        for out in (None, np.empty_like(want)):
            ch.core.nontemporal_out, kept = want.nbytes, ch.core.nontemporal_out  # copies out past the caches
            got = C.allgather(xs[ME], algorithm="shm", out=out, comm=one)
            ch.core.nontemporal_out = kept
            assert digest(got) == digest(want) and read_once(ch, list(range(N)))
            assert int(ch.slots[ME][ch.seq & 1][0:8].view(np.int64)[0]) == got.ctypes.data + ME * xs[ME].nbytes
    finally:
        one.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
def test_single_copies_of_window_arrays_copy_through_the_peers_mapped_segments(monkeypatch):
    # a single-copy allgather or broadcast whose sender's data lies in its segment of the
    # node's arena copies it through that segment as mapped here, not by cross-memory attach
    # (which pins those shared pages one by one); a root in place writes its share into a
    # reader's buffer there so too. An allgather's sender offers its x, or, where its copy
    # of x into out is non-temporal (out too large for the caches), its block of out, having
    # copied x there first, unless x lies in the arena: equal blocks (the one-step call) and
    # uneven, every rank's out in the arena or only some, and x in it or not, with either
    # kind of copy; the bytes counted, and the same as numpy's. (The in-place path, which
    # copies arrays that all lie in the arena otherwise, is off here: it takes them only up
    # to its size)
    from collectives.node import inplace

    monkeypatch.setattr(inplace, "COPY_INPLACE_MAX", 0)
    one = WORLD.Dup()
    ch = get_context(one, config=Config(shm_single_copy_bytes=1, shm_single_copy_broadcast_bytes=1)).channel()
    core, isz, out_nt = ch.core, 4, ch.core.nontemporal_out
    try:
        if ch.single_copy == 0:
            pytest.skip("the kernel refuses cross-memory attach here")

        def window(a):
            w = C.empty(a.shape, a.dtype, comm=one)
            assert C.is_shared(w, comm=one)
            w[...] = a
            return w

        def moved(call, x, **kw):  # the result, and the bytes this rank's call copied through a
            # peer's mapped segment
            before = core.mapped
            got = call(x, comm=one, **kw)
            return got, core.mapped - before

        big = ch.copy_small // 8 + 1
        for rows_of in (lambda r: big, lambda r: big + 301 * r):
            rows = [rows_of(r) for r in range(N)]
            xs = [make_input(r, rows[r] * 2, np.float32, "sum", seed=5).reshape(rows[r], 2) for r in range(N)]
            want = np.concatenate(xs)
            for in_window in (lambda r: True, lambda r: r % 2 == 0, lambda r: False):
                out = window(np.zeros_like(want)) if in_window(ME) else np.zeros_like(want)
                for x_in_window, nt in itertools.product((False, True), (0, 1)):
                    core.nontemporal_out = nt  # 1: every copy into out is non-temporal
                    x = window(xs[ME]) if x_in_window else xs[ME]
                    offers_out = nt and not x_in_window
                    offered = [in_window(r) if offers_out else x_in_window for r in range(N)]
                    read = sum(rows[r] * 2 * isz for r in range(N) if r != ME and offered[r])
                    out[...] = 0
                    got, n = moved(C.allgather, x, algorithm="shm", out=out)
                    assert got is out and digest(got) == digest(want) and n == read, (rows, x_in_window, nt)
                got, n = moved(C.allgather, xs[ME], algorithm="shm")  # a new out: ordinary memory
                assert digest(got) == digest(want) and n == 0
        # broadcasts: a root in place writes the last 1/n of whole lines into each reader
        # (into its window buffer through the mapping), which reads the rest from the root
        # (from the root's window buffer through the mapping)
        count = ch.copy_small // 4 + 3
        share = count * 4 // N // 64 * 64
        for root in range(N):
            want = np.arange(count, dtype=np.float32) * (root + 1) - 0.5
            for root_window, readers_window in ((False, True), (True, False), (True, True)):
                mine = root_window if ME == root else readers_window
                x = want.copy() if ME == root else np.zeros(count, np.float32)
                x = window(x) if mine else x
                got, n = moved(C.broadcast, x, root=root, out=x)
                if ME == root:
                    expect = share * (N - 1) if readers_window else 0
                else:
                    expect = count * 4 - share if root_window else 0
                assert digest(got) == digest(want) and n == expect, (root, root_window, readers_window)
    finally:
        core.nontemporal_out = out_nt
        one.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_large_reduce_scatters_read_each_block_once_with_the_windows_bits(comms, dtype):
    # past the one-step size, from shm_single_copy_reduce_scatter_bytes of input (of 2
    # ranks, or of more where broadcasts read the root's memory too), where staging is slow
    # (non-temporal stores into the window), each rank reads its block of every peer's input
    # straight out of its memory and reduces it with its own in rank order: the same bits
    # as staged through the window (the Python loop's communicator, single copy off), with
    # every op, by the compiled kernel or numpy's (half floats, float min and max); uneven
    # blocks, and blocks longer than the pieces read at a time; into a given out;
    # nonblocking
    from collectives.node.channel import REDUCE_READ_PIECE, STREAM_SHIFT

    _, slow = comms
    one = WORLD.Dup()
    try:
        ch = get_context(
            one, config=Config(shm_single_copy_reduce_scatter_bytes=1, **SINGLE_COPY_STAGING_SLOW)
        ).channel()
        if ch.single_copy == 0:
            pytest.skip("the kernel refuses cross-memory attach here")
        assert get_context(slow).chan.single_copy == 0
        assert ch.reads_peers("reduce_scatter", 1) and not ch.reads_peers("allreduce", 1)
        assert Config().shm_single_copy_reduce_scatter_bytes == 0  # by default it stages
        ch.single_copy_broadcast = 0  # from 3 ranks only where broadcasts read the root's memory too
        assert ch.reads_peers("reduce_scatter", 1) == (N == 2)
        ch.single_copy_broadcast = 1
        isz = np.dtype(dtype).itemsize
        counts = [ch.slot_bytes // isz + 3 * N + 1]
        if dtype in (np.float16, np.float32):  # numpy's reduction and the kernel's, over pieces
            counts.append((2 * REDUCE_READ_PIECE // isz + 3) * N + 5)
        for count in counts:
            m = block_counts(count, N)[ME]
            for op in OPS:
                xs = _inputs(count, dtype, op, seed=count)
                want = C.reduce_scatter(xs[ME], op=op, algorithm="shm", comm=slow)
                got = C.reduce_scatter(xs[ME], op=op, algorithm="shm", comm=one)
                done = (ch.seq << STREAM_SHIFT) + 1  # offered and read by every rank: nothing staged
                assert ch.streams[ME][0] == done and all(ch.takes[r][0] == done for r in range(N))
                assert digest(got) == digest(want), (count, op)
                out = np.zeros(m, dtype)
                got = C.reduce_scatter(xs[ME], op=op, algorithm="shm", out=out, comm=one)
                assert got is out and digest(out) == digest(want)
            if dtype == np.float32:
                off = offsets(block_counts(count, N))
                check_close(got, expected(xs, "prod").astype(np.float64)[off[ME] : off[ME + 1]], "prod", N, "rs")
                got = C.ireduce_scatter(xs[ME], algorithm="shm", comm=one).wait()
                assert digest(got) == digest(C.reduce_scatter(xs[ME], algorithm="shm", comm=slow))
    finally:
        one.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_large_allreduces_into_another_array_read_each_block_once_with_the_windows_bits(comms, dtype):
    # from shm_single_copy_allreduce_bytes (of 2 ranks, or of more where broadcasts read the
    # root's memory too), where staging is slow (non-temporal stores into the window), an
    # allreduce whose every rank's output is apart from its input is a reduce-scatter and
    # an allgather by single copy, nothing staged: the same bits as staged through the
    # window (the Python loop's communicator), with every op where the compiled kernel
    # reduces; over several pieces; nonblocking; a non-contiguous input. Where numpy must
    # reduce (half floats, float min and max), where one rank reduces in place, or where
    # the setting is 0, every rank stages it.
    from collectives.node.channel import REDUCE_READ_PIECE, STREAM_SHIFT

    _, slow = comms
    one, off = WORLD.Dup(), WORLD.Dup()
    try:
        ch = get_context(one, config=Config(shm_single_copy_allreduce_bytes=1, **SINGLE_COPY_STAGING_SLOW)).channel()
        if ch.single_copy == 0:
            pytest.skip("the kernel refuses cross-memory attach here")
        staged = get_context(
            off, config=Config(shm_single_copy_allreduce_bytes=0, **SINGLE_COPY_STAGING_SLOW)
        ).channel()
        assert Config().shm_single_copy_allreduce_bytes == 4 << 20 and not staged.reads_peers("allreduce", 1 << 30)
        assert ch.reads_peers("allreduce", 1) and get_context(slow).chan.single_copy_allreduce == 0
        ch.single_copy_broadcast = 0  # from 3 ranks only where broadcasts read the root's memory too
        assert ch.reads_peers("allreduce", 1) == (N == 2)
        ch.single_copy_broadcast = 1
        isz = np.dtype(dtype).itemsize
        counts = [ch.slot_bytes // isz + 3 * N + 1]
        if dtype in (np.float16, np.float32, np.int8):  # the kernel's reduction over pieces, and numpy's
            counts.append((2 * REDUCE_READ_PIECE // isz + 3) * N + 5)
        for count in counts:
            piece = min(REDUCE_READ_PIECE // isz, -(-count // N))
            rounds = -(-block_counts(count, N)[ME] // piece)
            for op in OPS:
                xs = _inputs(count, dtype, op, seed=count)
                want = C.allreduce(xs[ME], op=op, algorithm="shm", comm=slow)
                before = list(ch.copied)
                got = C.allreduce(xs[ME], op=op, algorithm="shm", comm=one)
                assert digest(got) == digest(want), (count, op)
                read = dtype in KERNELS and not (np.dtype(dtype).kind == "f" and op in ("min", "max"))
                if read:  # nothing staged; its block reduced into its output, the peers' copied in
                    mine = block_counts(count, N)[ME] * isz
                    assert [a - b for a, b in zip(ch.copied, before, strict=True)] == [0, mine, count * isz - mine]
                else:
                    assert ch.copied[0] > before[0], (count, op)
                if read:
                    base = ch.seq << STREAM_SHIFT  # every piece of this rank's block published, then taken
                    assert ch.streams[ME][0] == base + 1 + rounds and all(ch.takes[r][0] == base + 1 for r in range(N))
                assert digest(C.allreduce(xs[ME], op=op, algorithm="shm", comm=off)) == digest(want)
            y = xs[ME].copy()
            before = list(ch.copied)
            mine = y if ME == 0 else np.empty_like(y)  # rank 0 in place: every rank stages
            got = C.allreduce(y, op="sum", algorithm="shm", out=mine, comm=one)
            assert got is mine and digest(got) == digest(C.allreduce(xs[ME], algorithm="shm", comm=slow))
            assert ch.copied[0] > before[0]
        if dtype == np.float32:
            check_close(got, expected(xs, "sum").astype(np.float64), "sum", N, "ar")
            wide = np.stack([xs[ME], xs[ME]], axis=1)  # not contiguous: read from a copy
            got = C.allreduce(wide[:, 0], algorithm="shm", comm=one)
            assert digest(got) == digest(C.allreduce(xs[ME], algorithm="shm", comm=slow))
            got = C.iallreduce(xs[ME], op="max", algorithm="shm", comm=one).wait()
            assert digest(got) == digest(C.allreduce(xs[ME], op="max", algorithm="shm", comm=slow))
        _same_everywhere(got)
    finally:
        one.Free()
        off.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
def test_large_reductions_read_by_single_copy_only_while_every_rank_finds_staging_slow(comms):
    # staging is cheap where copies into the window take plain stores (the cores share a
    # cache): there an allreduce into another array and a reduce-scatter stage, whatever
    # their size; with measured stores they read by single copy while the stores call for
    # non-temporal ones, which one rank's probes decide for all, and stage again once they
    # no longer do; every RESTAGE_EVERY-th of them stages anyway, and so probes them again
    from collectives.node.channel import RESTAGE_EVERY, STREAM_SHIFT

    _, slow = comms
    plain, measured = WORLD.Dup(), WORLD.Dup()
    settings = {"shm_single_copy_bytes": 1, "shm_single_copy_broadcast_bytes": 1, "shm_single_copy_allreduce_bytes": 1}
    settings["shm_single_copy_reduce_scatter_bytes"] = 1
    try:
        cheap = get_context(plain, config=Config(shm_nontemporal_bytes=0, **settings)).channel()
        if cheap.single_copy == 0:
            pytest.skip("the kernel refuses cross-memory attach here")
        count = cheap.slot_bytes // 4 + 3 * N + 1
        x = _inputs(count, np.float32, "sum", seed=3)[ME]
        want = {f: digest(getattr(C, f)(x, algorithm="shm", comm=slow)) for f in ("allreduce", "reduce_scatter")}

        def read_by(ch, comm):  # whether each call read by single copy, its bits checked
            before = ch.copied[0]
            assert ch.reads_peers("allreduce", x.nbytes) and ch.reads_peers("reduce_scatter", x.nbytes)
            assert digest(C.allreduce(x, algorithm="shm", comm=comm)) == want["allreduce"]
            allreduce = ch.copied[0] == before
            assert digest(C.reduce_scatter(x, algorithm="shm", comm=comm)) == want["reduce_scatter"]
            return allreduce, ch.takes[ME][0] == (ch.seq << STREAM_SHIFT) + 1

        assert not cheap.staging_slow() and read_by(cheap, plain) == (False, False)
        ch = get_context(measured, config=Config(**settings)).channel()
        if ch.nontemporal or not ch.measured_stores:
            return  # the caches say the ranks span more than one: non-temporal from a size
        for ratio in (4.0, 1.0):  # plain stores four times as slow on the last rank, then as fast
            for _ in range(3):
                ch.core.note_stores(ratio if ME == N - 1 else 1.0, 1.0, True)
            WORLD.Barrier()
            ch.reductions_voted = 1  # the next three asks are not the RESTAGE_EVERY-th
            assert ch.staging_slow() == (ratio > 1) and read_by(ch, measured) == (ratio > 1, ratio > 1)
            WORLD.Barrier()
        for _ in range(3):
            ch.core.note_stores(4.0, 1.0, True)
        WORLD.Barrier()
        # every RESTAGE_EVERY-th large reduction stages to probe the stores again, whatever
        # the call numbers between (here the allreduce; the reduce-scatter after it reads)
        ch.reductions_voted = RESTAGE_EVERY - 1
        C.allreduce(np.zeros(1), comm=measured)  # a small call asks nothing
        assert read_by(ch, measured) == (False, True) and ch.reductions_voted == RESTAGE_EVERY + 1
    finally:
        plain.Free()
        measured.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["kernel", "numpy"])
def test_a_large_reduce_scatter_into_its_input_on_one_rank_stages_on_every_rank(comms, dtype):
    # one rank's out overlaps its input, the others' do not: that rank votes against the
    # single copy, so every rank stages the call (the same bits), where the ranks used to
    # take different paths and stall
    from collectives.node.channel import STREAM_SHIFT

    _, slow = comms
    one = WORLD.Dup()
    try:
        ch = get_context(
            one, config=Config(stall_timeout=20.0, shm_single_copy_reduce_scatter_bytes=1, **SINGLE_COPY_STAGING_SLOW)
        ).channel()
        if ch.single_copy == 0:
            pytest.skip("the kernel refuses cross-memory attach here")
        m = ch.slot_bytes // np.dtype(dtype).itemsize + 7
        xs = _inputs(m * N, dtype, "sum", seed=5)
        want = digest(C.reduce_scatter(xs[ME], algorithm="shm", comm=slow))
        for inside in range(N):
            x = xs[ME].copy()
            out = x[:m] if ME == inside else np.empty(m, dtype)
            got = C.reduce_scatter(x, algorithm="shm", out=out, comm=one)
            assert got is out and digest(got) == want, inside
            assert ch.takes[ME][0] != (ch.seq << STREAM_SHIFT) + 1  # staged: nothing read, nothing taken
        got = C.reduce_scatter(xs[ME], algorithm="shm", comm=one)  # and apart everywhere: read
        assert digest(got) == want and ch.takes[ME][0] == (ch.seq << STREAM_SHIFT) + 1
    finally:
        one.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
def test_the_loops_counters_tell_a_waits_polls_from_its_sleeps_and_wake_ups(comms):
    # the last rank comes late to a call: the others' waits poll while within the spin
    # budget and sleep past it (a futex wait each, 1 ms at most), and the late rank's post
    # wakes them; core.waits counts each (waits that found a peer behind, polls, sleeps,
    # wake-ups sent), as benchmarks.small_calls and the node report print them. Counted
    # over three calls (an oversubscribed rank may itself come later than the late one),
    # and checked on every rank from every rank's counts, so a miss fails everywhere
    fast, _ = comms
    ch = get_context(fast).chan
    spin = ch.spin
    x = np.ones(4, np.float32)
    counts = {}
    try:
        for budget in (10**9, 0):  # polls only, then sleeps
            ch.spin = budget
            before = ch.core.waits
            right = True
            for _ in range(3):
                WORLD.Barrier()
                if ME == N - 1:
                    time.sleep(0.05)
                right &= bool(np.all(C.allreduce(x, comm=fast) == N))
            counts[budget] = (right, [a - b for a, b in zip(ch.core.waits, before, strict=True)])
    finally:
        ch.spin = spin
    every = WORLD.allgather(counts)
    for budget in (10**9, 0):
        assert all(c[budget][0] for c in every)
        for r, c in enumerate(every[: N - 1]):
            waited, polls, sleeps, _ = c[budget][1]
            assert waited >= 1 and polls > 0 and (sleeps > 0) == (budget == 0), (r, budget, c)
    if futex.OK:
        assert every[N - 1][0][1][3] >= 1, "the late rank woke a sleeping peer"


@pytest.mark.mpi(min_size=2)
@needs_core
def test_broadcasts_timed_for_single_copy_agree_on_every_rank_and_leave_the_calls_in_step():
    # the measurement behind shm_single_copy_broadcast_bytes=-1, taken at any rank count:
    # every rank gets the same seconds (averaged over the ranks), and the calls after it
    # keep the channel's own single-copy size and give the root's bytes
    from collectives.node.channel import SINGLE_COPY_PROBE, STREAM_SHIFT

    one = WORLD.Dup()
    try:
        ch = get_context(one, config=Config(shm_single_copy_broadcast_bytes=1 << 20)).channel()
        if ch.single_copy_broadcast == 0:
            pytest.skip("the kernel refuses cross-memory attach here")
        got = ch.measure_broadcasts(_node_transport(one), rounds=1, calls=2)
        assert sorted(got) == ["single", "slots"]
        assert all(len(v) == len(SINGLE_COPY_PROBE) and min(v) > 0 for v in got.values())
        assert WORLD.allgather(got) == [got] * N
        for count, single in (((1 << 19) // 8, False), ((1 << 20) // 8, True), (SINGLE_COPY_PROBE[1] // 8, True)):
            want = np.arange(count, dtype=np.float64) - 7.5
            x = want.copy() if ME == N - 1 else np.zeros(count)
            assert digest(C.broadcast(x, root=N - 1, comm=one)) == digest(want)
            # the root's word: every piece streamed, or by single copy offered (1), then done
            # (2; a reader of a root not in place returns without waiting for that)
            pieces = ((2,) if ME == N - 1 else (1, 2)) if single else (-(-count * 8 // ch.piece),)
            assert ch.streams[N - 1][0] - (ch.seq << STREAM_SHIFT) in pieces, count
    finally:
        one.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
@pytest.mark.parametrize("refused", ["cma_read", "cma_write"])
def test_single_copy_is_off_everywhere_when_one_rank_cannot_read_a_peer(comms, refused):
    # the kernel refuses process_vm_readv, or only process_vm_writev (with which a
    # broadcast's root writes its share), on one rank (a strict ptrace_scope, a seccomp
    # profile): no rank takes the single-copy path, so none waits for a copy never made
    fast, _ = comms
    ch = get_context(fast).chan
    core = ch.core

    class Refusing:
        def __getattr__(self, name):
            def refuse(*args):
                raise PermissionError(1, "Operation not permitted")

            return refuse if name == refused else getattr(core, name)

    try:
        ch.core = Refusing() if ME == N - 1 else core
        assert ch._can_read_peers(_node_transport(fast), True) is False
    finally:
        ch.core = core
    assert ch._can_read_peers(_node_transport(fast), True) is True  # and where it can: on
    assert ch._can_read_peers(_node_transport(fast), False) is False  # where the settings say never


def _node_transport(comm):
    return get_context(comm).topology().node


class _Sub(np.ndarray):
    """An ndarray subclass: the API takes it, but only through the general path."""


@pytest.mark.mpi(min_size=2)
@needs_core
def test_reductions_that_read_little_go_through_the_slots_past_the_small_size(comms):
    # a reduce-scatter reads one block of each slot: one step up to a whole slot; an
    # allreduce or a reduce in two steps (from 3 ranks) up to half of one, and of 2 ranks in
    # one step up to a whole one (it reads both messages either way); just past those, the
    # general path
    fast, slow = comms
    ch = get_context(fast).chan
    dt = np.dtype(np.float32)
    cases = [("reduce_scatter", ch.slot_bytes, True), ("reduce_scatter", ch.slot_bytes + 4, False)]
    for coll in ("allreduce", "reduce"):
        cases += [
            (coll, ch.slot_bytes // 2, True),
            (coll, ch.slot_bytes // 2 + 64, N == 2),
            (coll, ch.slot_bytes + 4, False),
        ]
    assert ch.slot_bytes // 2 > ch.small  # past the small size, or this proves nothing
    root = N - 1
    for coll, nbytes, through_slots in cases:
        count = nbytes // dt.itemsize
        xs = _inputs(count, dt, "sum", seed=count)
        want = expected(xs, "sum").astype(np.float64)
        off = offsets(block_counts(count, N))
        assert ch.one_step(coll, nbytes) == through_slots, (coll, nbytes)
        kw = {"root": root} if coll == "reduce" else {}
        got = [getattr(C, coll)(xs[ME], algorithm="shm", comm=comm, **kw) for comm in (fast, slow)]
        key = (coll, dt, (count,), ("sum", root) if kw else "sum", "shm")
        assert _kind_of(fast, key) == ("Step" if through_slots else "bool")
        if coll == "reduce" and ME != root:
            assert got == [None, None]
            continue
        assert digest(got[0]) == digest(got[1]), f"{coll} of {nbytes} B: compiled and Python bits differ"
        check_close(got[0], want if coll != "reduce_scatter" else want[off[ME] : off[ME + 1]], "sum", N, coll)


@pytest.mark.mpi(min_size=3)
@needs_core
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reductions_in_two_steps_give_the_one_step_bits(dtype):
    # from 3 ranks a one-step allreduce or reduce may finish in two (Channel.split_at): each rank
    # reduces its block into its slot, then copies every rank's; forced here at every size,
    # on the compiled loop, on Python's, with ranks mixing the two, and on the general path
    dt = np.dtype(dtype)
    configs = {
        "one step": Config(shm_split_bytes=0),
        "compiled": Config(shm_split_bytes=1),
        "python": Config(shm_split_bytes=1, compiled_channel=False),
        "mixed": Config(shm_split_bytes=1, compiled_channel=ME % 2 == 0),
    }
    comms = {name: WORLD.Dup() for name in configs}
    try:
        ctxs = {name: get_context(comms[name], config=cfg) for name, cfg in configs.items()}
        if ctxs["one step"].topology().nodes != 1:
            pytest.skip("ranks span nodes: no node channel")
        chans = {name: ctx.channel() for name, ctx in ctxs.items()}
        assert chans["one step"].split_at(64 << 10) == 0 and chans["compiled"].split_at(100) == 128
        for op in OPS:
            for count in (*COUNTS, (64 << 10) // dt.itemsize):
                xs = _inputs(count, dt, op, seed=count + 11)
                x = xs[ME]
                ref = C.allreduce(x, op=op, comm=comms["one step"])
                want = expected(xs, op)
                check_close(ref, want.astype(np.float64) if dt.kind == "f" else want, op, N, f"{dt} {op} x{count}")
                for name in ("compiled", "python", "mixed"):
                    comm = comms[name]
                    what = f"{name} {dt} {op} x{count}"
                    assert digest(C.allreduce(x, op=op, comm=comm)) == digest(ref), what
                    out = np.empty_like(x)
                    C.allreduce(x, op=op, out=out, comm=comm)
                    assert digest(out) == digest(ref), what
                    assert digest(C.iallreduce(x, op=op, comm=comm).wait()) == digest(ref), what + " (general path)"
                    # a reduce the same way; a subclass takes the general path
                    root = count % N
                    for y, path in ((x, ""), (x.view(_Sub), " (general path)")):
                        red = C.reduce(y, op=op, root=root, comm=comm)
                        assert (red is None) == (ME != root), what
                        assert red is None or digest(red) == digest(ref), f"reduce: {what}{path}"
                _same_everywhere(ref)
    finally:
        for c in comms.values():
            c.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_broadcast_and_allgather_compiled_equal_python(comms, dtype):
    fast, slow = comms
    dt = np.dtype(dtype)
    for count in COUNTS:
        xs = _inputs(count, dt, "sum", seed=7 + count)
        x = xs[ME].reshape(count, 1) if count % 2 else xs[ME]
        for name, comm in (("compiled", fast), ("python", slow)):
            for root in range(N):
                b = C.broadcast(x, root=root, comm=comm)
                assert digest(b) == digest(xs[root].reshape(x.shape)), f"{name} broadcast from {root}"
                out = np.empty_like(x)
                assert C.broadcast(x, root=root, out=out, comm=comm) is out and digest(out) == digest(b)
                mine = x.copy()
                C.broadcast(mine, root=root, out=mine, comm=comm)  # in place
                assert digest(mine) == digest(b)
            g = C.allgather(x, comm=comm)
            want = np.concatenate([xi.reshape(x.shape) for xi in xs])
            assert digest(g) == digest(want), f"{name} allgather"
            out = np.empty_like(want)
            assert C.allgather(x, out=out, comm=comm) is out and digest(out) == digest(want)
        C.broadcast(x, root=0, comm=fast)
        assert _kind_of(fast, ("broadcast", dt, x.shape, 0, "auto")) == (
            "function" if dt == ml_dtypes.bfloat16 else "Step"
        )


@pytest.mark.mpi(min_size=2)
@needs_core
def test_inputs_of_any_layout_and_outputs_that_do_not_fit(comms):
    fast, _ = comms
    base = np.arange(40, dtype=np.float64).reshape(8, 5) * (ME + 1)
    x = base[::2, 1:4]  # not contiguous: posted through a contiguous copy
    got = C.allreduce(x, comm=fast)
    assert np.array_equal(got, np.arange(40, dtype=np.float64).reshape(8, 5)[::2, 1:4] * (N * (N + 1) // 2))
    # an out that is not C-contiguous, or of another dtype, takes the general path and gets
    # its error there, on every rank
    wide = np.empty((4, 6))
    with pytest.raises(C.OutputMismatchError, match="C-contiguous"):
        C.allreduce(x, out=wide[:, :3], comm=fast)
    with pytest.raises(C.OutputMismatchError if ME == 0 else C.PeerInputError):
        C.allreduce(x, out=np.empty((4, 3), np.float32) if ME == 0 else np.empty((4, 3)), comm=fast)
    # the communicator is still in step
    assert np.array_equal(C.allreduce(x, comm=fast), got)


@pytest.mark.mpi(min_size=2)
@needs_core
def test_a_mismatch_through_the_compiled_calls_raises_on_every_rank(comms):
    fast, _ = comms
    x = np.ones(3 if ME == 0 else 4, np.float32)
    with pytest.raises(CollectiveMismatchError, match="count"):
        C.allreduce(x, comm=fast)
    with pytest.raises(CollectiveMismatchError):
        C.broadcast(np.ones(2, np.float32 if ME else np.float64), root=0, comm=fast)
    with pytest.raises(CollectiveMismatchError):
        C.reduce(np.ones(2, np.int32), op="sum" if ME else "max", root=0, comm=fast)
    assert np.array_equal(C.allreduce(np.ones(2, np.float32), comm=fast), np.full(2, N, np.float32))


@pytest.mark.mpi(min_size=2)
@needs_core
@pytest.mark.parametrize("compiled_rank", [0, -1])
def test_ranks_on_either_loop_work_together(compiled_rank):
    # the same protocol on the same words: rank 0 (or the last) compiled, the others in Python
    comm = WORLD.Dup()
    try:
        ctx = get_context(comm, config=Config(compiled_channel=ME == compiled_rank % N))
        assert (ctx.chan.core is not None) == (ME == compiled_rank % N)
        for count in (1, 17, 1001):
            for dtype in (np.float32, np.int64, np.float16):
                xs = _inputs(count, dtype, "sum", seed=3)
                got = C.allreduce(xs[ME], comm=comm)
                check_close(got, expected(xs, "sum"), "sum", N, f"{np.dtype(dtype)} {count}")
                _same_everywhere(got)
                g = C.allgather(xs[ME], comm=comm)
                assert digest(g) == digest(np.concatenate(xs))
                assert digest(C.broadcast(xs[ME], root=N - 1, comm=comm)) == digest(xs[N - 1])
        with pytest.raises(CollectiveMismatchError):
            C.allreduce(np.ones(2 + (ME == 1), np.float32), comm=comm)
        uneven = np.ones((1 + ME, 2), np.float32)  # uneven rows: finished on the general path
        assert C.allgather(uneven, comm=comm).shape == (N * (N + 1) // 2, 2)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
def test_a_compiled_wait_takes_a_peers_call_from_its_slot_header_not_its_counter():
    # rank 0 exchanges a tiny call in the compiled loop while every other rank posts by hand:
    # its data, its header's words and the header's last word, its counter only once rank 0
    # is through. A wait on the counters would stall; a call of up to HEAD_DATA bytes needs
    # one line from each peer, which holds its header and its data.
    comm = WORLD.Dup()
    try:
        ctx = get_context(comm, config=Config(stall_timeout=20))
        if ctx.chan is None or ctx.chan.core is None:
            pytest.skip("no node channel on the compiled loop")
        ch = ctx.chan
        seq = ch.seqs[ME][0] + 1
        p = seq & 1
        payload = np.arange(HEAD_DATA // 8, dtype=np.int64) + 100 * ME
        got: object = None
        if ME == 0:
            try:
                got = ch.core.exchange(7, 8, 9, payload, False, 0, 0, payload.nbytes)
            except Exception as exc:  # noqa: BLE001 - every rank reaches the barrier below
                got = exc
        else:
            ch.payload(ME, p, payload.nbytes)[:] = payload.view(np.uint8)
            h = ch.heads[ME][p]
            h[0], h[1], h[2], h[3], h[4] = 7, 8, 9, 0, 0
            h[POSTED] = seq
        comm.Barrier()
        if ME:
            ch.seqs[ME][0] = seq  # as a post publishes it
        comm.Barrier()
        if ME == 0:
            assert got == seq, f"the wait ended in {got!r}"
            for r in range(1, N):
                got_r = ch.payload(r, p, payload.nbytes)
                assert got_r.ctypes.data % LINE == HEAD, "a tiny payload lies on its header's line"
                assert np.array_equal(got_r.view(np.int64), payload - 100 * ME + 100 * r)
                assert ch.payload(r, p, HEAD_DATA + 1).ctypes.data % LINE == 0, "a larger one on lines of its own"
        assert np.array_equal(C.allreduce(np.ones(3), comm=comm), np.full(3, float(N)))  # still in step
        # ranks whose calls differ wait for each other's posts in different ways (a broadcast
        # or a tiny call on the headers, a larger reduction on the counters): a mismatch, not
        # a stall
        for tiny, large in ((1, 2048), (4, 5), (2, 4096)):
            with pytest.raises(CollectiveMismatchError):
                C.broadcast(np.ones(tiny if ME else large, np.float32), root=0, comm=comm)
            with pytest.raises(CollectiveMismatchError):
                C.allreduce(np.ones(large if ME == N - 1 else tiny, np.float32), comm=comm)
        assert np.array_equal(C.allreduce(np.ones(3), comm=comm), np.full(3, float(N)))
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
@needs_core
def test_the_polite_hint_and_spin_budget_reach_the_compiled_waits(comms):
    fast, _ = comms
    ch = get_context(fast).chan

    def busy() -> bool:
        return True

    ch.polite = busy
    assert ch.core.polite is busy and ch.polite is busy
    ch.polite = None
    assert ch.core.polite is None
    spin = ch.spin
    ch.spin = 7
    assert ch.core.spin == 7
    ch.spin = spin
    assert ch.core.spin == spin


@needs_core
def test_a_cache_lines_round_trip_is_timed_between_two_sides_and_a_missing_side_times_out():
    import threading

    from collectives.node.cslots import line_round_trip

    buf = np.zeros(64, np.int64)  # 512 bytes, the two words two lines apart
    got: dict[int, float] = {}

    def side(me: int) -> None:
        got[me] = line_round_trip(buf, me, 200, 30.0)

    # two threads stand in for two processes: the loop releases the GIL while it polls
    ts = [threading.Thread(target=side, args=(me,)) for me in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert set(got) == {0, 1} and all(0 < s < 30.0 / 200 for s in got.values()), got
    assert buf[0] == 200 and buf[16] == 200  # each side's last round, in its own word
    # alone, either side waits for the other until its timeout, and says so
    for me in (0, 1):
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match=r"the other side did not answer within 0\.1 s"):
            line_round_trip(np.zeros(64, np.int64), me, 5, 0.1)
        assert time.perf_counter() - t0 < 5
    for args, error in [
        ((buf, 2, 10, 1.0), r"me=2 must be 0 or 1"),
        ((buf, 0, 0, 1.0), r"rounds=0 >= 1"),
        ((buf, 0, 10, 0.0), r"timeout > 0"),
        ((np.zeros(16, np.int64), 0, 10, 1.0), r"buf must hold 192 bytes"),
        ((np.zeros(512, np.uint8)[1:], 0, 10, 1.0), r"buf must hold 192 bytes from an 8-byte boundary"),
    ]:
        with pytest.raises(ValueError, match=error):
            line_round_trip(*args)
    with pytest.raises(TypeError, match="line_round_trip"):
        line_round_trip(buf, 0, 10)
    with pytest.raises(BufferError, match="not writable"):  # nowhere to store
        line_round_trip(bytes(512), 0, 10, 1.0)


@pytest.mark.mpi(min_size=2)
def test_line_round_trips_time_rank_0_with_each_other_rank_where_the_ranks_have_a_core_each():
    from collectives.launcher import node_cores, process_cpus
    from collectives.node.channel import line_round_trips

    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=ME)
    try:
        got = line_round_trips(node, rounds=2000)
        cores = node_cores(node.allgather(process_cpus()))
    finally:
        node.Free()
    everywhere = WORLD.allgather(got)
    assert all(g == everywhere[0] for g in everywhere)  # the same list on every rank
    if Core is None or N > cores:  # no compiled loop, or ranks sharing cores: a spinning pair would time the scheduler
        assert got is None
        return
    assert len(got) == N - 1 and all(0 < s < 1e-2 for s in got), got  # ns each on a quiet machine
    with pytest.raises(ValueError, match="rounds=0 must be >= 1"):
        line_round_trips(WORLD, rounds=0)


@pytest.mark.mpi(min_size=2)
def test_a_pair_that_does_not_answer_is_a_timeout_on_every_rank_and_the_benchmarks_go_on(monkeypatch):
    # one pair's side gives up (here rank 1's): line_round_trips raises on every rank, none
    # waits in the next pair's barrier, and the benchmarks' line_trips say "not measured"
    from benchmarks import osu
    from collectives.node import channel

    def trip(buf, me, rounds, timeout):
        if ME == 1:
            raise TimeoutError("line_round_trip: the other side did not answer")
        return 1e-7

    monkeypatch.setattr(channel, "_line_round_trip", trip)
    monkeypatch.setattr(channel, "node_cores", lambda cpus: len(cpus))  # as if each rank had a core
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 and rank\(s\) \[1\] did not answer each other within 10.0 s"):
        channel.line_round_trips(WORLD)
    assert osu.line_trips(WORLD) is None  # every rank alike, and the run goes on
    assert osu.trips_text(None, None).endswith("not measured (they share cores, no compiled loop, or late)")
    assert time.monotonic() - t0 < 30
