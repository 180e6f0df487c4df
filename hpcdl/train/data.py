"""Datasets that need no download, and the per-rank order of their samples.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), cut
  once into a stratified training split (80%) and a held-out test split (20%) with a fixed
  seed, so every run and every rank sees the same split.
- ``corpus``: the Python documentation topics that ship with CPython
  (``pydoc_data.topics``, about 465 kB of English text), as bytes; the first 90% train a
  byte-level model and the last 10% measure it. A sample is a window of ``block_size + 1``
  bytes (input and next-byte target), windows side by side without overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Split", "digits", "digits_arrays", "digits_split", "corpus", "ShardedOrder", "eval_indices"]

_DIGITS_TRAIN = 1437  # of 1797 samples; the other 360 are held out


@dataclass
class Split:
    """Inputs and targets of one split, indexable by a tensor of sample indices."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]

    def to(self, device: torch.device) -> Split:
        """The split with its tensors on ``device`` (small: moved once, not per batch)."""
        return Split(self.x.to(device), self.y.to(device))


def digits_arrays() -> tuple:
    """scikit-learn's digits as ``(data, target)`` numpy arrays (1797 x 64 pixel values
    0-16, and labels), read from the file scikit-learn ships without importing it (an
    import that costs each rank about 1.5 s of start-up); ``load_digits`` where the file
    is not found."""
    import gzip
    import importlib.util
    import os

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else ""
    if not os.path.isfile(path):
        from sklearn.datasets import load_digits

        data = load_digits()
        return data.data, data.target
    with gzip.open(path, "rt") as f:
        raw = np.loadtxt(f, delimiter=",")
    return raw[:, :-1], raw[:, -1].astype(int)


def digits_split() -> tuple[list[int], list[int]]:
    """The fixed split of the digits: training sample indices in training order, then the
    held-out ones. It is scikit-learn's ``train_test_split(test_size=0.2,
    stratify=target, random_state=0)``, computed once and shipped as ``digits_split.txt``
    so that every run, rank and version of scikit-learn sees the same split."""
    import os

    with open(os.path.join(os.path.dirname(__file__), "digits_split.txt")) as f:
        idx = [int(v) for line in f if not line.startswith("#") for v in line.split()]
    return idx[:_DIGITS_TRAIN], idx[_DIGITS_TRAIN:]


def digits(image: bool) -> tuple[Split, Split]:
    """Training and test split of scikit-learn's digits, scaled to [0, 1]; ``image``
    shapes a sample as 1x8x8 (for a CNN), else as 64 features."""
    data, target = digits_arrays()
    train, test = digits_split()

    def split(idx: list[int]) -> Split:
        xt = torch.tensor(data[idx], dtype=torch.float32) / 16.0
        return Split(xt.view(-1, 1, 8, 8) if image else xt, torch.tensor(target[idx], dtype=torch.long))

    return split(train), split(test)


def corpus_bytes() -> bytes:
    """The Python documentation topics text shipped with CPython, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class _Windows:
    """Non-overlapping windows of ``block + 1`` bytes: input = first ``block``, target = last."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block
        self.n = (len(data) - 1) // block

    def __len__(self) -> int:
        return self.n

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = idx * self.block
        pos = starts[:, None] + torch.arange(self.block + 1)
        w = self.data[pos].long()
        return w[:, :-1], w[:, 1:]

    def to(self, device: torch.device) -> _Windows:
        return _Windows(self.data.to(device), self.block)


def corpus(block_size: int) -> tuple[_Windows, _Windows]:
    raw = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8)
    cut = int(len(raw) * 0.9)
    train, test = _Windows(raw[:cut], block_size), _Windows(raw[cut:], block_size)
    if len(train) < 1 or len(test) < 1:
        raise ValueError(f"block_size={block_size} leaves no sample in the corpus")
    return train, test


class ShardedOrder:
    """Which samples rank ``rank`` of ``world`` trains on in each epoch.

    The permutation of an epoch depends only on ``(seed, epoch)``, so it is the same on every
    rank and differs between epochs. It is padded by wrapping around to a multiple of
    ``world`` (as torch's ``DistributedSampler`` does), so every rank has the same number of
    samples and therefore of batches: the last batch may be short, but it is equally short on
    every rank, and no rank waits for a gradient that another never sends.
    """

    def __init__(self, n: int, world: int, rank: int, seed: int, batch_size: int) -> None:
        self.n, self.world, self.rank, self.seed, self.batch_size = n, world, rank, seed, batch_size
        self.per_rank = math.ceil(n / world)

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def indices(self, epoch: int) -> torch.Tensor:
        perm = self.permutation(epoch)
        total = self.per_rank * self.world
        if total > self.n:  # wrap around (more than once only when there are fewer samples than ranks)
            perm = perm.repeat(math.ceil(total / self.n))[:total]
        return perm[self.rank : total : self.world]

    def batches(self, epoch: int) -> list[torch.Tensor]:
        return list(torch.split(self.indices(epoch), self.batch_size))

    def batches_per_epoch(self) -> int:
        return math.ceil(self.per_rank / self.batch_size)


def eval_indices(n: int, world: int, rank: int) -> torch.Tensor:
    """This rank's share of an evaluation split: every sample exactly once over the ranks."""
    return torch.arange(rank, n, world)
