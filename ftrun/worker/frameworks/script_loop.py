"""A script's own training loop over a framework's objects under --ft (Accelerate's Accelerator,
Lightning Fabric): the part the drop-ins ftrun.accelerate.Accelerator and ftrun.fabric.Fabric share.

The script keeps its loop: `for epoch in accelerator.epochs(n): for batch in loader: ...`. Its
position is the run's, not the script's: `epochs()` yields the run's epochs from the current one
(a restarted replica joins and heals before its first, and learns there where the run is), and
the training loader (`LoopLoader`) gives each pass from the run's committed batch of the epoch.
An epoch is StepBatchSampler's (sampler.py): a fixed number of batches of R x B samples, each
split over the live replicas. A step is every batch drawn between two optimizer steps (one, or
an accumulation window); its optimizer step votes, and:
- taken, the epoch's position moves past the step's batches;
- discarded (a peer died in it), the loader gives the same batches again from the step's top,
  and what the step changed beside the model and optimizer (the LR schedulers the script steps
  whatever the outcome, their param groups' hyperparameters, the framework's counters) is put
  back as it was there, so the script's own loop body runs the step again unchanged.
The loop's state (the position, the schedulers, the framework's counters) travels in heals and
checkpoints as the framework loop's registered state (loop.py), beside the model and optimizer
that ft's DDP and ft.Optimizer registered.

What the script counts itself (`enumerate`'s index, an `overall_step`) starts at 0 on a
restarted replica: a replica healed mid-epoch whose first step comes after another number of
batches than its peers' steps (a step taken on `batch_idx % k == 0`) stops the run in one line.
Must never decide a step's fate (ft.Optimizer's vote does), and never import the supervisor.
"""

from __future__ import annotations

import copy
import functools
import sys
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from ftrun.worker import patches, settings
from ftrun.worker.frameworks.loop import FrameworkLoop, framework_loop, say
from ftrun.worker.frameworks.sampler import StepBatchSampler, empty_like

Plan = Tuple[int, int, int, int]  # (epoch, batch, live workers, this worker's index)


# ------------------------------------------------------------------ the LR schedulers
_schedulers: List[Tuple[int, "weakref.ref[Any]"]] = []  # (creation order, scheduler) since install_schedulers()
_made = [0]


def watching_plain(cls: type, what: str, port: str, epochs: str,
                   callers_of_its_own: Tuple[str, ...] = ()) -> Callable[..., None]:
    """`cls.__init__` that says, under --ft, one line once when the script builds a plain `cls` (an
    Accelerator, a Fabric: not the drop-in, which sets `_ftrun`) in a run of several workers: why
    its loop cannot heal, and the two lines that port it. Frameworks that build one for themselves
    (modules named in `callers_of_its_own`) say nothing. The caller installs it as a patch."""
    init = cls.__init__
    said = [False]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not getattr(self, "_ftrun", False) and not (callers_of_its_own and caller.startswith(callers_of_its_own)) \
                and (settings.current().world_size or 1) > 1 and not said[0]:
            said[0] = True
            say(f"--ft: this script trains with {what}, whose loop keeps its epoch and batch in the script's own "
                f"variables, where a replica restarted alone cannot take them up: a failure restarts all workers "
                f"(for replica restarts: `{port}` and `{epochs}`)")

    return functools.update_wrapper(__init__, init)


def loop_epochs(loop: Optional["ScriptLoop"], start: int, stop: Optional[int] = None) -> Iterator[int]:
    """A drop-in's epochs(), as range(start, stop) (or range(stop)): a restarted replica starts at the
    run's epoch and its loaders at the run's batch; the loop ends on every replica together. Without
    --ft (`loop` None), range itself."""
    if stop is None:
        start, stop = 0, start
    if loop is None:
        return iter(range(start, stop))
    return loop.epochs(start, stop)


def install_schedulers() -> None:
    """Note every LR scheduler the script builds from now on (once per process): a heal carries
    the state of those over the run's optimizer, and a discarded step puts theirs back."""
    if "lr_scheduler" in patches.installed():
        return
    from torch.optim import lr_scheduler

    def noting(init: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if not any(ref() is self for _, ref in _schedulers):
                _made[0] += 1
                _schedulers.append((_made[0], weakref.ref(self)))
        return __init__

    for cls in (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau):
        patches.install("lr_scheduler", cls, "__init__", noting(cls.__dict__["__init__"]))


def _groups_of(opt: Any) -> Any:
    try:
        return opt.param_groups
    except AttributeError:
        return None


class ScriptLoop:
    """One per drop-in: the script's loop as a member of the run (see the module's docstring).
    `extra` is the framework's own state (heals and checkpoints): name -> (get, set); `counters`
    is what a discarded step puts back: (get, set); `hint` ends the line for a misaligned step."""

    def __init__(self, name: str, extra: Dict[str, Tuple[Callable[[], Any], Callable[[Any], None]]],
                 counters: List[Tuple[Callable[[], Any], Callable[[Any], None]]], port: str, hint: str = "") -> None:
        self.name, self.extra, self.counters, self.port, self.hint = name, extra, counters, port, hint
        self.loop: FrameworkLoop = framework_loop(name, self._capture, self._restore)
        self.mgr = self.loop.mgr
        self.epoch = 0
        self.batch = 0            # the epoch's batches in committed steps
        self.window = 0           # the most batches a committed step of the run drew
        self.inside = False       # between epochs()' start and its end
        self.models: List[torch.nn.Module] = []
        self.optimizer: Any = None   # the run's ft.Optimizer
        self.given: List[Any] = []   # schedulers handed to the framework (prepare(), setup())
        self.trainer: Optional["LoopLoader"] = None  # the loader whose passes are the run's batches
        self.started_at: Optional[int] = None  # the batch this process's first training pass began at
        self.checked = False      # this process's first step was compared with its peers'
        self._outcome: Optional[bool] = None  # the last step's, until the next step's top
        self._kept: Any = None    # what the current step's top held (put back after a discarded step)

    # ------------------------------------------------------------ the epochs
    def epochs(self, start: int, stop: int) -> Iterator[int]:
        """The run's epochs from the current one until `stop` (a fresh run begins at `start`)."""
        self.epoch, self.batch = start, 0
        self.inside = True
        self.loop.start()  # joins; a restarted replica heals here and learns the run's epoch
        self._kept, self._outcome = self._keep(), None  # the first step's top
        try:
            while not self.mgr.finished and self.epoch < stop:
                yield self.epoch
                self.epoch, self.batch = self.epoch + 1, 0
        finally:
            self.inside = False
        self.loop.finish()

    def training(self) -> bool:
        """Inside epochs() with a prepared model in training mode: a loader's pass is the run's."""
        return self.inside and any(m.training for m in self.models)

    # ------------------------------------------------------------ the steps
    def step_top(self) -> int:
        """At each training batch, before it is drawn. At a step's top (no round open) the last
        step's outcome is taken in first: after a discarded step, what it changed is put back;
        otherwise the state is kept as this step's top; then the round opens. Returns the step's
        serial."""
        if not self.mgr.member.step_open:
            if self._outcome is False and self._kept is not None:
                self._put_back(self._kept)
            else:
                self._kept = self._keep()
            self._outcome = None
        self.loop.step_top()
        return self.mgr.step_serial

    def pass_over(self, loader: "LoopLoader") -> bool:
        """The epoch's batches are all in committed steps (no step open, none to make again)."""
        return loader.epoch != self.epoch or (not self.mgr.member.step_open and self._outcome is not False
                                              and self.batch >= len(loader.steps))

    def took(self, stepped: bool) -> None:
        """The run's optimizer step voted: taken (`stepped`) or discarded."""
        self._outcome = stepped
        self.loop.in_step = False
        trainer = self.trainer
        if not stepped or trainer is None or trainer.serial != self.mgr.step_serial:
            return
        drew = trainer.cursor - self.batch
        if drew > 0 and self.started_at and not self.checked:
            self.checked = True
            if self.window and drew != self.window and trainer.cursor < len(trainer.steps):
                self.loop.misused(
                    f"{self.port}: this replica restarted mid-epoch and stepped after {drew} batch(es), where its "
                    f"peers step every {self.window}: the loop's own batch index (enumerate's) starts at 0 on a "
                    f"restarted replica, so a step taken on it must count from the last step, "
                    f"`(batch_idx + 1) % k == 0` (not `batch_idx % k == 0`){self.hint}")
        self.window = max(self.window, drew)
        self.batch = trainer.cursor

    def schedulers(self) -> List[Any]:
        """The LR schedulers over the run's optimizer, in the order the script built them."""
        groups = _groups_of(self.optimizer)
        found = [(n, ref()) for n, ref in _schedulers]
        found = [s for _, s in sorted(found, key=lambda x: x[0]) if s is not None]
        if groups is not None:
            found = [s for s in found if _groups_of(getattr(s, "optimizer", None)) is groups]
        for s in self.given:
            s = getattr(s, "scheduler", s)  # Accelerate's AcceleratedScheduler holds the script's
            if not any(s is f for f in found):
                found.append(s)
        return found

    def _keep(self) -> Any:
        scheds = [copy.deepcopy(s.state_dict()) for s in self.schedulers()]
        groups = _groups_of(self.optimizer) or []
        hyper = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in groups]
        return scheds, hyper, [get() for get, _ in self.counters]

    def _put_back(self, kept: Any) -> None:
        scheds, hyper, counters = kept
        for s, sd in zip(self.schedulers(), scheds):
            s.load_state_dict(copy.deepcopy(sd))
        for g, h in zip(_groups_of(self.optimizer) or [], hyper):
            g.update(copy.deepcopy(h))
        for (_, put), value in zip(self.counters, counters):
            put(value)

    # ------------------------------------------------------------ state (heals, checkpoints)
    def _capture(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "window": self.window,
                "schedulers": [s.state_dict() for s in self.schedulers()],
                "extra": {name: get() for name, (get, _) in self.extra.items()}}

    def _restore(self, sd: Dict[str, Any]) -> None:
        self.epoch, self.batch, self.window = int(sd["epoch"]), int(sd["batch"]), int(sd["window"])
        for s, state in zip(self.schedulers(), sd["schedulers"]):
            s.load_state_dict(state)
        for name, value in sd["extra"].items():
            if name in self.extra:
                self.extra[name][1](value)
        self._kept, self._outcome = None, None
        if self.trainer is not None:
            self.trainer.serial = -1

    def misused(self, why: str) -> None:
        self.loop.misused(why)


class _Plan:
    """The batches a worker is given from a plan on, were every step to commit at the plan's
    membership: what the loader's workers may prefetch (empty shares left out)."""

    def __init__(self, loader: "LoopLoader") -> None:
        self.loader = loader
        self.start: Plan = (0, 0, 1, 0)

    def __iter__(self) -> Iterator[List[int]]:
        epoch, batch, workers, index = self.start
        for b in range(batch, len(self.loader.steps)):
            indices = self.loader.steps.share(epoch, b, workers, index)
            if indices:
                yield indices


class LoopLoader(TorchDataLoader):
    """A training loader prepared by a drop-in (a torch DataLoader: isinstance holds). Its passes
    inside epochs() while a prepared model trains are the run's batches (see the module's
    docstring); any other pass (an evaluation, after model.eval()) is `whole`'s: the whole set, on
    this replica. `place` moves a batch to the device; `began`/`ended` tell the framework a
    training pass began or ended; `at_last` that its epoch's last batch was given."""

    def __init__(self, loop: ScriptLoop, source: TorchDataLoader, whole: Any, batch_size: int, shuffle: bool,
                 seed: int, place: Callable[[Any], Any], began: Callable[["LoopLoader"], None] = lambda _: None,
                 ended: Callable[["LoopLoader"], None] = lambda _: None) -> None:
        # torch's DataLoader.__init__ is not called (as ft.DataLoader): an inner loader loads the
        # plan ahead, and what a script reads of a DataLoader is the source's.
        self.loop, self.whole, self.place, self.began, self.ended = loop, whole, place, began, ended
        self.dataset = source.dataset
        self.batch_size = batch_size
        self.drop_last = source.drop_last
        self.collate_fn = source.collate_fn
        self.sampler = source.sampler
        self.unfit = self._unfit(loop, source)
        self.steps = None if self.unfit else StepBatchSampler(
            len(self.dataset), batch_size, _run_replicas(), shuffle, seed, source.drop_last,
            lambda: (loop.epoch, loop.batch), self._live)
        self._plan = _Plan(self)
        kwargs = {k: getattr(source, k) for k in ("num_workers", "pin_memory", "timeout", "worker_init_fn",
                                                   "multiprocessing_context", "generator", "persistent_workers",
                                                   "pin_memory_device", "in_order") if hasattr(source, k)}
        if source.num_workers > 0:
            kwargs["prefetch_factor"] = source.prefetch_factor
        self._inner_loader = TorchDataLoader(self.dataset, batch_sampler=self._plan, collate_fn=self.collate_fn,
                                             **kwargs)
        self._inner: Optional[Iterator[Any]] = None
        self._expect: Optional[Plan] = None  # the plan the inner loader gives next
        self._template: Any = None
        self.serial = -1  # the step whose draws `cursor` counts
        self.cursor = 0
        self._yielded = 0      # batches the current training pass gave (len())
        self._passing = False  # a training pass is under way
        self.epoch = -1   # the epoch of the current pass
        self.end_of_dataloader = False
        self.remainder = -1

    @staticmethod
    def _unfit(loop: ScriptLoop, source: Any) -> Optional[str]:
        """Why this loader cannot give the run's batches (said when a training pass begins)."""
        if isinstance(source.dataset, IterableDataset) or not hasattr(source.dataset, "__len__"):
            return (f"{loop.port}: the training DataLoader reads {type(source.dataset).__name__} (an iterable "
                    f"dataset): under --ft ftrun splits each step over the live replicas by sample index, which a "
                    f"stream has not; give it a dataset with __len__ and __getitem__, or train in an ftrun.ft loop "
                    f"with ft.DataLoader, which reads streams")
        if getattr(source, "batch_size", None) is None or type(getattr(source, "sampler", None)) not in (
                RandomSampler, SequentialSampler, DistributedSampler):
            return (f"{loop.port}: the training DataLoader has a sampler or batch_sampler of its own "
                    f"({type(source.sampler).__name__}): under --ft ftrun splits each step over the live replicas "
                    f"itself; give it batch_size= and shuffle= only")
        return None

    def _live(self) -> Tuple[int, int]:
        return self.loop.loop.num_replicas, self.loop.loop.replica_index

    def _training(self) -> bool:
        return self.loop.training()

    def __len__(self) -> int:
        # The training length (the run's steps an epoch) unless an evaluation is under way; before
        # the loop, a model trains (torch's default), and the script counts its schedule from it.
        # In a training pass, the batches it gave and those left from where the run is (as
        # ft.DataLoader's): exact at the epoch's last batch, a redone step's batches counted again,
        # so `batch_idx + 1 == len(loader)` holds there with enumerate's index.
        if self.steps is None or (self.loop.inside and not self._training()):
            return len(self.whole)
        if self._passing and self.epoch == self.loop.epoch:
            at = self.cursor if self.serial == self.loop.mgr.step_serial else self.loop.batch
            return self._yielded + len(self.steps) - at
        return len(self.steps)

    def __iter__(self) -> Any:
        loop = self.loop
        if not self._training():
            return iter(self.whole)
        if self.unfit:
            loop.misused(self.unfit)
        if loop.trainer is None:
            loop.trainer = self
        elif loop.trainer is not self:
            loop.misused(f"{loop.port}: a second DataLoader trains in the loop; under --ft one loader gives the run's "
                         f"batches (evaluate the others after model.eval())")
        if self.epoch != loop.epoch:
            self.epoch, self.serial = loop.epoch, -1
        if loop.started_at is None:
            loop.started_at = loop.batch
        self.end_of_dataloader, self.remainder = False, -1
        self._yielded, self._passing = 0, True
        self.began(self)
        return self

    def __next__(self) -> Any:
        loop = self.loop
        if loop.pass_over(self) or loop.mgr.finished:
            return self._end()
        serial = loop.step_top()
        if serial != self.serial:  # a new step (or one made again): drawn from the committed position
            self.serial, self.cursor = serial, loop.batch
        b = self.cursor
        if b >= len(self.steps) and b > loop.batch and not loop.mgr.finished:
            loop.misused(f"{loop.port}: the training loader's epoch ended inside a step (its last batch drawn and no "
                         f"optimizer step since): under --ft a step ends in its epoch; step on the last batch too, "
                         f"`(batch_idx + 1) % k == 0 or batch_idx + 1 == len(train_loader)`")
        if loop.mgr.finished or b >= len(self.steps):
            return self._end()
        self.cursor = b + 1
        self._yielded += 1
        self.end_of_dataloader = self.cursor >= len(self.steps)
        workers, index = self._live()
        if not self.steps.share(self.epoch, b, workers, index):
            return self.place(self._empty(b))
        return self.place(self._fetch((self.epoch, b, workers, index)))

    def _end(self) -> Any:
        self.end_of_dataloader, self._passing = False, False
        self.ended(self)
        raise StopIteration

    def _fetch(self, plan: Plan) -> Any:
        if self._inner is None or self._expect != plan:
            self._plan.start = plan  # what the loader's workers prefetch from now on
            self._inner = iter(self._inner_loader)
        batch = next(self._inner)
        self._expect = self._following(plan)
        return batch

    def _following(self, plan: Plan) -> Optional[Plan]:
        epoch, b, workers, index = plan
        for nxt in range(b + 1, len(self.steps)):
            if self.steps.share(epoch, nxt, workers, index):
                return epoch, nxt, workers, index
        return None

    def _empty(self, b: int) -> Any:
        """A batch of no samples (a short last step with fewer samples than live workers)."""
        if self._template is None:
            first = self.steps.share(self.epoch, b, 1, 0)[:1]
            self._template = empty_like(self.collate_fn([self.dataset[i] for i in first]))
        return self._template

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this loader lacks: torch's DataLoader attributes, the inner one's.
        inner = self.__dict__.get("_inner_loader")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)


def _run_replicas() -> int:
    """The replicas the run was started with (fixed): R of the epoch's R x B samples a step."""
    from ftrun.worker import settings

    s = settings.current()
    return max(1, (s.world_size or 1) // s.replica_size)


def loader_order(source: TorchDataLoader, seed: Optional[int]) -> Tuple[bool, int]:
    """(shuffle, seed) of a script's DataLoader: shuffled when its sampler is a RandomSampler; the
    seed given, else its generator's (every replica's is the same when the script seeded it), else 0."""
    shuffle = isinstance(source.sampler, RandomSampler)
    if seed is None:
        gen = getattr(source.sampler, "generator", None) or getattr(source, "generator", None)
        seed = int(gen.initial_seed()) if isinstance(gen, torch.Generator) else 0
    return shuffle, seed
