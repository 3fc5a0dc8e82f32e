"""DiLoCo's outer loop on one DDP model (`--hook diloco --period H`): semi-synchronous training.

Between two syncs every replica trains alone: the DDP comm hook sends nothing (each replica steps
its own optimizer, the inner one, on its own gradients). Every H steps of that optimizer, the
replicas average their pseudo-gradients (the global model as of the last sync less their own
parameters now), an outer optimizer (SGD with Nesterov momentum, `--outer-lr`, `--outer-momentum`)
steps the global model on that average, and every replica takes the new global model as its
parameters. With --outer-lr 1 and --outer-momentum 0 that is periodic parameter averaging
(--hook localsgd with --start-iter 0). The average is one all-reduce of the flattened
pseudo-gradients per dtype, in half precision with --wrap fp16|bf16 (summed and divided in full
precision); every replica gets the same bits, so every replica's global model, outer momentum and
parameters are bitwise the same after each sync. The inner optimizers' state stays each replica's
own, as DiLoCo has it.

Must never send anything between syncs, never touch the user's optimizer but through the
parameters it steps, and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Outer:
    """The global model (`anchor`: one tensor per trained parameter), its outer optimizer and the
    inner steps counted since the run began, for the parameters of one model."""

    def __init__(self, params: List[torch.Tensor], period: int, outer_lr: float, outer_momentum: float,
                 group: Optional[dist.ProcessGroup], wrap: Optional[str] = None) -> None:
        self.params = params
        self.period = period
        self.group = group
        self.wrap = wrap
        # Taken when the hook is registered, after DDP's constructor broadcast rank 0's parameters:
        # the same global model on every replica.
        self.anchor = [p.detach().clone() for p in params]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.steps = 0          # inner steps of the counted optimizer
        self.syncs = 0
        self.sync_bytes = 0     # what this replica sent at syncs
        self._counted: Optional[int] = None  # id() of the optimizer whose steps are counted

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer stepped: count it if it is the one counted (the first that stepped any of
        this model's parameters: a loop with two optimizers on one model syncs once per iteration),
        and sync every `period` of its steps."""
        mine = {id(p) for p in self.params}
        if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            return
        if self._counted is None:
            self._counted = id(optimizer)
        if id(optimizer) != self._counted:
            return
        self.steps += 1
        if self.steps % self.period == 0:
            self.sync()

    def next_sync(self) -> int:
        """The inner step at which the next sync happens."""
        return (self.steps // self.period + 1) * self.period

    @torch.no_grad()
    def sync(self) -> None:
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        by_kind: Dict[Any, List[int]] = {}
        for i, p in enumerate(self.params):
            by_kind.setdefault((p.dtype, p.device), []).append(i)
        for idx in by_kind.values():
            flat = torch.cat([(self.anchor[i] - self.params[i].detach()).reshape(-1) for i in idx])
            sent = flat.to(_HALF[self.wrap]) if self.wrap in _HALF else flat
            if world > 1:
                dist.all_reduce(sent, group=self.group)
            self.sync_bytes += sent.numel() * sent.element_size()
            mean = sent.to(flat.dtype).div_(world)
            at = 0
            for i in idx:
                n = self.anchor[i].numel()
                self.anchor[i].grad = mean[at:at + n].view_as(self.anchor[i]).clone()
                at += n
        self.outer.step()
        for a, p in zip(self.anchor, self.params):
            a.grad = None
            p.copy_(a)
        self.syncs += 1

    def figures(self) -> Dict[str, Any]:
        return {"steps": self.steps, "syncs": self.syncs, "period": self.period, "next_sync": self.next_sync(),
                "sync_bytes": self.sync_bytes}

    def state_dict(self) -> Dict[str, Any]:
        """Plain tensors and numbers (torch.load(weights_only=True) takes them): the global model,
        the outer momentum, the step count."""
        moms = [self.outer.state.get(a, {}).get("momentum_buffer") for a in self.anchor]
        return {"kind": "diloco", "steps": self.steps, "syncs": self.syncs,
                "anchor": [a.detach().clone() for a in self.anchor],
                "momentum": [m.detach().clone() if m is not None else torch.empty(0) for m in moms]}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        for a, saved in zip(self.anchor, state["anchor"]):
            a.copy_(saved)
        for a, m in zip(self.anchor, state["momentum"]):
            if m.numel():
                self.outer.state[a]["momentum_buffer"] = m.to(a.device).clone()
            else:
                self.outer.state.pop(a, None)
