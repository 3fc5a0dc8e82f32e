"""The optimizer for --ft: steps only when every replica of the round voted ok.

`step()` returns True when the round was committed (the inner optimizer
stepped) and False when it was discarded (parameters and optimizer state are
left exactly as they were). Must never step on a discarded round.
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
