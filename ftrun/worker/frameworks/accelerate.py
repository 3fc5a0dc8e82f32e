"""Accelerate's part of --ft: ftrun.accelerate.Accelerator, the drop-in whose loop heals, and the
line an unmodified `accelerate.Accelerator` script gets.

An unmodified Accelerate loop cannot go on mid-run on a restarted replica: its position is the
script's own (`for epoch in range(num_epochs)`, `enumerate(train_dataloader)`, an
`overall_step`), locals that a new process starts at 0 and that no call into Accelerate reveals
or sets (Accelerate's own resume is the script's code: load_state, then skip_first_batches by a
step the script parses from a folder's name). Such a script gets one line at the start and
group restarts. The drop-in is a two-line port: `from ftrun.accelerate import Accelerator`, and
`for epoch in accelerator.epochs(num_epochs):`.

The drop-in under --ft: each worker's Accelerator is a run of one (no process group of all
workers, which a restarted replica could never join: the distributed environment is hidden
from Accelerate's state while it is built), and the script's loop is a script loop
(script_loop.py):
- prepare() wraps a model with ft.DistributedDataParallel (after Accelerate's own preparation
  of a run of one: the device, bf16's autocast), an optimizer with ft.Optimizer under
  Accelerate's wrapper (whose step() votes; a discarded step says step_was_skipped, so the
  prepared scheduler does not step), a scheduler so that it steps as under R processes, and a
  DataLoader as a LoopLoader: the run's batches in a training pass, the whole set in an
  evaluation (so gather_for_metrics is this replica's own, and the same on every replica);
- accumulate() keeps Accelerate's own count (`accelerator.step`), put back on a discarded
  step and carried in heals, with DDP's sync held back by ft's DDP;
- num_processes is the run's replicas (fixed), process_index this replica's id; the main
  process is the first live replica (it writes save_state(), save_model(), save() and prints);
- a heal carries what save_state() saves: the models, optimizer and schedulers, the objects
  registered with register_for_checkpointing(), Accelerate's step and save iteration, and the
  loop's position.
What it cannot run (DeepSpeed, FSDP, Megatron, tensor or context parallelism, fp16's or fp8's
scaler, another Accelerate major) gets one line and the plain Accelerator: group restarts.
Must never import the supervisor, and never import Accelerate before the script does.
"""

from __future__ import annotations

import contextlib
import functools
import os
from types import ModuleType
from typing import Any, Iterator, Optional

from ftrun.worker import patches, settings
from ftrun.worker.frameworks import imports
from ftrun.worker.frameworks.loop import say

SUPPORTED = ((1,),)  # the Accelerate majors the drop-in is tested with (scripts/framework_versions.sh)
PORT = "ftrun.accelerate.Accelerator"
_PLUGINS = ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin", "parallelism_config")


def install() -> None:
    """Under --ft with one worker per replica: the line for a plain Accelerator the script builds."""
    imports.after_import("accelerate.accelerator", _watch)


def _watch(module: ModuleType) -> None:
    from ftrun.worker.frameworks.script_loop import watching_plain

    # The Trainer's own Accelerator (its part is hf.py), and the drop-in's, say nothing here.
    patches.install("accelerate.plain", module.Accelerator, "__init__", watching_plain(
        module.Accelerator, "accelerate.Accelerator", "from ftrun.accelerate import Accelerator",
        "for epoch in accelerator.epochs(num_epochs):", callers_of_its_own=("transformers", "accelerate")))


def _version(text: str) -> tuple:
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in str(text).split(".")[:2])


def _cannot_heal(kwargs: dict) -> Optional[str]:
    """Why this Accelerator cannot heal under --ft ("" when not under --ft; None when it can)."""
    import accelerate
    from accelerate.state import PartialState

    s = settings.current()
    if not s.ft:
        return ""
    if s.replica_size != 1:
        return f"--ft: {PORT} replicates a whole model per worker: use --replica-size 1"
    if _version(accelerate.__version__)[:1] not in SUPPORTED:
        return (f"--ft: this accelerate is {accelerate.__version__}; {PORT} heals Accelerate 1.x only, so a failure "
                f"restarts all workers")
    given = [k for k in _PLUGINS if kwargs.get(k) is not None]
    env = [k for k in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")
           if os.environ.get(k, "").lower() == "true"]
    if given or env:
        return (f"--ft: this Accelerator shards or splits its model over a group of all workers "
                f"({(given + env)[0]}), which a restarted replica cannot join: a failure restarts all workers")
    precision = str(kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")).lower()
    if precision in ("fp16", "fp8"):
        return (f"--ft: mixed_precision=\"{precision}\" steps through a gradient scaler, which {PORT} does not "
                f"support yet: a failure restarts all workers (bf16 works)")
    config = kwargs.get("dataloader_config")
    if config is not None and getattr(config, "dispatch_batches", None):
        return (f"--ft: DataLoaderConfiguration(dispatch_batches=True) reads every batch on the main process, "
                f"which ftrun's replicas do not share: a failure restarts all workers")
    if PartialState._shared_state and PartialState().use_distributed:
        return (f"--ft: an accelerate PartialState() was made before the {PORT}, with a process group of all "
                f"workers, which a restarted replica cannot join: a failure restarts all workers (make the "
                f"Accelerator first)")
    return None


_cls: Optional[type] = None
_active: Any = None  # the drop-in that runs under --ft (one per process)


def accelerator_class() -> type:
    """ftrun.accelerate.Accelerator, built once over the installed Accelerate."""
    global _cls
    if _cls is None:
        _cls = _build()
    return _cls


def _first_live(original: property) -> property:
    def get(self: Any) -> bool:
        if _active is None:
            return original.fget(self)
        return _active._ft_main()
    return property(get)


def _build() -> type:
    import accelerate
    import accelerate.state
    import accelerate.utils.environment
    import torch
    from accelerate.data_loader import prepare_data_loader
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils import send_to_device

    from ftrun.worker.frameworks.hf import _RunOfOne
    from ftrun.worker.frameworks.script_loop import (LoopLoader, ScriptLoop, install_schedulers, loader_order,
                                                        loop_epochs)

    class StepOptimizer(AcceleratedOptimizer):
        """Accelerate's optimizer over ft.Optimizer: its step votes, and a discarded one is a
        skipped step (the prepared schedulers do not step on it)."""

        def step(self, closure: Any = None) -> Any:
            drop = _active
            if drop is None or not self.gradient_state.sync_gradients:
                return super().step(closure)
            if not drop._ft.inside:
                drop._ft.misused(f"{PORT}: optimizer.step() outside the run's loop, where no step can be "
                                 f"committed: loop over `for epoch in accelerator.epochs(num_epochs):`")
            super().step(closure)
            stepped = self.optimizer.stepped
            self._is_overflow = not stepped
            drop._ft.took(stepped)

    class RunScheduler(AcceleratedScheduler):
        """Accelerate's scheduler, stepped as under the run's R processes: R times a step (once
        with split_batches), as the script's schedule over its unsplit loader's length expects."""

        def step(self, *args: Any, **kwargs: Any) -> None:
            if not self.step_with_optimizer or not self.gradient_state.sync_gradients or \
                    any(opt.step_was_skipped for opt in self.optimizers):
                return super().step(*args, **kwargs)
            for _ in range(1 if self.split_batches else _active.num_processes):
                if getattr(self.scheduler, "total_steps", None) is not None and \
                        self.scheduler._step_count > self.scheduler.total_steps:
                    break
                self.scheduler.step(*args, **kwargs)

    class Accelerator(accelerate.Accelerator):
        """accelerate.Accelerator whose loop heals under `ftrun --ft`: only a failed replica
        restarts, and it goes on mid-epoch with the run's state from a live peer. Takes
        Accelerator's arguments; loop with `for epoch in accelerator.epochs(num_epochs):`.
        Outside ftrun --ft (or where ftrun cannot heal it, said in one line) it is Accelerator."""

        _ftrun = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            global _active
            why = _cannot_heal(kwargs)
            self._ft: Optional[ScriptLoop] = None
            if why is not None:
                if why:
                    say(why)
                super().__init__(*args, **kwargs)
                return
            if torch.cuda.is_available() and not kwargs.get("cpu"):
                # A run of one takes cuda:0: this worker's own device.
                torch.cuda.set_device(settings.current().local_rank)
            view = _RunOfOne()
            for module in (accelerate.state, accelerate.utils.environment):
                patches.install("accelerate.run_of_one", module, "os", view)
            try:
                super().__init__(*args, **kwargs)
            finally:
                patches.undo("accelerate.run_of_one")
            install_schedulers()
            self._ft = ScriptLoop("accelerate", extra={
                "step": (lambda: self.step, self._set_step),
                "iteration": (lambda: self.project_configuration.iteration, self._set_iteration),
                "custom": (lambda: [obj.state_dict() for obj in self._custom_objects], self._set_custom),
            }, counters=[(lambda: self.step, self._set_step)], port=PORT,
                hint=", or accumulate with `with accelerator.accumulate(model):`")
            fresh = "accelerate.main" not in patches.installed()
            for cls in (accelerate.state.PartialState, accelerate.state.AcceleratorState):
                for name in ("is_main_process", "is_local_main_process"):
                    if fresh and name in cls.__dict__:
                        patches.install("accelerate.main", cls, name, _first_live(cls.__dict__[name]))
            _active = self

        def _set_step(self, value: int) -> None:
            self.step = int(value)

        def _set_iteration(self, value: int) -> None:
            self.project_configuration.iteration = int(value)

        def _set_custom(self, states: Any) -> None:
            for obj, sd in zip(self._custom_objects, states):
                obj.load_state_dict(sd)

        # ------------------------------------------------------------ the loop
        def epochs(self, start: int, stop: Optional[int] = None) -> Iterator[int]:
            """The run's epochs, as range(start, stop) (or range(stop)): script_loop.loop_epochs."""
            return loop_epochs(self._ft, start, stop)

        def _ft_main(self) -> bool:
            ft = self._ft
            if ft.mgr.quorum is not None:
                return ft.loop.replica_index == 0
            return settings.current().rank_text == "0"

        @property
        def num_processes(self) -> int:
            if self._ft is None:
                return super().num_processes
            from ftrun.worker.frameworks.script_loop import _run_replicas

            return _run_replicas()

        @property
        def process_index(self) -> int:
            return super().process_index if self._ft is None else int(settings.current().rank_text)

        @property
        def local_process_index(self) -> int:
            return super().local_process_index if self._ft is None else settings.current().local_rank

        @property
        def is_last_process(self) -> bool:
            return self.process_index == self.num_processes - 1

        def on_main_process(self, function: Any = None) -> Any:
            if self._ft is None or function is None:
                return super().on_main_process(function)

            @functools.wraps(function)
            def inner(*args: Any, **kwargs: Any) -> Any:  # the first live replica's, at each call
                if self.is_main_process:
                    return function(*args, **kwargs)
                return None
            return inner

        def on_local_main_process(self, function: Any = None) -> Any:
            if self._ft is None or function is None:
                return super().on_local_main_process(function)
            return self.on_main_process(function)

        # ------------------------------------------------------------ prepare
        def prepare_model(self, model: torch.nn.Module, device_placement: Any = None,
                          evaluation_mode: bool = False) -> Any:
            out = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
            if self._ft is None or evaluation_mode:
                return out
            from ftrun.worker.ft.api.ddp import DistributedDataParallel as FTDistributedDataParallel

            kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
            ids = [settings.current().local_rank] if self.device.type == "cuda" else None
            ddp = FTDistributedDataParallel(out, device_ids=ids, **kwargs)
            self._models = [ddp if m is out else m for m in self._models]
            self._ft.models.append(ddp)
            return ddp

        def prepare_optimizer(self, optimizer: Any, device_placement: Any = None) -> Any:
            if self._ft is None or getattr(optimizer, "_is_accelerate_prepared", False):
                return super().prepare_optimizer(optimizer, device_placement=device_placement)
            from ftrun.worker.ft.api.optim import Optimizer as FTOptimizer

            if self._ft.optimizer is not None:
                self._ft.misused(f"{PORT}: a second optimizer; under --ft a step is one optimizer step of the whole "
                                 f"model: prepare one optimizer over every parameter group")
            self._ft.optimizer = FTOptimizer(optimizer)
            prepared = StepOptimizer(self._ft.optimizer, device_placement=self.device_placement
                                     if device_placement is None else device_placement, scaler=None)
            self._optimizers.append(prepared)
            return prepared

        def prepare_scheduler(self, scheduler: Any) -> Any:
            if self._ft is None or getattr(scheduler, "_is_accelerate_prepared", False):
                return super().prepare_scheduler(scheduler)
            prepared = RunScheduler(scheduler, self._optimizers, step_with_optimizer=self.step_scheduler_with_optimizer,
                                    split_batches=self.split_batches)
            self._schedulers.append(prepared)
            self._ft.given.append(prepared)
            return prepared

        def prepare_data_loader(self, data_loader: Any, device_placement: Any = None,
                                slice_fn_for_dispatch: Any = None) -> Any:
            if self._ft is None or getattr(data_loader, "_is_accelerate_prepared", False):
                return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                                   slice_fn_for_dispatch=slice_fn_for_dispatch)
            if device_placement is None:
                device_placement = self.device_placement
            # The whole set, as a run of one prepares it: what an evaluation pass reads.
            whole = prepare_data_loader(
                data_loader, self.device, num_processes=1, process_index=0, split_batches=False,
                put_on_device=device_placement, rng_types=self.rng_types.copy(), dispatch_batches=self.dispatch_batches,
                even_batches=self.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
                use_seedable_sampler=self.use_seedable_sampler, data_seed=self.dataloader_config.data_seed,
                non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader)
            batch = data_loader.batch_size
            if batch is not None and self.split_batches:
                batch = max(1, batch // self.num_processes)
            shuffle, seed = loader_order(data_loader, self.dataloader_config.data_seed)
            device = self.device

            def place(b: Any) -> Any:
                return send_to_device(b, device, non_blocking=self.non_blocking) if device_placement else b

            loader = LoopLoader(self._ft, data_loader, whole, batch, shuffle, seed, place,
                                began=self.gradient_state._add_dataloader, ended=self.gradient_state._remove_dataloader)
            self._dataloaders.append(loader)
            return loader

        # ------------------------------------------------------------ what differs in a run of one
        @contextlib.contextmanager
        def no_sync(self, model: Any) -> Any:
            if self._ft is None:
                with super().no_sync(model):
                    yield
                return
            with (model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()):
                yield

        def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
            if self._ft is None or self.is_main_process:
                return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
            # One writer (the first live replica) of the files a run of one writes as process 0.
            self.project_configuration.iteration += 1
            return output_dir

        def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
            if self._ft is not None and isinstance(dataloader, LoopLoader):
                self._ft.misused(f"{PORT}: skip_first_batches() on the training loader: under --ft its passes start "
                                 f"where the run is; resume with --checkpoint-dir instead of the script's own "
                                 f"load_state() and skip_first_batches()")
            return super().skip_first_batches(dataloader, num_batches)

    Accelerator.__module__ = "ftrun.accelerate"
    Accelerator.__qualname__ = Accelerator.__name__ = "Accelerator"
    return Accelerator

