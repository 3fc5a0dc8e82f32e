"""A framework's training loader over a stream under --ft: the Hugging Face Trainer's
(train_dataset an IterableDataset, with max_steps) and Lightning's (a training DataLoader over an
IterableDataset), read through ft.DataLoader's stream (ft/api/stream.py): each replica reads its
own share, every replica holds every share's position after each committed step, and a
restarted replica goes on reading its own share at its last committed step.

Which share is a replica's is what the framework's own DDP gives that rank under torchrun
(ft/api/stream_sources.py):
- the Trainer: Accelerate's dispatcher, the loader's batches r, r + R, r + 2R, ... of the one
  stream for replica r of R (`dispatched()`): any replica can read any share, so a given-up
  replica's rest is read on by a peer whose share is done;
- Lightning: no sampler for a stream, each rank reads its own loader as the script built it (the
  script splits it, by its rank, or every rank reads all of it): a share only its replica can read,
  whose rest is not trained in the pass when that replica is given up (said in one line); a Hugging
  Face stream the script split with split_dataset_by_node is split by ftrun the same way, and read
  on by a peer.
The Trainer draws a step's batches inside the step (next_batch: a redone step draws them again);
Lightning's fetcher draws one ahead, so its loader draws and its batch top says which draw the
step trains (Stream.draw/consume).
Must never decide a step's fate, and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from torch.utils.data import DataLoader as TorchDataLoader

from ftrun.worker.ft.api.stream import Stream


class StreamLoader(TorchDataLoader):
    """The framework's training loader: a torch DataLoader (what the framework reads of one: its
    dataset, batch_size, workers...) whose batches are this replica's share's, from the run's
    position. Resumable (state_dict, load_state_dict: the stream's position), no len()."""

    _ftrun_steps = True  # the Trainer's mid-epoch resume skips nothing: the stream is where the run is

    def __init__(self, stream: Stream, dataset: Any, args: Dict[str, Any],
                 before_iter: Optional[Callable[[], None]] = None) -> None:
        super().__init__(dataset, **args)
        self.stream = stream
        self._before_iter = before_iter

    def __iter__(self) -> "StreamLoader":
        if self._before_iter is not None:
            self._before_iter()
        else:
            self.stream.start()
        return self

    def __next__(self) -> Any:
        return self.stream.draw() if self.stream.framework else self.stream.next_batch()

    def __len__(self) -> int:
        raise TypeError("a stream has no len(): its length is known when it ends")

    def state_dict(self) -> Dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd:
            self.stream.load_state_dict(sd)


def loader_args(loader: Any) -> Dict[str, Any]:
    """The DataLoader arguments of `loader` that a loader over the same dataset is built with."""
    names = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
             "multiprocessing_context", "generator", "persistent_workers", "pin_memory_device", "in_order")
    args = {k: getattr(loader, k) for k in names if hasattr(loader, k)}
    if getattr(loader, "num_workers", 0) > 0:
        args["prefetch_factor"] = loader.prefetch_factor
    else:
        args.pop("persistent_workers", None)
    return args
