"""The batches of a framework's data loader under --ft: every sample once an epoch in committed
steps, in a fixed number of steps.

An epoch is DistributedSampler's permutation (torch.randperm seeded with seed + epoch, or the
dataset's order), cut into steps of R * B samples (R: the replicas the run was started with, B:
the batch size per worker), so an epoch has the steps it has without failures, whoever is away:
the framework's own counts (batches per epoch, a schedule over steps, validation every N
batches) stay exact. A step's slice is split over the workers alive in it, worker i of n taking
every n-th sample from the i-th: with every replica alive that is exactly DistributedSampler's
and the DataLoader's batch for rank i; while replicas are away each live worker takes up to
ceil(R / n) * B samples (the same global batch: the same gradient, more memory per worker).

A loader's workers prefetch batches planned for the membership of the moment; a step that
runs at another membership (or a batch planned for a step that was redone) is loaded again by
the framework's part (`fix()` says which samples), so a batch is always the one its step needs.
Must never decide a step's fate, and never import the supervisor.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch.utils.data import Sampler

Plan = Tuple[int, int, bool]  # (live workers, this worker's index, whether its share was empty)


class StepBatchSampler(Sampler):
    """A batch sampler over `size` samples (see the module's docstring). `position()` is where
    the framework's loop is when it makes an iterator: (epoch, steps of it done); `live()` is
    (workers alive in the current step, this worker's index among them)."""

    def __init__(self, size: int, batch_size: int, replicas: int, shuffle: bool, seed: int, drop_last: bool,
                 position: Callable[[], Tuple[int, int]], live: Callable[[], Tuple[int, int]]) -> None:
        self.size, self.batch_size, self.replicas = size, batch_size, replicas
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.position, self.live = position, live
        self.per_step = replicas * batch_size
        self.steps = size // self.per_step if drop_last else math.ceil(size / self.per_step)
        self.plans: Dict[Tuple[int, int], Plan] = {}  # what the current iterator gave for (epoch, step)
        self._orders: Dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.steps

    def order(self, epoch: int) -> torch.Tensor:
        found = self._orders.get(epoch)
        if found is None:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                found = torch.randperm(self.size, generator=g)
            else:
                found = torch.arange(self.size)
            self._orders = {epoch: found}
        return found

    def share(self, epoch: int, step: int, workers: int, index: int) -> List[int]:
        """Worker `index` of `workers`' samples of step `step` of `epoch` (maybe none: a short last step)."""
        lo = step * self.per_step
        return self.order(epoch)[lo + index:min(self.size, lo + self.per_step):workers].tolist()

    def __iter__(self) -> Iterator[List[int]]:
        epoch, start = self.position()
        self.plans = {}
        return self._batches(epoch, start)

    def _batches(self, epoch: int, start: int) -> Iterator[List[int]]:
        for step in range(start, self.steps):
            workers, index = self.live()
            indices = self.share(epoch, step, workers, index)
            self.plans[(epoch, step)] = (workers, index, not indices)
            # A worker with no share still gives a batch (every worker takes part in a step): one
            # sample of the step's, which fix() turns into an empty batch before it is trained on.
            yield indices or self.share(epoch, step, 1, 0)[:1]

    def fix(self, epoch: int, step: int) -> Tuple[bool, List[int]]:
        """(whether the batch the loader gave for this step must be replaced, the samples it must
        hold: none for an empty batch) at the current membership."""
        workers, index = self.live()
        plan = self.plans.get((epoch, step))
        indices = self.share(epoch, step, workers, index)
        if plan == (workers, index, False) and indices:
            return False, indices
        return True, indices


def empty_like(batch: Any) -> Any:
    """A batch of no samples with `batch`'s structure (a worker with no share of a short last step)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, batch)
