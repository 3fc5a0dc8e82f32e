"""DDP for --ft: torch's DDP on a group of one, with gradients averaged over the live replicas.

Torch's DDP keeps doing what it does well (buckets, overlap with backward);
its comm hook sends each bucket over the current epoch's group through the
run's chosen hook (ftrun.worker.hooks), so the average is over exactly the
replicas that take part. The hook state is rebuilt on every member whenever
the group changes, so it never silently diverges. A collective that fails
marks the round failed and hands DDP the local buffer: nothing raises into
the user's loop.
Must never import the supervisor.
"""

import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ftrun.hookspec import HookSpec
from ftrun.worker.ft.group import local_group
from ftrun.worker.ft.manager import Manager


def _done(t: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


class ReplicaHook:
    """The comm hook DDP calls; rebound to each new group by the manager."""

    def __init__(self, mgr: Manager, spec: HookSpec, module: torch.nn.Module) -> None:
        self.mgr = mgr
        self.spec = spec
        self.module = module
        self.reg: Any = None
        mgr.on_group_change(self.rebind)

    def rebind(self, pg: Optional[dist.ProcessGroup]) -> None:
        from ftrun.worker.hooks import Registration

        self.reg = None
        if pg is None:
            return
        self.reg = Registration(self.spec, self.module, pg)
        state = self.reg.state
        if hasattr(state, "start_powerSGD_iter"):
            # Every member starts the fresh state at the same, global, iteration.
            state.iter = self.mgr.step

    def layout_average(self) -> None:
        """The layout round's one average (see wrap_model), counted in the hook's figures."""
        sent = average_gradients(self.mgr.pg, self.module)
        if self.reg is not None:
            stats = self.reg.stats
            stats.steps += 1
            stats.bytes_sent += sent
            stats.bytes_dense += sent
            stats.last_step_bytes = sent

    def __call__(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        mgr, buf = self.mgr, bucket.buffer()
        mgr.before_collective()
        if mgr.layout_round:
            return _done(buf)
        if self.reg is None or not mgr.round_ok:
            mgr.fail_round()
            return _done(buf)
        plain = self.reg.plain  # the default all-reduce: its future holds the collective's list
        try:
            fut = self.reg.send_plain(bucket) if plain else self.reg.hook(self.reg.state, bucket)
        except Exception as e:  # the group broke while sending: this round is voted down
            mgr.fail_round(str(e))
            return _done(buf)

        def guard(f: torch.futures.Future) -> torch.Tensor:
            try:
                return f.value()[0] if plain else f.value()
            except Exception as e:
                mgr.fail_round(str(e))
                return buf

        return fut.then(guard)


def wrap_model(mgr: Manager, module: torch.nn.Module, **kwargs: Any) -> TorchDDP:
    if mgr.k > 1:
        raise TypeError(f"ftrun.ft: with --replica-size {mgr.k} each replica's {mgr.k} workers shard the model: "
                        f"fully_shard(...) its blocks and root over ft.device_mesh(), then ft.replicate(model) "
                        f"(DDP replicates a whole model per worker: use --replica-size 1 for that)")
    mgr.register_model(module)
    mgr.uses_ddp = True
    if torch.cuda.is_available() and "device_ids" not in kwargs:
        kwargs["device_ids"] = [int(os.environ.get("LOCAL_RANK", "0"))]
    ddp = TorchDDP(module, process_group=local_group(), **kwargs)
    # DDP rebuilds its buckets once, at the second forward, in the order the
    # gradients became ready in the first backward (reverse order of use, which
    # lets each bucket's allreduce overlap the rest of the backward). A replica
    # that joins later would run its first step on the initial layout while its
    # peers use the rebuilt one, and the hook would sum mismatched slices. So the
    # first round after every heal is a layout round (manager.layout_round):
    # the hook sends nothing, so the newcomer's DDP records the same order as
    # its peers did and rebuilds the same buckets at its next forward; the
    # gradients are averaged once after the backward, in parameter order
    # (average_gradients), and the round is voted like any other, so the
    # user's loop never sees a step twice. (Forcing parameter order on every
    # replica instead cost 20% of a small model's step: no overlap.)
    raw = os.environ.get("FTRUN_HOOK")
    spec = HookSpec.from_json(raw) if raw else HookSpec("allreduce")
    hook = ReplicaHook(mgr, spec, module)
    sparse = any(getattr(m, "sparse", False) is True for m in module.modules())  # nn.Embedding(sparse=True)
    if spec.name in GRADIENT_AVERAGING and not sparse:
        mgr.layout_average = hook.layout_average

    def ftrun_ft_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)

    ddp.register_comm_hook(None, ftrun_ft_hook)
    if mgr.pg is not None:
        hook.rebind(mgr.pg)
    return ddp


# Hooks whose round is an average of gradients: their layout round can be one too. Local SGD
# averages parameters on a schedule and noop averages nothing: theirs is still discarded.
GRADIENT_AVERAGING = ("allreduce", "fp16", "bf16", "powersgd", "batched-powersgd")
CHUNK_BYTES = 64 << 20  # one flat buffer of at most this much per collective: memory stays bounded


def average_gradients(pg: dist.ProcessGroup, module: torch.nn.Module) -> int:
    """The layout round's average: every parameter's gradient averaged over the group, in the
    parameters' order (the same on every replica), in flat chunks of one dtype. A parameter
    without a gradient here sends zeros and keeps none, as DDP on its group of one leaves it.
    No host synchronisation (NCCL: the vote's settle bounds the wait). A failed collective, or
    a gradient that is not dense, raises: the round is voted down. Returns the bytes sent."""
    params = [p for p in module.parameters() if p.requires_grad]
    if any(p.grad is not None and p.grad.layout != torch.strided for p in params):
        raise ValueError("a gradient that is not dense cannot be averaged in the layout round")
    n, sent = pg.size(), 0
    by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group in by_dtype.values():
        start = 0
        while start < len(group):
            end, size = start, 0
            while end < len(group) and (end == start or size + group[end].nbytes <= CHUNK_BYTES):
                size += group[end].nbytes
                end += 1
            chunk = group[start:end]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(p.dtype)
                              for p in chunk])
            dist.all_reduce(flat, group=pg)
            sent += flat.numel() * flat.element_size()
            flat.div_(n)
            offset = 0
            for p in chunk:
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            start = end
    return sent
