"""Parameter servers against allreduce across emulated links: which wins where, and what the
cost model says.

For each link (``HPCDL_LINK``) and layout (workers on simulated nodes, then dedicated
servers on nodes of their own, as BytePS places them), it runs this module's worker part
under ``mpiexec`` and times one synchronous exchange of a gradient of each size, without
compute (ms, the model's prediction in brackets; and the same without a link, this
machine's own cost), for:

- ``ring``: the flat ring allreduce over the workers;
- ``hierarchical``: the hierarchical allreduce (ring inside a node, then across nodes);
- ``ps-sync``: ``HybridOptimizer(mode="sync", node_reduce=False)``: every worker pushes its
  whole gradient to the servers and pulls the sum;
- ``hybrid``: ``node_reduce=True``: reduce-scatter inside the node, push and pull of each
  worker's shard, allgather inside the node (Herring's scheme);
- ``auto``: ``node_reduce="auto"``, which takes one of the last two by the cost model.

With one worker a node the last three are one path, and the hierarchical allreduce is
the ring across the nodes; the winner is then named between the ring and ``ps-sync``.

Each gradient is cut into ``--partitions`` partitions a server (``partition_bytes``): with
one a server, the pushes of every worker reach the last server only at their end, and its
replies start then. The figures are the fastest of
``--steps`` exchanges (the slowest worker's time each), beside the predictions of
:func:`collectives.cost.allreduce_times` and :func:`collectives.cost.ps_times` (the one
cost model ``auto`` and the planner use), the latter with the servers' own work a
contribution and the hybrid's phases inside a node fitted to the runs without a link
(:func:`collectives.cost.fit_ps_own`, :func:`collectives.cost.fit_ps_phases`; where they
fit none, the tuning table's ``ps_own`` and ``ps_phases``, if any). It writes
``DIR/ps_links.json``, ``DIR/ps_links.md`` and ``DIR/ps_links.svg`` (the winner by size,
one row per link and layout)::

    python -m benchmarks.ps_links --out DIR
    python -m benchmarks.ps_links --link eth-10g --layouts 4x1+4 --sizes 4M,16M --out DIR

Below each table, each contender's prediction over its measurement: by the model, by the
links' time alone, and by the links' time plus the exchange's time without a link.
``--render F.json --out DIR`` writes the tables and the plot of a stored run again
(``--refit``: with the model's figures recomputed from its stored times).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from collectives.cli import ArgumentParser, dump_json, output_dir, parse_size, run_main
from collectives.cost import AlphaBeta, allreduce_times, fit_ps_own, fit_ps_phases, parse_link, ps_times
from collectives.select import configured_node_path, configured_ps_own

CONTENDERS = ("ring", "hierarchical", "ps-sync", "hybrid")
COLORS = {"ring": "#4c72b0", "hierarchical": "#c44e52", "ps-sync": "#55a868", "hybrid": "#8172b3"}


def parse_layout(text: str) -> tuple[int, int, int]:
    """``NxL+K``: N nodes of L workers, then K dedicated servers (on nodes of L ranks)."""
    try:
        nodes_by, servers = text.split("+")
        nodes, per_node = (int(v) for v in nodes_by.split("x"))
        counts = nodes, per_node, int(servers)
    except ValueError:
        raise ValueError(f"layout {text!r}: expected NODESxWORKERS_PER_NODE+SERVERS, e.g. 2x2+4") from None
    if min(counts) < 1:
        raise ValueError(f"layout {text!r}: nodes, workers a node and dedicated servers are each at least 1")
    return counts


# -- the worker part, under mpiexec -----------------------------------------------------------
def _best(run: Any, comm: Any, steps: int) -> float:
    """The fastest of ``steps`` calls of ``run`` (after one untimed), each the slowest rank's."""
    from mpi4py import MPI

    run()
    times = []
    for _ in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
        run()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return min(times)


def _exchange(size: int, piece: int, node_reduce: Any, comm: Any, steps: int) -> tuple[float, bool]:
    """The fastest push-and-pull of a ``size``-byte gradient through the servers, and whether
    the optimizer reduced inside the node."""
    import torch

    import hpcdl as hvd

    w = torch.nn.Parameter(torch.zeros(size // 4))
    opt = hvd.HybridOptimizer(
        torch.optim.SGD([w], lr=0.0),
        [("w", w)],
        mode="sync",
        partition_bytes=piece,
        node_reduce=node_reduce,
    )

    def step() -> None:
        opt.zero_grad()
        w.grad = torch.ones_like(w)
        opt.step()

    seconds = _best(step, comm, steps)
    reduced = opt.node_set is not None
    opt.close()
    return seconds, reduced


def work(sizes: list[int], steps: int, partitions: int, out: str) -> None:
    """Time every contender at every size; worker 0 writes the rows to ``out``."""
    import numpy as np

    import collectives as C
    import hpcdl as hvd

    hvd.init()  # dedicated servers serve in here, then end
    comm = hvd.state.current().comm.Dup()
    servers = len(hvd.state.current().ps.servers)
    rows = []
    for size in sizes:
        x = np.ones(size // 4, np.float32)
        us = {
            alg: _best(lambda alg=alg: C.allreduce(x, algorithm=alg, comm=comm), comm, steps) for alg in CONTENDERS[:2]
        }
        piece = -(-size // (servers * partitions))
        us["ps-sync"], _ = _exchange(size, piece, False, comm, steps)
        us["hybrid"], _ = _exchange(size, piece, True, comm, steps)
        us["auto"], reduced = _exchange(size, piece, "auto", comm, steps)
        rows.append(
            {"size": size, "us": {k: v * 1e6 for k, v in us.items()}, "auto_took": "hybrid" if reduced else "ps-sync"}
        )
    if hvd.rank() == 0:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh)
    comm.Free()
    hvd.shutdown()


# -- the sweep --------------------------------------------------------------------------------
def measure(link: str, layout: str, sizes: list[int], steps: int, partitions: int) -> list[dict[str, Any]]:
    nodes, per_node, servers = parse_layout(layout)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = {
            **os.environ,
            "HPCDL_LINK": link,
            "HPCDL_RANKS_PER_NODE": str(per_node),
            "HPCDL_PS_SERVERS": str(servers),
            "OMP_NUM_THREADS": "1",
        }
        cmd = ["mpiexec", "-n", str(nodes * per_node + servers), sys.executable, "-m", "benchmarks.ps_links"]
        cmd += ["--work", out, "--sizes", ",".join(map(str, sizes)), "--steps", str(steps)]
        cmd += ["--partitions", str(partitions)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)


def _fit(
    plain: dict[str, list[dict[str, Any]]], path: str, partitions: int, fitter: Any, per_node_from: int = 1
) -> AlphaBeta | None:
    """``fitter`` (:func:`collectives.cost.fit_ps_own`'s form) over ``path``'s exchanges of
    ``plain``'s layouts of ``per_node_from`` or more workers a node; None where it fits none
    or no finite bandwidth (the sizes told too little: a tuning table could not hold it)."""
    points = []
    for layout, rows in plain.items():
        nodes, per_node, servers = parse_layout(layout)
        if per_node < per_node_from:
            continue
        for row in rows:
            piece = -(-row["size"] // (servers * partitions))
            points.append((row["us"][path] / 1e6, row["size"], nodes * per_node, per_node, servers, piece))
    try:
        got = fitter(points)
    except ValueError:
        return None
    return got if math.isfinite(got.beta) else None


def fit_own(plain: dict[str, list[dict[str, Any]]], partitions: int = 4) -> AlphaBeta | None:
    """The parameter servers' own cost a contribution (:func:`collectives.cost.fit_ps_own`)
    fitted to the ``ps-sync`` exchanges of ``plain`` (each layout's rows without a link), or
    None where they hold fewer than two partition sizes, or where the time a contribution
    did not grow with its bytes (the fit's bandwidth is infinite: the sizes told too little)."""
    return _fit(plain, "ps-sync", partitions, fit_ps_own)


def fit_phases(plain: dict[str, list[dict[str, Any]]], own: AlphaBeta | None, partitions: int = 4) -> AlphaBeta | None:
    """A call of the hybrid's phases inside a node (:func:`collectives.cost.fit_ps_phases`)
    fitted to the ``hybrid`` exchanges of ``plain``'s layouts of two or more workers a node,
    less the servers' ``own`` work; None where those hold fewer than two sizes or no finite
    bandwidth fits."""
    return _fit(plain, "hybrid", partitions, lambda points: fit_ps_phases(points, own), per_node_from=2)


def fit_terms(plain: dict[str, list[dict[str, Any]]], partitions: int = 4) -> tuple[AlphaBeta | None, AlphaBeta | None]:
    """The servers' own work (:func:`fit_own`) and the hybrid's phases (:func:`fit_phases`,
    less the own work fitted, else the tuning table's) fitted to ``plain``; None for each
    not fitted."""
    own = fit_own(plain, partitions)
    return own, fit_phases(plain, own or configured_ps_own(), partitions)


def model_terms(own: AlphaBeta | None, phases: AlphaBeta | None) -> tuple[AlphaBeta | None, AlphaBeta | None]:
    """What the model takes: the fitted terms, else the tuning table's ``ps_own`` and
    ``ps_phases``, where it has them."""
    return own or configured_ps_own(), phases or configured_ps_own("ps_phases")


def terms_json(own: AlphaBeta | None, phases: AlphaBeta | None) -> dict[str, dict[str, float] | None]:
    """``ps_own`` and ``ps_phases`` as a tuning table and a run hold them (None: none)."""
    return {k: {"alpha": v.alpha, "beta": v.beta} if v else None for k, v in (("ps_own", own), ("ps_phases", phases))}


def summarize(
    link: str,
    layout: str,
    rows: list[dict[str, Any]],
    plain: list[dict[str, Any]],
    partitions: int = 4,
    own: AlphaBeta | None = None,
    phases: AlphaBeta | None = None,
) -> dict[str, Any]:
    """Per size: µs of each contender across ``link`` and without a link (``plain``: this
    machine's own cost), the model's prediction with the servers' ``own`` work and the
    hybrid's ``phases`` inside a node (a call's cost; None: a node's messages), and of the
    links' time alone, the measured and the modelled winner, auto's pick."""
    nodes, per_node, servers = parse_layout(layout)
    model = parse_link(link)
    intra = configured_node_path(per_node)  # as auto costs a node's messages
    workers = nodes * per_node
    out = []
    for row, own_row in zip(rows, plain, strict=True):
        size = row["size"]
        piece = -(-size // (servers * partitions))
        wire = allreduce_times(size, workers, per_node, intra, model)
        wire.update(ps_times(size, workers, per_node, intra, model, servers, piece))
        pred = {**wire, **ps_times(size, workers, per_node, intra, model, servers, piece, own=own, phases=phases)}
        got = row["us"]
        names = CONTENDERS if per_node > 1 else ("ring", "ps-sync")  # one a node: the others are these paths
        winner = min(names, key=got.__getitem__)
        best_ps = min(("ps-sync", "hybrid"), key=got.__getitem__)
        out.append(
            {
                "size": size,
                "us": got,
                "no_link_us": own_row["us"],
                "predicted_us": {c: pred[c] * 1e6 for c in CONTENDERS},
                "link_us": {c: wire[c] * 1e6 for c in CONTENDERS},
                "winner": winner,
                "predicted_winner": min(names, key=pred.__getitem__),
                "auto_took": row["auto_took"],
                "auto_over_best_ps": got["auto"] / got[best_ps],
            }
        )
    return {"link": link, "layout": layout, "partitions": partitions, **terms_json(own, phases), "sizes": out}


def table(run: dict[str, Any]) -> list[str]:
    nodes, per_node, servers = parse_layout(run["layout"])
    lines = [
        f"### {run['link']}: {nodes} nodes of {per_node} worker{'s' if per_node > 1 else ''}, {servers} servers on "
        "nodes of their own",
        "",
        "| size | " + " | ".join(CONTENDERS) + " | winner (model's) | auto took | auto / better PS | no link |",
        "|---" * (len(CONTENDERS) + 5) + "|",
    ]
    for s in run["sizes"]:
        cells = " | ".join(f"{s['us'][c] / 1e3:.1f} ({s['predicted_us'][c] / 1e3:.1f})" for c in CONTENDERS)
        own = " / ".join(f"{s['no_link_us'][c] / 1e3:.1f}" for c in CONTENDERS)
        lines.append(
            f"| {_label(s['size'])} | {cells} | {s['winner']} ({s['predicted_winner']}) | {s['auto_took']} "
            f"| {s['auto_over_best_ps']:.2f} | {own} |"
        )
    return lines + ["", *accuracy(run), ""]


def accuracy(run: dict[str, Any]) -> list[str]:
    """Each contender's prediction over its measurement: the model (the links' time, a
    node's messages at the measured path and, for the parameter servers, their own work
    fitted without a link), the links' time alone, and the links' time plus the same
    exchange's time without a link (this machine's own cost: its copies, reductions,
    waits and the runtime's negotiations)."""
    own, phases = run.get("ps_own"), run.get("ps_phases")
    fitted = (
        f"the servers' own work {own['alpha'] * 1e6:.0f} µs + bytes at {own['beta'] / 1e9:.2f} GB/s a contribution"
        if own
        else "no own work fitted"
    )
    if phases:
        fitted += (
            f"; the hybrid's phases inside a node {phases['alpha'] * 1e6:.0f} µs + bytes at "
            f"{phases['beta'] / 1e9:.2f} GB/s a call"
        )
    lines = [
        f"prediction / measurement: the model ({fitted}) / the links alone / the links plus the time without a link",
        "",
        "| size | " + " | ".join(CONTENDERS) + " |",
        "|---" * (len(CONTENDERS) + 1) + "|",
    ]
    for s in run["sizes"]:
        wire = s.get("link_us", s["predicted_us"])  # runs stored before the own work was modelled
        cells = " | ".join(
            f"{s['predicted_us'][c] / s['us'][c]:.2f} / {wire[c] / s['us'][c]:.2f} / "
            f"{(wire[c] + s['no_link_us'][c]) / s['us'][c]:.2f}"
            for c in CONTENDERS
        )
        lines.append(f"| {_label(s['size'])} | {cells} |")
    return lines


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def svg(runs: list[dict[str, Any]], path: Path) -> None:
    """Each contender's time over the fastest one's, a bar per contender, by run and size;
    a mark over the bar of the contender the model names the winner."""
    cells = [(run, s) for run in runs for s in run["sizes"]]
    bar, group, left, top, height = 9, 9 * len(CONTENDERS) + 10, 60, 30, 160
    width = max(left + group * len(cells) + 20, 18 + (len(CONTENDERS) + 1) * 110 + 60)  # the key fits
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + height + 120}" '
        'font-family="sans-serif" font-size="10">',
        '<text x="4" y="14">one synchronous gradient exchange: '
        "time over the fastest contender's (lower is better)</text>",
    ]
    scale = height / 3.0  # up to 3x the fastest
    for tick in (1, 2, 3):
        y = top + height - tick * scale
        out.append(f'<line x1="{left - 4}" x2="{width - 10}" y1="{y:.0f}" y2="{y:.0f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 8}" y="{y + 3:.0f}" text-anchor="end">{tick}x</text>')
    for i, (run, s) in enumerate(cells):
        x0 = left + i * group
        fastest = min(s["us"][c] for c in CONTENDERS)
        for j, c in enumerate(CONTENDERS):
            h = min(3.0, s["us"][c] / fastest) * scale
            out.append(
                f'<rect x="{x0 + j * bar}" y="{top + height - h:.1f}" width="{bar - 1}" height="{h:.1f}" '
                f'fill="{COLORS[c]}"/>'
            )
            if c == s["predicted_winner"]:
                out.append(_mark(x0 + j * bar + (bar - 1) / 2, top + height - h - 2))
        label = f"{run['link']} {run['layout']} {_label(s['size'])}"
        out.append(f'<text transform="translate({x0 + 12},{top + height + 6}) rotate(60)" font-size="9">{label}</text>')
    y = top + height + 100
    for k, name in enumerate(CONTENDERS):
        out.append(f'<rect x="{4 + k * 110}" y="{y}" width="10" height="10" fill="{COLORS[name]}"/>')
        out.append(f'<text x="{18 + k * 110}" y="{y + 9}">{name}</text>')
    out.append(_mark(4 + len(CONTENDERS) * 110 + 5, y + 8))
    out.append(f'<text x="{18 + len(CONTENDERS) * 110}" y="{y + 9}">the model\'s winner</text>')
    path.write_text("\n".join([*out, "</svg>"]) + "\n")


def _mark(x: float, y: float) -> str:
    """A small downward triangle whose tip is at ``(x, y)``."""
    return f'<path class="model" d="M{x - 4:.1f},{y - 6:.1f} L{x + 4:.1f},{y - 6:.1f} L{x:.1f},{y:.1f} Z" fill="#333"/>'


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", action="append", help="a link (repeatable); default eth-10g, eth-25g and eth-100g")
    p.add_argument("--layouts", default="2x2+4,4x1+4", help="comma-separated NODESxWORKERS_PER_NODE+SERVERS")
    p.add_argument("--sizes", default="1M,4M,16M", help="comma-separated gradient sizes (K/M suffixes)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--partitions", type=int, default=4, help="partitions a server")
    p.add_argument("--out", type=output_dir, help="directory for ps_links.{json,md,svg}")
    p.add_argument("--render", metavar="JSON", help="instead: write the tables and plot of a stored ps_links.json")
    p.add_argument(
        "--refit",
        action="store_true",
        help="with --render: the model's figures again, from the stored times, with the servers' own work and the "
        "hybrid's phases fitted to the stored runs without a link",
    )
    p.add_argument("--work", help=argparse.SUPPRESS)  # the worker part, under mpiexec: where to write its rows
    args = p.parse_args()
    if args.render:
        if not args.out:
            p.error("--out is required")
        with open(args.render, encoding="utf-8") as fh:
            runs = json.load(fh)["runs"]
        write(refit(runs) if args.refit else runs, Path(args.out), None)
        return
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.work:
        work(sizes, args.steps, args.partitions, args.work)
        return
    if not args.out:
        p.error("--out is required")
    layouts = args.layouts.split(",")
    for layout in layouts:
        try:
            parse_layout(layout)
        except ValueError as exc:
            p.error(str(exc))
    runs = []
    plain = {layout: measure("", layout, sizes, args.steps, args.partitions) for layout in layouts}
    own, phases = model_terms(*fit_terms(plain, args.partitions))
    for link in args.link or ["eth-10g", "eth-25g", "eth-100g"]:
        for layout in layouts:
            rows = measure(link, layout, sizes, args.steps, args.partitions)
            run = summarize(link, layout, rows, plain[layout], args.partitions, own, phases)
            print("\n".join(table(run)), flush=True)
            runs.append(run)
    write(runs, Path(args.out), " ".join(["python -m benchmarks.ps_links", *sys.argv[1:]]))


def refit(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``runs`` (a stored ``ps_links.json``'s) summarized again from their measured times:
    the model's figures by today's model, with the servers' own work and the hybrid's
    phases fitted to the stored exchanges without a link (:func:`fit_terms`,
    :func:`model_terms`: where they fit none, the tuning table's, if any)."""
    rows = {
        id(run): [{"size": s["size"], "us": s["us"], "auto_took": s["auto_took"]} for s in run["sizes"]] for run in runs
    }
    plain = {run["layout"]: [{"size": s["size"], "us": s["no_link_us"]} for s in run["sizes"]] for run in runs}
    own, phases = model_terms(*fit_terms(plain, runs[0]["partitions"] if runs else 4))
    return [
        summarize(run["link"], run["layout"], rows[id(run)], plain[run["layout"]], run["partitions"], own, phases)
        for run in runs
    ]


def write(runs: list[dict[str, Any]], out: Path, command: str | None) -> None:
    """``out/ps_links.md`` and ``.svg`` of ``runs``, and with the ``command`` that measured
    them, ``out/ps_links.json``."""
    out.mkdir(parents=True, exist_ok=True)
    if command is not None:
        with open(out / "ps_links.json", "w", encoding="utf-8") as fh:
            dump_json({"command": command, "runs": runs}, fh, indent=1)
    (out / "ps_links.md").write_text("\n".join(line for run in runs for line in table(run)))
    svg(runs, out / "ps_links.svg")


if __name__ == "__main__":
    run_main(main)
