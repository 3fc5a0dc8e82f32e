"""What ft.DataLoader checks of a port, so that it cannot go quietly wrong, and the script's own
DistributedSampler under --ft.

- The dataset's fingerprint: its length, and a hash of the indices of every Subset in it (what
  random_split makes), found through the datasets that wrap it (a transform over a split). Every
  worker compares it, as it builds the loader, with the first worker's, through one small key of
  the run's store (replicas that hold different samples, an unseeded random_split where every
  worker draws its own split, stop the run in one line before any step, even where no heal would
  compare them: the workers of one sharded replica, a replica that never heals). It also travels
  with the loader's position (registered state): a replica that receives the position in a heal,
  or a run resumed from a checkpoint, compares it with its own.
- The script's `sampler=DistributedSampler(...)`: ft.DataLoader takes its shuffle, seed and
  drop_last, so the port of `DataLoader(ds, sampler=DistributedSampler(ds))` is one word (a
  seed= given beside it wins: a script whose set_epoch counted from 1 passes its seed plus one).
- The script's set_epoch() on that sampler, counting from another start than ft.epochs()
  (minGPT's set_epoch(1..N)): the order is not the one the script trained; said once, with the
  seed that gives it.
- A DistributedSampler built in the script over the loader's dataset but not given to it,
  whose shuffle or seed is not the loader's: before the port the script trained in that order;
  said once.
- `DistributedSampler(dataset)` with no default group (a script that never called
  init_process_group(), or a restarted replica, where ftrun skips the call): it takes
  num_replicas=WORLD_SIZE and rank=RANK, what the default group of all workers gives on a first
  incarnation, instead of failing. An evaluation loader so works on every replica. The patch is
  listed in ftrun/worker/patches.py.
Never imports the supervisor.
"""

from __future__ import annotations

import hashlib
import sys
import weakref
from typing import Any, List, Optional, Tuple

import torch
from torch.utils.data import ConcatDataset, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from ftrun import keys
from ftrun.worker import patches, settings

SPLIT_FIX = ("the likely cause is an unseeded split: random_split(..., generator=torch.Generator().manual_seed(0)), "
             "or any random choice of samples seeded the same on every worker")

_built: "weakref.WeakSet[DistributedSampler]" = weakref.WeakSet()  # the script's DistributedSamplers


_WRAPPED = 64  # a list or tuple attribute longer than this is data, not datasets to look into


def _inner(d: Any) -> List[Any]:
    """The datasets `d` holds: a Subset's, a ConcatDataset's, or those among the attributes of
    any other dataset (a wrapper that transforms a split's samples holds the split)."""
    if isinstance(d, Subset):
        return [d.dataset]
    if isinstance(d, ConcatDataset):
        return list(d.datasets)
    found = []
    for value in getattr(d, "__dict__", {}).values():
        if isinstance(value, Dataset):
            found.append(value)
        elif isinstance(value, (list, tuple)) and 0 < len(value) <= _WRAPPED and \
                all(isinstance(v, Dataset) for v in value):
            found.extend(value)
    return found


def fingerprint(dataset: Any) -> Optional[str]:
    """A cheap hash of which samples `dataset` holds: the indices of every Subset in it (nested,
    in a ConcatDataset, or held by a dataset that wraps it); None for a dataset without one (its
    length says what it can)."""
    h = hashlib.blake2b(digest_size=8)
    found = False
    todo, seen = [dataset], set()
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        if isinstance(d, Subset):
            found = True
            h.update(torch.as_tensor(list(d.indices) if not torch.is_tensor(d.indices) else d.indices,
                                     dtype=torch.int64).numpy().tobytes())
            h.update(b"|")
        todo.extend(reversed(_inner(d)))
    return h.hexdigest() if found else None


def differs(index: int, theirs: Tuple[int, Optional[str]], mine: Tuple[int, Optional[str]],
            whose: str = "the run's position (from a peer, or the checkpoint) is in a dataset") -> Optional[str]:
    """Why this replica's dataset is not `whose` (by default the one the run's position belongs
    to), or None."""
    (size, fp), (my_size, my_fp) = theirs, mine
    if size != my_size:
        what = f"of {size} samples, this replica's has {my_size}"
    elif fp is not None and my_fp is not None and fp != my_fp:
        what = f"of {size} samples, and so is this replica's, but a Subset in it holds other samples"
    else:
        return None
    return (f"ft.DataLoader #{index}: {whose} {what}: every replica, and a run resumed from a checkpoint, "
            f"must load the same samples; {SPLIT_FIX}")


def first_workers(store: Any, store_errors: Tuple[type, ...], index: int, rank: int, size: int,
                  fp: Optional[str]) -> Optional[str]:
    """Why this worker's dataset for ft.DataLoader #`index` is not the one the run's first worker
    to build it holds, or None: one compare-and-set of a small key (the first writer's rank, size
    and fingerprint), so every worker of every replica is compared before its first step, heal or
    no heal. A store that is moving answers nothing: the heal's comparison still stands."""
    mine = f"{rank} {size} {fp or '-'}"
    try:
        first = store.compare_set(keys.dataset_key(index), "", mine).decode()
    except store_errors:
        return None
    if first == mine:
        return None
    r, their_size, their_fp = first.split()
    whose = f"rank {r}'s dataset is one" if int(r) != rank else "this rank's dataset before its restart was one"
    return differs(index, (int(their_size), None if their_fp == "-" else their_fp), (size, fp), whose)


def from_sampler(sampler: Any, shuffle: Optional[bool], seed: Optional[int],
                 drop_last: Optional[bool]) -> Tuple[bool, int, bool, Optional[str]]:
    """(shuffle, seed, drop_last, a line to say or None) for ft.DataLoader(sampler=...): the
    sampler's, but a seed given beside it (seed=1 for a script whose set_epoch counted from 1)."""
    if sampler is None:
        return bool(shuffle), 0 if seed is None else seed, bool(drop_last), None
    note = None
    if shuffle and not sampler.shuffle:
        note = ("ft.DataLoader(shuffle=True, sampler=DistributedSampler(..., shuffle=False)): the order is the "
                "sampler's, unshuffled (torch's DataLoader refuses the two together)")
    return (bool(sampler.shuffle), int(sampler.seed if seed is None else seed),
            bool(drop_last) or bool(sampler.drop_last), note)


def unlike_sampler(dataset: Any, shuffle: bool, seed: int) -> Optional[str]:
    """A line when the script built a DistributedSampler over `dataset` that orders it otherwise."""
    for s in list(_built):
        if s.dataset is dataset and (s.shuffle != shuffle or (shuffle and s.seed != seed)):
            was = f"shuffled with seed {s.seed}" if s.shuffle else "unshuffled"
            return (f"ft.DataLoader(shuffle={shuffle}{f', seed={seed}' if shuffle else ''}) over a dataset the "
                    f"script's DistributedSampler orders {was}: the port trains in another order than the "
                    f"script did; give the loader the sampler (sampler=...), whose order it then takes, or "
                    f"shuffle={s.shuffle}" + (f", seed={s.seed}" if s.shuffle else ""))
    return None


def unlike_set_epoch(sampler: Any, seed: int, epoch: int) -> Optional[str]:
    """A line when the script's set_epoch() on the sampler it gave the loader asks for another order
    than the loader's at ft.epochs()'s `epoch` (a script whose set_epoch counts from 1)."""
    if not sampler.shuffle or sampler.epoch == 0 or sampler.seed + sampler.epoch == seed + epoch:
        return None
    fix = sampler.seed + sampler.epoch - epoch
    return (f"ft.DataLoader: the script called its sampler's set_epoch({sampler.epoch}) in ft.epochs()'s epoch "
            f"{epoch} (ft.epochs() counts from 0): the loader orders epoch e with seed {seed} + e, the sampler "
            f"would have used {sampler.seed} + {sampler.epoch}; pass seed={fix} to ft.DataLoader to train the "
            f"order the script trained")


def say(line: str) -> None:
    """A note about the script's loader, from rank 0 only: every worker builds the same one."""
    s = settings.current()
    if s.rank in (0, None):
        sys.stderr.write(f"ftrun.ft: rank {s.rank_text}: {line}\n")
        sys.stderr.flush()


def install() -> None:
    """Patch DistributedSampler.__init__ in a --ft worker: fill num_replicas and rank from the
    worker's environment when there is no default group, and note each sampler the script builds."""
    real = DistributedSampler.__init__

    def __init__(self: DistributedSampler, dataset: Any, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, *args: Any, **kwargs: Any) -> None:
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                s = settings.current()
                num_replicas = s.world_size if num_replicas is None else num_replicas
                rank = s.rank if rank is None else rank
        real(self, dataset, num_replicas, rank, *args, **kwargs)
        _built.add(self)

    __init__.__wrapped__ = real  # type: ignore[attr-defined]
    patches.install("sampler", DistributedSampler, "__init__", __init__)
