"""Waiting without spinning: futexes sleep until woken (a short sleep where there are none),
and waiting ranks give up the core soon only on an oversubscribed node; and the node
channel's other choice by the machine: non-temporal stores where ranks span caches."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest


def test_waiting_ranks_sleep_soon_only_when_the_node_is_oversubscribed():
    from collectives.node import channel

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert channel.spin_budget(1, cores) == channel.SPIN
    assert channel.spin_budget(cores, cores) == channel.SPIN
    assert channel.spin_budget(cores + 1, cores) == channel.POLITE_SPIN < channel.SPIN
    # a node's channel counts the cores its ranks may run on together: bound to one each,
    # 4 ranks have 4; sharing 2, they have 2; a rank that cannot say leaves the machine's count
    assert channel.node_cores([[0], [1], [2], [3]]) == 4 and channel.spin_budget(4, 4) == channel.SPIN
    assert channel.node_cores([[0, 1]] * 4) == 2 and channel.spin_budget(4, 2) == channel.POLITE_SPIN
    assert channel.node_cores([[0], []]) == (os.cpu_count() or 1) == channel.node_cores([])


def test_non_temporal_stores_where_the_ranks_span_last_level_caches():
    from collectives.config import Config
    from collectives.errors import ConfigError
    from collectives.node import channel

    mib = 1 << 20
    one, other = {"0-7": 32 * mib}, {"8-15": 32 * mib}
    assert channel.nontemporal_bytes(-1, [one, other]) == channel.NONTEMPORAL  # two sockets or CCXs
    assert channel.nontemporal_bytes(-1, [{**one, **other}, one]) == channel.NONTEMPORAL  # unbound there
    assert channel.nontemporal_bytes(-1, [one, one, one]) == 0  # every rank under one cache
    assert channel.nontemporal_bytes(-1, [one, {}]) == 0  # unknown somewhere: plain
    assert channel.nontemporal_bytes(0, [one, other]) == 0 and channel.nontemporal_bytes(512, [one]) == 512
    # a broadcast's root: on any node, whatever the caches
    assert (
        channel.nontemporal_broadcast_bytes(-1) == channel.NONTEMPORAL and channel.nontemporal_broadcast_bytes(0) == 0
    )
    # copies out: three quarters of a cache's share per rank
    assert channel.nontemporal_out_bytes(-1, [one, one]) == 12 * mib  # 2 ranks on 32 MiB
    assert channel.nontemporal_out_bytes(-1, [one] * 4 + [other] * 4) == 6 * mib  # 4 ranks on each
    assert channel.nontemporal_out_bytes(-1, [{"0-1": 8 * mib}] * 2) == 3 * mib  # this reference machine
    assert channel.nontemporal_out_bytes(-1, [one, {}]) == 0 and channel.nontemporal_out_bytes(7, []) == 7
    # this machine's, as sysfs lists them: every CPU under one it names, with a size
    caches = channel.last_level_caches()
    if sys.platform.startswith("linux") and os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert caches and all(isinstance(c, str) and c and size >= 4096 for c, size in caches.items())
    assert channel.last_level_caches({10**6}) == {}  # no such CPU: unknown
    with pytest.raises(ConfigError, match="shm_nontemporal_bytes=-2"):
        Config(shm_nontemporal_bytes=-2)
    with pytest.raises(ConfigError, match="shm_nontemporal_out_bytes=-5"):
        Config(shm_nontemporal_out_bytes=-5)
    with pytest.raises(ConfigError, match="shm_single_copy_bytes=-1"):
        Config(shm_single_copy_bytes=-1)
    with pytest.raises(ConfigError, match="shm_single_copy_broadcast_bytes=-2"):
        Config(shm_single_copy_broadcast_bytes=-2)
    for name in ("shm_single_copy_reduce_scatter_bytes", "shm_single_copy_allreduce_bytes"):
        with pytest.raises(ConfigError, match=f"{name}=-1 must be >= 0"):
            Config(**{name: -1})


def test_single_copy_broadcasts_from_where_the_measured_lines_cross():
    from collectives.node import channel

    s1, s2 = channel.SINGLE_COPY_PROBE
    us = 1e-6
    # seconds at the two sizes: through the slots, and by single copy
    assert channel.broadcast_single_copy_bytes((10 * us, 45 * us), (6 * us, 30 * us)) == s1  # faster at both
    # slower at the smaller size, faster at the larger: where the lines cross, rounded up to 4 KiB
    cross = s1 + (4 * us) / ((40 - 10) * us / (s2 - s1) - (34 - 14) * us / (s2 - s1))
    got = channel.broadcast_single_copy_bytes((10 * us, 40 * us), (14 * us, 34 * us))
    assert got == -(-int(cross) // 4096) * 4096 and s1 < got < s2
    # slower at both, but gaining with size: from past the larger size, or never past the ceiling
    got = channel.broadcast_single_copy_bytes((10 * us, 50 * us), (20 * us, 55 * us))
    assert s2 < got <= channel.SINGLE_COPY_CEILING
    assert channel.broadcast_single_copy_bytes((10 * us, 50 * us), (20 * us, 59.99 * us)) == 0
    # slower at the larger size and not gaining (this reference machine): never
    assert channel.broadcast_single_copy_bytes((11 * us, 57 * us), (10 * us, 71 * us)) == 0
    # faster at both but losing ground with size: from the smaller size all the same
    assert channel.broadcast_single_copy_bytes((10 * us, 50 * us), (5 * us, 49 * us)) == s1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futexes are Linux's")
def test_futex_sleeps_until_woken_and_never_past_a_change():
    import threading

    from collectives.node import futex

    assert futex.OK
    word = np.zeros(1, np.int64)
    addr = word.ctypes.data
    t = time.perf_counter()
    futex.wait(addr, 7, 5.0)  # the word does not hold 7: back at once
    assert time.perf_counter() - t < 1.0
    t = time.perf_counter()
    futex.wait(addr, 0, 0.05)  # nobody wakes it: the timeout
    assert 0.04 < time.perf_counter() - t < 2.0
    # a high half that differs does not matter: the futex compares the low 32 bits it sees
    word[0] = 5 << 32
    t = time.perf_counter()
    futex.wait(addr, 0, 0.05)
    assert time.perf_counter() - t >= 0.04

    def bump() -> None:
        time.sleep(0.2)
        word[0] += 1
        futex.wake(addr)

    seen = int(word[0])
    th = threading.Thread(target=bump)
    th.start()
    t = time.perf_counter()
    cpu = time.thread_time()
    while word[0] == seen:
        futex.wait(addr, seen, 10.0)
    waited, spent = time.perf_counter() - t, time.thread_time() - cpu
    th.join()
    assert 0.15 < waited < 5.0  # woken by the change, long before the 10 s timeout
    assert spent < 0.5 * waited  # asleep, not spinning


def test_futex_fallback_sleeps_briefly(monkeypatch):
    from collectives.node import futex

    monkeypatch.setattr(futex, "_SYS", None)
    word = np.zeros(1, np.int64)
    t = time.perf_counter()
    futex.wait(word.ctypes.data, 0, 10.0)  # no futex: a short sleep, then the caller looks again
    assert time.perf_counter() - t < 1.0
    futex.wake(word.ctypes.data)  # a no-op
