"""HookSpec -> (state, hook) on a given process group; one registry.

Builds every hook of the catalogue from torch's own
`torch.distributed.algorithms.ddp_comm_hooks` and adds only what torch lacks
on CPU/gloo (bf16 without NCCL, a batched PowerSGD that compresses, a local
SGD subgroup built without CUDA, collectives issued in a deterministic order).
Also keeps per-rank traffic figures (`current_stats()`; one line every
FTRUN_HOOK_LOG_EVERY steps (default 100) and one at exit, totals across every registration a model had,
so --ft's rebuilt hooks add up) and exports, imports and resets hook state for
the fault-tolerance code.

Runs inside a training process. Must never change gradients beyond what the
chosen torch hook does, never import the supervisor, and never run a
collective that the other ranks do not run in the same order.
"""

from __future__ import annotations

import atexit
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as localsgd_mod
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from ftrun.hookspec import HookSpec
from ftrun.worker import progress, settings
from ftrun.worker.diloco import Outer

HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future]


_TORCH_HOOK_NAMES = {
    "allreduce": "allreduce_hook",
    "fp16": "fp16_compress_hook",
    "bf16": "bf16_compress_hook",
    "noop": "noop_hook",
    "diloco": "noop_hook",
    "powersgd": "powerSGD_hook",
    "batched-powersgd": "batched_powerSGD_hook",
    "localsgd": "post_localSGD_hook",
}


def comm_hook_name(spec: HookSpec) -> str:
    """The name DDP records for ftrun's hook (`_get_ddp_logging_data()['comm_hook']`)."""
    return f"ftrun.{spec.label}({_TORCH_HOOK_NAMES[spec.name]})"


def _log(line: str) -> None:
    sys.stderr.write(f"ftrun: {line}\n")
    sys.stderr.flush()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else (settings.current().rank or 0)


# --------------------------------------------------------------------------- stats


@dataclass
class Stats:
    """Traffic of one registered hook on this rank. Bytes are what this rank hands
    to collectives (ring allreduce puts about 2(n-1)/n of that on the wire)."""

    steps: int = 0
    bytes_sent: int = 0  # what the hook sent
    bytes_dense: int = 0  # what plain allreduce of the same buckets would have sent
    step_bytes: int = 0  # running total of the step in progress
    last_step_bytes: int = 0
    averaging_bytes: int = 0  # localsgd: parameter averaging after optimizer steps


# --------------------------------------------------------------------------- builders


def _batched_powersgd_hook(epsilon: float) -> HookFn:
    """torch's batched_powerSGD_hook with an orthogonalization that accepts its input.

    torch 2.x passes 2-D P/Q matrices to `_orthogonalize`, which asserts a 3-D
    batch, so compression dies at the first compressed step (and ignores
    orthogonalization_epsilon). We run torch's very code with a helper that
    views a matrix as a batch of one; nothing else changes.
    """
    try:
        psgd._orthogonalize(torch.ones(2, 1))
        fixed = False
    except AssertionError:
        fixed = True
    if not fixed and epsilon == 0:
        return psgd.batched_powerSGD_hook

    def _orthogonalize(matrices: torch.Tensor, epsilon_: float = 0) -> None:
        if matrices.dim() == 2:
            matrices = matrices.unsqueeze(0)  # a view: orthogonalized in place
        psgd._orthogonalize(matrices, epsilon_ or epsilon)

    original = psgd.batched_powerSGD_hook
    scope = dict(original.__globals__)
    scope["_orthogonalize"] = _orthogonalize
    hook = types.FunctionType(original.__code__, scope, original.__name__, original.__defaults__, original.__closure__)
    hook.__qualname__ = original.__qualname__
    hook.__doc__ = original.__doc__
    return hook


def _bf16_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    # torch's bf16_compress_hook is fine on gloo; only DDP's check of the hook's
    # *name* refuses it without CUDA+NCCL. Call it from a function of our own.
    return default_hooks.bf16_compress_hook(process_group, bucket)


def _local_subgroup(pg: dist.ProcessGroup) -> Optional[dist.ProcessGroup]:
    """The ranks of this node, for gradient averaging after local SGD starts.

    torch's post_localSGD_hook calls `dist.new_subgroups()` when given none, and that
    needs CUDA. We build the per-node groups from LOCAL_WORLD_SIZE instead. None
    when the node holds the whole group: then local SGD sends no gradients at all.
    """
    world = dist.get_world_size()
    local = settings.current().local_world_size or world
    if pg.size() != world or local <= 1 or local >= world or world % local:
        return None  # a one-rank node has nothing to average with; a whole-group node is the group
    ranks = [list(range(n * local, (n + 1) * local)) for n in range(world // local)]
    sub, _ = dist.new_subgroups_by_enumeration(ranks)
    return sub


def build(spec: HookSpec, pg: Optional[dist.ProcessGroup]) -> Tuple[Any, HookFn, Dict[str, Any]]:
    """(state, torch hook, extras) for `spec` on process group `pg` (None: WORLD)."""
    group = pg if pg is not None else dist.group.WORLD
    p = spec.effective_params()
    extras: Dict[str, Any] = {}
    if spec.name == "allreduce":
        return group, default_hooks.allreduce_hook, extras
    if spec.name == "fp16":
        return group, default_hooks.fp16_compress_hook, extras
    if spec.name == "bf16":
        return group, _bf16_hook, extras
    if spec.name in ("noop", "diloco"):  # diloco: nothing crosses replicas between syncs (ftrun.worker.diloco)
        return None, debugging_hooks.noop_hook, extras
    if spec.name in ("powersgd", "batched-powersgd"):
        kwargs = dict(
            process_group=group,
            matrix_approximation_rank=p["rank"],
            start_powerSGD_iter=p["start_iter"],
            use_error_feedback=p["error_feedback"],
            warm_start=p["warm_start"],
            orthogonalization_epsilon=p["orthogonalization_epsilon"],
            random_seed=p["seed"],
            # ftrun logs its own figures; keep torch's logger from adding more.
            compression_stats_logging_frequency=10 ** 9,
        )
        if spec.name == "powersgd":
            kwargs.update(min_compression_rate=p["min_compression_rate"],
                          batch_tensors_with_same_shape=p["batch_same_shape"])
            return psgd.PowerSGDState(**kwargs), psgd.powerSGD_hook, extras
        return psgd.PowerSGDState(**kwargs), _batched_powersgd_hook(p["orthogonalization_epsilon"]), extras
    if spec.name == "localsgd":
        sub = _local_subgroup(group)
        state = localsgd_mod.PostLocalSGDState(
            process_group=group, subgroup=sub, start_localSGD_iter=p["start_iter"],
            post_local_gradient_allreduce=sub is not None)
        extras["averager"] = PeriodicModelAverager(period=p["period"], warmup_steps=p["start_iter"], process_group=group)
        return state, localsgd_mod.post_localSGD_hook, extras
    raise ValueError(f"no builder for hook {spec.name!r}")  # parse_hook keeps this unreachable


# --------------------------------------------------------------------------- registration


def _compressing(spec: HookSpec, state: Any) -> bool:
    return spec.name in ("powersgd", "batched-powersgd") and state.iter >= state.start_powerSGD_iter


# Per model (by id): the model, its newest registration and their Stats. --ft builds a fresh
# registration on every group change; it takes over its predecessor's Stats, so the figures
# are the model's, not one group's. Only weak references to the registration: it holds its
# process group, and a dropped group must be freed when --ft drops it (its peers learn from
# the closed connections), not kept alive for the figures at exit.
_newest: Dict[int, Tuple["weakref.ref[torch.nn.Module]", "weakref.ref[Registration]", "Stats"]] = {}


class Registration:
    """ftrun's hook on one DDP model: spec, state, the callable DDP runs, figures."""

    def __init__(self, spec: HookSpec, model: torch.nn.Module, pg: Optional[dist.ProcessGroup]) -> None:
        global _atexit_installed
        self.spec = spec
        self.group = pg if pg is not None else dist.group.WORLD
        self.state, self.torch_hook, self.extras = build(spec, pg)
        self.name = comm_hook_name(spec)
        self._log_every = settings.current().hook_log_every
        before = _newest.get(id(model))
        same = before is not None and before[0]() is model  # not a new model at a freed one's address
        self.stats = before[2] if same else Stats()
        self.stats.step_bytes = 0  # a step the old group left half-sent is not this group's
        _newest[id(model)] = (weakref.ref(model), weakref.ref(self), self.stats)
        if not _atexit_installed:
            atexit.register(_log_at_exit)
            _atexit_installed = True
        self.model_ref = weakref.ref(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if spec.name == "diloco":
            p = spec.effective_params()
            self.extras["diloco"] = Outer(self.params, p["period"], p["outer_lr"], p["outer_momentum"], pg, spec.wrap,
                                          p["fragments"], p["sync_delay"])
        self.hook = self._compose()

    def _compose(self) -> HookFn:
        spec, stats, torch_hook = self.spec, self.stats, self.torch_hook

        def count(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
            # Sits inside any --wrap, so it sees the dtype that is actually sent.
            buf = bucket.buffer()
            # fp16/bf16 hooks cast inside torch's hook, after this point.
            elsize = 2 if spec.name in ("fp16", "bf16") else buf.element_size()
            if spec.name in ("noop", "diloco"):
                sent = 0
            elif spec.name in ("powersgd", "batched-powersgd"):
                before = state.total_numel_after_compression
                fut = torch_hook(state, bucket)
                after = state.total_numel_after_compression
                stats_add(after - before if after != before else buf.numel(), elsize)
                return fut
            elif spec.name == "localsgd":
                local = state.iter >= state.start_localSGD_iter
                sent = 0 if (local and not state.post_local_gradient_allreduce) else buf.numel()
            else:
                sent = buf.numel()
            stats_add(sent, elsize)
            return torch_hook(state, bucket)

        def stats_add(numel: int, elsize: int) -> None:
            stats.step_bytes += numel * elsize

        inner: HookFn = count
        if spec.name == "diloco":
            pass  # its --wrap casts what a sync sends, never the local gradients
        elif spec.wrap == "fp16":
            inner = default_hooks.fp16_compress_wrapper(count)
        elif spec.wrap == "bf16":
            inner = default_hooks.bf16_compress_wrapper(count)

        # Weakly: the hook must not hold its registration in a cycle. A registration dropped with
        # its group (--ft, at a failed round) then frees the group at once, and gloo closes its
        # connections only then: a peer blocked on this one fails without a garbage collection.
        step_sent = weakref.WeakMethod(self._step_sent)

        def ftrun_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
            buf = bucket.buffer()
            stats.bytes_dense += buf.numel() * buf.element_size()
            chained = _compressing(spec, state)
            fut = inner(state, bucket)
            if chained and buf.device.type == "cpu":
                # PowerSGD issues its P and Q allreduces from `then` callbacks. On
                # NCCL those run at once on this thread; on gloo they run later on
                # gloo's worker thread, racing the next bucket's allreduce and DDP's
                # own allreduce of the unused-parameter map (find_unused_parameters),
                # so ranks may issue collectives in different orders and mismatch.
                # Finishing the chain here gives gloo NCCL's ordering.
                fut.wait()
            sent = step_sent() if bucket.is_last() else None
            if sent is not None:
                sent()
            return fut

        ftrun_hook.__qualname__ = ftrun_hook.__name__ = self.name
        # DDP checks these annotations; `from __future__ import annotations` made them strings.
        ftrun_hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                      "return": torch.futures.Future[torch.Tensor]}
        return ftrun_hook

    def _step_sent(self) -> None:
        stats = self.stats
        stats.steps += 1
        stats.last_step_bytes = stats.step_bytes
        stats.bytes_sent += stats.step_bytes
        stats.step_bytes = 0
        # A line with traffic figures every FTRUN_HOOK_LOG_EVERY steps (0: only at exit).
        if self._log_every and stats.steps % self._log_every == 0:
            _log(self.figures_line())

    def count_step(self, nbytes: int) -> None:
        """A step whose gradients DDP's own reducer all-reduced whole (--ft's default hook,
        which is no Python hook at all: ftrun.worker.ft.api.ddp), counted as the composed hook counts."""
        self.stats.bytes_dense += nbytes
        self.stats.step_bytes += nbytes
        self._step_sent()

    # localsgd: parameters averaged after the user's optimizer steps; diloco: the outer step
    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        outer = self.extras.get("diloco")
        if outer is not None:
            outer.after_optimizer_step(optimizer)
            self._report_next_sync(outer.next_sync())
            return
        averager = self.extras.get("averager")
        if averager is None:
            return
        mine = {id(p) for p in self.params}
        params = [p for g in optimizer.param_groups for p in g["params"] if id(p) in mine]
        if not params:
            return
        s = averager.step
        if s >= averager.warmup_steps and (s - averager.warmup_steps) % averager.period == 0:
            self.stats.averaging_bytes += sum(p.numel() * p.element_size() for p in params if p.grad is not None)
        averager.average_parameters(params)
        # The averager's step counts from 0 at the first optimizer step: the next average's step, counted from 1.
        s, start, period = averager.step, averager.warmup_steps, averager.period
        self._report_next_sync(1 + (start if s <= start else start + -(-(s - start) // period) * period))

    @staticmethod
    def _report_next_sync(step: int) -> None:
        """Where `ftrun status` reads it: the worker's progress report (ftrun.worker.progress)."""
        rep = progress.reporter()
        if rep is not None:
            rep.next_sync = step

    def figures(self) -> Dict[str, Any]:
        st = self.stats
        steps = max(st.steps, 1)
        out: Dict[str, Any] = {
            "hook": self.spec.label,
            "spec": self.spec.describe(),
            "comm_hook": self.name,
            "steps": st.steps,
            "bytes_sent": st.bytes_sent + st.averaging_bytes + self._sync_bytes(),
            "bytes_per_step": (st.bytes_sent + st.averaging_bytes + self._sync_bytes()) / steps,
            "last_step_bytes": st.last_step_bytes,
            "dense_bytes_per_step": st.bytes_dense / steps,
        }
        if self.spec.name in ("powersgd", "batched-powersgd"):
            rate, before, after = self.state.compression_stats()
            out["powersgd"] = {"iter": self.state.iter, "start_iter": self.state.start_powerSGD_iter,
                               "compression_rate": rate, "numel_before": before, "numel_after": after}
        if self.spec.name == "diloco":
            out["diloco"] = self.extras["diloco"].figures()
        if self.spec.name == "localsgd":
            out["localsgd"] = {"iter": self.state.iter, "averaging_bytes": st.averaging_bytes,
                               "averager_step": self.extras["averager"].step}
        return out

    def _sync_bytes(self) -> int:
        outer = self.extras.get("diloco")
        return outer.sync_bytes if outer is not None else 0

    def figures_line(self, at_exit: bool = False) -> str:
        f = self.figures()
        dense = f["dense_bytes_per_step"]
        line = (f"rank {_rank()}: hook {f['hook']} {_step_words(f['steps'], at_exit)}: sent "
                f"{_mb(f['bytes_per_step'])}/step (plain allreduce: {_mb(dense)}/step")
        if dense > f["bytes_per_step"] > 0:
            line += f", {dense / f['bytes_per_step']:.1f}x less"
        line += ")"
        if "diloco" in f:
            d = f["diloco"]
            line += (f"; DiLoCo: {d['syncs']} sync{'s' if d['syncs'] != 1 else ''} of {_mb(d['sync_bytes'] / max(1, d['syncs']))} "
                     f"every {d['period']} steps, the next at step {d['next_sync']}")
        if "powersgd" in f:
            ps = f["powersgd"]
            line += (f"; PowerSGD iter {ps['iter']} (compresses from {ps['start_iter']}), "
                     f"rate {ps['compression_rate']:.1f}x of {ps['numel_before']} elements")
        return line


def _step_words(own: int, at_exit: bool) -> str:
    """The step as a person reads it: the run's (ftrun.ft counts its committed steps; a restarted or
    resumed process took fewer itself; inside a backward, the step in progress). Without --ft
    only this process's count is known: a restarted process says that it is its own."""
    rep = progress.reporter()
    run_step = rep.global_step if rep is not None else None
    if run_step is not None:
        run_step += 0 if at_exit else 1
        return f"step {run_step}" + (f" ({own} of them in this process)" if own < run_step else "")
    restarts = settings.current().restart_count
    return f"step {own}" + (f" of this process (restart {restarts})" if restarts else "")


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e4 else f"{int(n)} B"


# --------------------------------------------------------------------------- registry

_registrations: List[Registration] = []
_overridden: List[Dict[str, str]] = []
_step_hook_installed = False
_atexit_installed = False


def _on_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    for reg in _registrations:
        if reg.spec.name in ("localsgd", "diloco"):
            reg.after_optimizer_step(optimizer)


def register(spec: HookSpec, model: Any, register_fn: Optional[Callable[[Any, HookFn], None]] = None) -> Registration:
    """Build `spec` for `model` (a DDP) on its own process group and register it.

    `register_fn(state, hook)` defaults to `model.register_comm_hook`; the
    injector passes torch's original method so its own patch is bypassed.
    """
    global _step_hook_installed
    reg = Registration(spec, model, getattr(model, "process_group", None))
    (register_fn or model.register_comm_hook)(reg.state, reg.hook)
    _registrations.append(reg)
    if spec.name in ("localsgd", "diloco") and not _step_hook_installed:
        # Local SGD and DiLoCo without touching the user's optimizer: average (or the outer step) after a step.
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_on_optimizer_step)
        _step_hook_installed = True
    return reg


def note_overridden(spec: HookSpec, script_hook: str) -> None:
    _overridden.append({"ftrun_hook": spec.describe(), "script_hook": script_hook})


def _log_at_exit() -> None:
    # Every rank writes it to its log; the console shows one rank's (ftrun.supervisor.workers.logs).
    # A plain DDP's registration lives in _registrations; --ft's newest one in its replica hook.
    for _, ref, stats in list(_newest.values()):
        reg = ref()
        if reg is not None and stats.steps:
            _log(reg.figures_line(at_exit=True) + " (at exit)")


def current_stats() -> Dict[str, Any]:
    """This rank's hook figures as a JSON-able dict (for status code and logs).

    Top level sums every DDP model ftrun registered a hook on; `models` has one
    entry per model. `overridden` lists models where the script's own hook won.
    """
    models = [reg.figures() for reg in _registrations]
    out: Dict[str, Any] = {
        "rank": _rank(),
        "hook": models[0]["hook"] if models else None,
        "steps": max((m["steps"] for m in models), default=0),
        "bytes_sent": sum(m["bytes_sent"] for m in models),
        "bytes_per_step": sum(m["bytes_per_step"] for m in models),
        "dense_bytes_per_step": sum(m["dense_bytes_per_step"] for m in models),
        "models": models,
        "overridden": list(_overridden),
    }
    return out


def registration_of(model: Any) -> Optional[Registration]:
    """ftrun's registration on this DDP model, if ftrun's hook is the one in use."""
    for reg in _registrations:
        if reg.model_ref() is model:
            return reg
    return None


# --------------------------------------------------------------------------- state export / import / reset
#
# For the fault-tolerance code: a healthy peer sends its hook state to a
# restarted one. Everything is plain tensors, ints, floats and strings in
# dicts, so `torch.load(..., weights_only=True)` accepts it.


def hook_state_dict(model: Any) -> Dict[str, Any]:
    """Hook state of `model` (a DDP) as plain tensors and numbers; {} if ftrun's
    hook is not registered on it. PowerSGD: iteration counter, error-feedback
    tensors, warm-start P/Q matrices, RNG; localsgd: iteration and averager step."""
    reg = registration_of(model)
    if reg is None:
        return {}
    st = reg.state
    if reg.spec.name in ("powersgd", "batched-powersgd"):
        name, keys, pos, has_gauss, cached = st.rng.get_state()
        return {
            "kind": "powersgd",
            "iter": int(st.iter),
            "error": {int(k): v.detach().clone() for k, v in st.error_dict.items()},
            "p": {int(k): v.detach().clone() for k, v in st.p_memory_dict.items()},
            "q": {int(k): v.detach().clone() for k, v in st.q_memory_dict.items()},
            "rng": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "numel_before": int(st.total_numel_before_compression),
            "numel_after": int(st.total_numel_after_compression),
        }
    if reg.spec.name == "localsgd":
        return {"kind": "localsgd", "iter": int(st.iter), "averager_step": int(reg.extras["averager"].step)}
    if reg.spec.name == "diloco":
        return reg.extras["diloco"].state_dict()
    return {"kind": reg.spec.name}


def load_hook_state_dict(model: Any, state: Dict[str, Any]) -> None:
    """Load what hook_state_dict() returned (on any rank) into `model`'s hook state."""
    reg = registration_of(model)
    if reg is None or not state:
        return
    st = reg.state
    if state.get("kind") == "powersgd":
        import numpy as np

        dev = next((p.device for p in reg.params), torch.device("cpu"))
        st.iter = int(state["iter"])
        st.error_dict = {int(k): v.to(dev) for k, v in state["error"].items()}
        st.p_memory_dict = {int(k): v.to(dev) for k, v in state["p"].items()}
        st.q_memory_dict = {int(k): v.to(dev) for k, v in state["q"].items()}
        r = state["rng"]
        st.rng.set_state(("MT19937", r["keys"].numpy().astype(np.uint32), int(r["pos"]), int(r["has_gauss"]),
                          float(r["cached_gaussian"])))
        st.total_numel_before_compression = int(state["numel_before"])
        st.total_numel_after_compression = int(state["numel_after"])
    elif state.get("kind") == "localsgd":
        st.iter = int(state["iter"])
        reg.extras["averager"].step = int(state["averager_step"])
    elif state.get("kind") == "diloco":
        reg.extras["diloco"].load_state_dict(state)


def reset_hook_state(model: Any, iteration: Optional[int] = None) -> None:
    """Forget what the hook remembers between steps (PowerSGD error feedback and
    warm-start matrices), e.g. after the group changed. The iteration counter
    stays unless `iteration` is given. Every rank must call it at the same step."""
    reg = registration_of(model)
    if reg is None:
        return
    st = reg.state
    if reg.spec.name in ("powersgd", "batched-powersgd"):
        st.error_dict.clear()
        st.p_memory_dict.clear()
        st.q_memory_dict.clear()
        if iteration is not None:
            st.iter = int(iteration)
    elif reg.spec.name == "localsgd" and iteration is not None:
        st.iter = int(iteration)
        reg.extras["averager"].step = int(iteration)
    elif reg.spec.name == "diloco" and iteration is not None:
        reg.extras["diloco"].steps = int(iteration)
