"""Put the run's DDP communication hook on every DDP model a script builds.

`install_from_env()` is called once by the worker bootstrap before the user's
script runs. It reads FTRUN_HOOK (HookSpec JSON; absent or empty: do nothing)
and patches `torch.nn.parallel.DistributedDataParallel` at class level, so
plain scripts, subclasses, PyTorch Lightning and Accelerate all get the hook,
built with each model's own process group (the patch is listed in
ftrun/worker/patches.py; `uninstall()` undoes it).

DDP accepts one hook, once, before the first backward. So ftrun registers its
hook lazily, right after the model's first forward; a script that registers
its own hook before then keeps it (one warning naming both).
Must never change a script that registers its own hook, and never register a
hook on a model twice.
"""

from __future__ import annotations

from typing import Any, Optional

from ftrun.errors import ConfigError
from ftrun.hookspec import HookSpec, parse_hook
from ftrun.worker import patches, settings

_spec: Optional[HookSpec] = None
_originals: dict = {}


def install_from_env() -> Optional[HookSpec]:
    """Patch DDP construction with the hook in FTRUN_HOOK; returns the spec, or None."""
    text = settings.current().hook.strip()
    if not text:
        return None
    spec = HookSpec.from_json(text)
    try:  # the launcher validated it already; a hand-set FTRUN_HOOK gets the same checks
        spec = parse_hook({"name": spec.name, **dict(spec.params), "wrap": spec.wrap}, "FTRUN_HOOK")
    except ConfigError as e:
        raise SystemExit(f"ftrun: error: {e}")
    install(spec)
    return spec


def install(spec: HookSpec) -> None:
    """Patch DDP so every model built from now on gets `spec` (idempotent)."""
    global _spec
    from torch.nn.parallel import DistributedDataParallel as DDP

    _spec = spec
    if _originals:
        return
    orig_init = DDP.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        if "_ftrun_pending" in self.__dict__ or _spec is None:
            return  # a subclass calling DDP.__init__ again, or ftrun switched off
        self._ftrun_pending = _spec
        self._ftrun_script_hook = None
        if self._comm_hooks:  # e.g. DDP's own mixed-precision hook, or a subclass's
            _script_wins(self, getattr(self._comm_hooks[0][0], "__qualname__", "a hook"))
            return
        self._ftrun_handle = self.register_forward_hook(_register_after_first_forward)

    def register_comm_hook(self: Any, state: object, hook: Any) -> None:
        _before_script_hook(self, getattr(hook, "__qualname__", repr(hook)))
        return _originals["register"](self, state, hook)

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        _before_script_hook(self, str(comm_hook_type))
        return _originals["builtin"](self, comm_hook_type)

    __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
    _originals["init"] = patches.install("ddp.hook", DDP, "__init__", __init__)
    _originals["register"] = patches.install("ddp.hook", DDP, "register_comm_hook", register_comm_hook)
    _originals["builtin"] = patches.install("ddp.hook", DDP, "_register_builtin_comm_hook",
                                            _register_builtin_comm_hook)


def uninstall() -> None:
    """Undo install() (tests, and scripts that need torch's DDP untouched)."""
    global _spec
    if _originals:
        patches.undo("ddp.hook")
        _originals.clear()
    _spec = None


def _script_wins(model: Any, script_hook: str) -> None:
    from ftrun.worker import hooks

    spec = model.__dict__.get("_ftrun_pending")
    model._ftrun_pending = None
    model._ftrun_script_hook = script_hook
    handle = model.__dict__.pop("_ftrun_handle", None)
    if handle is not None:
        handle.remove()
    if spec is not None:
        hooks.note_overridden(spec, script_hook)
        hooks._log(f"warning: rank {hooks._rank()}: the script registers its own DDP comm hook {script_hook!r}; "
                   f"it is kept and ftrun's --hook {spec.describe()} is not used on this model")


def _before_script_hook(model: Any, script_hook: str) -> None:
    if model.__dict__.get("_ftrun_pending") is not None:
        _script_wins(model, script_hook)
    elif model.__dict__.get("_ftrun_registered"):
        # DDP takes one hook, once; ours is already in (after the first forward).
        raise RuntimeError(
            f"ftrun already registered the comm hook {model._ftrun_registered!r} on this DDP model at its first "
            f"forward, so {script_hook!r} cannot be added; register your hook before the first forward, "
            "or run without --hook")


def _register_after_first_forward(model: Any, _inputs: Any, _output: Any) -> None:
    from ftrun.worker import hooks

    spec = model.__dict__.get("_ftrun_pending")
    handle = model.__dict__.pop("_ftrun_handle", None)
    if handle is not None:
        handle.remove()
    if spec is None:
        return
    model._ftrun_pending = None
    reg = hooks.register(spec, model, lambda state, hook: _originals["register"](model, state, hook))
    model._ftrun_registered = reg.name
    n = sum(p.numel() for p in reg.params)
    hooks._log(f"rank {hooks._rank()}: registered DDP comm hook {spec.describe()} ({reg.name}) "
               f"on a model of {n} parameters, group of {reg.group.size()}")
