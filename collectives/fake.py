"""An in-process transport: each rank is a thread, messages are copied through mailboxes.

It lets tests (hypothesis among them) drive every algorithm without ``mpiexec``. Sends
are buffered (complete at once); receives complete when a matching message has arrived.
Matching follows MPI: per (source, destination, tag) in order.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ThreadWorld", "ThreadTransport", "FakeRequest", "run_ranks"]


class FakeRequest:
    """A request of the thread transport; quacks like ``MPI.Request``."""

    __slots__ = ("_poll", "done")

    def __init__(self, poll: Callable[[], bool] | None = None) -> None:
        self._poll = poll
        self.done = poll is None

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling
        if not self.done:
            self.done = self._poll()  # type: ignore[misc]
        return self.done

    def Wait(self) -> None:  # noqa: N802
        while not self.Test():
            self._poll_wait()

    def _poll_wait(self) -> None:
        # the poll function waits on the world's condition when it has nothing yet
        self._poll.wait()  # type: ignore[union-attr]

    @classmethod
    def Testall(cls, reqs: list[FakeRequest]) -> bool:  # noqa: N802
        return all([r.Test() for r in reqs])

    @classmethod
    def Waitall(cls, reqs: list[FakeRequest]) -> None:  # noqa: N802
        for r in reqs:
            r.Wait()


class _Poll:
    """Receive completion: copy the first matching message into ``buf`` if there is one."""

    __slots__ = ("world", "key", "buf")

    def __init__(self, world: ThreadWorld, key: tuple, buf: np.ndarray) -> None:
        self.world, self.key, self.buf = world, key, buf

    def __call__(self) -> bool:
        with self.world.cond:
            box = self.world.boxes.get(self.key)
            if not box:
                return False
            data = box.popleft()
        dst = self.buf.reshape(-1).view(np.uint8)
        if data.size != dst.size:
            raise RuntimeError(f"message of {data.size} bytes received into a {dst.size}-byte buffer {self.key}")
        dst[...] = data
        return True

    def wait(self) -> None:
        with self.world.cond:
            if not self.world.boxes.get(self.key):
                if not self.world.cond.wait(timeout=self.world.timeout):
                    raise TimeoutError(f"thread transport: no message for {self.key} in {self.world.timeout}s")


class ThreadWorld:
    """Shared state of one group of thread ranks."""

    def __init__(self, size: int, node_size: int | None = None, timeout: float = 30.0) -> None:
        self.size = size
        self.node_size = node_size or size
        self.timeout = timeout
        self.cond = threading.Condition()
        self.boxes: dict[tuple, collections.deque] = {}
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size
        self.made: dict[Any, Any] = {}

    def exchange(self, rank: int, obj: Any) -> list[Any]:
        """All-gather ``obj`` among the thread ranks of this world."""
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadTransport:
    """One thread rank's view of a :class:`ThreadWorld`."""

    def __init__(self, world: ThreadWorld, rank: int, node_id: tuple = ()) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self._node_id = node_id
        self._splits = 0

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> FakeRequest:
        data = buf.reshape(-1).view(np.uint8).copy()
        key = (self.rank, dest, tag)
        with self.world.cond:
            self.world.boxes.setdefault(key, collections.deque()).append(data)
            self.world.cond.notify_all()
        return FakeRequest()

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> FakeRequest:
        return FakeRequest(_Poll(self.world, (source, self.rank, tag), buf))

    def split(self, color: int, key: int) -> ThreadTransport:
        self._splits += 1
        entries = self.world.exchange(self.rank, (color, key, self.rank))
        members = sorted((k, r) for c, k, r in entries if c == color)
        ranks = [r for _, r in members]
        new_rank = ranks.index(self.rank)
        sig = (self._splits, color)
        if new_rank == 0:
            self.world.made[sig] = ThreadWorld(len(ranks), self.world.node_size, self.world.timeout)
        self.world.barrier.wait()
        sub = self.world.made[sig]
        self.world.barrier.wait()
        if new_rank == 0:
            del self.world.made[sig]
        return ThreadTransport(sub, new_rank, node_id=self._node_id + (color,))

    def split_shared(self) -> ThreadTransport:
        node = self.rank // self.world.node_size
        return self.split(node, self.rank)

    def shared_segments(self, nbytes: int) -> list[np.ndarray]:
        mine = np.zeros(nbytes, np.uint8)
        return self.world.exchange(self.rank, mine)

    def shared_window(self, nbytes: int) -> tuple[list[np.ndarray], Any]:
        # threads of one process: the interpreter orders memory accesses already
        return self.shared_segments(nbytes), _no_fence

    def allgather_obj(self, obj: Any) -> list[Any]:
        return self.world.exchange(self.rank, obj)


def _no_fence() -> None:
    pass


def run_ranks(
    size: int, fn: Callable[[ThreadTransport], Any], *, node_size: int | None = None, timeout: float = 30.0
) -> list[Any]:
    """Run ``fn(transport)`` on ``size`` thread ranks; return each rank's result.

    An exception on any rank is re-raised here (the first by rank), after all threads end.
    """
    world = ThreadWorld(size, node_size, timeout)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadTransport(world, rank))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc
            world.barrier.abort()
            with world.cond:
                world.cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    for exc in errors:
        if exc is not None:
            raise exc
    if any(t.is_alive() for t in threads):
        raise TimeoutError("thread ranks did not finish")
    return results
