"""State a script keeps that it never registered: found in its frames, so that heals carry it too.

A port to --ft registers the trained model (ft.DistributedDataParallel), its optimizers
(ft.Optimizer) and, with ft.register_state, what else holds state. A script often keeps more:
an EMA of the model (`torch.optim.swa_utils.AveragedModel`), a teacher, an LR scheduler, a
GradScaler, an optimizer it steps itself. Healed without them, a restarted replica would go on
with their initial state while its peers' moved on, and nothing would say so.

At the loop's first top, every process looks through the script's own frames (the locals of its
functions and its module's globals, and one level of attributes of its own objects) for such
objects that no registration covers (a submodule, a wrapper of a registered model, or a module
sharing its parameters are covered), and names each by where it was found (`ema`,
`trainer.teacher`). Every replica runs the same script to the same place, so each finds the same
names, and registers them as `ftrun.found.<name>`: a heal moves them, a checkpoint saves them,
and the guard compares them. Modules holding state that are not reachable that way (found only by
the garbage collector) cannot be matched between processes: they are named, in one line, as
state no heal carries.

Nothing here moves or compares state. Must never change an object it finds, and never import
the supervisor.
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import types
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ftrun.worker.ft.heal.state import ReplicaState

PREFIX = "ftrun.found."
_FTRUN = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_LIBRARIES = tuple({os.path.abspath(p) for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("purelib"),
                                                  sysconfig.get_paths().get("platlib"), _FTRUN) if p})


def _library(filename: str) -> bool:
    """Whether code in `filename` is a library's (the standard library, site-packages, ftrun), not the script's."""
    if not filename or filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    return path.startswith(_LIBRARIES) or "site-packages" in path or "dist-packages" in path


def _own_object(obj: Any) -> bool:
    """An instance of a class the script defines (its attributes are looked at, one level deep)."""
    cls = type(obj)
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType)):
        return False
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None) if module is not None else None
    return cls.__module__ == "__main__" or (filename is not None and not _library(filename))


def _stateful(obj: Any) -> bool:
    """An object whose state a heal must carry: a module holding tensors, an optimizer, an LR
    scheduler, a gradient scaler."""
    if isinstance(obj, torch.nn.Module):
        return any(isinstance(v, torch.Tensor) for v in obj.state_dict().values())
    if isinstance(obj, torch.optim.Optimizer):
        return type(obj).__module__.split(".")[0] != "ftrun"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return True
    scaler = getattr(torch.amp, "GradScaler", None)
    return scaler is not None and isinstance(obj, scaler)


class _Covered:
    """What the registrations already cover."""

    def __init__(self, state: ReplicaState) -> None:
        self.ids = {id(o) for o in [*state.models, *state.optimizers, *state.extras.values()]}
        self.modules = {id(m) for model in state.models for m in model.modules()}
        self.params = {id(p) for model in state.models for p in model.parameters()}

    def covers(self, obj: Any) -> bool:
        if id(obj) in self.ids:
            return True
        if isinstance(obj, torch.nn.Module):
            if id(obj) in self.modules or any(id(m) in self.modules for m in obj.modules()):
                return True  # a part of a registered model, or a wrapper of one (DDP, torch.compile)
            return any(id(p) in self.params for p in obj.parameters())
        return False


def _frames(start: Optional[types.FrameType]) -> Iterator[types.FrameType]:
    """The script's frames from the outermost in (its module's first)."""
    frames = []
    f = start
    while f is not None:
        if not _library(f.f_code.co_filename):
            frames.append(f)
        f = f.f_back
    return reversed(frames)


def _candidates(start: Optional[types.FrameType]) -> Iterator[Tuple[str, Any]]:
    seen_frames = set()
    for f in _frames(start):
        names = f.f_locals if f.f_code.co_name != "<module>" else f.f_globals
        if id(names) in seen_frames:
            continue
        seen_frames.add(id(names))
        for name, obj in sorted(names.items(), key=lambda kv: kv[0]):
            if name.startswith("__"):
                continue
            yield name, obj
            if _own_object(obj) and not isinstance(obj, torch.nn.Module):
                try:
                    attrs = sorted(vars(obj).items(), key=lambda kv: kv[0])
                except TypeError:
                    continue
                for attr, value in attrs:
                    if not attr.startswith("__"):
                        yield f"{name}.{attr}", value


def find(state: ReplicaState, start: Optional[types.FrameType]) -> Tuple[List[Tuple[str, Any]], List[str]]:
    """(name, object) of every stateful object in the script's frames from `start` outwards that
    no registration covers, each once under the first name it was found by; and a description of
    every other module holding state that the garbage collector sees and no registration covers
    (not reachable by name: no heal can match it between processes)."""
    covered = _Covered(state)
    found: List[Tuple[str, Any]] = []
    ids: Dict[int, str] = {}
    for name, obj in _candidates(start):
        if id(obj) in ids or not _stateful(obj) or covered.covers(obj):
            continue
        ids[id(obj)] = name
        found.append((name, obj))
    for obj in found:
        if isinstance(obj[1], torch.nn.Module):
            covered.modules.update(id(m) for m in obj[1].modules())
    with warnings.catch_warnings():  # an isinstance() on some of torch's deprecated objects warns
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    children = {id(c) for m in modules for c in m._modules.values() if c is not None}
    loose = sorted({type(m).__name__ for m in modules
                    if id(m) not in children and id(m) not in ids and id(m) not in covered.modules
                    and type(m).__module__.split(".")[0] != "ftrun" and not covered.covers(m) and _stateful(m)})
    return found, loose


def register(state: ReplicaState, found: List[Tuple[str, Any]]) -> List[str]:
    """Register what was found as `ftrun.found.<name>`; the names registered."""
    names = []
    for name, obj in found:
        state.add_extra(PREFIX + name, obj)
        names.append(name)
    return names
