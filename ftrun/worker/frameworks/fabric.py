"""Lightning Fabric's part of --ft: ftrun.fabric.Fabric, the drop-in whose loop heals, and the
line an unmodified `lightning.fabric.Fabric` script gets.

A Fabric loop is the script's own (`for epoch in range(epochs): for batch_idx, batch in
enumerate(train_loader)`): its position is in locals a restarted process starts at 0, which
nothing in Fabric reveals or sets (Fabric's own resume is the script's: fabric.load() of the
state dict it saved, iteration counters included). Such a script gets one line at the start and
group restarts. The drop-in is a two-line port: `from ftrun.fabric import Fabric`, and
`for epoch in fabric.epochs(epochs):`.

The drop-in under --ft puts its own strategy in place of Fabric's DDP ("ddp", or the default on
several devices): Fabric's DDPStrategy with no process group of all workers (so Fabric's
barrier, broadcast, all_reduce and all_gather are this replica's own, as in a run of one), the
model wrapped by ft.DistributedDataParallel (no_backward_sync holds its sync back), the optimizer
by ft.Optimizer (Fabric's optimizer.step() votes, and returns whether the step was taken), and
each loader from setup_dataloaders() a LoopLoader (script_loop.py): the run's batches in a
training pass, the whole set in an evaluation, ordered as Fabric's DistributedSampler (its
shuffle and seed). The first live replica is global zero: it writes fabric.save() and prints.
A heal carries the models, the optimizer, the LR schedulers built over it, and the position.
What it cannot run (another strategy, "16-mixed"'s scaler, another Lightning) gets one line and
the plain Fabric: group restarts.
Must never import the supervisor, and never import Lightning before the script does.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Iterator, Optional

from ftrun.worker import patches, settings
from ftrun.worker.frameworks import imports
from ftrun.worker.frameworks.loop import say

SUPPORTED = ((2, 5), (2, 6))  # the Lightning versions (major, minor) the drop-in is tested with
PORT = "ftrun.fabric.Fabric"


def install() -> None:
    """Under --ft with one worker per replica: the line for a plain Fabric the script builds."""
    imports.after_import("lightning.fabric.fabric", _watch)


def _watch(module: ModuleType) -> None:
    from ftrun.worker.frameworks.script_loop import watching_plain

    patches.install("fabric.plain", module.Fabric, "__init__", watching_plain(
        module.Fabric, "lightning.fabric.Fabric", "from ftrun.fabric import Fabric",
        "for epoch in fabric.epochs(num_epochs):"))


def _cannot_heal(strategy: Any, precision: Any) -> Optional[str]:
    """Why this Fabric cannot heal under --ft ("" when not under --ft, or a run of one; None when it can)."""
    import lightning

    s = settings.current()
    if not s.ft or (s.world_size or 1) == 1:
        return ""
    if s.replica_size != 1:
        return f"--ft: {PORT} replicates a whole model per worker: use --replica-size 1"
    version = tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in lightning.__version__.split(".")[:2])
    if version not in SUPPORTED:
        supported = ", ".join("%d.%d.x" % v for v in SUPPORTED)
        return (f"--ft: this Lightning is {lightning.__version__}; {PORT} heals Lightning {supported} only, so a "
                f"failure restarts all workers")
    if not (isinstance(strategy, str) and strategy in ("auto", "ddp")):
        name = strategy if isinstance(strategy, str) else type(strategy).__name__
        return (f"--ft: {PORT}(strategy={name!r}), which ftrun cannot heal: a failure restarts all workers "
                f"(strategy=\"ddp\" for replica restarts)")
    if str(precision) in ("16", "16-mixed", "transformer-engine", "transformer-engine-float16"):
        return (f"--ft: {PORT}(precision={str(precision)!r}) steps through a gradient scaler, which ftrun does not "
                f"support yet: a failure restarts all workers (\"bf16-mixed\" works)")
    return None


_cls: Optional[type] = None


def fabric_class() -> type:
    """ftrun.fabric.Fabric, built once over lightning.fabric."""
    global _cls
    if _cls is None:
        _cls = _build()
    return _cls


def _build() -> type:
    import lightning.fabric as lf
    import torch
    from lightning.fabric.strategies import DDPStrategy
    from lightning.fabric.utilities.data import _update_dataloader
    from torch.utils.data import DistributedSampler

    from ftrun.worker.frameworks.script_loop import (LoopLoader, ScriptLoop, install_schedulers, loader_order,
                                                        loop_epochs)

    class FabricFTStrategy(DDPStrategy):
        """Fabric's DDP over ftrun.ft (see the module's docstring)."""

        def __init__(self, loop: ScriptLoop, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._ft = loop

        def setup_environment(self) -> None:
            # The accelerator's device, and the run's ranks; no process group of all workers.
            super(DDPStrategy, self).setup_environment()
            self._set_world_ranks()
            self._process_group_backend = self._get_process_group_backend()

        def setup_module(self, module: torch.nn.Module) -> Any:
            from ftrun.worker.ft.api.ddp import DistributedDataParallel as FTDistributedDataParallel

            ddp = FTDistributedDataParallel(module, device_ids=self._determine_ddp_device_ids(), **self._ddp_kwargs)
            self._ft.models.append(ddp)
            return ddp

        def setup_optimizer(self, optimizer: Any) -> Any:
            from ftrun.worker.ft.api.optim import Optimizer as FTOptimizer

            if self._ft.optimizer is not None:
                self._ft.misused(f"{PORT}: a second optimizer; under --ft a step is one optimizer step of the whole "
                                 f"model: set up one optimizer over every parameter group")
            self._ft.optimizer = FTOptimizer(optimizer)
            return self._ft.optimizer

        def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
            if not self._ft.inside:
                self._ft.misused(f"{PORT}: optimizer.step() outside the run's loop, where no step can be committed: "
                                 f"loop over `for epoch in fabric.epochs(num_epochs):`")
            out = super().optimizer_step(optimizer, **kwargs)
            self._ft.took(bool(self._ft.optimizer.stepped))
            return out

        def process_dataloader(self, dataloader: Any) -> Any:
            sampler = dataloader.sampler
            if isinstance(sampler, DistributedSampler) and type(sampler) is DistributedSampler:
                # Fabric's own, over the run's replicas: the training order, and the whole set to evaluate.
                shuffle, seed = sampler.shuffle, sampler.seed
                whole = _update_dataloader(dataloader, DistributedSampler(
                    dataloader.dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=sampler.drop_last))
                source = whole
            else:
                shuffle, seed = loader_order(dataloader, None)
                whole = source = dataloader
            return LoopLoader(self._ft, source, whole, dataloader.batch_size, shuffle, seed, lambda b: b)

        @property
        def is_global_zero(self) -> bool:
            """The first live replica once the loop began (one writer whoever is away), else replica 0."""
            if self._ft.mgr.quorum is not None:
                return self._ft.loop.replica_index == 0
            return self.global_rank == 0

    class Fabric(lf.Fabric):
        """lightning.fabric.Fabric whose loop heals under `ftrun --ft`: only a failed replica
        restarts, and it goes on mid-epoch with the run's state from a live peer. Takes Fabric's
        arguments; loop with `for epoch in fabric.epochs(num_epochs):`. Outside ftrun --ft (or
        where ftrun cannot heal it, said in one line) it is Fabric."""

        _ftrun = True

        def __init__(self, *, strategy: Any = "auto", precision: Any = None, **kwargs: Any) -> None:
            why = _cannot_heal(strategy, precision)
            self._ft: Optional[ScriptLoop] = None
            if why is not None:
                if why:
                    say(why)
                super().__init__(strategy=strategy, precision=precision, **kwargs)
                return
            install_schedulers()
            self._ft = ScriptLoop("fabric", extra={}, counters=[], port=PORT)
            super().__init__(strategy=FabricFTStrategy(self._ft), precision=precision, **kwargs)

        def epochs(self, start: int, stop: Optional[int] = None) -> Iterator[int]:
            """The run's epochs, as range(start, stop) (or range(stop)): script_loop.loop_epochs."""
            return loop_epochs(self._ft, start, stop)

        def setup(self, module: Any, *optimizers: Any, scheduler: Any = None, **kwargs: Any) -> Any:
            if self._ft is not None and scheduler is not None:
                self._ft.given.append(scheduler)
            if scheduler is None:
                return super().setup(module, *optimizers, **kwargs)
            return super().setup(module, *optimizers, scheduler=scheduler, **kwargs)

        def print(self, *args: Any, **kwargs: Any) -> None:
            if self._ft is None:
                return super().print(*args, **kwargs)
            if self.is_global_zero:  # the first live replica: printed once whoever is away
                print(*args, **kwargs)

    Fabric.__module__ = "ftrun.fabric"
    Fabric.__qualname__ = Fabric.__name__ = "Fabric"
    return Fabric
