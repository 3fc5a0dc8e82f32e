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
from typing import Any, Callable, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ftrun.hookspec import HookSpec
from ftrun.worker import patches, settings
from ftrun.worker.ft.member.group import local_group
from ftrun.worker.ft.member.layout import LayoutLost
from ftrun.worker.ft.manager import Manager, manager


class GradMarks:
    """Each of a model's gradients as a moment left it (`take`): the tensor itself, held weakly
    (a script may drop it), and its version counter. `untouched()`: since then no gradient was
    created, dropped, replaced or changed in place, so no backward went through the model.

    By the tensor's identity, never its address: Lightning's closure sets the gradients to None
    between the forward (where a layout round marks them) and the backward, and the Python
    object of the gradient that backward creates is often allocated at the freed one's address,
    with the same version count (the same operations made both). Taken by address for the old
    one, the new gradient read as untouched on some members only: those skipped the layout
    round's average and stepped on their own gradients, while a peer waited in the average's
    collective until gloo's timeout (a failure-free run stalled 10 s at the keeper's re-pacing,
    the first new group after training began), or every member skipped it and the replicas
    went on apart."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.marks: List[Optional[Tuple["weakref.ref[torch.Tensor]", int]]] = []

    def _now(self) -> List[Optional[torch.Tensor]]:
        return [p.grad for p in self.module.parameters()]

    def take(self) -> None:
        self.marks = [None if g is None else (weakref.ref(g), g._version) for g in self._now()]

    def untouched(self) -> bool:
        now = self._now()
        if len(now) != len(self.marks):
            return False
        for g, mark in zip(now, self.marks):
            if mark is None:
                if g is not None:
                    return False
            elif g is None or mark[0]() is not g or g._version != mark[1]:
                return False
        return True


def _done(t: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


class _Replicated:
    """What both ways of sending share: the run's hook registered on the current group (its
    state and traffic figures) and the layout round's reduction, which runs as the backward of
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
        # The layout round (mgr.layout_planned) whose reducing forward this model ran: it averages
        # in that round only, decided on what the round did, which every member did alike. What a
        # process did before differs between members (a fresh healer has no history; a survivor's
        # discarded step dropped its gradients), and a decision read from it sends a collective
        # on some members only (docs/concepts/ft-protocol.md, layout rounds).
        self.forwarded_in = -1
        self.in_bucket: Set[int] = set()  # ids of the parameters whose gradient the backward adds into its bucket
        self.marks = GradMarks(module)  # each gradient as the layout forward left it (untouched)
        mgr.on_group_change(self.rebind)

    def reduces(self) -> bool:
        """The forward that just ran is followed by a backward that reduces (not no_sync, not eval)."""
        return torch.is_grad_enabled() and self.ddp.require_backward_grad_sync

    def layout_forward(self) -> None:
        """A reducing forward in a layout round: its backward averages. Again at each attempt:
        a script that skips opt.step() (GradScaler on inf) runs the same round once more. With
        gradient_as_bucket_view a gradient kept from the last step is its bucket's view, which
        DDP divides in place: which ones is known only before the backward."""
        self.pending = True
        self.averaged = -1
        self.forwarded_in = self.mgr.layout_planned
        self.in_bucket = ({id(p) for p in self.module.parameters() if p.grad is not None}
                          if self.ddp.gradient_as_bucket_view else set())
        self.marks.take()

    def untouched(self) -> bool:
        """No backward since this model's layout forward gave it a gradient: nothing to reduce, as
        DDP reduces nothing for a model no backward went through (a GAN's generator, forwarded in
        the discriminator's step, has its backward in its own: with several ft.Optimizers its
        reduction waits for it, member/iteration.py)."""
        return self.marks.untouched()

    def after_backward(self) -> None:
        """A backward returned: in a layout round, average this model's gradients now, also in
        one that is discarded (the script's clipping or inf check must agree on every replica)."""
        mgr = self.mgr
        if (self.pending and self.forwarded_in == mgr.layout_planned and mgr.layout_round and mgr.layout_can_average()
                and not self.untouched()):
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
        """The layout round's one reduction (see _attach), counted in the hook's figures; once
        a round (after the backward, or in the vote when no backward reduced)."""
        if (self.averaged == self.mgr.layout_serial or self.forwarded_in != self.mgr.layout_planned
                or self.untouched()):
            return
        self.averaged = self.mgr.layout_serial  # a failure is not retried: the round is voted down
        if self.reg is None or self.mgr.pg is None:
            raise LayoutLost("no group to average the layout round's gradients over")
        try:
            self.reduce_layout(self.mgr.pg)
        except Exception as e:
            # A collective's failure (a peer left), a gradient no collective can send, or anything
            # in a round that failed already votes the round down; DDP's own error in a sound round
            # (a parameter that got no gradient) is the script's, as under DDP: voted down, it
            # would be retried for ever.
            if isinstance(e, ValueError) or _collective_failure(e) or not self.mgr.round_ok:
                raise LayoutLost(str(e)) from None  # (a backward a failure cut short leaves DDP half-way)
            raise

    def reduce_layout(self, pg: dist.ProcessGroup) -> None:
        """Reduce the gradients over `pg` as the next round's buckets will (ReducerPath, ReplicaHook)."""
        raise NotImplementedError


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

    def reduce_layout(self, pg: dist.ProcessGroup) -> None:
        """Through the run's hook, bucket by bucket, as DDP hands the buckets to it (the hook counts them)."""
        reg = self.reg
        reduce_as_ddp(self.ddp, pg, lambda bucket: reg.hook(reg.state, bucket), None, set())


class ReducerPath(_Replicated):
    """The default hook: DDP's reducer all-reduces on the quorum's group itself.

    DDP was built on a group of one. A forward that may rebuild the buckets, and the layout
    round's rebuild, start there (a rebuild syncs the layout over the reducer's group, which
    must never be a collective with peers), and a forward that a reducing backward follows
    ends on the group this round's buckets go to: the quorum's, or the group of one when the
    round must not send (a layout round, a round known to have failed). Every new group
    (rebind) resets the reducer, and its first round is a layout round: each member records
    the order in which its gradients become ready and rebuilds its buckets from it right after
    that backward (reduce_as_ddp), so all members, newcomers included, send the same buckets.
    A reset also clears a backward that failed half-way."""

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

    def reduce_layout(self, pg: dist.ProcessGroup) -> None:
        """As the reducer would: each bucket divided by the group's size as DDP divides it, then summed."""
        self._use(self.local)  # the rebuild below syncs the layout over the reducer's group: never peers
        # The group's own call, not dist.all_reduce: with a default group in the script, torch's
        # error logger replaces a failed collective's error by "not initialized in the world
        # group map" (ftrun's groups are not in torch's registry), and that reached the console.
        reduce_as_ddp(self.ddp, pg, lambda bucket: pg.allreduce([bucket.buffer()]).get_future(), pg.size(),
                      self.in_bucket)
        self.reg.count_step(self.nbytes)


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
    if _depth == 0:  # a reentrant checkpoint's backward runs inside the outer one: DDP's is not done yet
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
    so every member records the same order; right after it each member
    rebuilds the same buckets from that order and reduces them as the next
    round will (reduce_as_ddp), and the round is voted like any other, so the
    user's loop never sees a step twice and the step ends bitwise as it would
    in a run that never changed groups. (Forcing parameter
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
    ddp._ftrun_path = path  # (ready_backward)
    _reducer_params(ddp)  # as the reducer has them now
    _guard_backward(path)
    if mgr.pg is not None:
        path.rebind(mgr.pg)


def ready_backward(ddp: TorchDDP, output: Any) -> None:
    """Ready ft's DDP `ddp` for one backward of `output` run inside its forward, as Lightning's
    manual optimization runs them (training_step, and each manual_backward in it, inside the
    wrapper's forward, DDP's own preparation at the forward's end held back): the reduction is
    set as at a reducing forward's end (the group this backward's buckets go to, a layout round's
    average after it), then DDP's reducer as Lightning's prepare_for_backward sets it. Several
    backward passes of one forward (a GAN's discriminator, then its generator) each reduce."""
    from torch.nn.parallel.distributed import _find_tensors

    path: _Replicated = ddp._ftrun_path
    if not path.reduces():
        ddp.require_forward_param_sync = False
        return
    if isinstance(path, ReducerPath):
        path._use(path.local)  # a rebuild syncs the layout over the reducer's group: never peers
    if ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True
    path._after_forward(ddp, (), output)
    ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_backward(list(_find_tensors(output)) if ddp.find_unused_parameters else [])


# Hooks whose round is an average of gradients: their layout round can be one too. Local SGD
# averages parameters on a schedule and noop averages nothing: theirs is still discarded.
GRADIENT_AVERAGING = ("allreduce", "fp16", "bf16", "powersgd", "batched-powersgd")


def reduce_as_ddp(ddp: TorchDDP, pg: dist.ProcessGroup, send: Callable[[dist.GradBucket], torch.futures.Future],
                  divide: Optional[int], in_bucket: Set[int]) -> None:
    """The layout round's reduction over `pg`: bitwise what DDP's next round computes from the same
    gradients, so a step that runs as a layout round (after a heal, a resume, any new group)
    ends as it would in a run that never changed groups.

    Both the grouping and the division show in the result: a collective's sum depends on how its
    elements lie in the buffer (gloo's ring splits a buffer among the ranks and adds each part in
    another order), and g/n differs from g*(1/n). So the buckets are the ones the next round
    sends, built now from the order in which this backward's gradients became ready (DDP would
    build the same ones at the next forward), each filled as DDP fills it (without a hook, that
    is `divide` given, divided by the group's size: in place for a gradient already in its
    bucket, else as it is copied in; a parameter without a gradient sends zeros), handed to
    `send` (a future of the summed buffer), and copied back into the gradients; with
    find_unused_parameters, a parameter no replica used keeps its gradient, as DDP leaves it.
    Holds one more copy of the gradients while it runs. A failed collective, or a gradient that
    is not dense, raises: the round is voted down."""
    reducer = ddp.reducer
    if reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True  # DDP's own mirror of the reducer's flag: its next forward rebuilds nothing
    buckets = reducer._get_zeros_like_grad_buckets()
    used: Optional[torch.Tensor] = None
    if ddp.find_unused_parameters:
        used = reducer._get_local_used_map().clone()  # this backward's, on the group of one
        pg.allreduce([used]).wait()
        used = used.cpu()  # read once per parameter below: one copy, not one device read each
        index = {id(p): i for i, p in enumerate(_reducer_params(ddp))}
    batched = getattr(ddp, "batched_grad_copy", False)  # DDP then copies a bucket whole and divides it once
    sending = []
    for bucket in buckets:
        buf, params = bucket.buffer(), bucket.parameters()
        offsets = [g.storage_offset() - buf.storage_offset() for g in bucket.gradients()]
        for p, view in zip(params, _views(buf, offsets, params)):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise ValueError("a gradient that is not dense cannot be averaged in the layout round")
            if divide is None:  # a comm hook divides, if at all
                view.copy_(g)
            elif batched or id(p) in in_bucket:
                view.copy_(g).div_(divide)
            else:
                torch.mul(g, 1.0 / divide, out=view)
        sending.append((params, offsets, send(bucket)))
    for params, offsets, fut in sending:
        out = fut.wait()
        for p, view in zip(params, _views(out[0] if isinstance(out, list) else out, offsets, params)):
            if used is not None and not used[index[id(p)]]:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(view)  # laid out as the parameter, as DDP creates it
            else:
                p.grad.copy_(view)


def _views(flat: torch.Tensor, offsets: List[int], params: List[torch.Tensor]) -> List[torch.Tensor]:
    """Each parameter's place in a bucket's buffer, laid out as DDP lays it: with the parameter's
    strides where its memory is dense (a channels_last weight's gradient lies in that order)."""
    return [flat.as_strided(p.size(), p.stride(), flat.storage_offset() + o) if _dense(p)
            else flat[o:o + p.numel()].view(p.size())
            for p, o in zip(params, offsets)]


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its memory without gaps or overlaps in some order of its
    dimensions (what torch calls non-overlapping and dense)."""
    if t.is_contiguous():
        return True
    need = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
        if stride != need:
            return False
        need *= size
    return True


def _reducer_params(ddp: TorchDDP) -> List[torch.nn.Parameter]:
    """The parameters in the reducer's order, which indexes its map of used parameters: those that
    took gradients when DDP was built (_attach asks first), as the reducer keeps them, also while
    the script turns requires_grad off for some (Lightning's toggle_optimizer)."""
    found = getattr(ddp, "_ftrun_reducer_params", None)
    if found is None:
        ignore = getattr(ddp, "parameters_to_ignore", ())
        found = ddp._ftrun_reducer_params = [p for name, p in ddp.module.named_parameters()
                                             if p.requires_grad and name not in ignore]
    return found
