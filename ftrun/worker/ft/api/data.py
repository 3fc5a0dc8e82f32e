"""ft.DataLoader and ft.epochs(): a script's own data pipeline under --ft, every sample of an
epoch trained once in committed steps, whatever fails.

An epoch is a permutation of the dataset (DistributedSampler's: torch.randperm seeded with
seed + epoch, or the dataset's order). The run consumes it from a position that advances by
the samples of every step a replica takes; a step's global batch is the next `n * B` samples
(n: the data-parallel workers alive in the step, B: batch_size), and worker i of n takes
every n-th of them from the i-th, which is exactly what DistributedSampler and a DataLoader
give rank i when nothing fails. A discarded step leaves the position where it was, so the
same samples come again (the same batch, when the membership is the same); a replica that
is away leaves its share to the live ones (the global batch shrinks, the epoch takes more
steps); no worker ever gets more than B samples. The position is registered state: it
travels in heals and checkpoints with the model. The last step of an epoch splits what is
left as evenly as it goes (no sample repeated, unlike DistributedSampler's padding).

Batches are loaded by a torch DataLoader (workers, pinned memory, prefetch, collate) from a
plan of the steps ahead; a batch planned for another position or membership is never
used: the plan restarts from the current one.
Must never decide a step's fate (opt.step() does), and never import the supervisor.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from ftrun.worker import settings
from ftrun.worker.ft.api import data_checks, stream_sources
from ftrun.worker.ft.api.stream import Stream
from ftrun.worker.ft.manager import Manager, manager

Plan = Tuple[int, int, int, int]  # (epoch, position, workers, this worker's index)


def share(take: int, workers: int, index: int) -> Tuple[int, int]:
    """(first offset, count) of worker `index`'s samples among `take` (every workers-th one)."""
    return index, max(0, math.ceil((take - index) / workers))


class _Tagged(Dataset):
    """The dataset, asked for (plan, index): each sample comes back with the plan it was loaded for."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: Tuple[Plan, int]) -> Tuple[Plan, Any]:
        plan, index = item
        return plan, self.dataset[index]


class _Collate:
    """The user's collate_fn over the samples, with the batch's plan kept beside it."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, items: List[Tuple[Plan, Any]]) -> Tuple[Plan, Any]:
        return items[0][0], self.collate([sample for _, sample in items])


class _PlanSampler:
    """The batches a worker will be given from a plan on, were every step to commit at the
    current membership: what the loader's workers may prefetch."""

    def __init__(self, loader: "DataLoader", start: Plan) -> None:
        self.loader, self.start = loader, start

    def __iter__(self) -> Iterator[List[Tuple[Plan, int]]]:
        epoch, pos, workers, index = self.start
        order = self.loader.order(epoch)
        while True:
            take = self.loader.take(pos, workers)
            if take == 0:
                return
            first, count = share(take, workers, index)
            if count:
                plan = (epoch, pos, workers, index)
                # The slice's tolist(): iterating the tensor itself makes a tensor per index (about
                # 95 us a batch of 32, in the main process), and a tolist() of the whole order would
                # build a list of every index at each new pass
                yield [(plan, i) for i in order[pos + first:pos + take:workers].tolist()]
            pos += take


class DataLoader(TorchDataLoader):
    """torch's DataLoader for --ft (a torch.utils.data.DataLoader: isinstance holds): this
    replica's batches from the run's current position, every sample of an epoch trained once in
    committed steps whatever fails. `batch_size` is per worker; `shuffle` (default False) and
    `seed` (default 0) are DistributedSampler's, or taken, with its drop_last, from the script's
    own `sampler=DistributedSampler(...)`, so that `DataLoader(ds, sampler=DistributedSampler(ds))`
    ports as `ft.DataLoader(ds, sampler=DistributedSampler(ds))`; a `seed` given beside it wins.
    Epoch e is ordered as the sampler after set_epoch(e), e counting from 0 in ft.epochs(): a
    script that called set_epoch(1..N) passes seed=1 (the sampler's seed plus one) to train the
    same order. Every other DataLoader argument (num_workers, pin_memory, collate_fn,
    prefetch_factor, persistent_workers, ...) works. Said in one line: an empty dataset (the run
    stops), workers whose datasets differ in length or in a Subset's indices (the run stops before
    its first step: an unseeded random_split), a shuffle or seed unlike the one of a DistributedSampler the script
    built over the dataset (said once, the run goes on).

    Over a stream (an IterableDataset, a list of a stream's shards, a Hugging Face streaming
    dataset, or a loader with state_dict() and load_state_dict(), as torchdata's
    StatefulDataLoader, given in place of the dataset) it is a StreamDataLoader: each replica reads
    its own shard, and every replica holds every shard's position (ft/api/stream.py)."""

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> "DataLoader":
        if cls is DataLoader and stream_sources.is_stream(dataset):
            return super().__new__(StreamDataLoader)
        return super().__new__(cls)

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: Optional[bool] = None,
                 seed: Optional[int] = None, drop_last: Optional[bool] = None, sampler: Any = None,
                 **kwargs: Any) -> None:
        # torch's DataLoader.__init__ is not called: an inner one (self._loader) loads the plan
        # ahead; what a script reads of a DataLoader (dataset, batch_size, sampler, drop_last) is
        # set here, and the rest (num_workers, pin_memory...) is the inner one's (__getattr__).
        mgr = manager()
        self._refuse(mgr, dataset, batch_size, seed, sampler, kwargs)
        self.mgr: Manager = mgr
        self.dataset = dataset
        self.batch_size = int(batch_size)
        # The script's own DistributedSampler, kept so that its set_epoch() calls still work (they
        # change nothing here: the order follows the run's epoch).
        self.sampler = sampler
        self._said_epoch = False
        self.shuffle, self.seed, self.drop_last, note = data_checks.from_sampler(sampler, shuffle, seed, drop_last)
        if note is None and sampler is None:
            note = data_checks.unlike_sampler(dataset, self.shuffle, self.seed)
        if note:
            data_checks.say(note)
        self.collate_fn = kwargs.pop("collate_fn", None) or torch.utils.data.default_collate
        self.size = len(dataset)
        if self.size == 0:
            mgr._misused(f"ft.DataLoader: the dataset ({type(dataset).__name__}) is empty, 0 samples: the loop would "
                         f"train nothing; check what loads it (a path, a filter, a split)")
        self.fingerprint = data_checks.fingerprint(dataset)
        why = data_checks.first_workers(mgr.store, mgr.fx.store_errors, len(mgr.loaders), mgr.rank, self.size,
                                        self.fingerprint)
        if why:
            mgr._misused(why)
        # The run's position: the epoch, and the samples of it consumed by the steps this
        # replica took (`pos`); `cursor` is where the open step's draws have got to.
        self.epoch = 0
        self.pos = 0
        self.cursor: Tuple[int, int] = (0, 0)
        self._serial = -1     # the step whose draws `cursor` counts (mgr.step_serial)
        # (epoch, pos, samples) of the open step's first draw, and of a step some of whose
        # optimizer steps were committed (several ft.Optimizers): it is handed out again with the
        # same samples, split over the replicas there are now (a heal carries it).
        self._drawn: Optional[Tuple[int, int, int]] = None
        self.held: Optional[Tuple[int, int, int]] = None
        self._orders: Dict[int, Any] = {}
        # torch's DataLoader does the loading (workers, prefetch, pinned memory, collate) over the
        # plan ahead; one for the whole run, so persistent workers persist.
        self._sampler = _PlanSampler(self, (0, 0, 1, 0))
        self._loader = TorchDataLoader(_Tagged(dataset), batch_sampler=self._sampler,
                                       collate_fn=_Collate(self.collate_fn), **kwargs)
        self._inner: Optional[Iterator[Tuple[Plan, Any]]] = None
        self._inner_next: Optional[Plan] = None  # the plan the inner loader gives next
        self._template: Any = None  # an empty batch of the dataset's structure (see _empty)
        self._yielded = 0       # batches the current pass gave (len())
        self.index = len(mgr.loaders)
        mgr.loaders.append(self)
        mgr.register_state(f"ftrun.data.{self.index}", self)
        mgr.step_listeners.append(self._took_step)

    @staticmethod
    def _refuse(mgr: Manager, dataset: Any, batch_size: Any, seed: Any, sampler: Any,
                kwargs: Dict[str, Any]) -> None:
        if isinstance(dataset, TorchDataLoader):
            mgr._misused(f"ft.DataLoader({type(dataset).__name__}(...)): a loader given in place of the dataset must "
                         f"say where it is (state_dict() and load_state_dict(), as torchdata's StatefulDataLoader): "
                         f"give ft.DataLoader the dataset and the loader's arguments, or a StatefulDataLoader")
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            mgr._misused(f"ft.DataLoader needs a dataset with __len__ and __getitem__ (map-style) or a stream (an "
                         f"IterableDataset), not {type(dataset).__name__}: wrap it in one")
        if sampler is not None and not isinstance(sampler, data_checks.DistributedSampler):
            mgr._misused(f"ft.DataLoader(sampler={type(sampler).__name__}(...)): ft.DataLoader orders an epoch as "
                         f"DistributedSampler does (shuffle=, seed=, or a DistributedSampler's), split over the live "
                         f"replicas: give it a DistributedSampler, or shuffle= and seed=, and drop this sampler")
        if kwargs.get("batch_sampler") is not None:
            mgr._misused("ft.DataLoader(batch_sampler=...): ft.DataLoader makes the batches itself (batch_size= per "
                         "worker, split over the live replicas): drop batch_sampler=")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            mgr._misused(f"ft.DataLoader(batch_size={batch_size!r}): the samples per worker and step, a whole "
                         f"number from 1 (the run's batch is that times the live workers)")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            mgr._misused(f"ft.DataLoader(seed={seed!r}): a whole number (DistributedSampler's seed)")

    # ------------------------------------------------------------ the order and the plan
    def order(self, epoch: int) -> Any:
        """The epoch's permutation, as DistributedSampler draws it."""
        found = self._orders.get(epoch)
        if found is None:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                found = torch.randperm(self.size, generator=g)
            else:
                found = torch.arange(self.size)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}  # a redo may go back one
            self._orders[epoch] = found
        return found

    def take(self, pos: int, workers: int) -> int:
        """Samples of the global batch at `pos` with `workers` live workers: n * B, or what is left
        at the end. When the next step would be left fewer samples than workers, this one takes
        fewer, so that every worker gets one in the last (batch_size 2 or more)."""
        left = self.size - pos
        full = workers * self.batch_size
        if left <= 0 or (self.drop_last and left < full):
            return 0
        if left <= full:
            return left
        if 0 < left - full < workers and self.batch_size > 1:
            return left - workers
        return full

    def _workers(self) -> Tuple[int, int]:
        """(data-parallel workers in this step, this worker's index): every worker of every live
        replica, since a sharded replica's workers are data parallel too."""
        k = self.mgr.k
        return self.mgr.num_replicas * k, self.mgr.replica_index * k + self.mgr.shard

    def __len__(self) -> int:
        """Batches this worker's current pass gives: those it gave, and those left from where the
        run is at the current membership (exact at the epoch's last batch, whatever changed)."""
        _, pos = self.cursor
        workers, _ = self._workers()
        left = 0
        while True:
            take = self.take(pos, workers)
            if take == 0:
                return self._yielded + left
            left += 1
            pos += take

    # ------------------------------------------------------------ state (heals, checkpoints)
    def state_dict(self) -> Dict[str, Any]:
        sd = {"epoch": self.epoch, "pos": self.pos, "size": self.size, "seed": self.seed,
              "shuffle": self.shuffle, "batch_size": self.batch_size, "fingerprint": self.fingerprint}
        held = self._partial()
        if held is not None:  # only inside a step (a heal's), never at a checkpoint's round boundary
            sd["held"] = list(held)
        return sd

    def _partial(self) -> Optional[Tuple[int, int, int]]:
        """The draw of the open step when some of its optimizer steps are committed, else None."""
        if self.mgr.member.iteration.done <= 0:
            return None
        return self.held or self._drawn

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        why = data_checks.differs(self.index, (int(sd.get("size", self.size)), sd.get("fingerprint")),
                                  (self.size, self.fingerprint))
        if why:
            self.mgr._misused(why)
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])
        self.cursor = (self.epoch, self.pos)
        self.held = tuple(sd["held"]) if sd.get("held") else None  # type: ignore[assignment]
        self._drawn = None
        self._serial = -1
        self._drop_inner()

    def _took_step(self) -> None:
        """This member took a step: what it drew for it is consumed."""
        if self._serial == self.mgr.step_serial:
            self.epoch, self.pos = self.cursor
            self.held = None

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> "DataLoader":
        self._yielded = 0
        epochs = self.mgr.epochs_state
        if self.sampler is not None and not self._said_epoch and epochs is not None and epochs.looping:
            note = data_checks.unlike_set_epoch(self.sampler, self.seed, epochs.epoch)
            if note:
                self._said_epoch = True
                data_checks.say(note)
        return self

    def on_epoch(self, epoch: int) -> None:
        """ft.epochs() moved on to `epoch`: begin it, unless the open step still holds draws of the
        last one (a step that spans the two: a redo must give the end of the last one again)."""
        if self._serial == self.mgr.step_serial and self.cursor != (self.epoch, self.pos):
            return
        if epoch != self.epoch:
            self.epoch, self.pos = epoch, 0
            self.cursor = (epoch, 0)
            self._yielded = 0

    def __next__(self) -> Any:
        mgr = self.mgr
        mgr.begin_step()
        if self._serial != mgr.step_serial:  # a new step (or a redo): draw from the committed position
            self._serial = mgr.step_serial
            self.cursor = (self.epoch, self.pos)
        epoch, pos = self.cursor
        workers, index = self._workers()
        held = self._partial()
        if held is not None and held[:2] == (epoch, pos):
            # Some of this step's optimizer steps are committed: its other ones train on the same
            # samples, however many replicas share them now.
            self.held = held
            first, count = share(held[2], workers, index)
            self.cursor = (epoch, pos + held[2])
            self._yielded += 1
            if count == 0:
                return self._empty()
            indices = self.order(epoch)[pos + first:pos + held[2]:workers].tolist()
            return self.collate_fn([self.dataset[i] for i in indices])
        take = self.take(pos, workers)
        if take == 0:  # the end of the epoch the cursor is in
            epochs = mgr.epochs_state
            if epochs is not None and epochs.looping and epochs.epoch > epoch:
                epoch = epochs.epoch  # on to ft.epochs()'s (a redo gave the last one's end again)
            elif (epochs is None or not epochs.looping) and self._yielded == 0:
                epoch += 1  # iter() again in an ft.steps() loop: the next epoch
            else:
                raise StopIteration
            pos, self._yielded = 0, 0
            if self.cursor == (self.epoch, self.pos):  # the open step drew nothing yet
                self.epoch, self.pos = epoch, 0
            take = self.take(0, workers)
            if take == 0:
                raise StopIteration  # an epoch too short for one step (drop_last)
        plan = (epoch, pos, workers, index)
        if pos == self.pos and epoch == self.epoch:
            self._drawn = (epoch, pos, take)
        self.cursor = (epoch, pos + take)
        self._yielded += 1
        if share(take, workers, index)[1] == 0:
            return self._empty()
        return self._fetch(plan)

    def _fetch(self, plan: Plan) -> Any:
        if self._inner is None or self._inner_next != plan:
            self._sampler.start = plan  # what the workers prefetch from now on
            self._inner = iter(self._loader)
        got, batch = next(self._inner)
        if got != plan:  # never: the plan ahead is what this worker draws as long as nothing changes
            raise RuntimeError(f"ft.DataLoader: loaded a batch for {got}, expected {plan}")
        self._inner_next = self._following(plan)
        if self._template is None:
            self._template = tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, batch)
        return batch

    def _following(self, plan: Plan) -> Optional[Plan]:
        """The plan of this worker's next non-empty batch after `plan`, were nothing to change."""
        epoch, pos, workers, index = plan
        while True:
            pos += self.take(pos, workers)
            take = self.take(pos, workers)
            if take == 0:
                return None
            if share(take, workers, index)[1]:
                return epoch, pos, workers, index

    def _drop_inner(self) -> None:
        """Forget what the loader's workers prefetched (another position or membership)."""
        self._inner = None
        self._inner_next = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this loader lacks: torch's DataLoader attributes, the inner one's.
        inner = self.__dict__.get("_loader")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def _empty(self) -> Any:
        """A batch of no samples, of the dataset's structure: the last step of an epoch left fewer
        samples than workers (batch_size 1, or the membership grew)."""
        if self._template is None:
            batch = self.collate_fn([self.dataset[0]])
            self._template = tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, batch)
        return self._template


class StreamDataLoader(DataLoader):
    """ft.DataLoader over a stream (what ft.DataLoader(stream, ...) makes): a torch DataLoader whose
    batches are this replica's shard's, from the position every replica holds (ft/api/stream.py,
    stream_sources.py for which shard of which stream). Takes the DataLoader's arguments but
    shuffle, sampler, batch_sampler and seed (a stream orders itself: its own shuffle); a
    StatefulDataLoader takes none (it has its own). Has no len()."""

    def __init__(self, dataset: Any, batch_size: Optional[int] = 1, shuffle: Optional[bool] = None,
                 seed: Optional[int] = None, drop_last: Optional[bool] = None, sampler: Any = None,
                 **kwargs: Any) -> None:
        mgr = manager()
        given = [name for name, v in (("shuffle", shuffle), ("seed", seed), ("sampler", sampler),
                                      ("batch_sampler", kwargs.get("batch_sampler"))) if v]
        if given:
            mgr._misused(f"ft.DataLoader over a stream ({type(dataset).__name__}) takes no {given[0]}=: a stream is "
                         f"read in its own order, each replica its own shard; shuffle the stream itself "
                         f"(a Hugging Face stream's .shuffle(seed=..., buffer_size=...)) and drop {given[0]}=")
        if stream_sources.shard_list(dataset) and not stream_sources.given_loaders(dataset) and \
                any(stream_sources.stateful_loader(x) for x in dataset):
            mgr._misused("ft.DataLoader([...]): a list of shards is of IterableDatasets or of stateful loaders, not "
                         "both: give every shard as one kind")
        loader = stream_sources.given_loaders(dataset)
        if loader and (kwargs or drop_last is not None or batch_size != 1):
            mgr._misused(f"ft.DataLoader({type(dataset).__name__}(...), ...): a loader given in place of the dataset "
                         f"reads as it was built: drop the other arguments (give them to the loader)")
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or
                                       batch_size < 1):
            mgr._misused(f"ft.DataLoader(batch_size={batch_size!r}): the samples per worker and step, a whole number "
                         f"from 1 (or None: the stream gives whole batches)")
        if mgr.k > 1:
            mgr._misused(f"ft.DataLoader over a stream is not supported with --replica-size {mgr.k} yet: use "
                         f"--replica-size 1, or a map-style dataset")
        if drop_last is not None:
            kwargs["drop_last"] = drop_last
        s = settings.current()
        ids = max(1, (s.world_size or 1) // mgr.k)
        source = stream_sources.source_for(dataset, batch_size, dict(kwargs), ids, max(1, ids - s.spares))
        self.mgr = mgr
        first = dataset[0] if stream_sources.shard_list(dataset) else dataset
        self.dataset = dataset.dataset if stream_sources.stateful_loader(dataset) else dataset
        self.batch_size = getattr(first, "batch_size", batch_size) if loader else batch_size
        self.drop_last = bool(kwargs.get("drop_last", False))
        self.sampler = None
        self.collate_fn = kwargs.get("collate_fn") or torch.utils.data.default_collate
        self.stream = Stream(mgr, source)

    def __iter__(self) -> "StreamDataLoader":
        self.stream.start()
        return self

    def __next__(self) -> Any:
        return self.stream.next_batch()

    def __len__(self) -> int:
        raise TypeError("ft.DataLoader over a stream has no len(): a stream's length is known when it ends")

    def on_epoch(self, epoch: int) -> None:
        pass  # the stream itself is in the manager's loaders (Stream.on_epoch)

    def state_dict(self) -> Dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.stream.load_state_dict(sd)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)


class TrainingEpochs:
    """ft.epochs(): the run's training epoch (not a quorum's), registered state like the model's."""

    def __init__(self, mgr: Manager) -> None:
        self.mgr = mgr
        self.epoch = 0
        self.looping = False
        mgr.register_state("ftrun.epochs", self)

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.epoch = int(sd["epoch"])

    def run(self, total: int) -> Iterator[int]:
        """Yield the run's epochs from the current one (a restarted replica learns it in its heal,
        a resumed run from the checkpoint) until `total`; then end the loop on every replica."""
        mgr = self.mgr
        mgr.looping = self.looping = True
        mgr.begin_step()  # a restarted replica joins and heals first: it learns the run's epoch
        while not mgr.finished and self.epoch < total:
            for loader in mgr.loaders:
                loader.on_epoch(self.epoch)
            yield self.epoch
            self.epoch += 1
        self.looping = False
        mgr.finish_loop()
