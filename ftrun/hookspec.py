"""HookSpec: which DDP communication hook a run uses, parsed and validated.

One parser for CLI flags and recipe dicts, one JSON form (carried to workers in
FTRUN_HOOK), one validator that runs in the launcher before any worker starts.
This module must never import torch: the CLI and `ftrun validate` use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ftrun.errors import ConfigError

HOOK_NAMES = ("allreduce", "fp16", "bf16", "powersgd", "batched-powersgd", "localsgd", "noop")
WRAP_NAMES = ("fp16", "bf16")


@dataclass(frozen=True)
class HookSpec:
    """A validated hook choice: name, its parameters (snake_case), optional wrapper."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    wrap: Optional[str] = None

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "params": dict(self.params), "wrap": self.wrap}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "HookSpec":
        d = json.loads(text)
        return cls(name=d["name"], params=dict(d.get("params") or {}), wrap=d.get("wrap"))

    def describe(self) -> str:
        parts = [self.name] + [f"{k}={v}" for k, v in sorted(self.params.items())]
        if self.wrap:
            parts.append(f"wrap={self.wrap}")
        return " ".join(parts)


def parse_hook(raw: Mapping[str, Any], where: str = "command line") -> HookSpec:
    """Turn {'name': ..., 'rank': ..., 'wrap': ...} into a validated HookSpec.

    Keys use snake_case (start_iter), as recipes and the CLI both produce.
    Raises ConfigError with one line naming `where`, the key and the fix.
    """
    name = raw.get("name")
    if name not in HOOK_NAMES:
        raise ConfigError(f"{where}: unknown hook {name!r}; known hooks: {', '.join(HOOK_NAMES)}")
    wrap = raw.get("wrap")
    if wrap is not None and wrap not in WRAP_NAMES:
        raise ConfigError(f"{where}: unknown --wrap {wrap!r}; use one of {', '.join(WRAP_NAMES)}")
    params = {k: v for k, v in raw.items() if k not in ("name", "wrap")}
    return HookSpec(name=name, params=params, wrap=wrap)
