"""The optimizer for --ft: steps only when the round's collectives went through.

`step()` returns True when this replica stepped: its collectives succeeded,
so the round commits (the decision is read during the next round; in the
rare case it says otherwise, the replica restarts and heals before its state
is used again). False: the round is discarded, and parameters and optimizer
state are left exactly as they were. Must never step on a round it knows failed.
"""

from typing import Any, Callable, Optional

import torch

from ftrun.worker.ft.manager import Manager


class ReplicaOptimizer:
    def __init__(self, mgr: Manager, optimizer: torch.optim.Optimizer) -> None:
        self._mgr = mgr
        self.optimizer = optimizer
        mgr.register_optimizer(optimizer)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> bool:
        if not self._mgr.vote():
            return False
        self.optimizer.step(closure)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
