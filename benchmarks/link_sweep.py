"""Allreduce algorithms across emulated links: which wins where, and does ``auto`` pick it.

For each link (``HPCDL_LINK``) and layout of simulated nodes (``HPCDL_RANKS_PER_NODE``), it
runs ``benchmarks.osu_allreduce --compare`` with the flat ring, recursive doubling,
Rabenseifner, the hierarchical allreduce and ``auto`` under ``mpiexec``, and reports per
size the measured time of each, the winner, what ``auto`` took, and what the cost model
that ``auto`` uses (:func:`collectives.cost.allreduce_times`) predicted. It writes
``DIR/link_sweep.json``, ``DIR/link_sweep.md`` (the tables) and ``DIR/link_sweep.svg``
(the winner by size, one row per link and layout)::

    python -m benchmarks.link_sweep --out DIR
    python -m benchmarks.link_sweep --link eth-10g --link "latency=1ms,bandwidth=100MB/s" --layouts 2x2 --out DIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from collectives.cli import ArgumentParser, dump_json, output_dir, parse_size, run_main
from collectives.cost import allreduce_times, parse_link
from collectives.select import configured_node_path

ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "hierarchical")
COLORS = {"ring": "#4c72b0", "recursive_doubling": "#dd8452", "rabenseifner": "#55a868", "hierarchical": "#c44e52"}


def measure(link: str, nodes: int, per_node: int, lo: int, hi: int, iterations: int, rounds: int) -> list[dict]:
    """The OSU allreduce rows of every contender on ``nodes`` simulated nodes of
    ``per_node`` ranks joined by ``link``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = {**os.environ, "HPCDL_LINK": link, "HPCDL_RANKS_PER_NODE": str(per_node), "OMP_NUM_THREADS": "1"}
        cmd = ["mpiexec", "-n", str(nodes * per_node), sys.executable, "-m", "benchmarks.osu_allreduce"]
        cmd += ["-m", f"{lo}:{hi}", "-i", str(iterations), "-x", "1", "--rounds", str(rounds), "--json", out]
        cmd += ["--compare", ",".join([*ALGORITHMS, "auto"])]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)["rows"]


def summarize(link: str, nodes: int, per_node: int, rows: list[dict]) -> dict[str, Any]:
    """Per size: µs of each contender, the measured winner, the modelled winner and times."""
    model = parse_link(link)
    intra = configured_node_path(per_node)  # as auto costs a node's messages
    sizes = []
    for row in rows:
        got = {n: row["results"][n]["avg"] for n in [*ALGORITHMS, "auto"]}
        pred = allreduce_times(row["size"], nodes * per_node, per_node, intra, model)
        winner = min(ALGORITHMS, key=got.__getitem__)
        sizes.append(
            {
                "size": row["size"],
                "us": got,
                "winner": winner,
                "predicted_us": {n: pred[n] * 1e6 for n in ALGORITHMS},
                "predicted_winner": min(ALGORITHMS, key=pred.__getitem__),
                "auto_over_winner": got["auto"] / got[winner],
            }
        )
    return {"link": link, "nodes": nodes, "per_node": per_node, "sizes": sizes}


def table(run: dict[str, Any]) -> list[str]:
    lines = [
        f"### {run['link']}, {run['nodes']} nodes of {run['per_node']}",
        "",
        "| size | " + " | ".join(ALGORITHMS) + " | auto | winner (model's) | auto / winner |",
        "|---" * (len(ALGORITHMS) + 4) + "|",
    ]
    for s in run["sizes"]:
        cells = " | ".join(f"{s['us'][n]:.0f} ({s['predicted_us'][n]:.0f})" for n in ALGORITHMS)
        lines.append(
            f"| {s['size']} | {cells} | {s['us']['auto']:.0f} | {s['winner']} ({s['predicted_winner']}) "
            f"| {s['auto_over_winner']:.2f} |"
        )
    return lines + [""]


def svg(runs: list[dict[str, Any]], path: Path) -> None:
    """The measured winner by size (columns), one row per link and layout."""
    sizes = [s["size"] for s in runs[0]["sizes"]]
    cell, left, top = 26, 190, 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + cell * len(sizes) + 20}" '
        f'height="{top + cell * len(runs) + 70}" font-family="sans-serif" font-size="11">',
        '<text x="4" y="16">allreduce: the fastest algorithm measured, by message size (B); '
        "x: auto took another</text>",
    ]
    for j, size in enumerate(sizes):
        x = left + j * cell + cell / 2
        label = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K" if size >= 1 << 10 else str(size)
        out.append(f'<text x="{x:.0f}" y="{top - 6}" text-anchor="middle" font-size="9">{label}</text>')
    for i, run in enumerate(runs):
        y = top + i * cell
        out.append(f'<text x="4" y="{y + 17}">{run["link"]}, {run["nodes"]} x {run["per_node"]}</text>')
        for j, s in enumerate(run["sizes"]):
            x = left + j * cell
            out.append(f'<rect x="{x}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{COLORS[s["winner"]]}"/>')
            if s["auto_over_winner"] > 1.10:
                out.append(f'<text x="{x + 8}" y="{y + 17}" fill="white">x</text>')
    y = top + cell * len(runs) + 20
    for k, name in enumerate(ALGORITHMS):
        out.append(f'<rect x="{4 + k * 150}" y="{y}" width="12" height="12" fill="{COLORS[name]}"/>')
        out.append(f'<text x="{20 + k * 150}" y="{y + 10}">{name}</text>')
    path.write_text("\n".join([*out, "</svg>"]) + "\n")


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--link", action="append", help="an HPCDL_LINK value, once per link (default: eth-10g, eth-25g, eth-100g)"
    )
    p.add_argument("--layouts", default="2x1,2x2,4x1", help="comma-separated NODESxRANKS_PER_NODE")
    p.add_argument("--min", default="4", help="smallest message (K/M suffixes)")
    p.add_argument("--max", default="4M", help="largest message")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=output_dir, required=True, help="directory for link_sweep.{json,md,svg}")
    a = p.parse_args()
    links = a.link or ["eth-10g", "eth-25g", "eth-100g"]
    for link in links:
        try:
            parse_link(link)  # a bad one fails here, not in the middle
        except ValueError as exc:
            p.error(str(exc))
    layouts = [tuple(int(v) for v in lay.split("x")) for lay in a.layouts.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for link in links:
        for nodes, per_node in layouts:
            rows = measure(link, nodes, per_node, parse_size(a.min), parse_size(a.max), a.iterations, a.rounds)
            runs.append(summarize(link, nodes, per_node, rows))
            print("\n".join(table(runs[-1])), flush=True)
    with open(out / "link_sweep.json", "w", encoding="utf-8") as fh:
        dump_json({"argv": sys.argv[1:], "runs": runs}, fh, indent=1)
    head = [f"<!-- python -m benchmarks.link_sweep {' '.join(sys.argv[1:])} -->", ""]
    head += ["µs per call, the cost model's prediction in brackets.", ""]
    (out / "link_sweep.md").write_text("\n".join(head + [line for r in runs for line in table(r)]))
    svg(runs, out / "link_sweep.svg")


if __name__ == "__main__":
    run_main(main)
