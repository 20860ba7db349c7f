"""What a resumed run must reproduce besides the weights: the data order and the learning rate.

`EpochSampler` draws each epoch's permutation from (seed, epoch), so a resumed run sees the same
batches; `lr_lambda` is the warm-up + cosine schedule (as a LambdaLR factor, step -> multiplier), over
steps or over the training time budget.

Deliberately not here: checkpoints (checkpoints.py), the loop (trainer.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["EpochSampler", "Records", "lr_lambda"]


class EpochSampler(Sampler[int]):
    """A permutation of range(n) drawn from (seed, epoch): the same order on resume."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class Records(Dataset):
    """A datasets.Dataset (or list) as a torch Dataset indexed by any int-like."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return self.ds[int(i)]


def lr_lambda(warmup: int, total: int, min_ratio: float, time_progress: Callable[[], float] | None = None):
    """Linear warm-up over `warmup` steps, then a cosine from 1 to `min_ratio` over the rest of `total`
    steps. With `time_progress` (a function returning the fraction of the training time budget used),
    the cosine follows whichever of steps and time is further along: a run its clock stops early
    still anneals to the floor instead of stopping at a mid-schedule learning rate."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        if time_progress is not None:
            progress = max(progress, time_progress())
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f
