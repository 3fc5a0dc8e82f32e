"""The guard's fingerprints: whether every replica of a quorum holds the same state, and what differs.

Each member reduces its state to one integer per entry: each tensor's bits summed as wrapping
32-bit integers (the models' parameters and buffers, the optimizers' state), each plain value of
an optimizer's settings or of registered state hashed. The entries' count and two sums of them
(plain, and weighted by position) are the fingerprint, which the group's members gather in one
small collective; only when they differ does a second gather of every entry's integer name what
differs (by the entry's name on this member). A DTensor counts by its local shard: each shard
group compares its own shards.

Left out, as they differ between healthy replicas: the running statistics of normalisation layers
(each replica's forward updates them from its own batch, and counts the forwards of a round a
failure cut short on the replicas that ran it; a heal moves them), ftrun's own record of where a
loop is (a Trainer's or Lightning's state: logs, timers; an ft.DataLoader's position, counted in
its replica's own batch size), and registered state a script names
as its replica's own (`ft.register_state(name, obj, compare=False)`).

Nothing here decides what a difference means (member/core.py `verdict` does). Must never put state
in the store, never change the state it reads, and never import the supervisor.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ftrun.worker.ft.heal.state import ReplicaState
from ftrun.worker.ft.heal.transport import _local
from ftrun.worker.ft.member.group import group_device

# Registered state under these names is ftrun's own record of where a loop is (a framework's, a
# loader's position in this replica's own batch size, the epoch): not compared.
UNCOMPARED_PREFIXES = ("ftrun.framework.", "ftrun.data.", "ftrun.epochs")
NAMED = 3  # entries named per member in a difference
_NORM_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _bits_sums(tensors: List[torch.Tensor]) -> List[int]:
    """Each tensor's bits summed as 32-bit integers, wrapping (to int64); one host copy for all."""
    if not tensors:
        return []
    sums = []
    for t in tensors:
        flat = t.detach()
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        flat = flat.contiguous().reshape(-1).view(torch.uint8)
        if flat.numel() % 4:
            sums.append(flat.sum(dtype=torch.int64))
        else:
            sums.append(flat.view(torch.int32).sum(dtype=torch.int32).to(torch.int64))
    return [int(v) for v in torch.stack([s.to("cpu") if s.device.type != "cpu" else s for s in sums]).tolist()]


def _hash(value: Any) -> int:
    """A plain value (a number, a string, a flag) as a signed 63-bit integer, the same in every process."""
    if isinstance(value, float) and math.isnan(value):
        text = "nan"
    else:
        text = f"{type(value).__name__}:{value!r}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


_PLAIN = (bool, int, float, str, bytes, type(None))


class Entries:
    """A state's entries in a fixed order: each one's name and integer (tensors by their bits)."""

    def __init__(self) -> None:
        self.names: List[str] = []
        self._tensors: List[Tuple[int, torch.Tensor]] = []  # (entry index, tensor)
        self._values: List[int] = []

    def tensor(self, name: str, t: torch.Tensor) -> None:
        self._tensors.append((len(self.names), _local(t)))
        self.names.append(name)
        self._values.append(0)

    def plain(self, name: str, value: Any) -> None:
        self.names.append(name)
        self._values.append(_hash(value))

    def tree(self, name: str, obj: Any) -> None:
        """Every tensor and plain value of a nested state (a state_dict), by its path."""
        leaves, _ = pytree.tree_flatten_with_path(obj)
        for path, leaf in leaves:
            where = name + "".join(f"[{_key(k)!r}]" for k in path)
            if isinstance(leaf, torch.Tensor):
                self.tensor(where, leaf)
            elif isinstance(leaf, _PLAIN):
                self.plain(where, leaf)

    def values(self) -> List[int]:
        out = list(self._values)
        for (i, _), v in zip(self._tensors, _bits_sums([t for _, t in self._tensors])):
            out[i] = v
        return out


def _key(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _norm_stats(model: torch.nn.Module) -> set:
    """The state-dict names of the running statistics of model's normalisation layers."""
    from torch.nn.modules.batchnorm import _NormBase

    return {f"{prefix}.{stat}" if prefix else stat for prefix, m in model.named_modules()
            if isinstance(m, _NormBase) and m.track_running_stats for stat in _NORM_STATS}


def entries(state: ReplicaState) -> Entries:
    """What the guard compares of a replica's state, in an order every replica shares."""
    out = Entries()
    names: Dict[int, str] = {}
    for i, model in enumerate(state.models):
        _module(out, f"model {i}", model)
        for key, p in model.named_parameters():
            names.setdefault(id(p), f"model {i} {key}")
    for i, opt in enumerate(state.optimizers):
        params = [p for g in opt.param_groups for p in g["params"]]
        for g, group in enumerate(opt.param_groups):
            for key, value in sorted((k, v) for k, v in group.items() if k != "params"):
                if isinstance(value, torch.Tensor):
                    out.tensor(f"optimizer {i} group {g} {key}", value)
                elif isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
                    out.plain(f"optimizer {i} group {g} {key}", tuple(value))
                elif isinstance(value, _PLAIN):
                    out.plain(f"optimizer {i} group {g} {key}", value)
        for index, p in enumerate(params):
            st = opt.state.get(p)
            if not st:
                continue
            owner = names.get(id(p), f"parameter {index}")
            for key, value in sorted(st.items()):
                if isinstance(value, torch.Tensor):
                    out.tensor(f"optimizer {i} {key} of {owner}", value)
                elif isinstance(value, _PLAIN):
                    out.plain(f"optimizer {i} {key} of {owner}", value)
    for name, obj in state.extras.items():
        if name.startswith(UNCOMPARED_PREFIXES) or name in state.uncompared:
            continue
        if isinstance(obj, torch.nn.Module):  # an EMA or a teacher: its own normalisation statistics too
            _module(out, repr(name), obj)
        else:
            out.tree(repr(name), obj.state_dict())
    return out


def _module(out: Entries, label: str, module: torch.nn.Module) -> None:
    skip = _norm_stats(module)
    for key, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and key not in skip:
            out.tensor(f"{label} {key}", t)


def _gather(pg: dist.ProcessGroup, t: torch.Tensor) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(pg.size())]
    pg.allgather([out], [t]).wait()
    return out


def _fingerprint(values: Iterable[int]) -> Tuple[int, int, int]:
    """(count, sum, position-weighted sum), each wrapped to a signed 64-bit integer."""
    total = weighted = count = 0
    for count, v in enumerate(values, 1):
        total += v
        weighted += count * v
    wrap = lambda x: (x + (1 << 63)) % (1 << 64) - (1 << 63)  # noqa: E731
    return count, wrap(total), wrap(weighted)


def compare(pg: dist.ProcessGroup, rank: int, state: ReplicaState
            ) -> Tuple[Tuple[Tuple[int, Tuple[int, ...]], ...], Tuple[Tuple[int, str], ...]]:
    """Over the quorum's group of this worker: ((rank, fingerprint) of every member, (rank, what
    differs) for the members whose entries differ from most members'). Every member calls it at
    the same round's top; a collective failure raises."""
    dev = group_device()
    mine = entries(state)
    values = mine.values()
    head = torch.tensor([rank, *_fingerprint(values)], dtype=torch.int64, device=dev)
    heads = [tuple(int(x) for x in h.tolist()) for h in _gather(pg, head)]
    prints = tuple(sorted((h[0], h[1:]) for h in heads))
    if len({fp for _, fp in prints}) == 1:
        return prints, ()
    # They differ: every member's every entry, to name what differs (padded to the longest).
    longest = max(fp[0] for _, fp in prints)
    row = torch.zeros(longest + 1, dtype=torch.int64, device=dev)
    row[0] = len(values)
    if values:
        row[1:len(values) + 1] = torch.tensor(values, dtype=torch.int64, device=dev)
    rows = {h[0]: gathered.tolist() for h, gathered in zip(heads, _gather(pg, row))}  # both in group order
    return prints, tuple(_differences(rows, mine.names))


def _differences(rows: Dict[int, List[int]], names: List[str]) -> List[Tuple[int, str]]:
    """For each rank whose entries differ from the most common value of each entry: what differs."""
    counts = {r: row[0] for r, row in rows.items()}
    usual_count = max(set(counts.values()), key=lambda c: (list(counts.values()).count(c), -c))
    out = []
    for r, row in sorted(rows.items()):
        if counts[r] != usual_count:
            out.append((r, f"its state has {counts[r]} entries where most have {usual_count}"))
            continue
        odd = []
        for i in range(usual_count):
            column = [other[i + 1] for other in rows.values() if other[0] == usual_count]
            usual = max(set(column), key=column.count)
            if row[i + 1] != usual:
                odd.append(i)
        if odd:
            shown = ", ".join(names[i] if i < len(names) else f"entry {i}" for i in odd[:NAMED])
            more = f" and {len(odd) - NAMED} more" if len(odd) > NAMED else ""
            out.append((r, f"{len(odd)} of {usual_count} entries differ: {shown}{more}"))
    return out
