"""Parameter servers against allreduce: bytes moved per step beside their formulas, step
time and throughput with and without a straggler, and accuracy with one.

Run at 2 simulated nodes x 2 workers + 2 servers (one section per command)::

    HPCDL_RANKS_PER_NODE=2 HPCDL_PS_SERVERS=2 mpiexec -n 6 python -m benchmarks.ps_vs_allreduce --section bytes
    HPCDL_RANKS_PER_NODE=2 HPCDL_PS_SERVERS=2 mpiexec -n 6 python -m benchmarks.ps_vs_allreduce --section steps
    HPCDL_RANKS_PER_NODE=2 HPCDL_PS_SERVERS=2 mpiexec -n 6 python -m benchmarks.ps_vs_allreduce --section accuracy

Contenders: ``allreduce`` (DistributedOptimizer), ``ps-sync`` (HybridOptimizer, every
worker pushes its whole gradient), ``hybrid`` (sync, reduce-scatter inside the node, push
and pull of the node's shards, allgather), ``ssp s=2``, ``ssp s=4`` and ``async``.

- bytes: one flat gradient of ``--mib`` MiB; the bytes each worker and each server sent and
  received per step, counted by the transports (``collectives.MPITransport.sent`` and
  ``received``; every collective runs the ring algorithm here, so node-local traffic is
  messages, not shared-memory copies) and by the parameter-server path (``hpcdl.ps``),
  beside allreduce 2S(n-1)/n, parameter server S out + S in, and hybrid 2S(L-1)/L inside
  the node plus S/L out and S/L in across nodes (L workers a node; a server of k gets n/k
  or nodes/k of S each way).
- steps: the MLP of ``benchmarks.train_throughput`` (12.6M parameters, batch 64 a
  worker, one torch thread), ``--steps`` timed steps after 2 of warm-up. Each worker times
  its own steps; throughput is the sum of the workers' rates and "step" is workers x batch /
  throughput. Three cases: no straggler; worker 1 slowed 2x (after backward it sleeps as
  long as its measured step takes); a moving straggler (each step one worker, in turn,
  slowed 2x).
- accuracy: ``hpcdl.train``'s default digits run (20 epochs) with --dp ps and worker 1
  slowed 2x, for sync, ssp s=4 and async: held-out accuracy and the workers' summed rate
  (each worker's steps over the wall-clock time from its first step's end to its last's).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from mpi4py import MPI

from collectives.cli import ArgumentParser, dump_json, output_file, run_main

BATCH = 64
WARMUP = 2
CONTENDERS = ["allreduce", "ps-sync", "hybrid", "ssp s=2", "ssp s=4", "async"]
CASES = ["no straggler", "worker 1 slowed 2x", "moving straggler"]


def _ring_everywhere() -> None:
    """Make every collective of this job run the ring algorithm (a tuning table of one rule
    per collective), so that node-local traffic goes through the transport as messages."""
    world = MPI.COMM_WORLD
    path = None
    if world.rank == 0:
        table = {
            "machine": "any",
            "command": "benchmarks.ps_vs_allreduce --section bytes",
            "tables": [
                {"collective": c, "size": n, "nodes": nodes, "rules": [[None, "ring"]]}
                for c in ("allreduce", "reduce_scatter", "allgather")
                for n in range(1, 17)
                for nodes in (1, 2)
            ],
        }
        fd, path = tempfile.mkstemp(prefix="hpcdl-ring-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(table, fh)
    os.environ["HPCDL_TUNING_FILE"] = world.bcast(path)


def make(name: str, model: torch.nn.Module, lr: float = 0.01, **kw: Any) -> torch.optim.Optimizer:
    import hpcdl as hvd

    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    named = model.named_parameters()
    if name == "allreduce":
        return hvd.DistributedOptimizer(inner, named)
    if name in ("ps-sync", "hybrid"):
        return hvd.HybridOptimizer(inner, named, mode="sync", node_reduce=name == "hybrid", **kw)
    if name.startswith("ssp"):
        return hvd.HybridOptimizer(inner, named, mode="ssp", staleness=int(name.split("=")[1]), **kw)
    return hvd.HybridOptimizer(inner, named, mode="async", **kw)


def _done(opt: torch.optim.Optimizer) -> None:
    close = getattr(opt, "close", None)
    if close is not None:
        close()


# -- bytes ------------------------------------------------------------------------------------
def _transport_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes this worker's transports of ``opt``'s collectives sent and received so far."""
    from collectives.context import get_context
    from hpcdl import state

    rt = state.current()
    sets = [0]
    node = getattr(opt, "node_set", None)
    if node is not None:
        sets = [node.process_set_id]
    elif getattr(opt, "job", None) is not None:
        sets = []
    sent = received = 0
    for sid in sets:
        t = get_context(rt.engine.sets.get(sid).comm).transport
        sent, received = sent + t.sent, received + t.received
    job = getattr(opt, "job", None)
    if job is not None:
        sent, received = sent + job.counter.sent, received + job.counter.received
    return sent, received


def measure_bytes(mib: int, steps: int) -> list[dict[str, Any]]:
    import hpcdl as hvd

    n, per_node = hvd.size(), hvd.local_size()
    k = len(hvd.state.current().ps.servers)
    size = mib << 20
    rows = []
    for name in ("allreduce", "ps-sync", "hybrid"):
        model = torch.nn.Linear(size // 4, 1, bias=False)
        opt = make(name, model, partition_bytes=size // 8) if name != "allreduce" else make(name, model)

        def step(opt: torch.optim.Optimizer = opt, w: torch.nn.Parameter = model.weight) -> None:
            opt.zero_grad()
            w.grad = torch.ones_like(w)
            opt.step()

        step()
        before = _transport_bytes(opt)
        srv0 = [st["bytes"] for st in opt.ps_stats()] if name != "allreduce" else []
        for _ in range(steps):
            step()
        after = _transport_bytes(opt)
        srv1 = [st["bytes"] for st in opt.ps_stats()] if name != "allreduce" else []
        mine = ((after[0] - before[0]) / steps, (after[1] - before[1]) / steps)
        every = hvd.allgather_object(mine)
        if name == "allreduce":
            formula, server = 2 * size * (n - 1) / n, None
        elif name == "ps-sync":
            formula, server = size, n * size / k
        else:
            formula, server = 2 * size * (per_node - 1) / per_node + size / per_node, (n // per_node) * size / k
        row = {
            "contender": name,
            "S": size,
            "workers": n,
            "per_node": per_node,
            "servers": k,
            "worker_sent": [e[0] for e in every],
            "worker_received": [e[1] for e in every],
            "worker_formula": formula,
        }
        if srv1:
            row["server_sent"] = [(b[0] - a[0]) / steps for a, b in zip(srv0, srv1, strict=True)]
            row["server_received"] = [(b[1] - a[1]) / steps for a, b in zip(srv0, srv1, strict=True)]
            row["server_formula"] = server
        rows.append(row)
        _done(opt)
    return rows


def report_bytes(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    size, n, per_node, k = r0["S"], r0["workers"], r0["per_node"], r0["servers"]
    out = [
        f"# bytes per step: S = {size / 2**20:.0f} MiB of gradients, {n} workers ({per_node} a node), {k} servers",
        f"{'contender':<11} {'role':<7} {'sent (MB)':>22} {'received (MB)':>22} {'formula (MB)':>13} "
        f"{'measured / formula':>19}",
    ]
    for r in rows:
        for role, sent, recv, f in (
            ("worker", r["worker_sent"], r["worker_received"], r["worker_formula"]),
            ("server", r.get("server_sent"), r.get("server_received"), r.get("server_formula")),
        ):
            if sent is None:
                continue
            ratio = max(max(sent), max(recv)) / f
            lo = min(min(sent), min(recv)) / f
            out.append(
                f"{r['contender']:<11} {role:<7} {_span(sent):>22} {_span(recv):>22} {f / 1e6:>13.4f} "
                f"{lo:>9.6f}-{ratio:.6f}"
            )
    out.append(
        "formulas: allreduce 2S(n-1)/n; parameter server S each way a worker, n S/k a server; hybrid "
        "2S(L-1)/L + S/L each way a worker (reduce-scatter and allgather in the node, push and pull "
        "of the node's shard), (n/L) S/k a server"
    )
    return "\n".join(out)


def _span(values: list[float]) -> str:
    lo, hi = min(values) / 1e6, max(values) / 1e6
    return f"{lo:.4f}" if abs(hi - lo) < 5e-5 else f"{lo:.4f}-{hi:.4f}"


# -- step time ------------------------------------------------------------------------------------
def mlp() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10))


def _slow(case: str, step: int, rank: int, n: int) -> bool:
    if case == "worker 1 slowed 2x":
        return rank == 1
    if case == "moving straggler":
        return step % n == rank
    return False


def measure_steps(steps: int) -> dict[str, Any]:
    import hpcdl as hvd

    n, me = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(me)
    x, y = torch.randn(BATCH, 2048, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    # the compute of one step without communication: the straggler's delay
    torch.manual_seed(0)
    model = mlp()
    plain = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for _ in range(WARMUP + steps):
        t0 = time.perf_counter()
        plain.zero_grad()
        loss_fn(model(x), y).backward()
        plain.step()
        times.append(time.perf_counter() - t0)
    compute = max(hvd.allgather_object(statistics.median(times[WARMUP:])))
    out: dict[str, Any] = {"workers": n, "compute_s": compute, "cases": {}}
    for case in CASES:
        rows = {}
        for name in CONTENDERS:
            torch.manual_seed(0)
            model = mlp()
            opt = make(name, model)
            ps = getattr(opt, "ps_stats", None)
            for i in range(WARMUP + steps):
                if i == WARMUP:
                    hvd.barrier()
                    t_start = time.perf_counter()
                    cpu0 = [st["cpu_s"] for st in ps()] if ps and me == 0 else []
                    wait0 = getattr(opt, "wait_seconds", 0.0)
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                if _slow(case, i, me, n):
                    time.sleep(compute)
                opt.step()
            mine = steps * BATCH / (time.perf_counter() - t_start)
            waited = (getattr(opt, "wait_seconds", 0.0) - wait0) / steps
            hvd.barrier()  # every worker's steps are in: the servers' CPU for them
            cpu = [(st["cpu_s"] - c0) / steps for st, c0 in zip(ps(), cpu0, strict=True)] if cpu0 else []
            rates = hvd.allgather_object(mine)
            rows[name] = {
                "rates": rates,
                "throughput": sum(rates),
                "step_s": n * BATCH / sum(rates),
                "wait_s": hvd.allgather_object(waited),
                "server_cpu_s": cpu,
            }
            _done(opt)
            hvd.barrier()
        out["cases"][case] = rows
    return out


def report_steps(res: dict[str, Any]) -> str:
    n = res["workers"]
    out = [
        f"# step time: the MLP (12.6M parameters, batch {BATCH} a worker) on {n} workers; one step's compute "
        f"without communication {res['compute_s'] * 1e3:.1f} ms",
        f"{'case':<20} {'contender':<10} {'step (ms)':>10} {'samples/s':>10} {'/ allreduce':>12} {'/ ps-sync':>10} "
        f"{'pull wait (ms)':>15} {'server cpu (ms)':>16}",
    ]
    for case, rows in res["cases"].items():
        ar, ps = rows["allreduce"]["step_s"], rows["ps-sync"]["throughput"]
        for name, r in rows.items():
            wait = "-" if name == "allreduce" else "/".join(f"{w * 1e3:.0f}" for w in r["wait_s"])
            cpu = "/".join(f"{c * 1e3:.0f}" for c in r["server_cpu_s"]) or "-"
            out.append(
                f"{case:<20} {name:<10} {r['step_s'] * 1e3:>10.1f} {r['throughput']:>10.0f} "
                f"{r['step_s'] / ar:>12.2f} {r['throughput'] / ps:>10.2f} {wait:>15} {cpu:>16}"
            )
    ok = res["cases"]["no straggler"]
    sync_ratio = ok["ps-sync"]["step_s"] / ok["allreduce"]["step_s"]
    out.append(f"bar: ps-sync's step <= 1.2 x allreduce's without a straggler: {sync_ratio:.2f}")
    for case in CASES[1:]:
        rows = res["cases"][case]
        best = max(rows["ssp s=2"]["throughput"], rows["ssp s=4"]["throughput"]) / rows["ps-sync"]["throughput"]
        out.append(f"bar: ssp's throughput >= 1.3 x sync's, {case}: {best:.2f} (the better of s=2 and s=4)")
    out.append(
        "(columns: step = workers x batch / throughput; / ps-sync: throughput over ps-sync's; pull wait: each "
        "worker's time per step waiting for the servers' replies; server cpu: each server's CPU time per step)"
    )
    return "\n".join(out)


# -- accuracy with a straggler ------------------------------------------------------------------------
def measure_accuracy() -> list[dict[str, Any]]:
    import hpcdl as hvd
    from hpcdl.train.config import TrainConfig
    from hpcdl.train.loop import run

    root = hvd.broadcast_object(tempfile.mkdtemp(prefix="hpcdl-ps-acc-") if hvd.rank() == 0 else None, 0)
    rows = []
    for mode, s in (("sync", 4), ("ssp", 4), ("async", 4)):
        seen: list[float] = []

        def straggle(step: int, seen: list[float] = seen) -> None:
            """Every worker notes when each step ends; worker 1, after a few steps, then sleeps
            as long as a step took (half its speed)."""
            seen.append(time.perf_counter())
            if hvd.rank() == 1 and len(seen) > 6:
                time.sleep(statistics.median(b - a for a, b in zip(seen[1:6], seen[2:7], strict=True)))

        cfg = TrainConfig.from_flat(
            dp="ps", ps_mode=mode, staleness=s, progress=False, run_dir=os.path.join(root, mode), checkpoint_every=0
        )
        summary = run(cfg, on_step=straggle)
        # this worker's own samples/s over its steps, wall clock (evaluations included alike)
        rate = (len(seen) - 1) * cfg.training.batch_size / (seen[-1] - seen[0])
        rates = hvd.allgather_object(rate)
        rows.append(
            {
                "mode": mode if mode != "ssp" else f"ssp s={s}",
                "accuracy": summary["final"]["accuracy"],
                "throughput": sum(rates),
                "staleness": summary.get("staleness"),
            }
        )
    return rows


def report_accuracy(rows: list[dict[str, Any]]) -> str:
    out = ["# accuracy: hpcdl.train's default digits run with --dp ps, worker 1 slowed 2x"]
    out.append(f"{'mode':<9} {'held-out accuracy':>18} {'samples/s':>10} {'/ sync':>7}  largest lag by worker")
    sync = rows[0]
    for r in rows:
        lag = r["staleness"]["max_lag"] if r["staleness"] else "-"
        out.append(
            f"{r['mode']:<9} {r['accuracy'] * 100:>17.2f}% {r['throughput']:>10.0f} "
            f"{r['throughput'] / sync['throughput']:>7.2f}  {lag}"
        )
    ssp = rows[1]
    out.append(
        f"bar: ssp's accuracy within 1 point of sync's: {(ssp['accuracy'] - sync['accuracy']) * 100:+.2f} points; "
        f"throughput {ssp['throughput'] / sync['throughput']:.2f} x sync's (bar 1.3)"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--section", choices=["bytes", "steps", "accuracy"], required=True)
    p.add_argument("--steps", type=int, default=8, help="timed steps per contender and case")
    p.add_argument("--mib", type=int, default=4, help="bytes section: MiB of gradients")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this file (rank 0)")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    p.require_at_least(("--steps", a.steps, 1), ("--mib", a.mib, 1))
    if a.section == "bytes":
        _ring_everywhere()
    torch.set_num_threads(1)
    import hpcdl as hvd

    hvd.init()  # the servers serve here, and end the process
    if hvd.state.current().ps is None:
        p.error("start it with dedicated servers: HPCDL_PS_SERVERS=k (and HPCDL_RANKS_PER_NODE for nodes)")
    if a.section == "bytes":
        res: Any = measure_bytes(a.mib, a.steps)
        text = report_bytes(res)
    elif a.section == "steps":
        res = measure_steps(a.steps)
        text = report_steps(res)
    else:
        res = measure_accuracy()
        text = report_accuracy(res)
    if hvd.rank() == 0:
        env = " ".join(f"{v}={os.environ[v]}" for v in ("HPCDL_RANKS_PER_NODE", "HPCDL_PS_SERVERS") if v in os.environ)
        k = len(hvd.state.current().ps.servers)
        cmd = f"{env} mpiexec -n {hvd.size() + k} python -m benchmarks.ps_vs_allreduce " + " ".join(argv)
        print(f"# {cmd.strip()}\n{text}", flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                dump_json(res, fh, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
