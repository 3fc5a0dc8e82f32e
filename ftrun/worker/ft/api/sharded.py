"""A sharded replica under --ft: FSDP2 inside the replica, ftrun's average across replicas.

FSDP2 keeps doing what it does inside the replica (all-gather, reduce-scatter
over the replica's own mesh, untouched). Its all-reduce hook, called with
each reduce-scattered gradient shard, sums that shard over the quorum's group
of the same shard index (worker j of every live replica) and divides by the
number of live replicas; FSDP2 itself is set to sum and divide by the
replica's size afterwards. So the result is the exact mean over every
worker of every live replica, whatever the backend's own averaging does
(ReduceOp.AVG is not what gloo does for every collective). A collective
that fails marks the round failed and leaves the shard as it was: nothing
raises into the user's loop, and the vote discards the round.
Must never import the supervisor.
"""

from __future__ import annotations

from typing import Optional

import torch

from ftrun.hookspec import HookSpec
from ftrun.worker import settings
from ftrun.worker.ft.manager import Manager

# What --hook / --wrap may ask of the cross-replica reduce of a shard (the launcher refuses
# the others for --replica-size > 1): average, optionally sent in half precision.
_COMPRESS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _compression(spec: Optional[HookSpec]) -> Optional[torch.dtype]:
    if spec is None:
        return None
    return _COMPRESS.get(spec.wrap or "") or _COMPRESS.get(spec.name)


class CrossReplicaMean:
    """FSDP2's all-reduce hook: the mean of a gradient shard over the live replicas, in place."""

    def __init__(self, mgr: Manager, dtype: Optional[torch.dtype]) -> None:
        self.mgr = mgr
        self.dtype = dtype

    def __call__(self, shard: torch.Tensor) -> None:
        mgr = self.mgr
        mgr.before_collective()
        pg = mgr.pg
        if pg is None or not mgr.round_ok:
            mgr.fail_round()
            return
        n = pg.size()
        if n == 1:
            return
        try:
            if self.dtype is not None and shard.dtype != self.dtype:
                # Divide first: a sum of n half-precision shards may overflow where the mean does not.
                half = (shard / n).to(self.dtype)
                pg.allreduce([half]).wait()
                shard.copy_(half)
            else:
                pg.allreduce([shard]).wait()
                shard.div_(n)
        except Exception as e:  # the group broke while sending: this round is voted down
            mgr.fail_round(str(e))


def replicate_sharded(mgr: Manager, model: torch.nn.Module) -> torch.nn.Module:
    """Register a fully_shard-ed model for heals and average its gradients across replicas."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not isinstance(model, FSDPModule):
        raise TypeError("ftrun.ft.replicate(model): the model's root is not fully_shard-ed; call "
                        "fully_shard(model, mesh=ft.device_mesh()) on the root too (after its blocks)")
    raw = settings.current().hook
    hook = CrossReplicaMean(mgr, _compression(HookSpec.from_json(raw) if raw else None))
    for m in modules:
        # Sum inside the replica and let FSDP2 divide by its size after our hook; the hook
        # divides by the live replicas. Set on every FSDP module: each has its own param group.
        m.set_force_sum_reduction_for_comms(True)
        try:
            m.set_all_reduce_hook(hook)
        except ValueError as e:  # several param groups in one module: per-parameter meshes
            raise TypeError(f"ftrun.ft.replicate(): {type(m).__name__} has several FSDP parameter groups "
                            f"(per-parameter meshes); ftrun averages one group per module across replicas "
                            f"({str(e).splitlines()[0][:120]})") from None
    mgr.register_model(model)
    return model
