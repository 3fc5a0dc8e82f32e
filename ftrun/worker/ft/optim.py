"""The optimizer for --ft: steps only when the round's collectives went through.

`step()` returns True when this replica stepped: its collectives succeeded,
so the round commits (the decision is read during the next round; in the
rare case it says otherwise, the replica restarts and heals before its state
is used again). False: the round is discarded, and parameters and optimizer
state are left exactly as they were. One per run, holding every optimizer
the loop steps: a global step is one step of the whole model. Must never step
on a round it knows failed.
"""

from typing import Any, Callable, List, Optional

import torch

from ftrun.worker.ft.manager import Manager


class ReplicaOptimizer:
    def __init__(self, mgr: Manager, *optimizers: torch.optim.Optimizer) -> None:
        if not optimizers or not all(callable(getattr(o, "step", None)) and callable(getattr(o, "state_dict", None))
                                     for o in optimizers):
            got = ", ".join(type(o).__name__ for o in optimizers) or "nothing"
            raise TypeError(f"ftrun.ft.Optimizer() takes optimizers (with step() and state_dict()), got {got}: "
                            f"ft.Optimizer(torch.optim.AdamW(model.parameters()))")
        if len({id(o) for o in optimizers}) != len(optimizers):
            raise TypeError("ftrun.ft.Optimizer(): the same optimizer twice would step twice a step: pass each once")
        if mgr.optimizer_wrapped:
            raise TypeError("ftrun.ft.Optimizer: a second one: under --ft a global step is one optimizer step of the "
                            "whole model; give every optimizer to one: ft.Optimizer(opt_a, opt_b) (a loop that steps "
                            "optimizers between backward passes, such as a GAN's, needs group restarts: drop --ft)")
        mgr.optimizer_wrapped = True
        self._mgr = mgr
        self.optimizers: List[torch.optim.Optimizer] = list(optimizers)
        self.optimizer = self.optimizers[0]
        for opt in self.optimizers:
            mgr.register_optimizer(opt)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> bool:
        if closure is not None and len(self.optimizers) > 1:
            raise TypeError("ftrun.ft.Optimizer.step(closure): a closure needs a single optimizer")
        if not self._mgr.vote():
            return False
        for opt in self.optimizers:
            opt.step(closure)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class lacks (param_groups, state, state_dict...): the
        # optimizer's own, which is unambiguous only when there is one.
        optimizers = self.__dict__.get("optimizers", [])
        if len(optimizers) == 1:
            return getattr(optimizers[0], name)
        raise AttributeError(f"ftrun.ft.Optimizer holds {len(optimizers)} optimizers: use .optimizers[i].{name}")
