"""DDP for --ft: torch's DDP with gradients averaged over the live replicas.

Torch's DDP keeps doing what it does well (buckets, overlap with backward).
With the default hook (a plain averaging all-reduce) DDP's own C++ reducer
sends each bucket over the current quorum's group: no Python runs per
bucket, so a failure-free --ft step costs what plain DDP's does. ftrun
points the reducer at the quorum's group before each backward (at a group of
one when the round must not send) and turns a collective that fails inside
the backward into a failed round (`torch.autograd.backward` is wrapped for
that, listed in ftrun/worker/patches.py, and only re-raises what is not a
collective failure). Once the round is known lost (a member of its quorum
is gone and a newer quorum is out: member/driver.py `abandoned`), a check on
each parameter's gradient stops that backward where it is, so the survivors
of a failure compute no gradients nobody will apply. Any other hook
(--hook, --wrap) is a Python comm hook that sends through the run's chosen
hook (ftrun.worker.hooks) on the quorum's group. Either way the hook state is
rebuilt on every member whenever the group changes, so it never silently
diverges, and nothing raises into the user's loop for a failed collective.
Must never import the supervisor.
"""

import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ftrun.hookspec import HookSpec
from ftrun.worker import patches, settings
from ftrun.worker.ft.member.group import local_group
from ftrun.worker.ft.manager import Manager, manager


def _done(t: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


class _Replicated:
    """What both ways of sending share: the run's hook registered on the current group (its
    state and traffic figures) and the layout round's average, which runs as the backward of
    a forward that reduces returns (the script reads averaged gradients, as under DDP: a
    clip_grad_norm_ or GradScaler's inf check sees the same on every replica)."""

    def __init__(self, mgr: Manager, spec: HookSpec, module: torch.nn.Module, ddp: TorchDDP) -> None:
        self.mgr = mgr
        self.spec = spec
        self.module = module
        self.ddp = ddp
        self.reg: Any = None
        self.pending = False  # a reducing forward ran in a layout round: its backward averages
        self.averaged = -1    # the layout round (mgr.layout_serial) whose average this model ran
        mgr.on_group_change(self.rebind)

    def reduces(self) -> bool:
        """The forward that just ran is followed by a backward that reduces (not no_sync, not eval)."""
        return torch.is_grad_enabled() and self.ddp.require_backward_grad_sync

    def layout_forward(self) -> None:
        """A reducing forward in a layout round: its backward averages. Again at each attempt:
        a script that skips opt.step() (GradScaler on inf) runs the same round once more."""
        self.pending = True
        self.averaged = -1

    def after_backward(self) -> None:
        """A backward returned: in a layout round, average this model's gradients now, also in
        one that is discarded (the script's clipping or inf check must agree on every replica)."""
        mgr = self.mgr
        if self.pending and mgr.layout_round and mgr.layout_can_average():
            self.pending = False
            mgr.layout_average([self.layout_average])

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
        """The layout round's one average (see _attach), counted in the hook's figures; once
        a round (after the backward, or in the vote when no backward reduced)."""
        if self.averaged == self.mgr.layout_serial:
            return
        self.averaged = self.mgr.layout_serial  # a failure is not retried: the round is voted down
        sent = average_gradients(self.mgr.pg, self.module)
        if self.reg is not None:
            stats = self.reg.stats
            stats.steps += 1
            stats.bytes_sent += sent
            stats.bytes_dense += sent
            stats.last_step_bytes = sent


class ReplicaHook(_Replicated):
    """The Python comm hook DDP calls for any hook but the default one."""

    def __init__(self, mgr: Manager, spec: HookSpec, module: torch.nn.Module, ddp: TorchDDP) -> None:
        super().__init__(mgr, spec, module, ddp)
        ddp.register_forward_hook(self._after_forward)

    def _after_forward(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self.mgr.layout_round and self.reduces():
            self.layout_forward()

    def __call__(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        mgr, buf = self.mgr, bucket.buffer()
        mgr.before_collective()
        if mgr.layout_round:
            return _done(buf)
        if self.reg is None or not mgr.round_ok:
            mgr.fail_round()
            return _done(buf)
        try:
            fut = self.reg.hook(self.reg.state, bucket)
        except Exception as e:  # the group broke while sending: this round is voted down
            mgr.fail_round(str(e))
            return _done(buf)

        def guard(f: torch.futures.Future) -> torch.Tensor:
            try:
                return f.value()
            except Exception as e:
                mgr.fail_round(str(e))
                return buf

        return fut.then(guard)


class ReducerPath(_Replicated):
    """The default hook: DDP's reducer all-reduces on the quorum's group itself.

    DDP was built on a group of one. A forward that may rebuild the buckets starts there
    (it syncs their layout over the reducer's group, which must never be a collective with
    peers), and a forward that a reducing backward follows ends on the group this round's
    buckets go to: the quorum's, or the group of one when the round must not send (a layout
    round, a round known to have failed). Every new group (rebind) resets the
    reducer, and its first round is a layout round: each member records the order in which
    its gradients become ready and rebuilds its buckets from it at the next forward, so all
    members, newcomers included, send the same buckets. A reset also clears a backward that
    failed half-way."""

    def __init__(self, mgr: Manager, spec: HookSpec, module: torch.nn.Module, ddp: TorchDDP) -> None:
        self.local = ddp.process_group
        self.on: dist.ProcessGroup = self.local
        # What the reducer sends per step: every parameter that takes a gradient, once.
        self.nbytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        super().__init__(mgr, spec, module, ddp)
        ddp.register_forward_pre_hook(self._before_forward)
        ddp.register_forward_hook(self._after_forward)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._check)

    def _check(self, _param: torch.Tensor) -> None:
        """After each gradient of a backward that sends to the quorum: stop it if the round is lost.
        Only inside ftrun's guarded backward, which catches what this raises (never the script)."""
        if _depth and self.armed:
            why = self.mgr.abandoned()
            if why:
                raise RoundLost(why)

    def rebind(self, pg: Optional[dist.ProcessGroup]) -> None:
        super().rebind(pg)
        self._use(self.local)  # also lets a dropped group go at once: its peers see it closed
        self.ddp.reducer._reset_state()
        self.ddp._has_rebuilt_buckets = False  # DDP's own mirror of the reducer's flag, as its reset keeps it

    @property
    def armed(self) -> bool:
        """The reducer is on the quorum's group: a collective failure in a backward is this round's."""
        return self.on is not self.local

    def _use(self, pg: dist.ProcessGroup) -> None:
        if pg is not self.on:
            self.ddp.reducer._update_process_group(pg)
            self.on = pg

    def _before_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        if not self.ddp._has_rebuilt_buckets:  # this forward may rebuild the buckets
            self._use(self.local)

    def _after_forward(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if not self.reduces():
            return  # no reduction follows this forward
        mgr = self.mgr
        mgr.before_collective()  # the previous round's decision is in before anything is sent
        if mgr.layout_round:
            self._use(self.local)
            self.layout_forward()
            return
        if not mgr.round_ok or mgr.pg is None or self.reg is None:
            if mgr.quorum is not None:
                mgr.fail_round()  # the round is already known to have failed: nothing goes out
            self._use(self.local)
            return
        self._use(mgr.pg)
        self.reg.count_step(self.nbytes)

    def failed(self, error: BaseException) -> None:
        self.mgr.fail_round(str(error))
        self._use(self.local)
        self.ddp.reducer._reset_state()  # the next forward must not wait for this backward's reduction
        self.ddp._has_rebuilt_buckets = False


# Every wrapped model's path (weakly: a model the script drops is gone), and torch's own
# backward, which the guard calls.
_paths: List["weakref.ref[_Replicated]"] = []
_torch_backward: Any = None
# How many guarded backwards are running (a reentrant checkpoint's backward runs inside another):
# not a thread-local, as on CUDA the gradient hooks run on autograd's device threads.
_depth = 0


class RoundLost(Exception):
    """Raised by a gradient hook to stop a backward whose round can no longer commit; caught by
    the outermost guarded backward, never seen by the script."""


def _collective_failure(e: BaseException) -> bool:
    """Whether a backward failed in a collective (a peer died, a group was aborted or timed out):
    gloo's errors name gloo, and torch raises its own distributed errors as DistError. A user's
    error (a shape, a graph freed twice, DDP misuse) is neither, and reaches the user."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return "gloo" in text or "nccl" in text


def _guarded_backward(*args: Any, **kwargs: Any) -> Any:
    """torch.autograd.backward, but a collective failure of a reducer on a quorum's group fails
    the round instead of raising (the optimizer then leaves the state as it was), and in a
    layout round the gradients are averaged before it returns."""
    global _depth
    paths = [p for p in (r() for r in _paths) if p is not None]
    armed = [p for p in paths if isinstance(p, ReducerPath) and p.armed]
    _depth += 1
    try:
        result = _torch_backward(*args, **kwargs)
    except RoundLost as e:
        if _depth > 1:  # a backward inside a backward (reentrant checkpoint): the outermost one stops
            raise
        for p in armed:
            p.failed(e)
        return None
    except RuntimeError as e:
        if not armed or not _collective_failure(e):
            raise
        for p in armed:
            p.failed(e)
        return None
    finally:
        _depth -= 1
    for p in paths:
        p.after_backward()
    return result


def _guard_backward(path: _Replicated) -> None:
    global _torch_backward
    _paths[:] = [r for r in _paths if r() is not None] + [weakref.ref(path)]
    if _torch_backward is None:
        # Tensor.backward() calls torch.autograd.backward by name, as do Lightning and Accelerate.
        _guarded_backward.__doc__ = torch.autograd.backward.__doc__
        _torch_backward = patches.install("autograd.backward", torch.autograd, "backward", _guarded_backward)


class DistributedDataParallel(TorchDDP):
    """torch's DistributedDataParallel whose gradients are averaged over the replicas alive at
    each step: `ft.DistributedDataParallel(model, **ddp_options)` is a
    torch.nn.parallel.DistributedDataParallel (isinstance holds, `model.module` is the model,
    `no_sync()` works). Every DDP option but process_group= (ftrun chooses the group: the live
    replicas) and static_graph=True works."""

    def __init__(self, module: torch.nn.Module, **kwargs: Any) -> None:
        mgr = manager()
        if mgr.k > 1:
            raise TypeError(f"ftrun.ft: with --replica-size {mgr.k} each replica's {mgr.k} workers shard the model: "
                            f"fully_shard(...) its blocks and root over ft.device_mesh(), then ft.replicate(model) "
                            f"(DDP replicates a whole model per worker: use --replica-size 1 for that)")
        if "process_group" in kwargs:
            raise TypeError("ftrun.ft.DistributedDataParallel(process_group=...): under --ft ftrun chooses the group "
                            "(the replicas alive at each step): drop process_group=")
        if kwargs.get("static_graph"):
            # Measured: with it, a replica that heals ends with parameters that differ from its peers'.
            raise TypeError("ftrun.ft.DistributedDataParallel(static_graph=True) is not supported under --ft (a "
                            "replica that heals would not reduce the same buckets as its peers): drop static_graph=True")
        mgr.register_model(module)
        mgr.uses_ddp = True
        if torch.cuda.is_available() and "device_ids" not in kwargs:
            kwargs["device_ids"] = [settings.current().local_rank]
        super().__init__(module, process_group=local_group(), **kwargs)
        _attach(mgr, module, self)


def _attach(mgr: Manager, module: torch.nn.Module, ddp: TorchDDP) -> None:
    """Point a new DDP's reduction at the live replicas (see the module's docstring).

    DDP rebuilds its buckets once, at the second forward, in the order the
    gradients became ready in the first backward (reverse order of use, which
    lets each bucket's allreduce overlap the rest of the backward). A replica
    that joins later would run its first step on the initial layout while its
    peers use the rebuilt one, and the sums would mix mismatched slices. So the
    first round after a heal (with the default hook: on every new group) is a
    layout round (manager.layout_round): nothing is sent during the backward,
    so every member records the same order and rebuilds the same buckets at
    its next forward; the gradients are averaged once after the backward, in
    parameter order (average_gradients), and the round is voted like any
    other, so the user's loop never sees a step twice. (Forcing parameter
    order on every replica instead cost 20% of a small model's step: no overlap.)"""
    raw = settings.current().hook
    spec = HookSpec.from_json(raw) if raw else HookSpec("allreduce")
    sparse = any(getattr(m, "sparse", False) is True for m in module.modules())  # nn.Embedding(sparse=True)
    if spec.name == "allreduce" and spec.wrap is None:
        path: _Replicated = ReducerPath(mgr, spec, module, ddp)
        mgr.layout_each_group = True
    else:
        path = ReplicaHook(mgr, spec, module, ddp)

        def ftrun_ft_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return path(state, bucket)

        ddp.register_comm_hook(None, ftrun_ft_hook)
    # One entry per wrapped model: a layout round averages every model's gradients, or is
    # discarded when one of them cannot be averaged.
    mgr.layout_averages.append(path.layout_average if spec.name in GRADIENT_AVERAGING and not sparse else None)
    _guard_backward(path)
    if mgr.pg is not None:
        path.rebind(mgr.pg)


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
            # The group's own call, not dist.all_reduce: with a default group in the script, torch's
            # error logger replaces a failed collective's error by "not initialized in the world
            # group map" (ftrun's groups are not in torch's registry), and that reached the console.
            pg.allreduce([flat]).wait()
            sent += flat.numel() * flat.element_size()
            flat.div_(n)
            offset = 0
            for p in chunk:
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            start = end
    return sent
