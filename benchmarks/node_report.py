"""Characterise the node this runs on, in one command, and say what the figures mean.

Run it on the node itself, once, not under ``mpiexec`` or ``srun -n N`` (started as one of
several tasks, each stops and says so; a Slurm batch script or ``srun -n 1`` is fine): it
launches each measurement with the ``mpiexec`` beside this Python (the wheel's MPICH, or
the one on ``PATH``)::

    python -m benchmarks.node_report --out report/ [--budget 480] [--max-ranks N]

or ``jobs/node_report.sh [DIR]``. Each step runs at 2, 4, 8, ... ranks up to one rank per
core (or ``--max-ranks``):

1. ``collectives``: every collective against the MPI library, ``benchmarks.bars`` (auto /
   MPI per size; the bar is 1.10);
2. ``small_calls``: where a small call's time goes (``benchmarks.small_calls``): Python's
   part, the one step (posting, waiting for the peers, copying), MPI's barrier and call,
   and a cache line's round trip between the ranks, the floor under the waits;
3. ``stores``: plain against non-temporal stores into the node's shared window
   (``benchmarks.stores``, 2 ranks and the largest count): whether the default
   ``HPCDL_SHM_NONTEMPORAL_BYTES`` (decided by the last-level caches the ranks span) suits
   this node;
4. ``tuner``: ``collectives.tune`` at the same counts: the algorithm that wins each size
   here, to set against the packaged table's rows, and ``tuning.json``: the packaged table
   with every row measured here in place of its own (:func:`node_tuning`), for
   ``HPCDL_TUNING_FILE``;
5. ``training``: a training step with each optimizer against the same step without
   communication (``benchmarks.train_throughput``, at each count up to 8);
6. ``pipeline``: the measured bubble of a 2-stage pipeline (the GPT, and equal stages)
   against ``(p-1)/(m+p-1)``, and the TP grid's traffic per step (calls, bytes, the time
   spent in them: the calls' own cost, against what α-β models fitted on its group
   predict, and the wait for a later peer) (``benchmarks.parallel_gpt``);
7. ``plan``: the planner (``hpcdl.plan``) against the GPT's measured step on every grid of
   4 ranks (2 where the node has fewer cores), from this node's measured compute, links
   and per-call cost (``benchmarks.plan_check``; the bound is 25%, and the two rankings
   should agree);
8. ``ps``: the parameter servers against allreduce across emulated 10 and 100 Gbit/s
   Ethernet (``benchmarks.ps_links``'s exchange of 4 and 16 MiB, 2 simulated nodes of 2
   workers and 4 of one, each with 4 servers on nodes of their own; 2 nodes of one worker
   and 2 servers on 4 to 7 cores): the winner by size against the cost model's, what
   ``HybridOptimizer(node_reduce="auto")`` took, and the same exchanges without a link
   (this node's own cost); ``DIR/ps_links.{json,md,svg}``;
9. ``gpu`` (when torch sees a GPU): the device path against staging through host memory and
   gloo by size at 2 ranks (``benchmarks.osu_allreduce -d cuda``), without NVIDIA's MPS and
   with it where ``nvidia-cuda-mps-control`` is found (the daemon started and stopped for
   the run), the crossover ``auto`` should use; NCCL at one rank.

``--steps`` runs some of the steps only (the budget then goes to them). Every rank is bound
to a core of its own, as ``srun`` and Open MPI's ``mpirun`` place them and as a node with a
core per rank runs its collectives' spinning waits; in the steps that train a model
(``training``, ``pipeline``, ``plan``) to two where the node has two cores a rank, one for
its compute and one for the engine's thread, as a job asks ``srun --cpus-per-task=2`` for
(bound to one, the engine's thread could only take turns with backward, never overlap it).
``--bind none`` leaves the ranks unbound (MPICH's default), where the node's ranks may move
between its cores.

Every step has a share of ``--budget`` seconds (default 480) and ends at it; what a step
did not finish is said in the summary, and the steps after it still run. The directory
holds ``report.json`` (every figure), ``summary.md`` (the verdicts, read first),
``ratios.png`` (auto / MPI against size) when matplotlib is installed, ``tuning.json``
(after the tuner step) and ``raw/`` (each step's output and JSON): well under 5 MB, small
enough to copy off a machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from collectives.cli import dump_json
from collectives.launcher import launcher, launcher_size
from collectives.node.channel import SINGLE_COPY_PROBE
from collectives.select import load_table, rules
from collectives.tune import merge

from .osu import trips_text
from .ps_links import CONTENDERS as PS_CONTENDERS
from .ps_links import fit_terms, model_terms, parse_layout, terms_json
from .ps_links import summarize as summarize_ps
from .ps_links import write as write_ps

__all__ = ["main", "rank_counts", "summarize", "worst_ratios", "crossover", "world_check", "node_tuning"]

BAR = 1.10
"""auto / MPI at or below which a size meets the bar."""

SMALL = 64 << 10
"""Sizes up to this many bytes count as small calls in the summary."""

SHARES = {
    "collectives": 0.35,
    "small_calls": 0.10,
    "stores": 0.05,
    "tuner": 0.20,
    "training": 0.20,
    "pipeline": 0.10,
    "plan": 0.08,
    "ps": 0.12,
    "gpu": 0.15,
}
"""Each step's share of the budget (the GPU's only where there is one; the shares of steps
that end early pass on to the later ones)."""


def rank_counts(cores: int, cap: int | None = None) -> list[int]:
    """2, 4, 8, ... up to ``cores`` (or ``cap``), and ``cores`` itself when it is not a power
    of two; at least ``[2]``."""
    top = max(2, min(cores, cap) if cap else cores)
    out = [2]
    while out[-1] * 2 <= top:
        out.append(out[-1] * 2)
    if out[-1] != top:
        out.append(top)
    return out


def huge_pages(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """The kernel's transparent huge pages mode (``always``, ``madvise`` or ``never``: the
    bracketed word of ``path``), or ``?``. It decides where arrays lie, on 2 MiB pages or
    on 4 KiB ones, and so what a single copy of a peer's pages costs (the kernel pins 4 KiB
    pages one by one)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "?"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "?"


def machine() -> dict[str, Any]:
    """What the node is: cores this process may use, CPU model, sockets, memory, the
    kernel and its huge pages, GPU, and the versions that matter."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "kernel": f"{platform.system()} {platform.release()}",
        "huge_pages": huge_pages(),
    }
    try:
        text = Path("/proc/cpuinfo").read_text()
        models = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
        sockets = {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("physical id")}
        info["cpu"] = models[0] if models else platform.processor()
        info["sockets"] = max(1, len(sockets))
    except OSError:
        info["cpu"] = platform.processor()
    try:
        mem = Path("/proc/meminfo").read_text().split()[1]
        info["memory_gib"] = round(int(mem) / (1 << 20), 1)
    except (OSError, IndexError, ValueError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if info["gpus"]:
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["gpus"] = 0
    try:
        from mpi4py import MPI

        info["mpi"] = " ".join(MPI.Get_library_version().split()[:3])
    except ImportError:
        pass
    return info


def binding_flags(version: str, bind: str, cores: int = 1) -> list[str] | None:
    """The launcher's options that bind each rank to ``cores`` cores of its own (``bind="core"``;
    ranks past the cores share them) or leave the ranks unbound (``"none"``), given the
    text its ``--version`` prints: MPICH's Hydra binds nothing unless told, Open MPI binds by
    default and refuses more ranks than cores bound unless allowed. None where the launcher
    is neither: it then runs as it chooses."""
    if "HYDRA" in version:
        if bind != "core":
            return []
        return ["-bind-to", f"core:{cores}" if cores > 1 else "core"]
    if "Open MPI" in version or "OpenRTE" in version:
        if bind == "core" and cores > 1:
            return ["--map-by", f"slot:PE={cores}", "--bind-to", "core"]
        return ["--bind-to", "core:overload-allowed" if bind == "core" else "none"]
    return None


def model_cores(ranks: int, cores: int) -> int:
    """Cores to bind each of ``ranks`` ranks to in a step that trains a model on a node of
    ``cores``: two where the node has them, one for the rank's compute thread and one for the
    engine's (the thread that runs its collectives while backward goes on), as a job asks
    ``srun --cpus-per-task=2`` for; else one."""
    return 2 if cores >= 2 * ranks else 1


class Runner:
    """Runs the steps' commands under one deadline, writing each one's output under ``raw``;
    every rank bound to a core (``bind="core"``), as ``srun`` and Open MPI's ``mpirun`` place
    them by default, or left unbound (``"none"``)."""

    def __init__(self, out: Path, budget: float, bind: str = "core", cores: int = 1) -> None:
        self.raw = out / "raw"
        self.raw.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget
        self.runs: list[dict[str, Any]] = []
        self.cores = cores
        """The cores this node's ranks may use."""
        exe = Path(sys.executable).parent / "mpiexec"
        self.mpiexec = str(exe) if exe.exists() else (shutil.which("mpiexec") or "mpiexec")
        try:
            self.version = subprocess.run(
                [self.mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            self.version = ""
        self.bind = bind
        flags = binding_flags(self.version, bind)
        # how the ranks were placed, in words, for the summary
        if flags is None:
            self.binding = (
                f"as the launcher places them (neither MPICH's Hydra nor Open MPI: --bind {bind} not applied)"
            )
        elif bind == "core":
            two = " ".join(binding_flags(self.version, bind, 2) or [])
            self.binding = (
                f"each rank bound to a core (mpiexec {' '.join(flags)}); where the node has two cores a rank, "
                f"each rank of a step that trains a model to two (mpiexec {two}), one for its compute "
                "and one for the engine's thread"
            )
        else:
            self.binding = "unbound"

    def flags(self, cores: int = 1) -> list[str]:
        """What a command whose ranks each get ``cores`` cores passes the launcher before ``-n``."""
        return binding_flags(self.version, self.bind, cores) or []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(
        self,
        name: str,
        ranks: int,
        args: list[str],
        limit: float,
        env: dict[str, str] | None = None,
        model: bool = False,
    ) -> bool:
        """``mpiexec [binding] -n ranks python -m args`` with its output in ``raw/name.txt``, for at most
        ``limit`` seconds (and never past the deadline), with ``env`` added to the
        environment; each rank bound to :func:`model_cores` cores where the command trains a
        model (``model``), else to one; True when it ended well."""
        limit = min(limit, self.left())
        flags = self.flags(model_cores(ranks, self.cores) if model else 1)
        entry: dict[str, Any] = {
            "name": name,
            "ranks": ranks,
            "command": " ".join(["mpiexec", *flags, "-n", str(ranks), "python", "-m", *args]),
        }
        self.runs.append(entry)
        if limit < 5:
            entry["status"] = "skipped: the budget was spent"
            return False
        cmd = [self.mpiexec, *flags, "-n", str(ranks), sys.executable, "-m", *args]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        t0 = time.monotonic()
        with open(self.raw / f"{name}.txt", "w", encoding="utf-8") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit, check=False)
                entry["status"] = "ok" if proc.returncode == 0 else f"failed with status {proc.returncode}"
            except subprocess.TimeoutExpired:
                entry["status"] = f"cut off after {limit:.0f} s"
        entry["seconds"] = round(time.monotonic() - t0, 1)
        return entry["status"] == "ok"

    def load(self, name: str) -> Any:
        """A step's JSON output, or None when it wrote none."""
        path = self.raw / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None


def launcher_name(version: str) -> str:
    """Which MPI a launcher is, from the text its ``--version`` prints."""
    if "HYDRA" in version:
        number = [line.split(":", 1)[1].strip() for line in version.splitlines() if line.strip().startswith("Version:")]
        return f"MPICH's Hydra {number[0]}" if number else "MPICH's Hydra"
    return version.strip().splitlines()[0] if version.strip() else "unknown"  # Open MPI's names itself first


_PROBE = (  # one write a line, so that the launcher's forwarding of two ranks' output never splits one
    "import sys; from mpi4py import MPI; "
    "sys.stdout.write(f'{MPI.COMM_WORLD.size} {MPI.Get_library_version().splitlines()[0].strip()}\\n')"
)


def world_check(mpiexec: str, version: str = "") -> str | None:
    """None where ``mpiexec -n 2`` starts one MPI job of 2 ranks of this Python; else why
    not, in words. Where the MPI library mpi4py loads is not the one ``mpiexec`` belongs
    to (a system's mpi4py built on its Open MPI, launched by the wheel's MPICH), each
    process is a job of its own rank, and every figure after would be one rank's."""
    try:
        proc = subprocess.run(
            [mpiexec, "-n", "2", sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`{mpiexec} -n 2` did not run: {exc}"
    seen = [line.split(" ", 1) for line in proc.stdout.splitlines() if line[:1].isdigit() and " " in line]
    sizes = [int(size) for size, _ in seen]
    if proc.returncode == 0 and sizes == [2, 2]:
        return None
    if sizes and set(sizes) == {1}:
        launcher = launcher_name(version)
        return (
            f"`{mpiexec} -n 2` started {len(sizes)} processes, but each is an MPI job of 1 rank: mpi4py here "
            f"loads {seen[0][1]}, which is not this mpiexec's MPI ({launcher}). Launch with the mpiexec of "
            "mpi4py's MPI (on PATH first), or point mpi4py at this one's library (MPI4PY_LIBMPI=.../libmpi.so.12 "
            "for MPICH)"
        )
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"`{mpiexec} -n 2` ended with status {proc.returncode}, ranks seen {sizes}: {tail}"


def worst_ratios(bars: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per collective of a ``benchmarks.bars`` result: the worst auto / MPI among small sizes
    and among the others, with their sizes, and the sizes over :data:`BAR`."""
    out = {}
    for coll, rows in bars.get("bars", {}).items():
        ratios = [
            (r["size"], r["results"]["auto"]["avg"] / r["results"]["mpi"]["avg"])
            for r in rows
            if "auto" in r["results"] and "mpi" in r["results"] and r["results"]["mpi"]["avg"] > 0
        ]
        small = [x for x in ratios if x[0] <= SMALL]
        large = [x for x in ratios if x[0] > SMALL]
        out[coll] = {
            "ratios": {str(s): round(q, 3) for s, q in ratios},
            "worst_small": max(small, key=lambda x: x[1]) if small else None,
            "worst_large": max(large, key=lambda x: x[1]) if large else None,
            "over_bar": [s for s, q in ratios if q > BAR],
            "algorithms": {str(r["size"]): r["algorithm"] for r in rows if "algorithm" in r},
            # the node algorithm on arrays in the window (read in place, whatever the row says)
            "window": {
                str(r["size"]): round(r["results"]["window"]["avg"] / r["results"]["mpi"]["avg"], 3)
                for r in rows
                if "window" in r["results"] and "mpi" in r["results"] and r["results"]["mpi"]["avg"] > 0
            },
        }
    return out


def _over(w: dict[str, Any]) -> str:
    """The sizes over the bar, each with the algorithm auto took and the window's ratio there."""
    took, win = w.get("algorithms", {}), w.get("window", {})
    cells = []
    for s in w["over_bar"]:
        notes = [took[str(s)]] if str(s) in took else []
        notes += [f"window {win[str(s)]:.2f}"] if str(s) in win else []
        cells.append(_size(s) + (f" ({'; '.join(notes)})" if notes else ""))
    return ", ".join(cells) or "none"


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _rules(rows: list[list[Any]]) -> str:
    return ", ".join(f"{name} to {_size(lim)}" if lim else f"{name} beyond" for lim, name in rows)


def _cell(worst: Any) -> str:
    if worst is None:
        return "–"
    size, q = worst
    return f"{q:.2f} ({_size(size)}){'' if q <= BAR else ' **over**'}"


def summarize(report: dict[str, Any]) -> str:
    """``summary.md``: the machine, then the verdicts of each step that ran, then what did
    not finish."""
    m = report["machine"]
    lines = [
        f"# Node report: {m.get('host', '?')}",
        "",
        f"{m.get('cores')} cores ({m.get('cpu', '?')}, {m.get('sockets', '?')} socket(s)), "
        f"{m.get('memory_gib', '?')} GiB, {m.get('gpus', 0)} GPU(s){' (' + m['gpu'] + ')' if m.get('gpu') else ''}; "
        f"{m.get('kernel', '?')}, transparent huge pages {m.get('huge_pages', '?')}; "
        f"Python {m.get('python')}, torch {m.get('torch', '?')}, {m.get('mpi', 'MPI ?')}. "
        f"{report['date']}, {report['seconds']:.0f} s of a {report['budget']:.0f} s budget. "
        f"Ranks: {report.get('binding', 'unbound')}.",
    ]
    sections = {
        "collectives": _collective_lines,
        "small_calls": _small_call_lines,
        "stores": _stores_lines,
        "tuner": _tuner_lines,
        "training": _training_lines,
        "pipeline": _pipeline_lines,
        "plan": _plan_lines,
        "ps": _ps_lines,
    }
    for step, section in sections.items():
        if step in report.get("steps", SHARES):
            lines += ["", *section(report)]
    if report.get("gpu") is not None:
        lines += _gpu_lines(report["gpu"])
    problems = [r for r in report["runs"] if r.get("status") != "ok"]
    if problems:
        lines += ["", "## What did not finish", ""]
        lines += [f"- `{r['command']}`: {r['status']}" for r in problems]
    return "\n".join(lines) + "\n"


def _collective_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        f"## Collectives against MPI (auto / MPI time per call; the bar is {BAR:.2f})",
        "",
        "Worst ratio among calls up to 64 KiB and above it, with its size; beside each size over",
        "the bar, the algorithm `auto` took there (its tuning row's pick) and the window's ratio:",
        "the node algorithm on arrays from `collectives.empty`, read in place whatever the row says.",
        "",
        "| ranks | collective | worst small | worst large | sizes over the bar |",
        "|---|---|---|---|---|",
    ]
    for n, per in sorted(report["collectives"].items(), key=lambda kv: int(kv[0])):
        for coll, w in per.items():
            lines.append(f"| {n} | {coll} | {_cell(w['worst_small'])} | {_cell(w['worst_large'])} | {_over(w)} |")
    return lines


def _small_call_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        "## Where a small call's time goes (µs per call)",
        "",
        "python: argument checks, dispatch and cache lookup; step: post, wait for the peers, copy;",
        "wait: step less the copy at this rank's cache copy rate. A wait well above MPI's barrier",
        "is time lost between the ranks: spinning, sleeping or waking. Then, per step, from the",
        "compiled loop's counters: the waits that found a peer behind, their polls, their sleeps",
        "and the wake-ups sent; with a core per rank a step should poll and never sleep. Below it,",
        "a cache line's round trip from rank 0 to each other rank, before and after the calls:",
        "half of it is the least a call that waits for a peer can wait.",
        "",
        "| ranks | collective | bytes | total | python | step | wait | MPI barrier | MPI call "
        "| waited | polls | sleeps | wake-ups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    trips = []
    for n, data in sorted(report.get("small_calls", {}).items(), key=lambda kv: int(kv[0])):
        rows = data  # a list: a report from before the round trips
        if isinstance(data, dict):
            rows, trip = data["rows"], data.get("line_round_trip_s") or {}
            trips.append(f"- {n} ranks: {trips_text(trip.get('before'), trip.get('after'))}")
        for w in rows:
            counts = " | ".join(
                "-" if w.get(k) is None else f"{w[k]:.3g}" for k in ("waited", "polls", "sleeps", "wakes")
            )
            lines.append(
                f"| {n} | {w['collective']} | {w['size']} | {w['total']:.2f} | {w['python']:.2f} | {w['step']:.2f} "
                f"| {w['wait']:.2f} | {w['barrier']:.2f} | {w['mpi']:.2f} | {counts} |"
            )
    return lines + ([""] + trips if trips else [])


def single_copy_line(nbytes: int, times: dict[str, list[float]]) -> str:
    """What the channel chose for broadcasts read from the root's memory (single copy), and
    the times it chose by, where it measured them."""
    chose = f"broadcasts read the root's memory from {_size(nbytes)}" if nbytes else "broadcasts go through the slots"
    if not times:
        return chose + " (set, not measured)" if nbytes else chose + " (single copy set off, or not measured)"
    sizes = "/".join(_size(s) for s in SINGLE_COPY_PROBE)
    slots, single = ("/".join(f"{t * 1e6:.1f}" for t in times[k]) for k in ("slots", "single"))
    return f"{chose}: measured at {sizes}, through the slot {slots} us, single copy {single} us"


def _stores_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        "## Plain or non-temporal stores into the shared window (time with non-temporal / plain)",
        "",
        "| ranks | last-level caches spanned | setting (bytes; 0: plain) | collective | nt / plain by size |",
        "|---|---|---|---|---|",
    ]
    ratios, chosen, auto = [], [], []
    for n, rec in sorted(report.get("stores", {}).items(), key=lambda kv: int(kv[0])):
        if "single_copy_broadcast" in rec:
            chosen += ["", f"{n} ranks: {single_copy_line(rec['single_copy_broadcast'], rec['broadcast_times'])}."]
        for coll, rows in rec.get("results", {}).items():
            cells = ", ".join(f"{_size(r['size'])} {r['nt'] / r['plain']:.2f}" for r in rows)
            ratios += [r["nt"] / r["plain"] for r in rows]
            if rec.get("measured"):
                auto += [r["auto"] / min(r["nt"], r["plain"]) for r in rows if "auto" in r]
            lines.append(f"| {n} | {rec['last_level_caches']} | {rec['setting']} | {coll} | {cells} |")
    if auto:
        mid = sorted(auto)[len(auto) // 2]
        lines += [
            "",
            "Each rank measures its stores here (the caches name one): the channel's own choice took "
            f"{mid:.2f} x the faster of the two (median).",
        ]
    elif ratios:
        mid = sorted(ratios)[len(ratios) // 2]
        setting = {rec["setting"] for rec in report["stores"].values()}
        if mid < 0.95 and setting == {0}:
            lines += [
                "",
                f"Non-temporal stores are faster here (median {mid:.2f} x): HPCDL_SHM_NONTEMPORAL_BYTES=4096.",
            ]
        elif mid > 1.05 and 0 not in setting:
            lines += ["", f"Plain stores are faster here (median {mid:.2f} x): HPCDL_SHM_NONTEMPORAL_BYTES=0."]
        else:
            lines += ["", f"The default suits this node (median nt / plain {mid:.2f} x)."]
    return lines + chosen


def _tuner_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        "## What the tuner picks here, against the packaged table",
        "",
    ]
    if report.get("tuning_file"):
        lines += [
            f"Where they differ, `HPCDL_TUNING_FILE={report['tuning_file']}` (in this directory: the packaged "
            "table with every row measured here in place of its own) makes `auto` follow this node.",
            "",
        ]
    packaged = load_table()
    for n, table in sorted(report["tuner"].items(), key=lambda kv: int(kv[0])):
        for e in table:
            # what auto takes there: the tuner's row says whether its ranks outnumbered the cores
            ours = rules(packaged, e["collective"], int(n), 1, e.get("oversubscribed"))
            same = "the same" if ours == e["rules"] else f"packaged: {_rules(ours)}"
            lines.append(f"- {n} ranks, {e['collective']}: {_rules(e['rules'])} ({same})")
    return lines


def _training_lines(report: dict[str, Any]) -> list[str]:
    lines = ["## Training step against the same step without communication", ""]
    for n, models in sorted(report["training"].items(), key=lambda kv: int(kv[0])):
        for model in models:
            base = model["rows"].get("no communication", {}).get("step_ms")
            for row, fig in model["rows"].items():
                if base and row != "no communication":
                    each = fig.get("round_ratios") or []
                    spread = f" (round by round {', '.join(f'{v:.2f}' for v in each)})" if len(each) > 1 else ""
                    lines.append(f"- {n} ranks, {model['model']}: {row} {fig['step_ms'] / base:.2f} x{spread}")
    return lines


def bubble_line(row: dict[str, Any]) -> str | None:
    """What one pipeline's measured bubble is made of, in a line, from its row of
    ``benchmarks.parallel_gpt`` (None for a grid without a pipeline)."""
    if not row.get("bubble_formula") or row.get("bubble_slowest") is None:
        return None
    formula, slowest = row["bubble_formula"], row["bubble_slowest"]
    ahead = row.get("bubble_replayed_ahead_slowest")
    return (
        f"{row['grid']}, {row['chunks']} micro-batches: the slowest stage's bubble measured {slowest:.3f}, "
        f"(p-1)/(m+p-1) = {formula:.3f} ({slowest / formula:.2f} x; the bar is {BAR:.2f} x); with hops "
        f"that cost nothing its spans give {row['bubble_replayed_slowest']:.3f}"
        + ("" if ahead is None else f", and {ahead:.3f} with one more micro-batch in flight ahead of the last stage")
        + f": the hops add {row['hop_s'] * 1e6:.0f} us a micro-batch, and the slowest stage spends "
        f"{row['between_s'] * 1e6:.0f} us a micro-batch between its spans"
        + ("" if row.get("gap_s") is None else f", typically {row['gap_s'] * 1e6:.0f} us before a forward")
        + f". Mean over the stages {row['bubble']:.3f} ({row['bubble_replayed']:.3f} with free "
        "hops): the others also wait for the slowest"
    )


def _pipeline_lines(report: dict[str, Any]) -> list[str]:
    lines = ["## Pipeline bubble and tensor-parallel traffic", ""]
    for row in report["pipeline"]:
        if line := bubble_line(row):
            lines.append(f"- {line}")
        if "tp_calls" in row:
            lines.append(
                f"- {row['grid']} step {row['step_s'] * 1e3:.1f} ms: {row['tp_calls']:.0f} tensor-parallel calls "
                f"of {row['tp_bytes'] / (1 << 20):.2f} MiB in all, {row['tp_seconds'] * 1e3:.1f} ms waiting in them: "
                f"{row['tp_call_seconds'] * 1e3:.1f} ms the calls' own, where the alpha-beta models measured on its "
                f"group predict {row['tp_predicted_seconds'] * 1e3:.1f} ms ("
                + ", ".join(f"{k} {m['alpha_s'] * 1e6:.0f} us" for k, m in row["tp_models"].items())
                + f" a call), and {row['tp_peer_wait_seconds'] * 1e3:.1f} ms for a later peer"
            )
    return lines


def _plan_lines(report: dict[str, Any]) -> list[str]:
    lines = ["## The planner against the GPT's measured steps", ""]
    got = report.get("plan")
    if not got:
        return lines + ["- did not finish (see below)"]
    cal = got["calibration"]
    lines.append(
        f"- measured here: compute {cal['gpu']['peak'] / 1e9:.1f} GFLOP/s a rank and "
        f"{cal['gpu']['overhead'] * 1e6:.0f} us a layer pass, a call {cal['call_overhead'] * 1e3:.2f} ms "
        "beside its link, contention "
        f"{cal['contention']:.2f} ({cal['gpus']} ranks on {cal['cores_per_node']} cores); each grid is predicted "
        "at the contention measured just before and after it"
    )
    for row in got["rows"]:
        beside = f", contention {row['contention']:.2f}" if "contention" in row else ""
        lines.append(
            f"- {row['grid']}: measured {row['step_s'] * 1e3:.1f} ms, predicted {row['predicted_step_s'] * 1e3:.1f} "
            f"({row['predicted_step_s'] / row['step_s']:.2f} x{beside})"
        )
    v = got["verdict"]
    unordered = {tuple(p) for p in v.get("unordered", [])}
    pairs = []
    for a, b, gap in v["swapped"]:
        spread = ", within their steps' spread" if (a, b) in unordered else ""
        pairs.append(f"{a} and {b} ({gap:.1%} apart{spread})")
    swapped = ", ".join(pairs) or "none"
    lines.append(
        f"- worst {v['worst']:+.1%} (the bound is {v['bound']:.0%}); pairs the planner orders the other way: {swapped}"
    )
    if report.get("quick"):
        lines.append(
            "- (--quick: a GPT of width 32 whose steps are mostly the framework's own work around its layers, "
            "which the model leaves out; the check is the full run's)"
        )
    return lines


def _ps_lines(report: dict[str, Any]) -> list[str]:
    lines = ["## Parameter servers against allreduce across emulated links", ""]
    got = report.get("ps")
    if got and got.get("skipped"):
        return lines + [f"- not run: {got['skipped']}"]
    if not got or not got["runs"]:
        return lines + ["- did not finish (see below)"]
    ms = lambda us: " / ".join(f"{us[c] / 1e3:.2f}" for c in PS_CONTENDERS)  # noqa: E731
    lines.append(
        f"One synchronous exchange of a gradient without compute, the fastest of its steps, ms "
        f"({' / '.join(PS_CONTENDERS)}; with one worker a node the hybrid is the parameter servers' own path); "
        "`ps_links.md` has the model's prediction of each."
    )
    lines.append("")
    for layout, run in {run["layout"]: run for run in got["runs"]}.items():
        own = "; ".join(f"{_size(s['size'])} {ms(s['no_link_us'])}" for s in run["sizes"])
        lines.append(f"- {layout}, without a link (this node's own cost): {own}")
    rows = [(run, s) for run in got["runs"] for s in run["sizes"]]
    for run, s in rows:
        lines.append(
            f"- {run['link']}, {run['layout']}, {_size(s['size'])}: {ms(s['us'])}: {s['winner']} wins (the model: "
            f'{s["predicted_winner"]}); `node_reduce="auto"` took {s["auto_took"]}, '
            f"{s['auto_over_best_ps']:.2f} x the better parameter-server path"
        )
    own = got.get("ps_own")
    lines.append(
        f"- the servers' own work a contribution, fitted to the exchanges without a link: {own['alpha'] * 1e6:.0f} µs "
        f'+ its bytes at {own["beta"] / 1e9:.2f} GB/s (`ps_own` in `tuning.json`, which `node_reduce="auto"` '
        "costs it at); the model's predictions include it"
        if own
        else "- the servers' own work: not fitted here (it needs exchanges without a link at two partition sizes, "
        "a contribution's time growing with its bytes); the model takes the tuning table's `ps_own` where it has one"
    )
    phases = got.get("ps_phases")
    if phases:
        lines.append(
            f"- each of the hybrid's two calls inside a node (reduce-scatter, allgather), fitted to its exchanges "
            f"without a link less the servers' work: {phases['alpha'] * 1e6:.0f} µs + a rank's bytes at "
            f"{phases['beta'] / 1e9:.2f} GB/s (`ps_phases` in `tuning.json`)"
        )
    right = sum(s["winner"] == s["predicted_winner"] for _, s in rows)
    close = sum(s["auto_over_best_ps"] <= BAR for _, s in rows)
    lines.append(
        f"- the model named the winner in {right} of {len(rows)} rows; `auto` took within {BAR:.2f} x the better "
        f"parameter-server path in {close} of {len(rows)}"
    )
    return lines


def crossover(rows: list[dict[str, Any]], below: str = "staged", above: str = "ipc") -> int | None:
    """The largest size up to which ``below`` is faster than ``above`` at every measured
    size (0: not even at the smallest; None: neither measured)."""
    best = None
    for row in sorted(rows, key=lambda r: r["size"]):
        res = row.get("results", {})
        if below not in res or above not in res:
            continue
        if res[below]["avg"] >= res[above]["avg"]:
            return best or 0
        best = row["size"]
    return best


def _gpu_lines(gpu: dict[str, Any]) -> list[str]:
    """The GPU section of the summary: by size, each contender's time per call at 2 ranks on
    one GPU without MPS and with it, and the staged/ipc crossover ``auto`` should use."""
    lines = ["", "## GPU: device path against staged (and gloo), 2 ranks", ""]
    runs = [(k, gpu.get(k)) for k in ("np2", "np2_mps") if gpu.get(k)]
    if not runs:
        return [*lines, "No figures (see `raw/gpu_*.txt`)."]
    lines += [
        "µs per call, timed until the GPU has finished it. The staged/ipc crossover is the",
        "`HPCDL_DEVICE_STAGED_BYTES` for ranks sharing a GPU in that mode.",
        "",
    ]
    for key, data in runs:
        rows = data.get("rows", [])
        names = list(rows[0]["results"]) if rows else []
        cut = crossover(rows)
        mode = "under MPS" if key.endswith("mps") else "without MPS"
        if data.get("complete") is False:  # cut off: the sizes it measured
            mode += f" (cut off after {_size(rows[-1]['size']) if rows else 'no size'})"
        lines += [
            f"{mode}: staged faster than ipc up to {_size(cut) if cut else 'no size'}",
            "",
            "| size | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for row in rows:
            cells = [f"{row['results'][n]['avg']:.1f}" if n in row["results"] else "" for n in names]
            lines.append(f"| {_size(row['size'])} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot(report: dict[str, Any], path: Path) -> bool:
    """auto / MPI against size, a panel per collective and a line per rank count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colls = sorted({c for per in report["collectives"].values() for c in per})
    if not colls:
        return False
    fig, axes = plt.subplots(1, len(colls), figsize=(3.2 * len(colls), 3), squeeze=False)
    for ax, coll in zip(axes[0], colls, strict=True):
        for n, per in sorted(report["collectives"].items(), key=lambda kv: int(kv[0])):
            got = per.get(coll, {}).get("ratios", {})
            if got:
                ax.plot([int(s) for s in got], list(got.values()), marker=".", label=f"{n} ranks")
        ax.axhline(BAR, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(coll)
        ax.set_xlabel("bytes")
    axes[0][0].set_ylabel("auto / MPI")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _each(end: float, counts: list[int], n: int) -> float:
    """The seconds left to the step's end, shared among its runs from rank count ``n`` on."""
    return (end - time.monotonic()) / (len(counts) - counts.index(n))


def _command(step: str, n: int, json_path: Path, quick: bool) -> list[str]:
    """The module and arguments of one run of a per-rank-count step."""
    few = ["--min", "4", "--max", "4K", "--rounds", "1"] if quick else None
    if step == "collectives":
        sizes = few or ["--rounds", "3", "--max", "16M" if n <= 4 else "4M"]
        return ["benchmarks.bars", "--no-gloo", *sizes, "--json", str(json_path)]
    if step == "small_calls":
        sizes = ["--sizes", "4", "--calls", "100", "--rounds", "1"] if quick else ["--calls", "500", "--rounds", "3"]
        return ["benchmarks.small_calls", *sizes, "--json", str(json_path)]
    return ["collectives.tune", *(few or ["--rounds", "3", "--max", "4M"]), "--out", str(json_path)]


def _ends(r: Runner, chosen: list[str]) -> dict[str, float]:
    """When each chosen step must end: the budget left, shared among them by their
    :data:`SHARES`, in order."""
    total, scale = r.left(), 1 / sum(SHARES[k] for k in chosen)
    ends, end = {}, time.monotonic()
    for step in chosen:
        end += total * SHARES[step] * scale
        ends[step] = end
    return ends


def node_tuning(out: Path, counts: list[int], machine: str, ps: dict[str, Any] | None = None) -> str | None:
    """Write ``out/tuning.json``: the packaged tuning table with every row the tuner step
    measured here (``raw/tuner_npN.json``) in place of the packaged row of that collective
    and rank count, each labelled ``machine``, and what the ``ps`` step fitted (``ps``'s
    ``ps_own`` and ``ps_phases``): the one file ``HPCDL_TUNING_FILE`` takes for a job of
    any rank count on this node. Its name, or None where neither step measured anything."""
    table, measured = load_table(), False
    for n in counts:
        try:
            new = json.loads((out / "raw" / f"tuner_np{n}.json").read_text())
        except (OSError, ValueError):
            continue
        if new.get("tables"):
            table, measured = merge(table, new, machine), True
    fitted = {key: (ps or {}).get(key) for key in ("ps_own", "ps_phases")}
    if any(fitted.values()):
        table, measured = merge(table, {k: v for k, v in fitted.items() if v}), True
    if not measured:
        return None
    table["machine"] = f"per entry: those labelled {machine!r} measured here, the others the packaged table's"
    with open(out / "tuning.json", "w", encoding="utf-8") as fh:
        dump_json(table, fh, indent=1)
    return "tuning.json"


def _steps(r: Runner, counts: list[int], args: argparse.Namespace, gpus: int) -> dict[str, Any]:
    """Run every chosen step under the budget; their figures by step and rank count."""
    got: dict[str, Any] = {step: {} for step in ("collectives", "small_calls", "stores", "tuner", "training")}
    got.update(pipeline=[], plan=None, ps=None, gpu=None)
    chosen = [k for k in SHARES if k in args.steps and (gpus or k != "gpu")]
    ends = _ends(r, chosen) if chosen else {}
    for step in ("collectives", "small_calls", "stores", "tuner"):
        if step not in ends:
            continue
        if step == "stores":
            _stores(r, counts, args, got, ends[step])
            continue
        for n in counts:
            name = f"{step}_np{n}"
            r.run(name, n, _command(step, n, r.raw / f"{name}.json", args.quick), _each(ends[step], counts, n))
            data = r.load(name)
            if data and step == "collectives":
                got["collectives"][str(n)] = worst_ratios(data)
            elif data and step == "small_calls":
                got["small_calls"][str(n)] = data
            elif data:
                got["tuner"][str(n)] = data.get("tables", [])
    if "training" in ends:
        _training(r, counts, args, got, ends["training"])
    if "pipeline" in ends:
        _pipeline(r, args, got, ends["pipeline"])
    if "plan" in ends:
        _plan(r, counts, args, got, ends["plan"])
    if "ps" in ends:
        got["ps"] = _ps(r, counts, args, ends["ps"])
    if "gpu" in ends:
        got["gpu"] = _gpu(r, args)
    return got


def _stores(r: Runner, counts: list[int], args: argparse.Namespace, got: dict[str, Any], end: float) -> None:
    few = ["--min", "4K", "--max", "64K", "--rounds", "1", "--collectives", "allreduce,bcast"]
    sizes = few if args.quick else ["--min", "16K", "--max", "4M", "--rounds", "3"]
    runs = sorted({2, counts[-1]})
    for n in runs:
        name = f"stores_np{n}"
        r.run(name, n, ["benchmarks.stores", *sizes, "--json", str(r.raw / f"{name}.json")], _each(end, runs, n))
        if data := r.load(name):
            got["stores"][str(n)] = data


def _training(r: Runner, counts: list[int], args: argparse.Namespace, got: dict[str, Any], end: float) -> None:
    train = [n for n in counts if n <= 8]
    for n in train:
        name = f"training_np{n}"
        steps = ["--rounds", "1", "--steps", "2", "--timeline-steps", "1"] if args.quick else ["--rounds", "2"]
        r.run(
            name,
            n,
            ["benchmarks.train_throughput", "--models", "mlp", *steps, "--json", str(r.raw / f"{name}.json")],
            _each(end, train, n),
            model=True,
        )
        got["training"][str(n)] = r.load(name) or []


def _pipeline(r: Runner, args: argparse.Namespace, got: dict[str, Any], end: float) -> None:
    steps = ["--steps", "2", "--chunks", "4", "--no-equal"] if args.quick else ["--steps", "4"]
    r.run(
        "pipeline_np2",
        2,
        [
            "benchmarks.parallel_gpt",
            "--grids",
            "1x1x2,1x2x1",
            *steps,
            "--json",
            str(r.raw / "pipeline_np2.json"),
        ],
        end - time.monotonic(),
        model=True,
    )
    got["pipeline"] = r.load("pipeline_np2") or []


def _plan(r: Runner, counts: list[int], args: argparse.Namespace, got: dict[str, Any], end: float) -> None:
    n = 4 if 4 in counts else 2
    name = f"plan_np{n}"
    tiny = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "4"]
    grids = ["--grids", "2x1x1,1x1x2" if n == 2 else "2x2x1,1x2x2,2x1x2"]
    steps = [*tiny, *grids, "--chunks", "2", "--steps", "1"] if args.quick else ["--steps", "3"]
    r.run(
        name,
        n,
        ["benchmarks.plan_check", *steps, "--json", str(r.raw / f"{name}.json")],
        end - time.monotonic(),
        model=True,
    )
    got["plan"] = r.load(name)


PS_LINKS = ("eth-10g", "eth-100g")
"""The links of the ``ps`` step: the slowest and the fastest of the Ethernet presets."""


def ps_layouts(ranks: int) -> list[str]:
    """The ``ps`` step's layouts (``benchmarks.ps_links``'s ``NODESxWORKERS+SERVERS``) for
    a node whose ``ranks`` ranks have a core each: 2 simulated nodes of 2 workers, and 4 of
    one, each with 4 servers on nodes of their own (where theory has the hierarchical
    allreduce win, and the parameter servers); 2 nodes of one worker and 2 servers on 4
    to 7 cores; none on fewer."""
    if ranks >= 8:
        return ["2x2+4", "4x1+4"]
    return ["2x1+2"] if ranks >= 4 else []


def _ps(r: Runner, counts: list[int], args: argparse.Namespace, end: float) -> dict[str, Any]:
    """Parameter servers against allreduce across emulated links: each layout's exchange
    without a link (this node's own cost) and across each of :data:`PS_LINKS`, by
    ``benchmarks.ps_links``'s worker part; ``DIR/ps_links.{json,md,svg}`` beside the summary."""
    layouts = ["2x1+2"] if args.quick else ps_layouts(counts[-1])
    if not layouts:
        return {"skipped": f"it needs 4 ranks with a core each (2 workers, 2 servers); this node runs {counts[-1]}"}
    links = ["eth-25g"] if args.quick else list(PS_LINKS)
    sizes, steps = ("64K", "1") if args.quick else ("4M,16M", "3")
    jobs = [(layout, "") for layout in layouts] + [(layout, link) for layout in layouts for link in links]
    plain: dict[str, Any] = {}
    linked = []
    for i, (layout, link) in enumerate(jobs):
        nodes, per_node, servers = parse_layout(layout)
        name = f"ps_{nodes}x{per_node}_{servers}_{link or 'nolink'}"
        env = {"HPCDL_LINK": link, "HPCDL_RANKS_PER_NODE": str(per_node), "HPCDL_PS_SERVERS": str(servers)}
        work = ["benchmarks.ps_links", "--work", str(r.raw / f"{name}.json"), "--sizes", sizes, "--steps", steps]
        r.run(name, nodes * per_node + servers, work, (end - time.monotonic()) / (len(jobs) - i), env=env)
        rows = r.load(name)
        if rows and not link:
            plain[layout] = rows
        elif rows and layout in plain:
            linked.append((link, layout, rows))
    fitted = fit_terms(plain)  # the servers' own work and the hybrid's phases, measured here: for tuning.json
    own, phases = model_terms(*fitted)
    runs = [summarize_ps(link, layout, rows, plain[layout], own=own, phases=phases) for link, layout, rows in linked]
    if runs:
        command = f"node report: benchmarks.ps_links --sizes {sizes} --steps {steps}, layouts {','.join(layouts)}"
        write_ps(runs, r.raw.parent, command)
    return {"runs": runs, **terms_json(*fitted)}


SWEEP_SECONDS = 0.5
"""About what one iteration of the GPU step's sweep costs, every size and contender once
(2 ranks sharing an H100 or H200 without MPS; gloo's calls, of 3.5-5.5 ms each, the most):
the step fits its iterations to its share of the budget by it."""


def gpu_iterations(seconds: float, start: float = 10.0) -> tuple[int, int]:
    """The timed and warm-up iterations a size gets in a GPU sweep of ``seconds``, less
    ``start`` for the ranks' start and the GPU's: up to 100 and 10, as OSU takes, and no
    fewer than 10 and 2."""
    timed = int(max(10, min(100, (seconds - start) / SWEEP_SECONDS)))
    return timed, max(2, timed // 10)


def _gpu(r: Runner, args: argparse.Namespace) -> dict[str, Any]:
    """The device path against staged and gloo at 2 ranks on this node's GPUs, without MPS
    and (where ``nvidia-cuda-mps-control`` is found and no MPS daemon is named already) with
    it; NCCL at one rank. Each sweep's iterations fit its share of what is left."""
    sizes = "4:64K" if args.quick else "4:16M"
    ctl = shutil.which("nvidia-cuda-mps-control")
    mps = ctl is not None and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    parts = 3 if mps else 2

    def osu(json_name: str, share: float) -> list[str]:
        timed, warm = (10, 2) if args.quick else gpu_iterations(share)
        cmd = ["benchmarks.osu_allreduce", "-d", "cuda", "-m", sizes, "--compare", "auto,ipc,staged,gloo"]
        return [*cmd, "--rounds", "1" if args.quick else "2", "-i", str(timed), "-x", str(warm), "--json", json_name]

    share = r.left() / parts
    r.run("gpu_np2", 2, osu(str(r.raw / "gpu_np2.json"), share), share)
    got: dict[str, Any] = {"np2": r.load("gpu_np2")}
    if mps:
        with _mps_daemon(ctl, r.raw) as env:
            share = r.left() / 2
            r.run("gpu_np2_mps", 2, osu(str(r.raw / "gpu_np2_mps.json"), share), share, env)
        got["np2_mps"] = r.load("gpu_np2_mps")
    r.run("gpu_nccl_np1", 1, ["benchmarks.osu_allreduce", "-d", "cuda", "-a", "nccl", "-c", "-m", sizes], r.left())
    return got


@contextlib.contextmanager
def _mps_daemon(ctl: str, raw: Path):
    """NVIDIA's MPS control daemon started for the block, with its pipe and log directories
    under a fresh temporary directory; gives the variables its clients need. The daemon's
    log goes to ``raw/mps.log``."""
    tmp = Path(tempfile.mkdtemp(prefix="hpcdl-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(tmp / "log")}
    for d in env.values():
        Path(d).mkdir()
    full = {**os.environ, **env}
    with open(raw / "mps.log", "w", encoding="utf-8") as log:
        subprocess.run([ctl, "-d"], env=full, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=30)
    try:
        yield env
    finally:
        subprocess.run([ctl], input="quit\n", text=True, env=full, capture_output=True, check=False, timeout=30)
        with contextlib.suppress(OSError):
            (raw / "mps.log").write_text((raw / "mps.log").read_text() + (tmp / "log" / "control.log").read_text())
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="node_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory to write (created)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for every step together")
    p.add_argument("--max-ranks", type=int, default=None, help="the largest rank count (default: one per core)")
    p.add_argument("--quick", action="store_true", help="a few small sizes and one round each: a smoke run")
    p.add_argument(
        "--bind",
        choices=("core", "none"),
        default="core",
        help="core (default): each rank bound to a core, as srun and Open MPI place them; none: unbound",
    )
    p.add_argument(
        "--steps",
        type=lambda v: v.split(","),
        default=list(SHARES),
        help="comma-separated steps to run, of "
        + ",".join(SHARES)
        + " (default: all; the budget is shared among them)",
    )
    args = p.parse_args(argv)
    if args.budget < 10 or (args.max_ranks is not None and args.max_ranks < 2):
        p.error("--budget must be at least 10 seconds and --max-ranks at least 2")
    unknown = [x for x in args.steps if x not in SHARES]
    if unknown:
        p.error(f"--steps: unknown {', '.join(unknown)}; the steps are {', '.join(SHARES)}")
    tasks = launcher_size()
    if tasks is not None and tasks > 1:  # every task would run the whole report into one directory
        print(
            f"node_report: started as one of {tasks} tasks by {launcher()}; run it once, not under mpiexec or "
            "srun -n: it starts its own MPI jobs",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "raw").mkdir(exist_ok=True)
    except OSError as exc:
        p.error(f"--out {out}: cannot make the directory: {exc.strerror or exc}")
    t0 = time.monotonic()
    info = machine()
    counts = rank_counts(info["cores"] or 2, args.max_ranks)
    r = Runner(out, args.budget, args.bind, info["cores"] or 2)
    why = world_check(r.mpiexec, r.version)
    if why:  # every figure would be one rank's: say so instead
        (out / "summary.md").write_text(f"# Node report: {info['host']}\n\nNot run: {why}.\n")
        print(f"node_report: not run: {why}", file=sys.stderr)
        return 2
    got = _steps(r, counts, args, info.get("gpus", 0))
    where = f"{info['cores']} cores ({info.get('cpu', '?')}), node report"
    got["tuning_file"] = node_tuning(out, counts, where, got["ps"])
    report = {
        "machine": info,
        "binding": r.binding,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "budget": args.budget,
        "seconds": time.monotonic() - t0,
        "rank_counts": counts,
        "steps": args.steps,
        "quick": args.quick,
        **got,
        "runs": r.runs,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "summary.md").write_text(summarize(report))
    plot(report, out / "ratios.png")
    print(f"node report in {out}/ (summary.md first), {report['seconds']:.0f} s")
    return 0 if all(x["status"] == "ok" for x in r.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
