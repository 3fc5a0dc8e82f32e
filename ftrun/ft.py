"""ftrun's fault-tolerance API for training scripts run with `ftrun --ft`.

A few lines turn a DDP script into one whose replicas survive each other's
deaths: wrap the model, the optimizer and the data loader, loop over the run's
epochs (or its global step), register any extra state. Everything else
(membership, votes, healing, the data's position) comes from the environment
ftrun gives each worker.

    import ftrun.ft as ft
    model = ft.DistributedDataParallel(model)
    opt = ft.Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    loader = ft.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1000)
    ft.register_state("sched", scheduler)
    for epoch in ft.epochs(10):          # a restarted replica starts at the run's epoch
        for x, y in loader:              # this replica's batches, from the run's position
            opt.zero_grad(); loss_fn(model(x), y).backward()
            if opt.step():               # False: discarded, nothing changed; the batch comes again
                scheduler.step()

The three classes are torch's: ft.DistributedDataParallel is a DistributedDataParallel,
ft.Optimizer a torch.optim.Optimizer (`loss = opt.step(closure)` works, and opt.stepped says
whether that step was taken), ft.DataLoader a torch.utils.data.DataLoader.

A loop over the global step works too: `for step in ft.steps(1000):`.
A replica may also be K workers sharding the model (`ftrun --ft --replica-size K`):

    mesh = ft.device_mesh()               # this replica's K workers
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model = ft.replicate(model)           # averaged over the live replicas, healed shard by shard

No init_process_group() is needed.
"""
# Worker-side only: the launcher never imports this module (it imports torch).

import sys
import warnings
from typing import Any, Iterator, Optional, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from ftrun.worker.ft.api.data import DataLoader
from ftrun.worker.ft.api.ddp import DistributedDataParallel
from ftrun.worker.ft.manager import manager
from ftrun.worker.ft.api.optim import Optimizer

__all__ = ["DistributedDataParallel", "Optimizer", "DataLoader", "epochs", "steps", "register_state", "redo",
           "replica_id", "replica_index", "num_replicas", "global_step", "replicate", "device_mesh",
           "replica_rank"]


def replicate(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """Average `module`'s gradients over the live replicas and register it for heals: a
    fully_shard-ed model (FSDP2 over device_mesh()) shard by shard, a plain one under DDP."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        if kwargs:
            raise TypeError(f"ftrun.ft.replicate(): a fully_shard-ed model takes no options, not {sorted(kwargs)}")
        from ftrun.worker.ft.api.sharded import replicate_sharded

        return replicate_sharded(manager(), module)
    return DistributedDataParallel(module, **kwargs)


def device_mesh(mesh_shape: Optional[Tuple[int, ...]] = None,
                mesh_dim_names: Optional[Tuple[str, ...]] = None) -> DeviceMesh:
    """This replica's own workers (--replica-size K of them) as a DeviceMesh to fully_shard over;
    1-D by default, or `mesh_shape` (e.g. (2, 4) with names ("dp_shard", "tp")) multiplying to K."""
    return manager().device_mesh(mesh_shape, mesh_dim_names)


def register_state(name: str, obj: Any, compare: bool = True) -> None:
    """Send `obj.state_dict()` to restarted replicas too (an LR scheduler, a data sampler, an EMA
    of the model...). The guard checks that every replica holds the same; `compare=False` for
    state each replica keeps of its own (a running metric of its own batches), which a heal still
    moves."""
    manager().register_state(name, obj, compare)


def steps(total: int) -> Iterator[int]:
    """The global step, from where the run is (a restarted replica resumes there) to `total`."""
    mgr = manager()
    mgr.look_for_state(sys._getframe(1))
    return mgr.steps(total)


def replica_id() -> int:
    """Which replica this is: its fixed id, 0 to the replicas the run was started with, minus 1
    (RANK // --replica-size; its RANK when a replica is one worker). It never changes, whoever
    dies or comes back: name this replica's own files and log lines by it. Not a position to
    shard data by (replica_index() is)."""
    return manager().replica


def replica_index() -> int:
    """This replica's position among the replicas alive in the current step, 0 to
    num_replicas() - 1 (shard a step's data by the pair, as by dist.get_rank() and
    dist.get_world_size() without --ft). It changes as replicas die and come back; replica 0 of
    a step is one live replica, for a side effect once per step. A worker's place inside its
    replica is device_mesh().get_local_rank()."""
    return manager().replica_index


def num_replicas() -> int:
    """How many replicas take part in the current step (replica_index() counts among them)."""
    return manager().num_replicas


def replica_rank() -> int:
    """The old name of replica_id(), kept so that scripts written with it run unchanged; it warns
    (a DeprecationWarning): a "rank" reads as the position among the live replicas, which it
    is not (that is replica_index())."""
    warnings.warn("ftrun.ft.replica_rank() is ft.replica_id() (this replica's fixed id); the position among "
                  "the live replicas is ft.replica_index()", DeprecationWarning, stacklevel=2)
    return manager().replica


def global_step() -> int:
    """The global step this replica is at (the steps the run has committed): the same on every live
    replica, and where a restarted one resumes."""
    return manager().step


def epochs(total: int) -> Iterator[int]:
    """The run's training epochs, from the current one to `total` (a restarted replica, or a run
    resumed from a checkpoint, starts at the run's current epoch): `for epoch in ft.epochs(10):`."""
    from ftrun.worker.ft.api.data import TrainingEpochs

    mgr = manager()
    mgr.look_for_state(sys._getframe(1))
    if mgr.epochs_state is None:
        mgr.epochs_state = TrainingEpochs(mgr)
    return mgr.epochs_state.run(total)


def redo() -> bool:
    """True when the step just handed out was handed out before on this state: the step before
    was discarded (a peer died mid-step) or not stepped. The same on every replica. Gate the
    script's own side effects on it (an evaluation, a save, a log line) to run them once per
    step: `if step % 500 == 0 and not ft.redo(): evaluate()`. At a round's top it first reads
    the decision of the round before (its collectives went through, its vote was still out):
    voted down, the step is handed out again on the committed state, and this call says True.
    Inside a round of several steps (FTRUN_FT_ROUND_STEPS) the steps before are decided at the
    round's end: a failure later in the round may discard the state a side effect ran on, and
    the step then runs them again. A run resumed from a checkpoint hands out the checkpoint's
    step as a new one: the checkpoint holds the state from before that step's side effects."""
    return manager().redo
