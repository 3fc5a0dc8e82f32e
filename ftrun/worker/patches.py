"""Every global patch ftrun applies to torch inside a worker: the one list, with why and how each is undone.

A worker replaces a few of torch's module-level functions and one class's
methods, because a user's unchanged script (and Lightning, Accelerate) calls
them by name. Each is listed in PATCHES, and each is applied through
`install()`, which records the original so that `undo()` puts it back:

- `torch.autograd.backward` (ft/api/ddp.py, --ft with ftrun.ft's DDP): a peer's
  death inside a backward's allreduce fails the round instead of raising,
  and a layout round averages the gradients once the backward returns.
  Tensor.backward() calls it by name. Installed at the first ft.DistributedDataParallel();
  a pass-through (torch's own backward) for a model that is not armed.
- `torch.save` and `torch.load` (progress.py): with --step-timeout, a long
  save or load counts as progress, not a hang; without --ft, torch.save (and
  `torch.distributed.checkpoint.save`/`async_save`, once the script imported
  DCP) notes the step count it saved at, for the goodput of a group restart.
  The wrappers only bump counters and call torch's function.
- `torch.distributed.init_process_group` and `destroy_process_group`
  (ft/api/world.py, --ft with one worker per replica): a restarted replica cannot
  join the group of all workers formed at the start, so its call is skipped
  with one line, and the destroy of that group is then a no-op. ftrun's own
  calls go to torch's function (`world.torch_init_process_group()`).
- `DistributedSampler.__init__` (ft/api/data_checks.py, --ft): with no default
  group (a restarted replica, or a script that never made one), a sampler
  built without num_replicas/rank splits over WORLD_SIZE at RANK, as the
  group of all workers would, instead of raising; ft.DataLoader reads the
  samplers the script built to say when its order is not theirs.
- `DistributedDataParallel.__init__` with `register_comm_hook` and
  `_register_builtin_comm_hook` (inject.py, --hook without --ft): every DDP
  model gets the run's comm hook after its first forward, unless the script
  registers its own. `inject.uninstall()` undoes it.

- `TrainingArguments._setup_devices`, `should_save`, `should_log` and eight of the `Trainer`'s
  methods (frameworks/hf.py, --ft, once the script imports transformers): each worker's Trainer
  is a run of one whose model, optimizer, loader and loop go through ftrun.ft; while its arguments
  set up their device, Accelerate's state modules see `os` with an environment that lacks the
  distributed run's variables (`hf.accelerate_env`, undone when the set-up returns).
- `_AcceleratorConnector.__init__` of Lightning (frameworks/lightning.py, --ft, once the script
  imports Lightning): one line when a Trainer's strategy is one ftrun cannot heal (a strategy
  object, FSDP, one device per run...), so a group restart is not a surprise.
- `Accelerator.__init__` of Accelerate and `Fabric.__init__` of Lightning Fabric
  (frameworks/accelerate.py, frameworks/fabric.py, --ft): one line for a plain one, whose loop
  ftrun cannot heal. With the drop-ins (ftrun.accelerate.Accelerator, ftrun.fabric.Fabric):
  Accelerate's state modules see a run of one while the Accelerator is built
  (`accelerate.run_of_one`), its main process is the first live replica (`accelerate.main`),
  and torch's LR schedulers note themselves as they are built (`lr_scheduler`,
  frameworks/script_loop.py).

Not patches, but global too: under --ft a finder on sys.meta_path (frameworks/imports.py) runs
ftrun's code right after Lightning's strategies package is imported, which registers FTStrategy
under Lightning's DDP names in its StrategyRegistry (an entry Lightning's API lets any package
override). progress.py registers an optimizer step
post-hook and (with --step-timeout) a module forward hook through torch's
own API (`register_optimizer_step_post_hook`, `register_module_forward_hook`);
they last as long as the worker. ft/manager.py patches nothing of torch.

Each patch lasts as long as the worker process unless undone: `undo(name)`
restores what `install()` replaced for that patch, newest first (a function
wrapped twice comes back as torch's own).
Must never patch anything not listed in PATCHES, never import torch at
import time (the bootstrap imports this before the user's script), and
never import the supervisor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple


@dataclass(frozen=True)
class Patch:
    targets: Tuple[str, ...]  # what is replaced
    where: str                # the module that installs it
    why: str
    undo: str


PATCHES: Dict[str, Patch] = {
    "autograd.backward": Patch(
        ("torch.autograd.backward",), "ftrun.worker.ft.api.ddp",
        "a collective failure in a backward on a quorum's group fails the round instead of raising; a layout "
        "round averages the gradients after the backward",
        "undo('autograd.backward'); otherwise a pass-through to torch's backward for models ftrun does not arm"),
    "save.load": Patch(
        ("torch.save", "torch.load"), "ftrun.worker.progress",
        "--step-timeout: a save or load in progress is progress, not a hang; without --ft: the step count of "
        "the script's latest save (goodput)",
        "undo('save.load'); the wrappers call torch's own function"),
    "dcp.save": Patch(
        ("torch.distributed.checkpoint.save", "torch.distributed.checkpoint.async_save"), "ftrun.worker.progress",
        "without --ft: the step count of the script's latest DCP save (goodput)",
        "undo('dcp.save'); the wrappers call DCP's own function"),
    "process_group": Patch(
        ("torch.distributed.init_process_group", "torch.distributed.destroy_process_group"), "ftrun.worker.ft.api.world",
        "--ft, one worker per replica: a restarted replica skips the script's group of all workers, which it "
        "could never join again",
        "undo('process_group'); ftrun's own calls use world.torch_init_process_group()"),
    "sampler": Patch(
        ("torch.utils.data.distributed.DistributedSampler.__init__",), "ftrun.worker.ft.api.data_checks",
        "--ft: DistributedSampler(dataset) with no default group takes WORLD_SIZE and RANK (a restarted replica has "
        "no default group); ft.DataLoader compares its order with the samplers the script built",
        "undo('sampler'); a sampler with num_replicas and rank given, or built with a default group, is torch's own"),
    "lightning.strategy": Patch(
        ("lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector.__init__",),
        "ftrun.worker.frameworks.lightning",
        "--ft: one line when a Lightning Trainer's strategy is not one ftrun can heal (the run then gets group "
        "restarts)", "undo('lightning.strategy'); the wrapper calls Lightning's own __init__ first"),
    "hf.arguments": Patch(
        tuple(f"transformers.training_args.TrainingArguments.{a}" for a in ("_setup_devices", "should_save",
                                                                           "should_log")),
        "ftrun.worker.frameworks.hf",
        "--ft: each worker's Trainer is a run of one (Accelerate forms no group of all workers, which a restarted "
        "replica could never join); the first live replica saves and logs",
        "undo('hf.arguments'); the wrappers call transformers' own functions"),
    "hf.accelerate_env": Patch(
        ("accelerate.state.os", "accelerate.utils.environment.os"), "ftrun.worker.frameworks.hf",
        "--ft: while a TrainingArguments sets up its device, Accelerate reads an environment without the "
        "distributed run's variables (a run of one); the worker's own environment is not changed",
        "undone as soon as the set-up returns"),
    "hf.trainer": Patch(
        ("transformers.trainer.skip_first_batches",) + tuple(f"transformers.trainer.Trainer.{m}" for m in (
            "get_train_dataloader", "create_optimizer", "_wrap_model", "_init_training_state",
            "_prepare_for_training", "_run_epoch", "get_batch_samples", "_finalize_training",
            "is_world_process_zero", "save_model", "training_step")),
        "ftrun.worker.frameworks.hf",
        "--ft: the Trainer's model, optimizer, loader and loop over ftrun.ft (a failed replica heals from a peer); "
        "over a stream, a batch of no samples is trained as the stream's first sample at zero weight (for that "
        "training_step, the Trainer's accelerator.backward is given the loss times 0)",
        "undo('hf.trainer'); a Trainer whose arguments ftrun did not set up calls transformers' own methods"),
    "accelerate.plain": Patch(
        ("accelerate.accelerator.Accelerator.__init__",), "ftrun.worker.frameworks.accelerate",
        "--ft: one line when the script trains with a plain accelerate.Accelerator, whose loop ftrun cannot heal "
        "(the run then gets group restarts)", "undo('accelerate.plain'); the wrapper calls Accelerate's own __init__ first"),
    "accelerate.run_of_one": Patch(
        ("accelerate.state.os", "accelerate.utils.environment.os"), "ftrun.worker.frameworks.accelerate",
        "--ft: while ftrun.accelerate.Accelerator is built, Accelerate reads an environment without the distributed "
        "run's variables (a run of one); the worker's own environment is not changed",
        "undone as soon as the Accelerator is built"),
    "accelerate.main": Patch(
        tuple(f"accelerate.state.{c}.{p}" for c in ("PartialState", "AcceleratorState")
              for p in ("is_main_process", "is_local_main_process")), "ftrun.worker.frameworks.accelerate",
        "--ft with ftrun.accelerate.Accelerator: the main process is the first live replica (one writer and printer "
        "whoever is away)", "undo('accelerate.main'); the properties ask Accelerate's own while no drop-in runs"),
    "fabric.plain": Patch(
        ("lightning.fabric.fabric.Fabric.__init__",), "ftrun.worker.frameworks.fabric",
        "--ft: one line when the script trains with a plain lightning.fabric.Fabric, whose loop ftrun cannot heal "
        "(the run then gets group restarts)", "undo('fabric.plain'); the wrapper calls Fabric's own __init__ first"),
    "lr_scheduler": Patch(
        ("torch.optim.lr_scheduler.LRScheduler.__init__", "torch.optim.lr_scheduler.ReduceLROnPlateau.__init__"),
        "ftrun.worker.frameworks.script_loop",
        "--ft with ftrun.accelerate.Accelerator or ftrun.fabric.Fabric: the LR schedulers the script builds are "
        "noted (weakly), so that a heal carries them and a discarded step puts them back",
        "undo('lr_scheduler'); the wrapper calls torch's own __init__ first and only notes the scheduler"),
    "ddp.hook": Patch(
        ("torch.nn.parallel.DistributedDataParallel.__init__",
         "torch.nn.parallel.DistributedDataParallel.register_comm_hook",
         "torch.nn.parallel.DistributedDataParallel._register_builtin_comm_hook"), "ftrun.worker.inject",
        "--hook without --ft: every DDP model gets the run's comm hook after its first forward, unless the "
        "script registers its own",
        "inject.uninstall(), which calls undo('ddp.hook')"),
}

# name -> [(owner, attribute, what it held before)], in the order they were installed
_installed: Dict[str, List[Tuple[Any, str, Any]]] = {}


def install(name: str, owner: Any, attr: str, replacement: Any) -> Any:
    """Set `owner.attr` to `replacement` as part of the patch `name`; returns what it held."""
    patch = PATCHES[name]  # a KeyError here: a patch that is not on the list
    if not any(t.endswith("." + attr) for t in patch.targets):
        raise ValueError(f"ftrun: patch {name!r} does not list {attr!r}")
    original = getattr(owner, attr)
    _installed.setdefault(name, []).append((owner, attr, original))
    setattr(owner, attr, replacement)
    return original


def undo(name: str) -> None:
    """Put back everything the patch `name` replaced (newest first)."""
    for owner, attr, original in reversed(_installed.pop(name, [])):
        setattr(owner, attr, original)


def installed() -> List[str]:
    """The names of the patches in force in this process."""
    return [name for name, done in _installed.items() if done]
