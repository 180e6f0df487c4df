"""Waiting without spinning: futexes sleep until woken (a short sleep where there are none),
and waiting ranks give up the core soon only on an oversubscribed node."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest


def test_waiting_ranks_sleep_soon_only_when_the_node_is_oversubscribed():
    from collectives.node import channel

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert channel.spin_budget(1) == channel.SPIN
    assert channel.spin_budget(cores) == channel.SPIN
    assert channel.spin_budget(cores + 1) == channel.POLITE_SPIN < channel.SPIN


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
