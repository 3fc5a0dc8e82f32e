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
    ft.register_state("sched", scheduler)
    for epoch in ft.epochs(10):          # a restarted replica starts at the run's epoch
        for x, y in loader:              # this replica's batches, from the run's position
            opt.zero_grad(); loss_fn(model(x), y).backward()
            if opt.step():               # False: discarded, nothing changed; the batch comes again
                scheduler.step()

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

from typing import Any, Iterator, Optional, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from ftrun.worker.ft.ddp import wrap_model
from ftrun.worker.ft.manager import manager
from ftrun.worker.ft.optim import ReplicaOptimizer

__all__ = ["DistributedDataParallel", "Optimizer", "register_state", "steps", "replica_index",
           "num_replicas", "global_step", "replica_rank", "replicate", "device_mesh", "redo", "DataLoader",
           "epochs"]


def DistributedDataParallel(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """torch DDP whose gradients are averaged over the replicas alive at each step."""
    return wrap_model(manager(), module, **kwargs)


def replicate(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """Average `module`'s gradients over the live replicas and register it for heals: a
    fully_shard-ed model (FSDP2 over device_mesh()) shard by shard, a plain one under DDP."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        if kwargs:
            raise TypeError(f"ftrun.ft.replicate(): a fully_shard-ed model takes no options, not {sorted(kwargs)}")
        from ftrun.worker.ft.sharded import replicate_sharded

        return replicate_sharded(manager(), module)
    return wrap_model(manager(), module, **kwargs)


def device_mesh(mesh_shape: Optional[Tuple[int, ...]] = None,
                mesh_dim_names: Optional[Tuple[str, ...]] = None) -> DeviceMesh:
    """This replica's own workers (--replica-size K of them) as a DeviceMesh to fully_shard over;
    1-D by default, or `mesh_shape` (e.g. (2, 4) with names ("dp_shard", "tp")) multiplying to K."""
    return manager().device_mesh(mesh_shape, mesh_dim_names)


def Optimizer(*optimizers: torch.optim.Optimizer) -> ReplicaOptimizer:
    """Wrap the run's optimizer, or all of them (`ft.Optimizer(adamw, muon)`): its step()
    commits the round on every replica or on none, and steps every optimizer it holds."""
    return ReplicaOptimizer(manager(), *optimizers)


def register_state(name: str, obj: Any) -> None:
    """Send `obj.state_dict()` to restarted replicas too (an LR scheduler, a data sampler...)."""
    manager().register_state(name, obj)


def steps(total: int) -> Iterator[int]:
    """The global step, from where the run is (a restarted replica resumes there) to `total`."""
    return manager().steps(total)


def replica_index() -> int:
    """This replica's position among the live replicas (use it to shard data)."""
    return manager().replica_index


def num_replicas() -> int:
    """How many replicas take part in the current step."""
    return manager().num_replicas


def replica_rank() -> int:
    """This replica's fixed id (RANK // --replica-size; its RANK when a replica is one worker).
    A worker's place inside its replica is device_mesh().get_local_rank() of its size."""
    return manager().replica


def global_step() -> int:
    """The global step this replica is at (the steps the run has committed): the same on every live
    replica, and where a restarted one resumes."""
    return manager().step


def DataLoader(dataset: Any, batch_size: int = 1, shuffle: Optional[bool] = None, seed: Optional[int] = None,
               drop_last: Optional[bool] = None, sampler: Any = None, **kwargs: Any) -> Any:
    """torch's DataLoader for --ft: this replica's batches from the run's current position, every
    sample of an epoch trained once in committed steps whatever fails. `batch_size` is per
    worker; `shuffle` (default False) and `seed` (default 0) are DistributedSampler's, or taken,
    with its drop_last, from the script's own `sampler=DistributedSampler(...)`, so that
    `DataLoader(ds, sampler=DistributedSampler(ds))` ports as `ft.DataLoader(ds,
    sampler=DistributedSampler(ds))`; a `seed` given beside it wins. Epoch e is ordered as the
    sampler after set_epoch(e), e counting from 0 in ft.epochs(): a script that called
    set_epoch(1..N) passes seed=1 (the sampler's seed plus one) to train the same order. Every other DataLoader argument works. Said in one line:
    an empty dataset (the run stops), replicas whose datasets differ in length or in a Subset's
    indices (the run stops: an unseeded random_split), a shuffle or seed unlike the one of a
    DistributedSampler the script built over the dataset (said once, the run goes on)."""
    from ftrun.worker.ft.data import DataLoader as FtDataLoader

    return FtDataLoader(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                        sampler=sampler, **kwargs)


def epochs(total: int) -> Iterator[int]:
    """The run's training epochs, from the current one to `total` (a restarted replica, or a run
    resumed from a checkpoint, starts at the run's current epoch): `for epoch in ft.epochs(10):`."""
    from ftrun.worker.ft.data import Epochs

    mgr = manager()
    if mgr.epochs_state is None:
        mgr.epochs_state = Epochs(mgr)
    return mgr.epochs_state.run(total)


def redo() -> bool:
    """True when the step just handed out was handed out before on this state: the step before
    was discarded (a peer died mid-step) or not stepped. The same on every replica. Gate the
    script's own side effects on it (an evaluation, a save, a log line) to run them once per
    step: `if step % 500 == 0 and not ft.redo(): evaluate()`. A run resumed from a checkpoint
    hands out the checkpoint's step as a new one: the checkpoint holds the state from before
    that step's side effects."""
    return manager().redo
