"""What a run leaves in its directory: ``config.json``, ``ranks.json``, ``metrics.jsonl``,
``summary.json`` and ``curves.png`` (written by rank 0)."""

from __future__ import annotations

import json
import os
from typing import Any

from collectives.cli import replace_file

__all__ = ["Metrics", "write_json", "plot"]


def write_json(path: str, obj: Any) -> None:
    """``obj`` as JSON into ``path``, whole (:func:`collectives.cli.replace_file`); a NaN or
    an infinity raises, as JSON has no word for them."""

    def write(fh: Any) -> None:
        json.dump(obj, fh, indent=1, allow_nan=False)
        fh.write("\n")

    replace_file(path, write)


class Metrics:
    """Append-only JSON lines, one record per optimizer step or evaluation."""

    def __init__(self, path: str, resume_step: int | None) -> None:
        self.path = path
        if resume_step is not None and os.path.exists(path):
            # records made after the checkpoint by the run that stopped happen again: its
            # training steps past it, and the evaluation that follows a checkpoint at an epoch's end
            with open(path) as fh:
                recs = [json.loads(line) for line in fh if line.strip()]
            keep = [
                json.dumps(r) + "\n"
                for r in recs
                if r["step"] < resume_step or (r["step"] == resume_step and r["kind"] == "train")
            ]
            with open(path, "w") as fh:
                fh.writelines(keep)
        elif resume_step is None and os.path.exists(path):
            os.unlink(path)
        self.fh = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self.fh.write(json.dumps(record, allow_nan=False) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def plot(metrics_path: str, png_path: str, title: str) -> None:
    """Training loss per step, evaluation loss and accuracy (digits) or perplexity (gpt)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, label="train (mean over ranks)")
    if evals:
        left.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="held-out")
    left.set_xlabel("optimizer step")
    left.set_ylabel("cross-entropy loss")
    left.set_yscale("log")
    left.legend()
    key = "accuracy" if evals and "accuracy" in evals[0] else "perplexity"
    if evals:
        right.plot([r["step"] for r in evals], [r[key] for r in evals], "o-", color="C1")
    right.set_xlabel("optimizer step")
    right.set_ylabel(f"held-out {key}")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
