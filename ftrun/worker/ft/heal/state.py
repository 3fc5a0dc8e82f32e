"""What a heal moves: a replica's registered models, optimizers and extra state.

`capture()` is the state the source sends; `targets()` is the healer's own
tensors for the transfer to land in; `restore()` takes in what arrived. For
a sharded replica (FSDP2: DTensor parameters and optimizer state) each
worker moves its own shard (the transport sends a DTensor's local tensor),
and everything must land in place: a healer's optimizer state is first
created at its final shapes (a step with zero gradients and a learning rate
of 0, as torch.distributed.checkpoint does), so no tensor is allocated and
no DTensor is rebuilt. A state that does not fit this replica (another
model, optimizer, mesh or replica size) raises StateMismatch.
Must never communicate, and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, Dict, List, Set, Tuple

import torch

from ftrun.worker.ft.heal.transport import StateMismatch, _local, tensor_leaves

Path = Tuple[Any, ...]


class ReplicaState:
    def __init__(self) -> None:
        self.models: List[torch.nn.Module] = []
        self.optimizers: List[torch.optim.Optimizer] = []
        self.extras: Dict[str, Any] = {}
        self.uncompared: Set[str] = set()  # registered state the guard leaves out (ft/heal/agreement.py)
        self.sharded = False  # some model holds DTensor shards (FSDP2)
        self.steps_apart = False  # several ft.Optimizers step one after another (no hot spare is fed)

    def add_model(self, model: torch.nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        self.models.append(model)
        self.sharded = self.sharded or any(isinstance(p, DTensor) for p in model.parameters())

    def add_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.optimizers.append(opt)

    def add_extra(self, name: str, obj: Any, compare: bool = True) -> None:
        """`compare`: the guard checks that every replica holds the same (False: this replica's own)."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"ftrun.ft.register_state({name!r}, ...): the object needs state_dict() and load_state_dict()")
        self.extras[name] = obj
        if compare:
            self.uncompared.discard(name)
        else:
            self.uncompared.add(name)

    def capture(self, round_: int, step: int, yielded: int = -1, sub_steps: int = 0, kept: bool = False) -> Dict[str, Any]:
        """`yielded`: the newest step the loop has handed the script (ft.redo() on the healer).
        `sub_steps`: the sub-steps of the current loop step committed (several ft.Optimizers).
        `kept`: the healers hold the models' parameters and the optimizers already (a fed hot spare,
        ft/heal/feed.py): only the optimizers' settings, the models' buffers and the registered state."""
        out: Dict[str, Any] = {"round": round_, "step": step, "yielded": yielded, "sub_steps": sub_steps,
                               "extras": {name: obj.state_dict() for name, obj in self.extras.items()}}
        if kept:
            out["settings"] = [[{k: v for k, v in g.items() if k != "params"} for g in o.state_dict()["param_groups"]]
                               for o in self.optimizers]
            out["buffers"] = [buffers_of(m) for m in self.models]
        else:
            out["models"] = [dict(m.state_dict()) for m in self.models]
            out["optimizers"] = [o.state_dict() for o in self.optimizers]
        return out

    def kept_targets(self) -> Dict[str, Any]:
        """What a healer that keeps its parameters and optimizers receives into: its buffers."""
        return {"models": [], "optimizers": [], "buffers": [buffers_of(m) for m in self.models]}

    def targets(self) -> Dict[str, Any]:
        """This replica's own tensors, for the transfer to land in where they fit."""
        if self.sharded:
            for o in self.optimizers:
                _create_optimizer_state(o)
        return {"models": [dict(m.state_dict()) for m in self.models],
                "optimizers": [o.state_dict() for o in self.optimizers]}

    def restore(self, payload: Dict[str, Any], in_place: Set[Path]) -> Tuple[int, int, int, int]:
        """Load what arrived; returns the (round, step, newest step yielded, sub-steps of the current
        loop step committed) it was captured at."""
        if "settings" in payload:
            return self._restore_kept(payload, in_place)
        if len(payload["models"]) != len(self.models) or len(payload["optimizers"]) != len(self.optimizers):
            raise StateMismatch(f"its peer has {len(payload['models'])} model(s) and {len(payload['optimizers'])} "
                                f"optimizer(s), this replica {len(self.models)} and {len(self.optimizers)}")
        try:
            with torch.no_grad():
                for i, (m, sd) in enumerate(zip(self.models, payload["models"])):
                    if any(("models", i, k) not in in_place for k in sd):
                        self._refuse_if_sharded(("models", i), sd, in_place)
                        m.load_state_dict(sd)
            for i, (o, sd) in enumerate(zip(self.optimizers, payload["optimizers"])):
                if self.sharded:
                    self._refuse_if_sharded(("optimizers", i), sd, in_place)
                    _load_hyperparameters(o, sd)
                else:
                    o.load_state_dict(sd)
            for name, sd in payload["extras"].items():
                if name in self.extras:
                    self.extras[name].load_state_dict(sd)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
            raise StateMismatch(" ".join(lines[:2])[:300]) from None
        return _snapshot(payload)

    def _restore_kept(self, payload: Dict[str, Any], in_place: Set[Path]) -> Tuple[int, int, int, int]:
        """The parameters and optimizers were found bit for bit the source's: the optimizers'
        settings, the buffers (a failed round's forward may have changed the source's BatchNorm
        statistics after the step the spare was fed) and the registered state are what is left."""
        try:
            if len(payload.get("buffers", ())) != len(self.models):
                raise StateMismatch(f"its peer has {len(payload.get('buffers', ()))} model(s), this replica "
                                    f"{len(self.models)}")
            with torch.no_grad():
                for i, (m, theirs) in enumerate(zip(self.models, payload["buffers"])):
                    mine = buffers_of(m)
                    for name, t in theirs.items():
                        if ("buffers", i, name) not in in_place:
                            _local(mine[name]).copy_(t)
            for o, groups in zip(self.optimizers, payload["settings"]):
                if len(groups) != len(o.param_groups):
                    raise StateMismatch(f"its peer's optimizer has {len(groups)} param group(s), this one "
                                        f"{len(o.param_groups)}")
                for mine, theirs in zip(o.param_groups, groups):
                    for key, value in theirs.items():
                        if isinstance(mine.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                            mine[key].copy_(value)
                        else:
                            mine[key] = value
            for name, sd in payload["extras"].items():
                if name in self.extras:
                    self.extras[name].load_state_dict(sd)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise StateMismatch(str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__) from None
        return _snapshot(payload)

    def _refuse_if_sharded(self, root: Path, sd: Any, in_place: Set[Path]) -> None:
        """A shard must land in this worker's own shard tensors: one that does not fit means a
        different model, optimizer, mesh or replica size, never something to load."""
        if not self.sharded:
            return
        missing = [p for p, _ in tensor_leaves(sd, root) if p not in in_place]
        if missing:
            where = "/".join(str(x) for x in missing[0])
            raise StateMismatch(f"{len(missing)} tensor(s) of its shard do not fit this worker's shard (first: "
                                f"{where}); the model, optimizer, mesh or --replica-size differ")


def _snapshot(payload: Dict[str, Any]) -> Tuple[int, int, int, int]:
    return (int(payload["round"]), int(payload["step"]), int(payload.get("yielded", -1)),
            int(payload.get("sub_steps", 0)))


def buffers_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The buffers a model's state dict holds (its persistent ones: what a whole heal moves)."""
    names = {n for n, _ in model.named_buffers()}
    return {k: v for k, v in model.state_dict().items() if k in names and isinstance(v, torch.Tensor)}


def _load_hyperparameters(opt: torch.optim.Optimizer, sd: Dict[str, Any]) -> None:
    """Every state tensor arrived in place: what is left are the param groups' settings
    (a scheduler's learning rate, ...)."""
    groups = sd.get("param_groups", [])
    if len(groups) != len(opt.param_groups):
        raise StateMismatch(f"its peer's optimizer has {len(groups)} param group(s), this one "
                            f"{len(opt.param_groups)}")
    params = [p for g in opt.param_groups for p in g["params"]]
    for index, p in enumerate(params):
        if index not in sd.get("state", {}):
            # State this worker created to receive in place that the source does not have
            # (no step taken yet): a state that is not there is the state to have.
            opt.state.pop(p, None)
    for mine, theirs in zip(opt.param_groups, groups):
        if len(theirs.get("params", ())) != len(mine["params"]):
            raise StateMismatch("its peer's optimizer groups hold other parameters than this one's")
        for key, value in theirs.items():
            if key == "params":
                continue
            if isinstance(mine.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                mine[key].copy_(value)
            else:
                mine[key] = value


def _create_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (DTensors, for sharded parameters) at their
    final shapes without changing a parameter: one step on zero gradients with lr 0."""
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    saved = [(g, g["lr"]) for g in opt.param_groups]
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for g, lr in saved:
            g["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        try:
            opt.step()
        finally:
            for g, lr in saved:
                g["lr"] = lr
            for p in params:
                p.grad = None
