"""A replica's state as DCP takes it, for --checkpoint-dir: what a save copies, what a load fills.

`StateDicts` turns the registered models, optimizers and extra state into
{"model", "optim", "extras"} (parameters and optimizer state by parameter
name, DTensors for a sharded model, so DCP can lay them out for another
shard count), copies at once what the loop may change before the round's
optimizer step, and takes a loaded checkpoint back in. The stager helpers
say how DCP's stager copies the rest in the background.
Must never touch the disk, never communicate, and never import the supervisor.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch

# A registered object's tensors up to this size are copied at once with the rest of its state (a
# counter, an RNG state); larger ones (an EMA of the model) are staged in the background like
# parameters, so must not change in place before the round's optimizer step either.
SMALL_TENSOR_BYTES = 1 << 20


class StateDicts:
    """One per Checkpointer: keeps the container DCP names several models under ("0.", "1.")."""

    def __init__(self) -> None:
        self._container: Optional[torch.nn.Module] = None

    def models(self, state: Any) -> torch.nn.Module:
        """The registered model, or several under one root ("0.", "1.", ...) for DCP's names."""
        if len(state.models) == 1:
            return state.models[0]
        if self._container is None or len(self._container) != len(state.models):
            self._container = torch.nn.ModuleDict({str(i): m for i, m in enumerate(state.models)})
        return self._container

    def state_dict(self, state: Any) -> Dict[str, Any]:
        """{"model", "optim", "extras"}: parameters and optimizer state by parameter name (FQN),
        as DTensors for a sharded model, so DCP can lay them out for another shard count."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        container = self.models(state)
        if state.optimizers:
            msd, osd = get_state_dict(container, tuple(state.optimizers))
        else:
            msd, osd = get_model_state_dict(container), {}
        return {"model": msd, "optim": osd, "extras": {name: obj.state_dict() for name, obj in state.extras.items()}}

    def copy_what_may_change(self, sd: Dict[str, Any], state: Any) -> Dict[str, Any]:
        """Copy now what the loop may change before the round's optimizer step: buffers (a
        forward updates BatchNorm's statistics), registered state (a data sampler moves on as
        the loop takes its batch), the optimizer's settings. Parameters and optimizer state
        only change at the optimizer step: those are staged in the background."""
        buffers = {name for name, _ in self.models(state).named_buffers()}
        with torch.no_grad():
            sd["model"] = {k: (v.clone() if k in buffers and isinstance(v, torch.Tensor) else v)
                           for k, v in sd["model"].items()}
        if "param_groups" in sd["optim"]:
            sd["optim"] = {**sd["optim"], "param_groups": copy.deepcopy(sd["optim"]["param_groups"])}
        sd["extras"] = copy_small(sd["extras"])
        return sd

    def load_target(self, state: Any) -> Dict[str, Any]:
        """This worker's own tensors for a checkpoint to be read into. A fresh optimizer first gets
        its state tensors at their final shapes (a step on zero gradients with lr 0, parameters
        unchanged), even where gradients of a discarded round are still there."""
        from ftrun.worker.ft.heal.state import _create_optimizer_state

        for opt in state.optimizers:
            _create_optimizer_state(opt)
        return self.state_dict(state)

    def apply(self, state: Any, loaded: Dict[str, Any]) -> None:
        """Tensors were read in place; what remains are the values that are not tensors (learning
        rates, a scheduler's counters...)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        container = self.models(state)
        if not state.optimizers:
            container.load_state_dict(loaded["model"])
        else:
            set_model_state_dict(container, loaded["model"])
            for opt, part in zip(state.optimizers, split_optimizers(state.optimizers, loaded["optim"])):
                # Not strict: a parameter an optimizer keeps no state for (SGD without momentum, a
                # group with momentum 0) has none in the checkpoint either.
                set_optimizer_state_dict(container, opt, part, options=StateDictOptions(strict=False))
        for name, sd in loaded["extras"].items():
            state.extras[name].load_state_dict(sd)


def split_optimizers(optimizers: Any, osd: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each optimizer's part of the one state dict get_state_dict made of several: their param
    groups one after another, in the optimizers' order, and the state of the parameters (by name)
    in each one's groups. torch's own set_state_dict splits it by the state, and cannot place an
    optimizer's groups when some of its parameters have none."""
    groups, at, parts = osd.get("param_groups", []), 0, []
    for opt in optimizers:
        mine = groups[at:at + len(opt.param_groups)]
        at += len(opt.param_groups)
        names = {name for g in mine for name in g["params"]}
        parts.append({"state": {k: v for k, v in osd.get("state", {}).items() if k in names}, "param_groups": mine})
    return parts


def copy_small(obj: Any) -> Any:
    """A copy of a registered object's state, made now: containers (those torch.utils._pytree
    knows) and plain values copied, small tensors cloned, large tensors left for the
    background staging."""
    from torch.utils._pytree import tree_map

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.numel() * x.element_size() <= SMALL_TENSOR_BYTES:
                with torch.no_grad():
                    return x.clone()
            return x
        return copy.deepcopy(x)

    return tree_map(leaf, obj)


def tensor_bytes(sd: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: about what a checkpoint of it takes on disk."""
    from torch.utils._pytree import tree_leaves

    total = 0
    for leaf in tree_leaves(sd):
        if isinstance(leaf, torch.Tensor):
            local = getattr(leaf, "_local_tensor", leaf)  # a DTensor: this worker's shard
            total += local.numel() * local.element_size()
    return total


def new_stager() -> Any:
    """DCP's stager: it copies in a thread of its own into buffers it keeps, keyed by the live
    tensors' storages, so from its second save on it copies into memory already there."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=False))


def stager_reusable(stager: Any) -> bool:
    """Whether a stager stages more than once. torch 2.11's fails every stage after its first
    (KeyError: <class 'type'> in its cached deep copy; seen on CPU and CUDA): there, every save
    gets a fresh stager (its copy allocates its buffers anew). Two tiny stages tell; the
    stager tried is closed."""
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)}).result()
        return True
    except Exception:  # noqa: BLE001 - any failure means: do not reuse
        return False
    finally:
        stager.close()

