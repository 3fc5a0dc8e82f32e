"""How one shard of a stream is read, and where it is: what ft.DataLoader over a stream
(ft/api/stream.py) builds for the shard a replica reads.

- A Hugging Face `datasets.IterableDataset` is split by ftrun itself (splittable): shard s of S
  is `split_dataset_by_node(stream, rank=s, world_size=S)` (any split the script made is replaced
  by this one), so any replica can read any shard. The same for a `StatefulDataLoader` over one:
  it is rebuilt over each shard with its own arguments.
- Any other `IterableDataset`, and a `StatefulDataLoader` over one, is read as the script built
  it (fixed: the script splits it, by RANK or otherwise, and only its replica can read it).
- A list of shards (IterableDatasets, or stateful loaders, one per shard, as many as the script
  likes) is splittable too: shard s is the list's s-th, read by whichever replica holds it.
- The Hugging Face Trainer's stream (`dispatched()`): what Accelerate's DDP gives process s of S
  by default (its dispatcher): the loader's batches s, s + S, s + 2S, ... of the one stream; any
  replica can read any shard (splittable), each reading the whole stream and keeping its own.
- A shard's position is its loader's state_dict(): torchdata's StatefulDataLoader (over the shard,
  when torchdata is installed, with its workers: the dataset's own state, e.g. the Hugging Face
  stream's shard index and offset, or batches it fast-forwards), else the count of batches read,
  which a reader resumes by reading and dropping them.
Must never communicate, never decide a step's fate, and never import the supervisor.
"""

from __future__ import annotations

import copy
import io
import json
import sys
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset

# The DataLoader arguments a StatefulDataLoader is rebuilt with over another shard of its stream.
_LOADER_ARGS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers", "pin_memory_device",
                "in_order", "snapshot_every_n_steps")


def encode(state: Any) -> bytes:
    """A reader's state as bytes: JSON where it goes there and back unchanged (most are: ints,
    strings, dicts), else torch.save (read back with weights_only=True)."""
    try:
        text = json.dumps(state, sort_keys=True)
        if json.loads(text) == state:
            return b"J" + text.encode()
    except (TypeError, ValueError):
        pass
    buf = io.BytesIO()
    torch.save(state, buf)
    return b"T" + buf.getvalue()


def decode(raw: bytes) -> Any:
    if raw[:1] == b"J":
        return json.loads(raw[1:].decode())
    return torch.load(io.BytesIO(raw[1:]), weights_only=True)


def hf_stream(obj: Any) -> bool:
    """`obj` is a Hugging Face datasets.IterableDataset (without importing datasets)."""
    mod = sys.modules.get("datasets")
    cls = getattr(mod, "IterableDataset", None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


def stateful_loader(obj: Any) -> bool:
    """`obj` is a data loader that says where it is (torchdata's StatefulDataLoader, or one like it)."""
    return isinstance(obj, TorchDataLoader) and callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def _one_stream(obj: Any) -> bool:
    return isinstance(obj, IterableDataset) or hf_stream(obj) or stateful_loader(obj)


def shard_list(obj: Any) -> bool:
    """`obj` is a list (or tuple) of a stream's shards: each an IterableDataset or a stateful loader."""
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(_one_stream(x) for x in obj)


def given_loaders(obj: Any) -> bool:
    """`obj` is a stateful loader, or a list of them: read as they were built (no loader arguments)."""
    return stateful_loader(obj) or (shard_list(obj) and all(stateful_loader(x) for x in obj))


def is_stream(obj: Any) -> bool:
    return _one_stream(obj) or shard_list(obj)


def _stateful_class() -> Optional[type]:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def split_hf(stream: Any, shard: int, shards: int, pass_no: int) -> Any:
    """Shard `shard` of a Hugging Face stream, as split_dataset_by_node makes it (a fresh object:
    loading a position into a stream changes where that object starts)."""
    from datasets.distributed import split_dataset_by_node

    whole = copy.copy(stream)
    if getattr(whole, "_distributed", None) is not None:
        whole._distributed = None  # the script's own split, by RANK: ftrun's replaces it
    part = split_dataset_by_node(whole, rank=shard, world_size=shards)
    if pass_no and hasattr(part, "set_epoch"):
        part.set_epoch(pass_no)  # its shuffling, reseeded each pass, as the usual set_epoch(epoch) does
    return part


class ShardReader:
    """One shard's batches for one pass, from a position; `position()` is where it is after the
    batches it gave."""

    def __init__(self, loader: Any, pos: Optional[bytes]) -> None:
        self.loader = loader
        self.stateful = stateful_loader(loader)
        self.count = 0
        state = decode(pos) if pos else None
        if self.stateful and state is not None:
            loader.load_state_dict(state)
        self.it = iter(loader)
        if not self.stateful and state is not None:
            for _ in range(int(state["batches"])):  # no state of its own: read up to where it was
                next(self.it)
            self.count = int(state["batches"])

    def next(self) -> Any:
        batch = next(self.it)
        self.count += 1
        return batch

    def position(self) -> bytes:
        return encode(self.loader.state_dict() if self.stateful else {"batches": self.count})


class StreamSource:
    """A stream ft.DataLoader reads: `count` shards, `splittable` or not, and how to open a shard."""

    def __init__(self, kind: str, count: int, splittable: bool, make: Callable[[int, int], Any],
                 first: Callable[[], Any]) -> None:
        self.kind, self.count, self.splittable = kind, count, splittable
        self._make = make  # (shard, pass) -> a loader over it
        self._first = first  # the stream's first batch (for its structure), from a fresh pass

    def open(self, shard: int, pass_no: int, pos: Optional[bytes]) -> ShardReader:
        return ShardReader(self._make(shard, pass_no), pos)

    def first_batch(self) -> Any:
        return self._first()


def source_for(data: Any, batch_size: Optional[int], kwargs: Dict[str, Any], replica_ids: int,
               training: int, split: bool = True) -> StreamSource:
    """The source of `data` (an IterableDataset, a Hugging Face stream, or a stateful loader) for a
    run of `replica_ids` replicas of which `training` train (the rest are spares). `split=False`:
    a Hugging Face stream is read as the script built it too (a framework's loader over a stream
    the script did not split: under torchrun every rank reads all of it)."""
    if shard_list(data):
        shards = list(data)
        if all(stateful_loader(x) for x in shards):
            return StreamSource("list-stateful", len(shards), True, lambda shard, pass_no: shards[shard],
                                lambda: _first(shards[0].dataset, shards[0].collate_fn, shards[0].batch_size))
        cls = _stateful_class() or TorchDataLoader
        return StreamSource("list", len(shards), True,
                            lambda shard, pass_no: cls(shards[shard], batch_size=batch_size, **kwargs),
                            lambda: _first(shards[0], kwargs.get("collate_fn"), batch_size))
    if stateful_loader(data):
        loader = data
        if hf_stream(loader.dataset):
            args = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
            if not args.get("num_workers"):
                args.pop("prefetch_factor", None)
                args.pop("persistent_workers", None)

            def rebuilt(shard: int, pass_no: int) -> Any:
                return type(loader)(split_hf(loader.dataset, shard, training, pass_no), **args)

            try:
                rebuilt(0, 0)
            except TypeError:  # a subclass built otherwise: read as the script built it
                pass
            else:
                return StreamSource("stateful-datasets", training, True, rebuilt,
                                    lambda: _first(loader.dataset, loader.collate_fn, loader.batch_size))
        return StreamSource("stateful", replica_ids, False, lambda shard, pass_no: loader,
                            lambda: _first(loader.dataset, loader.collate_fn, loader.batch_size))
    cls = _stateful_class() or TorchDataLoader
    collate = kwargs.get("collate_fn") or torch.utils.data.default_collate

    def over(dataset: Any) -> Any:
        return cls(dataset, batch_size=batch_size, **kwargs)

    if hf_stream(data) and split:
        return StreamSource("datasets", training, True,
                            lambda shard, pass_no: over(split_hf(data, shard, training, pass_no)),
                            lambda: _first(data, collate, batch_size))
    return StreamSource("iterable", replica_ids, False, lambda shard, pass_no: over(data),
                        lambda: _first(data, collate, batch_size))


class Strided:
    """Batches `shard`, `shard + shards`, ... of a loader `make()` builds for each pass over it."""

    def __init__(self, make: Callable[[], Any], shard: int, shards: int) -> None:
        self.make, self.shard, self.shards = make, shard, shards

    def __iter__(self) -> Any:
        for i, batch in enumerate(self.make()):
            if i % self.shards == self.shard:
                yield batch


def dispatched(dataset: Any, batch_size: int, kwargs: Dict[str, Any], training: int,
               dispatch: bool = True) -> StreamSource:
    """The Hugging Face Trainer's stream over `training` replicas, split as Accelerate's DDP splits
    it for the Trainer: by default (dispatch_batches) the main process reads the loader's batches
    and process s gets batches s, s + S, ...; here each replica reads the stream and keeps those
    of its shard (the same batches, read by each). The dataset's set_epoch(pass), where it has
    one, each pass, as the dispatcher calls it. With dispatch_batches=False, a Hugging Face stream
    of at least S file shards is split by them (datasets' shard(), as Accelerate does), else as
    by default (Accelerate's IterableDatasetShard: the same batches, but at the stream's end).
    The position is the count of the shard's batches read (a resume reads up to there again)."""
    collate = kwargs.get("collate_fn") or torch.utils.data.default_collate

    def over(data: Any, pass_no: int) -> Any:
        if callable(getattr(data, "set_epoch", None)):
            data.set_epoch(pass_no)
        return TorchDataLoader(data, batch_size=batch_size, **kwargs)

    if not dispatch and hf_stream(dataset) and getattr(dataset, "n_shards", 0) >= training:
        def by_files(shard: int, pass_no: int) -> Any:
            return over(copy.copy(dataset).shard(num_shards=training, index=shard), pass_no)

        return StreamSource("trainer-files", training, True, by_files, lambda: _first(dataset, collate, batch_size))
    return StreamSource("trainer", training, True,
                        lambda shard, pass_no: Strided(lambda: over(dataset, pass_no), shard, training),
                        lambda: _first(dataset, collate, batch_size))


def _first(dataset: Any, collate: Any, batch_size: Optional[int]) -> Any:
    """The stream's first sample as a batch (a fresh pass of the dataset in this process)."""
    sample = next(iter(dataset))
    return sample if batch_size is None else (collate or torch.utils.data.default_collate)([sample])
