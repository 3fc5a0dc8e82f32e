"""ft.Optimizer: a torch.optim.Optimizer that steps only when the round's collectives went through.

It holds the run's optimizer, or all of them, and is one itself, as torch's own wrappers
(PostLocalSGDOptimizer, ZeroRedundancyOptimizer) are: its param_groups are the wrapped ones'
own dicts, so an LR scheduler built on it sets the learning rate the wrapped optimizers use.

`step()` votes on the round. This replica steps (every wrapped optimizer, at once) when its
collectives succeeded, so the round commits (the decision is read during the next round; in
the rare case it says otherwise, the replica restarts and heals before its state is used
again). Otherwise the step is discarded: parameters and optimizer state are left exactly as
they were, and the same step is handed out again (ft.redo()). One per run, holding every
optimizer the loop steps: a global step is one step of the whole model. Must never step on a
round it knows failed, and never import the supervisor.
"""

from __future__ import annotations

from collections import ChainMap
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from ftrun.worker.ft.manager import Manager, manager


class _Once:
    """The closure a wrapped optimizer gets: the loss of the one evaluation ft.Optimizer ran
    before the vote (the gradients voted on). An optimizer that evaluates it again in one step
    (LBFGS) would compute gradients no replica averaged: said, and the run stops."""

    def __init__(self, mgr: Manager, opt: torch.optim.Optimizer, loss: Any) -> None:
        self.mgr, self.opt, self.loss, self.calls = mgr, opt, loss, 0

    def __call__(self) -> Any:
        self.calls += 1
        if self.calls > 1:
            self.mgr._misused(f"ft.Optimizer.step(closure): {type(self.opt).__name__} evaluates the closure "
                              f"several times a step, but under --ft a step's gradients are averaged over the "
                              f"replicas once: use an optimizer that takes one gradient a step (SGD, Adam...)")
        return self.loss


class Optimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer for --ft: wraps the run's optimizer, or all of them
    (`ft.Optimizer(adamw, muon)`), and steps them only on a round that commits.

    `step()` returns True when the step was taken and False when it was discarded (a peer died
    mid-step: parameters and optimizer state are exactly as before, the step's gradients are
    dropped, and the loop hands the same step out again). `step(closure)` evaluates the closure once, votes, and returns its loss, as
    torch's optimizers do, taken or not. Either way `opt.stepped` says whether the last step()
    was taken: step an LR scheduler only then, `if opt.step(): sched.step()`.

    An LR scheduler takes it directly (`StepLR(opt, 100)`): `param_groups` are the wrapped
    optimizers' own, in order. `state_dict()` is the wrapped optimizer's (of several, one in
    torch's format over all their groups), `zero_grad()` and `add_param_group()` (one optimizer)
    act on the wrapped ones, and `opt.optimizers` lists them. It may wrap the optimizer before
    or after ft.DistributedDataParallel wraps the model.
    """

    # GradScaler hands a fused optimizer (`_step_supports_amp_scaling`) its scale as attributes of
    # the optimizer it is given, which the wrapped one would never read: it would step on scaled
    # gradients. Said False, GradScaler unscales through param_groups and skips an inf step itself.
    _step_supports_amp_scaling = False

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        # Optimizer.__init__ is not called (nor is it by torch's PostLocalSGDOptimizer): it would
        # build param groups of its own, where these must be the wrapped optimizers' own dicts.
        mgr = manager()
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) or (
                callable(getattr(o, "step", None)) and callable(getattr(o, "state_dict", None))) for o in optimizers):
            got = ", ".join(type(o).__name__ for o in optimizers) or "nothing"
            raise TypeError(f"ftrun.ft.Optimizer() takes optimizers (with step() and state_dict()), got {got}: "
                            f"ft.Optimizer(torch.optim.AdamW(model.parameters()))")
        if any(isinstance(o, Optimizer) for o in optimizers):
            raise TypeError("ftrun.ft.Optimizer(ft.Optimizer(...)): wrap the torch optimizers themselves, once")
        if len({id(o) for o in optimizers}) != len(optimizers):
            raise TypeError("ftrun.ft.Optimizer(): the same optimizer twice would step twice a step: pass each once")
        if mgr.optimizer_wrapped:  # optimizers stepped one after another in a step (a GAN's D then G)
            mgr.several_optimizers()
        mgr.optimizer_wrapped = True
        self._mgr = mgr
        self.optimizers: List[torch.optim.Optimizer] = list(optimizers)
        self._stepped = False
        self._optimizer_step_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_step_post_hooks: Dict[int, Callable] = {}
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = {}
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = {}
        for opt in self.optimizers:
            mgr.register_optimizer(opt)

    @property
    def stepped(self) -> bool:
        """Whether the last step() was taken: False when it was discarded (nothing changed, and
        the loop hands the same step out again, ft.redo() True) or before the first step()."""
        return self._stepped

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first wrapped optimizer (kept for scripts written before ft.Optimizer was one)."""
        return self.optimizers[0]

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        if len(self.optimizers) == 1:
            return self.optimizers[0].param_groups
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> Any:  # type: ignore[override]
        if len(self.optimizers) == 1:
            return self.optimizers[0].state
        return ChainMap(*(opt.state for opt in self.optimizers))  # a parameter is in one optimizer

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optimizers[0].defaults

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Union[bool, Any]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():  # the one forward and backward whose gradients are voted on
                loss = closure()
        self._stepped = self._mgr.vote()
        if self._stepped:
            for hook in list(self._optimizer_step_pre_hooks.values()):
                hook(self, (), {})
            self._mgr.feeding()  # the gradients the optimizers step on, as they are now
            for opt in self.optimizers:
                if closure is None:
                    opt.step()
                else:
                    opt.step(_Once(self._mgr, opt, loss))
            for hook in list(self._optimizer_step_post_hooks.values()):
                hook(self, (), {})
            self._mgr.fed()
        else:
            self._drop_gradients()
        return self._stepped if closure is None else loss

    def _drop_gradients(self) -> None:
        """A discarded step's gradients are a failed round's (half averaged, or this replica's
        alone): none may add to the step handed out again, also on a parameter that no wrapped
        optimizer steps, which the script's zero_grad() leaves alone. With several ft.Optimizers
        (each a sub-step of the loop's step) only this one's: another's, from the same backward,
        are its own sub-step's to step or drop."""
        if not self._mgr.state.steps_apart:
            for model in self._mgr.state.models:
                for p in model.parameters():
                    p.grad = None
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            self._mgr.fx.feeder.settle()  # the gradients a hot spare is being fed are zeroed in place
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if len(self.optimizers) > 1:
            raise TypeError(f"ftrun.ft.Optimizer holds {len(self.optimizers)} optimizers: add the group to the one "
                            f"that steps it, opt.optimizers[i].add_param_group(...)")
        self.optimizers[0].add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        if len(self.optimizers) == 1:
            return self.optimizers[0].state_dict()
        # Several: one state dict in torch's format, as if one optimizer held all their groups
        # in order (parameter ids numbered on from one optimizer to the next).
        state: Dict[Any, Any] = {}
        groups: List[Dict[str, Any]] = []
        offset = 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({offset + i: st for i, st in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if len(self.optimizers) == 1:
            self.optimizers[0].load_state_dict(state_dict)
            return
        groups = list(state_dict["param_groups"])
        offset = 0
        for opt in self.optimizers:
            mine, groups = groups[:len(opt.param_groups)], groups[len(opt.param_groups):]
            count = sum(len(g["params"]) for g in mine)
            opt.load_state_dict({
                "state": {i - offset: st for i, st in state_dict["state"].items() if offset <= i < offset + count},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine]})
            offset += count

    def __repr__(self) -> str:
        return f"ftrun.ft.Optimizer({', '.join(repr(o) for o in self.optimizers)})"

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class lacks: the optimizer's own, which is unambiguous only
        # when there is one.
        optimizers = self.__dict__.get("optimizers", [])
        if len(optimizers) == 1 and not name.startswith("__"):
            return getattr(optimizers[0], name)
        raise AttributeError(f"ftrun.ft.Optimizer holds {len(optimizers)} optimizers: use .optimizers[i].{name}")
