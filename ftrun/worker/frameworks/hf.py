"""The Hugging Face Trainer's part of --ft: an unmodified script's `Trainer(...).train()` becomes
fault tolerant, with no change to the script.

The replicas are not one Accelerate run: each worker's Trainer sees a run of one process (the
distributed environment is hidden from Accelerate while TrainingArguments sets up its device), so
no process group of all workers is formed (a restarted replica could never join it again). ftrun
then does what Accelerate's DDP did, over the replicas alive at each step:
- the model is wrapped by ft.DistributedDataParallel, the optimizer by ft.Optimizer (under
  Accelerate's own wrapper), the training loader's sampler replaced by ft's step sampler
  (sampler.py), or a stream's loader by one over ft's Stream, each replica Accelerate's
  dispatched share (streams.py), and the training loop driven as a framework loop (loop.py);
- the member joins once the model, optimizer and scheduler exist, before the loop picks its
  starting epoch: a restarted replica receives the model and optimizer (as ft's DDP and
  ft.Optimizer registered them), the LR scheduler, the TrainerState (global step, epoch, log
  history, best metric) and the stateful callbacks' states, and its train() goes on mid-epoch
  from the run's step (the Trainer's own resume path, its data skip replaced by the sampler's
  position);
- each optimizer step (a whole gradient accumulation window) opens its round as its batches are
  fetched; a step whose round is discarded is redone inside the optimizer's step: the window's
  batches loaded again for the live replicas, forward and backward again, clipped again, so
  global_step, the scheduler and the callbacks count committed steps only;
- evaluation runs on every live replica over the whole set (each Trainer is a run of one), so
  its metrics are the same on each; the first live replica saves checkpoints and logs.
What it cannot run (another transformers or Accelerate version, DeepSpeed, FSDP, fp16's
GradScaler) gets one line at the start and the plain distributed run: ftrun then restarts the
whole group on a failure.
Must never import the supervisor, and never import transformers before the script does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ftrun.worker import patches, settings
from ftrun.worker.frameworks import imports
from ftrun.worker.frameworks.loop import say

SUPPORTED = {"transformers": ((5,),), "accelerate": ((1,),)}  # the majors the Trainer's part is tested with
# The Trainer's methods this part wraps: a Trainer without one of them is another version.
METHODS = ("get_train_dataloader", "_init_training_state", "_prepare_for_training", "_run_epoch",
           "get_batch_samples", "create_optimizer", "_wrap_model", "_finalize_training", "training_step",
           "_clip_grad_norm")
# What makes Accelerate see a distributed run: hidden while a TrainingArguments sets up its device.
_DISTRIBUTED_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


_installed = False


def install() -> None:
    """Under --ft with one worker per replica: the Trainer's part, as the script imports it (once)."""
    global _installed
    if _installed:
        return
    _installed = True
    imports.after_import("transformers.training_args", _patch_arguments)
    imports.after_import("transformers.trainer", _patch_trainer)


def trainer_class() -> type:
    """ftrun.hf.FTTrainer: the Trainer, for a script that says it runs under ftrun (under --ft the
    Trainer's part is installed, as for an unmodified script; otherwise it is the Trainer)."""
    s = settings.current()
    if s.ft and s.replica_size == 1:
        install()
    import transformers

    class FTTrainer(transformers.Trainer):
        """transformers.Trainer under `ftrun --ft`: only a failed replica restarts, and its train()
        goes on mid-epoch with the Trainer's whole state from a live peer. Takes Trainer's arguments."""

    FTTrainer.__module__ = "ftrun.hf"
    return FTTrainer


def _version(text: str) -> Tuple[int, ...]:
    parts = []
    for p in str(text).split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def unsupported() -> Optional[str]:
    """Why this installation's Trainer cannot be healed (None when it can)."""
    import importlib

    for name, majors in SUPPORTED.items():
        try:
            version = importlib.import_module(name).__version__
        except ImportError:
            continue
        if _version(version)[:1] not in majors:
            tested = ", ".join("%d.x" % m for m in majors)
            return (f"--ft: this {name} is {version}; ftrun heals Trainer replicas with {name} {tested} only, "
                    f"so a failure restarts all workers")
    return None


def _cannot_heal(args: Any) -> Optional[str]:
    why = unsupported()
    if why:
        return why
    # The Trainer this script trains with: its module is imported now (the script's own next step),
    # so that a Trainer ftrun cannot drive never trains as a lone run of one.
    from transformers import trainer as trainer_module

    missing = [m for m in METHODS if not callable(getattr(trainer_module.Trainer, m, None))]
    if missing:
        return (f"--ft: this transformers' Trainer has no {missing[0]}(), which ftrun's Trainer part "
                f"drives: a failure restarts all workers")
    if getattr(args, "deepspeed", None):
        return ("--ft: a Trainer with DeepSpeed shards its state over a group of all workers, which a restarted "
                "replica cannot join: a failure restarts all workers")
    if getattr(args, "fsdp", None) or _RunOfOne().environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return ("--ft: a Trainer with FSDP (through Accelerate) shards its state over a group of all workers, which "
                "a restarted replica cannot join: a failure restarts all workers")
    backend = getattr(args, "ddp_backend", None)
    if backend not in (None, "gloo", "nccl"):
        return (f"--ft: TrainingArguments(ddp_backend=\"{backend}\"): ftrun's replicas average over gloo or NCCL "
                f"only, so this run keeps its own group and a failure restarts all workers (leave ddp_backend out "
                f"for replica restarts)")
    if getattr(args, "fp16", False):
        return ("--ft: TrainingArguments(fp16=True) steps through a GradScaler, which ftrun's Trainer part does not "
                "support yet: a failure restarts all workers (bf16 works)")
    return None


def _refuse_backend(args: Any) -> None:
    """A TrainingArguments(ddp_backend=...) that cannot train with or without --ft: a backend this
    torch was built without, NCCL with no CUDA device to reduce on (no CUDA, or use_cpu=True), or
    use_cpu=True with a backend Accelerate refuses on the CPU (all but gloo and mpi). One line
    naming the fix, and the run stops (exit 2, nothing restarted). gloo and nccl train over
    ftrun's groups (gloo on CPU, NCCL on CUDA); another backend (mpi, a vendor's) gets the plain
    distributed run (_cannot_heal), as without --ft."""
    backend = getattr(args, "ddp_backend", None)
    if not backend:
        return
    import torch
    import torch.distributed as dist

    built = getattr(dist, f"is_{backend}_available", None)  # torch's own backends have one
    cpu = getattr(args, "use_cpu", False) or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "y", "yes", "t",
                                                                                          "true", "on")
    if built is not None and not built():
        why = f"this torch is built without {backend}"
    elif backend == "nccl" and (cpu or not torch.cuda.is_available()):
        why = ("NCCL reduces CUDA tensors only, and use_cpu=True trains on the CPU" if cpu
               else "NCCL reduces CUDA tensors only, and this machine has no CUDA device")
    elif cpu and backend not in ("gloo", "mpi"):
        why = "with use_cpu=True Accelerate trains over gloo (or mpi) only"
    else:
        return
    from ftrun.exits import EXIT_CANNOT_GO_ON
    from ftrun.worker.ft.member.member_io import leave

    leave(EXIT_CANNOT_GO_ON, f"rank {settings.current().rank_text}: TrainingArguments(ddp_backend=\"{backend}\"): "
                             f"{why}; set ddp_backend=\"gloo\" or leave it out")


# ------------------------------------------------------------------ TrainingArguments

def _loader_kwargs(args: Any, dataloader: Any) -> Dict[str, Any]:
    """The DataLoader arguments the Trainer builds its training loader with (TrainingArguments')."""
    kwargs: Dict[str, Any] = {"collate_fn": dataloader.collate_fn, "num_workers": args.dataloader_num_workers,
                              "pin_memory": args.dataloader_pin_memory}
    if args.dataloader_num_workers > 0:
        kwargs.update(persistent_workers=args.dataloader_persistent_workers,
                      prefetch_factor=args.dataloader_prefetch_factor,
                      multiprocessing_context=args.dataloader_multiprocessing_context)
    return kwargs


class _RunOfOne:
    """`os` as Accelerate's state modules see it while a TrainingArguments sets up its device: the
    worker's environment without the distributed run's variables, so Accelerate sets up a run of
    one process (no group of all workers) while the worker's own environment stays as it is."""

    def __init__(self) -> None:
        self.environ = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def _patch_arguments(module: ModuleType) -> None:
    cls = module.TrainingArguments
    found = cls.__dict__.get("_setup_devices")
    if not isinstance(found, functools.cached_property):
        say(unsupported() or "--ft: this transformers' TrainingArguments sets up its device in a way ftrun does "
                             "not know, so a failure restarts all workers")
        return
    setup = found.func

    def _setup_devices(self: Any) -> Any:
        _refuse_backend(self)
        why = _cannot_heal(self)
        if why is not None:
            if not getattr(cls, "_ftrun_said", False):
                cls._ftrun_said = True
                say(why)
            return setup(self)
        import accelerate.state
        import accelerate.utils.environment

        view = _RunOfOne()
        for module in (accelerate.state, accelerate.utils.environment):
            patches.install("hf.accelerate_env", module, "os", view)
        # ddp_backend names the backend of the group of all workers, which a run of one does not
        # form (Accelerate, given one, asks the group that is not there for its size): the
        # replicas average over ftrun's own groups instead.
        backend, self.ddp_backend = self.ddp_backend, None
        try:
            device = setup(self)
        finally:
            self.ddp_backend = backend
            patches.undo("hf.accelerate_env")
        self._ftrun = True
        if device.type == "cuda":
            # A run of one would take cuda:0 and every visible GPU (DataParallel): this worker's own.
            import torch

            device = torch.device("cuda", settings.current().local_rank)
            torch.cuda.set_device(device)
            self._n_gpu = 1
        return device

    prop = functools.cached_property(_setup_devices)
    prop.__set_name__(cls, "_setup_devices")
    patches.install("hf.arguments", cls, "_setup_devices", prop)

    def _first_live(original: Any) -> property:
        def get(self: Any) -> bool:
            if not getattr(self, "_ftrun", False):
                return original.fget(self)
            ft = _active_ft()
            if ft is not None and ft.joined:
                # The first replica of the newest quorum (after train(), the last one's: a
                # save_model() after it has one writer too).
                return ft.loop.replica_index == 0
            # Before any train() (an evaluate() alone): replica 0, as without --ft.
            return settings.current().rank_text == "0"
        return property(get)

    # One writer of checkpoints and logs: the first live replica (each Trainer is a run of one).
    for name in ("should_save", "should_log"):
        patches.install("hf.arguments", cls, name, _first_live(cls.__dict__[name]))


# ------------------------------------------------------------------ the Trainer
_current: Optional["_TrainerFT"] = None  # the Trainer whose train() runs under --ft


def _active_ft() -> Optional["_TrainerFT"]:
    return _current


def _ft(trainer: Any) -> Optional["_TrainerFT"]:
    """The trainer's ft part, made at its first train() under --ft (None when it runs as without --ft)."""
    if not getattr(trainer.args, "_ftrun", False):
        return None
    found = trainer.__dict__.get("_ftrun")
    if found is None:
        found = trainer.__dict__["_ftrun"] = _TrainerFT(trainer)
    return found


class _TrainerFT:
    """One Trainer's state under --ft: its loop, sampler and where its epoch is."""

    def __init__(self, trainer: Any) -> None:
        from ftrun.worker.frameworks.loop import framework_loop

        global _current
        self.trainer = trainer
        self.loop = framework_loop("transformers", self.capture, self.restore)
        self.sampler: Any = None
        self.dataset: Any = None
        self.collate: Any = None
        self.epoch = 0          # the epoch the loop is in
        self.batch = 0          # the loader's batches of it fetched
        self.window: Tuple[int, int] = (0, 0)  # (first batch, batches) of the current optimizer step
        self.items: Any = None  # the current window's num_items_in_batch
        self.model: Any = None  # the wrapped model of train()
        self.pending_loader: Any = None  # the training loader train() made, for the early preparation
        self.prepared: Any = None  # _prepare_for_training's result, made early (before the heal)
        self.top: Dict[str, Any] = {}  # the stateful callbacks' states at the current step's top
        self.joined = False  # the member joined (train() began): the first live replica is known
        self.stream: Any = None  # the training set's stream (an IterableDataset), read through ft's Stream
        _current = self

    # ------------------------------------------------------------ the whole Trainer state
    def _callback_states(self) -> Dict[str, Any]:
        from transformers.trainer_callback import ExportableState

        states: Dict[str, Any] = {}
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, ExportableState):
                states.setdefault(type(cb).__name__, []).append(json.loads(json.dumps(cb.state())))
        return states

    def capture(self) -> Dict[str, Any]:
        import dataclasses

        t = self.trainer
        # The TrainerState whole, its stateful_callbacks too (the callbacks' states as the Trainer
        # last wrote them there, at its start or its latest checkpoint: a JSON dict by then).
        state = dataclasses.asdict(t.state)
        sched = t.lr_scheduler.state_dict() if t.lr_scheduler is not None else None
        # The callbacks as they were at this step's top: a peer that heals inside the step (a
        # redone one) runs the step's callbacks itself.
        return {"trainer_state": json.dumps(state), "callbacks": json.dumps(self.top or self._callback_states()),
                "lr_scheduler": sched}

    def restore(self, sd: Dict[str, Any]) -> None:
        from transformers.trainer_callback import TrainerState

        t = self.trainer
        fields = json.loads(sd["trainer_state"])
        if sd.get("lr_scheduler") is not None and t.lr_scheduler is not None:
            t.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        states = json.loads(sd["callbacks"])
        seen: Dict[str, int] = {}
        for cb in t.callback_handler.callbacks:
            name = type(cb).__name__
            if name in states and seen.get(name, 0) < len(states[name]):
                for attribute, value in states[name][seen.get(name, 0)].get("attributes", {}).items():
                    setattr(cb, attribute, value)
                seen[name] = seen.get(name, 0) + 1
        t.state = TrainerState(**fields)

    # ------------------------------------------------------------ the data
    def loader(self, dataloader: Any) -> Any:
        """The Trainer's training loader over ft's step sampler."""
        from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

        from ftrun.worker.frameworks.sampler import StepBatchSampler

        t, args = self.trainer, self.trainer.args
        dataset = dataloader.dataset
        if isinstance(dataset, IterableDataset):
            return self.stream_loader(dataloader)
        # The sampler that orders the Trainer's batches: Accelerate's prepare() moves the Trainer's
        # (a RandomSampler) into the batch sampler, and the loader's own .sampler is then a
        # SequentialSampler that orders nothing (read alone, the data went unshuffled).
        batches = getattr(getattr(dataloader, "base_dataloader", dataloader), "batch_sampler", None)
        while hasattr(batches, "batch_sampler"):  # Accelerate's BatchSamplerShard around it
            batches = batches.batch_sampler
        shuffle = not isinstance(getattr(batches, "sampler", None), SequentialSampler)
        seed = args.data_seed if args.data_seed is not None else args.seed
        self.sampler = StepBatchSampler(len(dataset), t._train_batch_size, settings.current().world_size or 1,
                                        shuffle, seed, args.dataloader_drop_last, lambda: (self.epoch, self.batch),
                                        lambda: (self.loop.num_replicas, self.loop.replica_index))
        self.dataset, self.collate = dataset, dataloader.collate_fn
        kwargs = _loader_kwargs(args, dataloader)
        loader = DataLoader(dataset, batch_sampler=self.sampler, **kwargs)
        loader._ftrun_steps = True  # type: ignore[attr-defined]  # its position is the sampler's: no skip
        return loader

    def stream_loader(self, dataloader: Any) -> Any:
        """The Trainer's training loader over a stream: each replica reads its share as Accelerate's
        DDP would give it that rank (frameworks/streams.py), from the run's position."""
        from ftrun.worker.frameworks.streams import StreamLoader
        from ftrun.worker.ft.api import stream_sources
        from ftrun.worker.ft.api.stream import Stream

        t, args = self.trainer, self.trainer.args
        config = getattr(t.accelerator, "dataloader_config", None)
        if getattr(config, "split_batches", False):
            self.loop.misused("TrainingArguments(accelerator_config={'split_batches': True}) over a stream: under --ft "
                              "ftrun splits the Trainer's stream as Accelerate's default does (each replica its own "
                              "batches of per_device_train_batch_size); drop split_batches")
        s = settings.current()
        ids = s.world_size or 1
        kwargs = _loader_kwargs(args, dataloader)
        source = stream_sources.dispatched(dataloader.dataset, t._train_batch_size, kwargs, max(1, ids - s.spares),
                                           getattr(config, "dispatch_batches", None) is not False)
        # Each exchange reads a window ahead: every replica knows the pass's end by the draw that meets it.
        self.stream = Stream(self.loop.mgr, source, ahead=args.gradient_accumulation_steps,
                             name="the Trainer's train_dataset")
        self.collate = dataloader.collate_fn
        return StreamLoader(self.stream, dataloader.dataset, {"batch_size": t._train_batch_size,
                                                              "collate_fn": dataloader.collate_fn})

    def batches(self, fetched: List[Any]) -> Tuple[List[Any], bool]:
        """The window's batches at the current membership (the loader's, or loaded again)."""
        from ftrun.worker.frameworks.sampler import empty_like

        if self.stream is not None:
            # This replica's share's, whoever else is there; a batch of no samples (its share is
            # done before the pass ends) is trained as the stream's first sample at zero weight.
            out = [self.stream.filler() if self.stream.is_empty(b) else b for b in fetched]
            return out, any(a is not b for a, b in zip(out, fetched))
        out, changed = [], False
        first, _ = self.window
        for k, batch in enumerate(fetched):
            again, indices = self.sampler.fix(self.epoch, first + k)
            if again:
                changed = True
                batch = self.collate([self.dataset[i] for i in indices]) if indices else empty_like(batch)
            out.append(batch)
        return out, changed

    def count_items(self, window: List[Any], device: Any) -> Any:
        """The window's num_items_in_batch, as the Trainer counts it (a filler's left out)."""
        real = [b for b in window if self.stream is None or not self.stream.is_filler(b)]
        return _ORIGINAL["get_batch_samples"](self.trainer, iter(real), len(real), device)[1]

    # ------------------------------------------------------------ a redone step
    def redo(self) -> None:
        """Forward and backward over the step's whole window again, for the live replicas of the
        round the step is redone in; clipped again as the Trainer clips."""
        t, model = self.trainer, self.model
        first, count = self.window
        if self.stream is not None:
            window, _ = self.batches([self.stream.next_batch() for _ in range(count)])  # the same, given again
        else:
            fetched = [self.collate([self.dataset[i] for i in self.sampler.share(self.epoch, first + k, 1, 0)[:1]])
                       for k in range(count)]
            self.sampler.plans.clear()  # every batch of the window is loaded for this membership
            window, _ = self.batches(fetched)
        items = self.count_items(window, t.args.device)
        model.zero_grad()
        for i, inputs in enumerate(window):
            sync = contextlib.nullcontext() if i == len(window) - 1 else model.no_sync()
            with sync:
                t.training_step(model, inputs, items)
        if t.args.max_grad_norm > 0:
            t._clip_grad_norm(model)


_ORIGINAL: Dict[str, Callable[..., Any]] = {}


def _optimizer_class() -> type:
    from ftrun.worker.ft.api.optim import Optimizer as FTOptimizer

    class TrainerOptimizer(FTOptimizer):
        """ft.Optimizer whose step() is the Trainer's whole optimizer step: a discarded round's
        step is redone (the window's forward and backward again) until it commits."""

        def step(self, closure: Any = None) -> Any:
            ft = _active_ft()
            if ft is None or not ft.loop.running:
                return super().step(closure)
            tries = [0]

            def attempt() -> Any:
                if tries[0]:
                    ft.redo()
                tries[0] += 1
                return FTOptimizer.step(self, closure)

            return ft.loop.until_committed(attempt, lambda: self.stepped)

    return TrainerOptimizer


def _patch_trainer(module: ModuleType) -> None:
    cls = module.Trainer
    if unsupported() or any(not callable(getattr(cls, m, None)) for m in METHODS):
        return  # said by TrainingArguments' set-up, which then sets up the plain distributed run
    original = {m: getattr(cls, m) for m in METHODS}
    _ORIGINAL.update(original)
    skip_first_batches = getattr(module, "skip_first_batches", None)

    def skip(dataloader: Any, num_batches: int = 0) -> Any:
        # ft's loader starts where the loop is (its sampler's position): nothing to skip.
        return dataloader if getattr(dataloader, "_ftrun_steps", False) else skip_first_batches(dataloader, num_batches)

    if skip_first_batches is not None:  # what the Trainer's mid-epoch resume calls
        patches.install("hf.trainer", module, "skip_first_batches", skip)

    def get_train_dataloader(self: Any) -> Any:
        dataloader = original["get_train_dataloader"](self)
        ft = _ft(self)
        if ft is None:
            return dataloader
        ft.pending_loader = ft.loader(dataloader)
        return ft.pending_loader

    def create_optimizer(self: Any, *args: Any, **kwargs: Any) -> Any:
        opt = original["create_optimizer"](self, *args, **kwargs)
        ft = _ft(self)
        if ft is not None and self.optimizer is not None and not isinstance(self.optimizer, _optimizer_class_once()):
            self.optimizer = _optimizer_class_once()(self.optimizer)
            opt = self.optimizer
        return opt

    def _wrap_model(self: Any, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        out = original["_wrap_model"](self, model, training, dataloader)
        ft = _ft(self)
        if ft is None or not training or out is not model or self.accelerator.unwrap_model(model) is not model:
            return out
        from ftrun.worker.ft.api.ddp import DistributedDataParallel as FTDistributedDataParallel

        model.to(self.args.device)
        # The Trainer prepares only the optimizer once _wrap_model has wrapped the model, so the
        # model gets here what accelerator.prepare() would give it in a run of one, but its DDP:
        # bf16's autocast around its forward (without it bf16=True trained in float32).
        return FTDistributedDataParallel(self.accelerator.prepare_model(model, evaluation_mode=True))

    def _init_training_state(self: Any, max_steps: int, per_epoch: int, epochs: int, resume: Any,
                             trial: Any) -> Tuple[int, int]:
        epochs_trained, in_epoch = original["_init_training_state"](self, max_steps, per_epoch, epochs, resume, trial)
        ft = _ft(self)
        if ft is None:
            return epochs_trained, in_epoch
        # The model, optimizer and scheduler exist before the member joins (a heal restores them).
        ft.prepared = original["_prepare_for_training"](self, max_steps, ft.pending_loader, resume)
        ft.model = ft.prepared[0]
        # Accelerate's no_sync() is a no-op for a run of one: the accumulation window's backward
        # passes but the last reduce nothing, as DDP's would.
        self.accelerator.no_sync = lambda model=None: (model.no_sync() if hasattr(model, "no_sync")
                                                       else contextlib.nullcontext())
        ft.loop.start()  # joins; a restarted replica heals here (restore)
        ft.joined = True
        if ft.stream is not None:
            # A stream's epoch is its pass, and its batches so far the pass's committed draws.
            return ft.stream.table.pass_no, ft.stream.table.drawn
        step = self.state.global_step
        return step // per_epoch, (step % per_epoch) * self.args.gradient_accumulation_steps

    def _prepare_for_training(self: Any, max_steps: int, train_dataloader: Any, resume: Any) -> Any:
        ft = _ft(self)
        if ft is not None and ft.prepared is not None:
            prepared, ft.prepared = ft.prepared, None
            return prepared
        return original["_prepare_for_training"](self, max_steps, train_dataloader, resume)

    def _run_epoch(self: Any, *args: Any, **kwargs: Any) -> Any:
        ft = _ft(self)
        if ft is None:
            return original["_run_epoch"](self, *args, **kwargs)
        epoch = kwargs["epoch"]
        first = epoch == kwargs["epochs_trained"]
        ft.epoch, ft.batch = epoch, kwargs["steps_trained_in_current_epoch"] if first else 0
        if first and ft.batch > 0 and kwargs.get("resume_from_checkpoint") is None:
            # The Trainer's own mid-epoch resume (its step counts), with nothing to skip or load.
            kwargs["resume_from_checkpoint"] = ""
        return original["_run_epoch"](self, *args, **kwargs)

    def get_batch_samples(self: Any, epoch_iterator: Iterator[Any], num_batches: int, device: Any) -> Any:
        ft = _ft(self)
        if ft is None or not ft.loop.running:
            return original["get_batch_samples"](self, epoch_iterator, num_batches, device)
        # The top of an optimizer step, before its batches are fetched.
        ft.top = ft._callback_states()
        ft.loop.step_top()
        ft.window = (ft.batch, num_batches)
        fetched, items = original["get_batch_samples"](self, epoch_iterator, num_batches, device)
        ft.window = (ft.batch, len(fetched))
        ft.batch += len(fetched)
        window, changed = ft.batches(fetched)
        if changed:
            items = ft.count_items(window, device)
        return window, items

    def training_step(self: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        ft = _ft(self)
        if ft is None or ft.stream is None or not ft.stream.is_filler(inputs):
            return original["training_step"](self, model, inputs, *args, **kwargs)
        # A batch of no samples: the stream's first sample, its loss at zero weight (every
        # replica's step runs its forward, backward and gradient average alike; a compute_loss
        # of the script's own is left as it is).
        accelerator = self.accelerator
        backward = accelerator.backward
        accelerator.backward = lambda loss, **kw: backward(loss * 0, **kw)
        try:
            return original["training_step"](self, model, inputs, *args, **kwargs) * 0
        finally:
            del accelerator.backward

    def _finalize_training(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original["_finalize_training"](self, *args, **kwargs)
        ft = _ft(self)
        if ft is not None:
            ft.loop.finish()
        return out

    def is_world_process_zero(self: Any) -> bool:
        # save_metrics(), save_state(), log_metrics() write (or print) on one process: the one
        # writer of checkpoints (each Trainer is a run of one, which takes itself for process 0).
        if getattr(self.args, "_ftrun", False):
            return self.args.should_save
        return original["is_world_process_zero"](self)

    def save_model(self: Any, output_dir: Optional[str] = None, _internal_call: bool = False) -> Any:
        out = original["save_model"](self, output_dir, _internal_call)
        ft = _ft(self)
        if ft is not None and ft.loop.running:
            # The replicas wait for the writer's files, as DDP's processes do after a checkpoint's
            # model is saved: the Trainer then looks for the best checkpoint's folder on disk (a
            # replica that looked before the writer made it would keep an older best), and
            # load_best_model_at_end reads it.
            import torch
            import torch.distributed as dist

            ft.loop.across(lambda group: dist.all_reduce(torch.zeros(1, device=self.args.device), group=group),
                           lambda: None)
        return out

    original["is_world_process_zero"] = cls.is_world_process_zero
    original["save_model"] = cls.save_model
    for name, fn in (("get_train_dataloader", get_train_dataloader), ("create_optimizer", create_optimizer),
                     ("is_world_process_zero", is_world_process_zero), ("save_model", save_model),
                     ("_wrap_model", _wrap_model), ("_init_training_state", _init_training_state),
                     ("_prepare_for_training", _prepare_for_training), ("_run_epoch", _run_epoch),
                     ("get_batch_samples", get_batch_samples), ("_finalize_training", _finalize_training),
                     ("training_step", training_step)):
        functools.update_wrapper(fn, original[name])
        patches.install("hf.trainer", cls, name, fn)


_optimizer_cls: Optional[type] = None


def _optimizer_class_once() -> type:
    global _optimizer_cls
    if _optimizer_cls is None:
        _optimizer_cls = _optimizer_class()
    return _optimizer_cls
