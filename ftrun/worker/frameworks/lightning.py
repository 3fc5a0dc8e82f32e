"""Lightning's part of --ft: FTStrategy, a DDP strategy over ftrun.ft, and its injection into an
unmodified script.

FTStrategy is Lightning's DDPStrategy with the model wrapped by ft.DistributedDataParallel, the
optimizer by ft.Optimizer, and the training loader's DistributedSampler replaced by ft's step
sampler (sampler.py), or a stream's loader (an IterableDataset) by one over ft's Stream, each
replica reading its own loader's batches as under torchrun (streams.py); the fit loop is driven
as a framework loop (loop.py):
- no process group of all workers is formed (a restarted replica could never join it again);
- the member joins at the end of setup(), before the fit loop builds its data iterator: a
  restarted replica receives the model and optimizer (as ft's DDP and ft.Optimizer registered
  them) and Lightning's own state (what a checkpoint of it holds: the fit loop's progress, LR
  schedulers, callbacks, the precision plugin's state, the datamodule's, on_save_checkpoint's),
  and restores it as Lightning restores a checkpoint, so fit() goes on mid-epoch;
- each training batch opens a round as it is moved to the device, before its hooks run; an
  optimizer step whose round is discarded is made again on the same step's batch (training_step
  loads it again when the live replicas changed), so global_step and batch_idx count committed
  steps only; with accumulate_grad_batches=k a step is its window of k batches, and a redone one
  computes them all again;
- manual optimization: each optimizer gets its own ft.Optimizer (each opt.step() a sub-step of
  the batch's step), each manual_backward reduces over the step's replicas (ready_backward: it
  runs inside the wrapper's forward), and a batch that lost an optimizer step is trained again,
  from its LR schedulers' states at its top, its committed sub-steps skipped and not counted in
  global_step;
- validation (and testing) runs on every live replica over the whole set, so its metrics are the
  same on each, and the run's whoever is away (the cost: each replica evaluates all of it);
- barrier(), broadcast(), reduce() (sync_dist), all_gather() and reduce_boolean_decision() go
  over the replicas alive in the step where they are in step (FrameworkLoop.across: inside a
  training step, and between steps once this process committed one), else they are this
  replica's own; reduce() and all_gather() in an evaluation are this replica's own (it evaluated
  the whole set). world_size and global_rank are the run's: the replicas it was started with, and this replica's
  fixed id; is_global_zero is the first live replica's, so checkpoints are written by one
  replica whoever is away (Lightning's rank-zero logging stays replica 0's).

`install()` (the worker bootstrap, --ft) registers FTStrategy under Lightning's DDP names as
Lightning's strategies package is imported (both `lightning` and `pytorch_lightning`), so that
`Trainer(strategy="ddp")` and the default strategy on several devices get it; what it cannot run
(another Lightning version, a GradScaler, another strategy) gets one line at the start and the
plain strategy: ftrun then restarts the whole group on a failure, as for any script that does
not use ftrun.ft.
Must never import the supervisor, and never import Lightning before the script does.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from ftrun.worker import patches, settings
from ftrun.worker.frameworks import imports
from ftrun.worker.frameworks.loop import say

SUPPORTED = ((2, 5), (2, 6))  # the Lightning versions (major, minor) FTStrategy is tested with (scripts/framework_versions.sh)
PACKAGES = ("lightning.pytorch", "pytorch_lightning")
DDP_NAMES = ("ddp", "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true")
_classes: Dict[str, type] = {}


def _version(pl: ModuleType) -> Tuple[int, ...]:
    parts = []
    for p in str(getattr(pl, "__version__", "0")).split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def unsupported_version(pl: ModuleType) -> Optional[str]:
    if _version(pl)[:2] in SUPPORTED:
        return None
    supported = ", ".join("%d.%d.x" % v for v in SUPPORTED)
    return (f"--ft: this Lightning is {pl.__version__}; ftrun heals Lightning {supported} "
            f"replicas only, so a failure restarts all workers (install a supported Lightning for replica restarts)")


def strategy_class(package: str = "") -> type:
    """FTStrategy for one Lightning package ("lightning.pytorch" or "pytorch_lightning"; when not
    said, the one the script imported, else the one installed), built once: each package has its
    own DDPStrategy to extend."""
    import importlib

    if not package:
        import importlib.util
        import sys

        # The one the script imported, else the one installed.
        package = next((p for p in PACKAGES if p in sys.modules), None) or next(
            (p for p in PACKAGES if importlib.util.find_spec(p.split(".")[0]) is not None), PACKAGES[0])
    found = _classes.get(package)
    if found is None:
        found = _classes[package] = _build(importlib.import_module(package))
    return found


def install() -> None:
    """Under --ft with one worker per replica: FTStrategy under Lightning's DDP names, as soon as
    the script imports Lightning (either package)."""
    for package in PACKAGES:
        imports.after_import(f"{package}.strategies", _register)
        imports.after_import(f"{package}.trainer.connectors.accelerator_connector", _watch_choice)


def _root(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[0] if module.__name__.endswith(".strategies") else \
        module.__name__.split(".trainer.")[0]


def _register(strategies: ModuleType) -> None:
    import importlib

    package = _root(strategies)
    pl = importlib.import_module(package.split(".")[0])
    why = unsupported_version(pl)
    if why:
        say(why)
        return

    def make(**init_params: Any) -> Any:
        return strategy_class(package)(**init_params)

    registry = strategies.StrategyRegistry
    for name in DDP_NAMES:
        if name in registry:
            entry = registry[name]
            registry.register(name, make, description=f"ftrun --ft: {entry['description']}", override=True,
                              **entry["init_params"])


def _watch_choice(connector_module: ModuleType) -> None:
    """One line when the Trainer's strategy is not FTStrategy (a strategy object, FSDP, one device...)."""
    import importlib

    if unsupported_version(importlib.import_module(_root(connector_module).split(".")[0])):
        return  # said once already (_register)
    cls = connector_module._AcceleratorConnector
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        strategy = getattr(self, "strategy", None)
        if strategy is not None and not getattr(strategy, "_ftrun", False) and (settings.current().world_size or 1) > 1:
            say(f"--ft: this Lightning Trainer's strategy is {type(strategy).__name__}, which ftrun cannot heal: a "
                f"failure restarts all workers (Trainer(strategy=\"ddp\") or ftrun.lightning.FTStrategy() for "
                f"replica restarts)")

    patches.install("lightning.strategy", cls, "__init__", __init__)


def _all_reduce(tensor: Any, group: Any, reduce_op: Any) -> Any:
    """Lightning's reduce (in place, as DDPStrategy's) over `group`: "mean"/"avg" (a sum divided
    by the group's size: gloo has no average), "sum", "max", "min", "product", or a ReduceOp."""
    import torch
    import torch.distributed as dist

    op, mean = reduce_op, False
    if op is None or isinstance(op, str):
        name = (op or "sum").lower()
        mean = name in ("mean", "avg")
        op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, name.upper())
    dist.all_reduce(tensor, op=op, group=group)
    if not mean:
        return tensor
    if not torch.is_floating_point(tensor):
        return tensor.copy_(tensor / group.size())
    return tensor.div_(group.size())


def _build(pl: ModuleType) -> type:
    """The FTStrategy class over `pl`'s DDPStrategy (see the module's docstring)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

    # ftrun.ft's classes by their own modules: importing ftrun.ft itself marks a script as one that
    # uses it (ft/api/world.py), which one whose strategy fell back to Lightning's DDP is not.
    from ftrun.worker.ft.api.ddp import DistributedDataParallel as FTDistributedDataParallel
    from ftrun.worker.ft.api.ddp import ready_backward
    from ftrun.worker.ft.api.optim import Optimizer as FTOptimizer
    from ftrun.worker.frameworks.loop import FrameworkLoop, framework_loop
    from ftrun.worker.frameworks.sampler import StepBatchSampler, empty_like

    import importlib
    import inspect
    from collections import OrderedDict

    class Gather(torch.autograd.Function):
        """(group size, ...) of every member's tensor (the same shape on each, as under DDP);
        gradients flow back to each member's own, summed over the members. torch.distributed.nn's
        all_gather asks torch's registry for the group's backend in its backward, which the
        quorum's group (not made by new_group) is not in."""

        @staticmethod
        def forward(ctx: Any, tensor: Any, group: Any) -> Any:
            ctx.group = group
            out = [torch.empty_like(tensor) for _ in range(group.size())]
            dist.all_gather(out, tensor.contiguous(), group=group)
            return torch.stack(out)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad[ctx.group.rank()], None

    def all_gather(tensor: Any, group: Any, sync_grads: bool) -> Any:
        if sync_grads:
            return Gather.apply(tensor, group)
        with torch.no_grad():
            return Gather.apply(tensor, group)

    DDPStrategy = pl.strategies.DDPStrategy
    TrainerFn = importlib.import_module(f"{pl.__name__}.trainer.states").TrainerFn
    update_dataloader = importlib.import_module(f"{pl.__name__}.utilities.data")._update_dataloader
    version_line = unsupported_version(pl)

    class StepLoader(DataLoader):
        """The training loader over ft's step sampler. Resumable for Lightning (its position is
        the fit loop's, restored with it), so a restart mid-epoch is not warned about."""

        def state_dict(self) -> Dict[str, Any]:
            return {}

        def load_state_dict(self, sd: Dict[str, Any]) -> None:
            pass

    class FTStrategy(DDPStrategy):
        """Lightning's DDP strategy over ftrun.ft: only a failed replica restarts, and it goes on
        mid-epoch with the whole Lightning state from a live peer. Takes DDPStrategy's arguments."""

        strategy_name = "ftrun_ft"
        _ftrun = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._ft = True
            self._loop: Optional[FrameworkLoop] = None
            self._sampler: Optional[StepBatchSampler] = None
            self._stream: Any = None  # the training loader's stream (an IterableDataset): ft's Stream
            self._fillers: List[Any] = []  # the window's batches that stand in for ones of no samples
            self._collate: Any = None
            self._dataset: Any = None
            self._reloading = False  # training_step loads its step's batch again (not a new step)
            # The callbacks' states at the current batch's top: what a peer that heals at a redone
            # step's top (inside the batch) receives, since it runs the batch's hooks itself.
            self._callbacks_at_top: Tuple[Any, Dict[str, Any]] = (None, {})
            self._window: Tuple[int, int, int] = (-1, -1, -1)  # (round serial, epoch, batch) of a window's top
            # Manual optimization: each opt.step() of the batch's current attempt, taken or not.
            self._manual_steps: Optional[List[bool]] = None

        # ------------------------------------------------------------ what it cannot heal
        def _cannot_heal(self) -> Optional[str]:
            if version_line:
                return version_line
            if not settings.current().ft:
                return ""  # not under `ftrun --ft` (or after a group restart): Lightning's own DDP
            if settings.current().replica_size != 1:
                return "--ft: FTStrategy replicates a whole model per worker: use --replica-size 1"
            module = self.lightning_module
            trainer = module.trainer if module is not None else None
            if module is not None and "dataloader_iter" in inspect.signature(module.training_step).parameters:
                return ("--ft: a training_step(dataloader_iter) fetches its own batches, which ftrun cannot give "
                        "again for a redone step: a failure restarts all workers")
            if self._layer_sync is not None:
                return ("--ft: Trainer(sync_batchnorm=True) needs a process group of all workers, which a "
                        "restarted replica cannot join: a failure restarts all workers")
            if getattr(self.precision_plugin, "scaler", None) is not None:
                return ("--ft: a GradScaler (precision='16-mixed') is not supported by ftrun's Lightning strategy "
                        "yet: a failure restarts all workers (bf16 works)")
            return None

        # ------------------------------------------------------------ set-up: no group of all workers
        def setup_environment(self) -> None:
            why = self._cannot_heal()
            if why is not None:
                self._ft = False
                if why:
                    say(why)
                super().setup_environment()
                return
            super(DDPStrategy, self).setup_environment()  # the accelerator's device, not DDP's group
            self.set_world_ranks()
            self._process_group_backend = self._get_process_group_backend()
            self._loop = framework_loop("lightning", self._capture, self._restore)

        def _setup_model(self, model: torch.nn.Module) -> Any:
            if not self._ft:
                return super()._setup_model(model)
            return FTDistributedDataParallel(model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

        def _register_ddp_hooks(self) -> None:
            if not self._ft:
                super()._register_ddp_hooks()
            # Under --ft, ftrun's --hook goes through ft.DistributedDataParallel.

        def setup_optimizers(self, trainer: Any) -> None:
            super().setup_optimizers(trainer)
            if self._ft and self.optimizers:
                if len(self.optimizers) != 1 and self._automatic():  # (Lightning says so itself)
                    self._loop.misused(f"FTStrategy: {len(self.optimizers)} optimizers; automatic optimization "
                                       f"steps one")
                # Manual optimization: each optimizer's step() is a sub-step of the batch's step
                # (ftrun.ft's several optimizers: a GAN's discriminator, then its generator).
                self.optimizers = [FTOptimizer(opt) for opt in self.optimizers]

        def _automatic(self) -> bool:
            module = self.lightning_module
            return module is None or module.automatic_optimization

        def setup(self, trainer: Any) -> None:
            if not self._ft or trainer.state.fn == TrainerFn.FITTING:
                super().setup(trainer)
                if self._ft:
                    # Joins; a restarted replica heals here (_restore), before the fit loop starts.
                    self._loop.start()
                return
            # validate(), test(), predict(): each replica evaluates its own model (DDP's set-up
            # would broadcast replica 0's over a group of all workers, which there is not).
            self.accelerator.setup(trainer)
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self.setup_precision_plugin()

        # ------------------------------------------------------------ the whole Lightning state
        @staticmethod
        def _batch_key(trainer: Any) -> Tuple[int, int]:
            """(epoch, batches of it begun): the same at a batch's top and all through it."""
            progress = trainer.fit_loop.epoch_loop.batch_progress.current
            return trainer.current_epoch, progress.completed

        @staticmethod
        def _callback_states(trainer: Any) -> Dict[str, Any]:
            """Every callback's state_dict() as a checkpoint holds them, its containers copied (a
            callback may change its own dicts in place later in the batch)."""
            from torch.utils._pytree import tree_map

            states = {}
            for callback in trainer.callbacks:
                state = callback.state_dict()
                if state:
                    states[callback.state_key] = tree_map(lambda leaf: leaf, state)
            return states

        def _capture(self) -> Dict[str, Any]:
            trainer = self.lightning_module.trainer
            ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            progress = trainer.fit_loop.epoch_loop.batch_progress.current
            key, states = self._callbacks_at_top
            if progress.ready != progress.completed and key == self._batch_key(trainer) and "callbacks" in ckpt:
                # Inside a batch (a redone step's top): the healer runs this batch's hooks itself.
                ckpt["callbacks"] = states
            fit = ckpt.get("loops", {}).get("fit_loop", {}).get("state_dict")
            pending = getattr(trainer.fit_loop, "_combined_loader_states_to_load", None)
            if isinstance(fit, dict) and "combined_loader" not in fit and pending:
                # Taken before the fit loop set up its loader (this replica restored the state
                # itself a moment ago, from a checkpoint or a peer): the loader's state it holds
                # for it (a stream's position) goes on with the rest.
                fit["combined_loader"] = pending
            # The model and optimizer travel as tensors already (ft's DDP and ft.Optimizer
            # registered them); hyperparameters are the script's, the same on every replica.
            for key in ("state_dict", "optimizer_states", "hyper_parameters", "hparams_name", "hparams_type",
                        "datamodule_hyper_parameters", "datamodule_hparams_name"):
                ckpt.pop(key, None)
            return ckpt

        def _restore(self, ckpt: Dict[str, Any]) -> None:
            trainer = self.lightning_module.trainer
            connector = trainer._checkpoint_connector
            connector._loaded_checkpoint = ckpt
            try:
                connector.restore_datamodule()
                self.lightning_module.on_load_checkpoint(ckpt)
                connector.restore_callbacks()
                connector.restore_precision_plugin_state()
                connector.restore_loops()
                for config, sd in zip(trainer.lr_scheduler_configs, ckpt.get("lr_schedulers", [])):
                    config.scheduler.load_state_dict(sd)
            finally:
                connector._loaded_checkpoint = {}
            # Taken inside a batch (a redone step's top), the fit loop's restart counts the step
            # before as one more batch that stepped (it expects a checkpoint saved at a batch's end).
            progress = trainer.fit_loop.epoch_loop.batch_progress.total
            if progress.ready != progress.completed:
                trainer.fit_loop.epoch_loop._batches_that_stepped -= 1

        # ------------------------------------------------------------ the data
        def process_dataloader(self, dataloader: Any) -> Any:
            dataloader = super().process_dataloader(dataloader)
            module = self.lightning_module
            if not self._ft or module is None:
                return dataloader
            sampler = getattr(dataloader, "sampler", None)
            if not module.trainer.training:
                if type(sampler) is DistributedSampler and sampler.num_replicas > 1:
                    # Each live replica evaluates the whole set: its metrics are the run's, whoever is away.
                    whole = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle,
                                               seed=sampler.seed, drop_last=sampler.drop_last)
                    return update_dataloader(dataloader, whole)
                return dataloader
            if isinstance(dataloader.dataset, IterableDataset):
                return self._stream_loader(dataloader)
            batches = getattr(dataloader, "batch_sampler", None)
            if type(sampler) is not DistributedSampler or (batches is not None and type(batches) is not BatchSampler):
                self._loop.misused(
                    f"FTStrategy: the training DataLoader's sampler is {type(sampler).__name__} (batches from "
                    f"{type(batches).__name__}); under --ft ftrun splits each step over the live replicas itself: "
                    f"give the DataLoader shuffle= (and no sampler or batch_sampler of its own)")
            dataset = dataloader.dataset
            trainer = module.trainer

            def position() -> Tuple[int, int]:
                return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.completed

            def live() -> Tuple[int, int]:
                return self._loop.num_replicas, self._loop.replica_index

            self._sampler = StepBatchSampler(len(dataset), dataloader.batch_size, self.world_size, sampler.shuffle,
                                             sampler.seed, dataloader.drop_last, position, live)
            self._collate, self._dataset = dataloader.collate_fn, dataset
            kwargs = {k: getattr(dataloader, k) for k in (
                "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                "generator", "persistent_workers", "pin_memory_device", "in_order") if hasattr(dataloader, k)}
            if dataloader.num_workers > 0:
                kwargs["prefetch_factor"] = dataloader.prefetch_factor
            return StepLoader(dataset, batch_sampler=self._sampler, **kwargs)

        def _stream_loader(self, dataloader: Any) -> Any:
            """The training loader over a stream: each replica reads its own loader's batches, as
            under torchrun (frameworks/streams.py), from the run's position. Lightning's fetcher
            draws one ahead; each batch's top says which draw the step trains."""
            from ftrun.worker.frameworks.streams import StreamLoader, loader_args
            from ftrun.worker.ft.api import stream_sources
            from ftrun.worker.ft.api.stream import Stream

            if not self._automatic() and len(self.optimizers) > 1:
                self._loop.misused(f"FTStrategy: manual optimization of {len(self.optimizers)} optimizers over a "
                                   f"stream (the training DataLoader reads {type(dataloader.dataset).__name__}) is "
                                   f"not supported yet under --ft: give the DataLoader a Dataset with __len__ and "
                                   f"__getitem__, or step one optimizer")
            trainer = self.lightning_module.trainer
            ids = self.world_size
            training = max(1, ids - settings.current().spares)
            args = loader_args(dataloader)
            if stream_sources.stateful_loader(dataloader):  # a loader that says where it is: read as built
                source = stream_sources.source_for(dataloader, None, {}, ids, training)
            else:
                data = dataloader.dataset
                # A Hugging Face stream the script split by node is split by ftrun (any replica can
                # read any shard); one it did not split is read whole by every rank, as under torchrun.
                split = stream_sources.hf_stream(data) and getattr(data, "_distributed", None) is not None
                kwargs = {k: v for k, v in args.items() if k != "batch_size"}
                source = stream_sources.source_for(data, dataloader.batch_size, kwargs, ids, training, split=split)
            stream = self._stream = Stream(self._loop.mgr, source, register=False,
                                           ahead=trainer.accumulate_grad_batches, framework=True,
                                           name="the training DataLoader")

            def begin() -> None:
                # Lightning's epoch is the stream's pass; a replica that healed inside an
                # accumulation window goes on at its batch, the window's earlier ones drawn for it.
                stream.on_epoch(trainer.current_epoch)
                stream.start()
                stream.align(trainer.fit_loop.epoch_loop.batch_progress.current.completed)

            return StreamLoader(stream, dataloader.dataset, args, begin)

        def _step_batch(self, batch: Any, batch_idx: int) -> Any:
            """The batch of this step at the current membership (the loader's, or loaded again)."""
            if self._sampler is None:
                return batch
            trainer = self.lightning_module.trainer
            again, indices = self._sampler.fix(trainer.current_epoch, batch_idx)
            if not again:
                return batch
            return self._load(indices, batch)

        def _load(self, indices: Any, like: Any = None) -> Any:
            """The batch of these samples, as Lightning's loop would give it (none: an empty batch
            shaped as `like`, or as one sample of the dataset's)."""
            if not indices:
                if like is None:
                    like = self._load([0])
                return empty_like(like)
            return self._prepare(self._collate([self._dataset[i] for i in indices]))

        def _prepare(self, fresh: Any) -> Any:
            """A batch as the loader gave it, as Lightning's loop gives it to training_step."""
            fresh = self.precision_plugin.convert_input(fresh)
            fresh = self.lightning_module._on_before_batch_transfer(fresh, dataloader_idx=0)
            self._reloading = True
            try:
                return self.batch_to_device(fresh, dataloader_idx=0)
            finally:
                self._reloading = False

        # ------------------------------------------------------------ the steps
        def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
            # A training batch just fetched: the step's top, before any of the batch's hooks run,
            # so a peer's state taken here holds nothing of this batch.
            if self._ft and self._loop is not None and self._loop.running and not self._reloading:
                trainer = self.lightning_module.trainer
                if trainer.training and not trainer.sanity_checking:
                    total = trainer.fit_loop.epoch_loop.batch_progress.total
                    if total.ready != total.completed:
                        # After a heal inside a batch, Lightning's restart resets the epoch's counts
                        # only: no batch is in progress at a batch's top (total_batch_idx, which
                        # step-based validation counts by, is then the peers').
                        total.ready = total.started = total.processed = total.completed
                    self._callbacks_at_top = (self._batch_key(trainer), self._callback_states(trainer))
                    self._loop.step_top()
                    epoch, b = self._batch_key(trainer)
                    if b % trainer.accumulate_grad_batches == 0:
                        # The first batch of an accumulation window, in this round.
                        self._window = (self._loop.mgr.step_serial, epoch, b)
                        self._fillers = []
                    if self._stream is not None:
                        stream = self._stream
                        stream.consume()  # this step trains the batch drawn first of those left
                        if self._automatic() and stream.empty_at(stream.used - 1):
                            return self._filler()
            return super().batch_to_device(batch, device, dataloader_idx)

        def _filler(self) -> Any:
            """In place of a stream's batch of no samples (this replica's stream is done before the
            pass ends): the stream's first sample, which training_step trains at zero weight (a
            loss over no samples is often NaN, which the gradients' average would spread)."""
            from torch.utils._pytree import tree_map

            batch = self._prepare(tree_map(lambda leaf: leaf, self._stream.filler()))
            self._fillers.append(batch)
            return batch

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            if not (self._ft and len(args) >= 2 and self.lightning_module.trainer.training):
                return super().training_step(*args, **kwargs)
            if self._automatic():
                args = (self._step_batch(args[0], args[1]),) + tuple(args[1:])
                out = super().training_step(*args, **kwargs)
                if any(args[0] is filler for filler in self._fillers):
                    if isinstance(out, torch.Tensor):
                        return out * 0
                    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
                        return {**out, "loss": out["loss"] * 0}
                return out

            top = None

            def attempt() -> Any:
                nonlocal top
                # The schedules at the step's top: past the round's top, where a heal lands (a
                # healer takes them from its source), and put back before the next round's top
                # when the attempt is lost (until_complete), so that a heal served there sends them.
                top = self._schedules()
                self._manual_steps = []
                out = super(FTStrategy, self).training_step(self._step_batch(args[0], args[1]), *args[1:], **kwargs)
                if not self._manual_steps:
                    trainer = self.lightning_module.trainer
                    self._loop.misused(
                        f"FTStrategy: training_step (manual optimization) stepped no optimizer in batch {args[1]} of "
                        f"epoch {trainer.current_epoch}; under --ft each batch is one step of the run, trained again "
                        f"whole when a peer dies in it, so gradients kept for a later batch's step would be lost: "
                        f"step each optimizer in the batch of its backward (to accumulate: automatic optimization "
                        f"and Trainer(accumulate_grad_batches=k))")
                return out

            self._manual_steps = None

            return self._loop.until_complete(attempt, self._manual_discarded, lambda: self._schedules(top))

        def _schedules(self, back: Any = None) -> Any:
            """The LR schedulers' states and the optimizers' hyperparameters (what a scheduler sets
            in their param groups), or put back as `back` holds them: a manual training_step that
            steps its schedulers itself steps them once per batch, however often it is trained."""
            import copy

            trainer = self.lightning_module.trainer
            if back is None:
                return copy.deepcopy(([config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
                                      [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                                       for opt in self.optimizers]))
            schedulers, groups = copy.deepcopy(back)
            for config, sd in zip(trainer.lr_scheduler_configs, schedulers):
                config.scheduler.load_state_dict(sd)
            for opt, saved in zip(self.optimizers, groups):
                for g, hyper in zip(opt.param_groups, saved):
                    g.update(hyper)
            return None

        def _manual_discarded(self) -> bool:
            """Manual optimization: whether an optimizer step of the batch was discarded (the batch
            is then trained again: with several optimizers, its committed sub-steps are skipped)."""
            if len(self.optimizers) > 1:
                return self._loop.mgr.step_voted_down
            return not self._manual_steps[-1]

        def pre_backward(self, closure_loss: Any) -> None:
            if self._ft and isinstance(self.model, FTDistributedDataParallel) and not self._automatic():
                # manual_backward inside training_step, inside the wrapper's forward: each one
                # reduces over the replicas of the step, as a forward's end would set it.
                ready_backward(self.model, closure_loss)
                return
            super().pre_backward(closure_loss)

        def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
            if not self._ft or not isinstance(optimizer, FTOptimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)
            if not self._automatic():
                return self._manual_step(optimizer, closure, model, **kwargs)

            def attempt() -> Any:
                self._accumulate_again(optimizer)
                return super(FTStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)

            return self._loop.until_committed(attempt, lambda: optimizer.stepped)

        def _manual_step(self, optimizer: Any, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
            """One opt.step() of manual optimization: voted (a sub-step with several optimizers), and
            when it is not taken (discarded, or committed before the batch was handed out again),
            not counted in Lightning's optimizer steps, so global_step counts committed ones."""
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self._manual_steps is not None:
                self._manual_steps.append(optimizer.stepped)
            if not optimizer.stepped:
                # LightningOptimizer.step counts ready before this and completed after it.
                progress = self.lightning_module.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
                for tracker in (progress.total, progress.current):
                    tracker.ready -= 1
                    tracker.completed -= 1
            return out

        def _accumulate_again(self, optimizer: Any) -> None:
            """With accumulate_grad_batches=k, a step is its window's k batches and its round opens
            at the first: an attempt of the step in another round (a redone step, or the first of a
            replica that healed inside the window) computes the window's batches before the last
            again (Lightning's own closure for each, gradients zeroed at the first, DDP's sync held
            back as Lightning holds it), at the current membership; the last batch's closure follows
            in the optimizer step. Each batch's training_step and backward hooks run once more."""
            trainer = self.lightning_module.trainer
            k = trainer.accumulate_grad_batches
            epoch, b = self._batch_key(trainer)
            start = b - b % k
            if k == 1 or start == b or self._window == (self._loop.mgr.step_serial, epoch, start):
                return
            automatic = trainer.fit_loop.epoch_loop.automatic_optimization
            window = self._stream.window() if self._stream is not None else None
            for j in range(start, b):
                if window is not None:  # the stream's: the batches this step consumed, in order
                    batch = self._filler() if self._stream.empty_at(j - start) else self._prepare(window[j - start])
                else:
                    batch = self._load(self._sampler.share(epoch, j, self._loop.num_replicas, self._loop.replica_index))
                again = automatic._make_closure(OrderedDict(batch=batch, batch_idx=j), optimizer, j)
                with self.block_backward_sync():
                    again()
                again.consume_result()
            self._window = (self._loop.mgr.step_serial, epoch, start)

        def on_train_end(self) -> None:
            super().on_train_end()
            if self._ft and self._loop is not None:
                self._loop.finish()

        @property
        def is_global_zero(self) -> bool:
            """The first live replica of the step: the one that writes checkpoints (there is always
            one, whoever is away). Lightning's rank_zero_only (logging) stays replica 0's."""
            if self._ft and self._loop is not None and self._loop.running:
                return self._loop.replica_index == 0
            return super().is_global_zero

        # ------------------------------------------------------------ collectives
        # Over the replicas alive in the step (FrameworkLoop.across says where the replicas are in
        # step, and what a collective is elsewhere: this replica's own). Values an evaluation
        # reduces stay this replica's: every live replica evaluates the whole set itself.
        def _evaluating(self) -> bool:
            module = self.lightning_module
            return module is None or not module.trainer.training

        def barrier(self, *args: Any, **kwargs: Any) -> None:
            if not self._ft:
                return super().barrier(*args, **kwargs)
            if self._loop is not None:
                self._loop.across(lambda group: dist.all_reduce(torch.zeros(1, device=self.root_device), group=group),
                                  lambda: None)

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            if not self._ft:
                return super().broadcast(obj, src)
            if self._loop is None:
                return obj

            def send(group: Any) -> Any:
                # src is a replica's fixed id (Lightning's global rank); the first live one when it is away.
                live = sorted(self._loop.mgr.quorum.ranks)
                box = [obj]
                dist.broadcast_object_list(box, group_src=live.index(src) if src in live else 0, group=group)
                return box[0]

            return self._loop.across(send, lambda: obj)

        def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
            if not self._ft:
                return super().reduce(tensor, group, reduce_op)
            if not isinstance(tensor, torch.Tensor) or self._loop is None or self._evaluating():
                return tensor
            return self._loop.across(lambda g: _all_reduce(tensor, g, reduce_op), lambda: tensor)

        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
            if not self._ft:
                return super().reduce_boolean_decision(decision, all)
            if self._loop is None:
                return decision

            def send(group: Any) -> bool:
                votes = torch.tensor(int(decision), device=self.root_device)
                dist.all_reduce(votes, group=group)
                return bool(votes == group.size()) if all else bool(votes)

            return self._loop.across(send, lambda: decision)

        def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
            if not self._ft:
                return super().all_gather(tensor, group, sync_grads)
            # (live replicas, ...) as DDP's (world size, ...): (1, ...) for this replica's own.
            if self._loop is None or self._evaluating():
                return tensor.unsqueeze(0)
            return self._loop.across(lambda g: all_gather(tensor, g, sync_grads), lambda: tensor.unsqueeze(0))

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            pass  # registered by install() under DDP's names, not by Lightning's scan of subclasses

    FTStrategy.__module__ = "ftrun.lightning"
    FTStrategy.__qualname__ = FTStrategy.__name__ = "FTStrategy"
    return FTStrategy
