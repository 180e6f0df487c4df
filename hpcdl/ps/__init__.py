"""The parameter-server side of the runtime: roles, servers, partitions.

With ``hpcdl.init(ps_servers=k)`` (or ``HPCDL_PS_SERVERS=k``) the last ``k`` ranks of
``MPI.COMM_WORLD`` are servers: on them ``init`` serves until every worker has called
``shutdown()`` (or exited), then ends the process with exit status 0, so one script serves
both roles. On the workers the runtime runs over the first ``W`` ranks alone (``size()``,
``rank()`` and the global process set count workers only) and :class:`PSJob` holds what
:class:`~hpcdl.optim.HybridOptimizer` needs to reach the servers. Without dedicated
servers the optimizer starts a server thread on every node leader (co-located).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from collectives.launcher import process_cpus
from collectives.link import emulate_comm

from ..errors import HpcdlError
from ..startup import ignore_sigterm_while_serving
from .partitions import PartitionPlan, Piece
from .server import Server, serve
from .wire import (
    CTRL,
    CTRL_REPLY,
    NAP,
    Ask,
    Bye,
    Counter,
    Load,
    Register,
    Release,
    Reply,
    Stats,
    TableSpec,
    Tags,
    as_bytes,
    wait_nap,
    wait_politely,
)

__all__ = [
    "PSJob",
    "split_roles",
    "PartitionPlan",
    "Piece",
    "Server",
    "Tags",
    "Counter",
    "wait_politely",
    "wait_nap",
    "as_bytes",
    "CTRL",
    "CTRL_REPLY",
    "TableSpec",
    "Register",
    "Ask",
    "Load",
    "Stats",
    "Release",
    "Bye",
    "Reply",
]


class PSJob:
    """How the workers reach the servers of the job.

    Attributes:
        comm: the communicator workers and servers talk over (a duplicate of the world for
            dedicated servers; the ranks of a worker in it equal its runtime rank).
        servers: the server ranks in ``comm``.
        where: for each server, ``(host, pid)``, to tell a dead one by name.
        counter: bytes this worker moved on the parameter-server path.
        dedicated: True for server ranks of their own, False for co-located threads.
        nap: the longest sleep between polls while this worker waits on the servers
            (:func:`.wire.wait_nap`); 0 only yields, as a worker whose own thread serves does.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        servers: list[int],
        where: list[tuple[str, int]],
        dedicated: bool,
        nap: float | None = None,
    ) -> None:
        self.comm = comm
        self.servers = servers
        self.where = where
        self.dedicated = dedicated
        self.nap = (NAP if dedicated else 0.0) if nap is None else nap
        self.counter = Counter()
        self.threads: list[threading.Thread] = []
        self.ended = False
        self.progress: Callable[[], None] | None = None
        """Where a server thread runs in this process: its :meth:`.Server.serve_once`,
        which this worker calls while it waits on the servers."""

    def register(self, specs: list[TableSpec]) -> list[int]:
        """Register a table with every server (``specs[s]`` for server ``s``), all of them
        first and then their answers, so no server waits on another; return the slot each
        server gave the table. A server's error raises."""
        for dest, spec in zip(self.servers, specs, strict=True):
            self.comm.send(Register(spec), dest=dest, tag=CTRL)
        return [self.answer(s) for s in range(len(self.servers))]

    def ask(self, server: int, msg: tuple) -> Any:
        """Send a control message (a named tuple of :mod:`.wire`) to server ``server`` (an
        index) and return its answer."""
        dest = self.servers[server]
        self.comm.send(msg, dest=dest, tag=CTRL)
        return self.answer(server)

    def answer(self, server: int) -> Any:
        """The next control answer of server ``server``; an error answer raises."""
        src = self.servers[server]
        start = time.monotonic()
        while (msg := self.comm.improbe(source=src, tag=CTRL_REPLY)) is None:
            if time.monotonic() - start > 1.0:
                self.check_alive(server)
                start = time.monotonic()
            time.sleep(2e-4)
        reply = msg.recv()
        if not reply.ok:
            raise HpcdlError(reply.value)
        return reply.value

    def check_alive(self, server: int) -> None:
        """End the job naming server ``server`` if its process on this host has died."""
        host, pid = self.where[server]
        if host != socket.gethostname() or pid == os.getpid():
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.stderr.write(
                f"hpcdl: parameter server {server} (rank {self.servers[server]}, pid {pid} on {host}) has died; "
                "ending the job\n"
            )
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        except PermissionError:
            pass

    def end(self) -> None:
        """Say goodbye to every server (once); join co-located server threads."""
        if self.ended:
            return
        self.ended = True
        for dest in self.servers:
            self.comm.send(Bye(), dest=dest, tag=CTRL)
        for t in self.threads:
            t.join()
        if not self.dedicated:
            self.comm.Free()


def split_roles(world: MPI.Comm, k: int, stall_seconds: float, spin: int = -1) -> tuple[MPI.Comm, PSJob]:
    """Collective over ``world``: make its last ``k`` ranks servers. On a server, serve and
    then end the process (exit status 0); on a worker, return the workers' communicator
    and the :class:`PSJob`. Every rank raises alike on a bad ``k``. Workers and servers
    sleep between polls while they wait only where a host's ranks outnumber its cores, or
    as ``spin`` (``HPCDL_SHM_SPIN``) says (:func:`.wire.wait_nap`)."""
    n = world.size
    if k >= n:
        raise HpcdlError(
            f"ps_servers={k} leaves no worker: the job has {n} ranks; start it with more ranks "
            f"(mpiexec -n W+{k}) or use fewer servers"
        )
    first = n - k
    is_server = world.rank >= first
    comm = emulate_comm(world.Dup())  # the data between nodes takes an emulated link's time
    everyone = comm.allgather((socket.gethostname(), os.getpid(), process_cpus()))
    where = [(host, pid) for host, pid, _ in everyone[first:]]
    nap = wait_nap(spin, [(host, c) for host, _, c in everyone])
    part = world.Split(1 if is_server else 0, world.rank)
    if not is_server:
        if world.rank == 0:  # a launcher that ends the job when a rank dies names its pid: say whose it is
            told = ", ".join(f"{i} = rank {first + i} (pid {pid} on {host})" for i, (host, pid) in enumerate(where))
            sys.stderr.write(f"hpcdl: {first} workers; parameter servers {told}\n")
            sys.stderr.flush()
        return part, PSJob(comm, list(range(first, n)), where, dedicated=True, nap=nap)
    part.Free()
    ignore_sigterm_while_serving()  # in the training job the workers answer it, with the servers' state
    serve(comm, world.rank - first, list(range(first)), stall_seconds, nap)
    comm.Free()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(0)
