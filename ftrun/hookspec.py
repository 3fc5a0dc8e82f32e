"""HookSpec: which DDP communication hook a run uses, parsed and validated.

One parser for CLI flags and recipe dicts, one JSON form (carried to workers in
FTRUN_HOOK), one validator that runs in the launcher before any worker starts.
The catalogue here (names, parameters, defaults, bounds) is the single source
of truth; ftrun.worker.hooks turns a spec into torch objects.
This module must never import torch: the CLI and `ftrun validate` use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from ftrun.errors import ConfigError

HOOK_NAMES = ("allreduce", "fp16", "bf16", "powersgd", "batched-powersgd", "localsgd", "diloco", "noop")
WRAP_NAMES = ("fp16", "bf16", "int8")
HALF_WRAPS = ("fp16", "bf16")

# Hooks whose payload a --wrap may cast to half precision. fp16/bf16 already
# send half precision and noop sends nothing, so wrapping them means nothing.
WRAPPABLE = ("allreduce", "powersgd", "batched-powersgd", "localsgd", "diloco")


@dataclass(frozen=True)
class Param:
    """One hook parameter: its CLI flag, type, default and lower bound."""

    flag: str
    kind: type
    default: Any
    minimum: Optional[float] = None
    help: str = ""


PARAMS: Dict[str, Param] = {
    "rank": Param("--rank", int, 1, 1, "matrix approximation rank (1-4 typical; lower = more compression)"),
    "start_iter": Param("--start-iter", int, 1000, 0, "plain allreduce for this many steps first"),
    "min_compression_rate": Param("--min-compression-rate", float, 2.0, 0,
                                  "compress a tensor only if it shrinks at least this much"),
    "error_feedback": Param("--no-error-feedback", bool, True, None, "carry the compression error to the next step"),
    "warm_start": Param("--no-warm-start", bool, True, None, "reuse last step's P/Q matrices"),
    "orthogonalization_epsilon": Param("--orthogonalization-epsilon", float, 0.0, 0,
                                       "added in orthogonalization to avoid dividing by zero"),
    "seed": Param("--seed", int, 0, 0, "seed of the random initial Q matrices (same on every rank)"),
    "batch_same_shape": Param("--batch-same-shape", bool, False, None, "compress same-shape tensors as one batch"),
    "period": Param("--period", int, None, 1,
                    "steps between two syncs (localsgd: the parameters averaged; diloco: the outer step)"),
    "outer_lr": Param("--outer-lr", float, 0.7, 0, "diloco: the outer optimizer's learning rate (SGD on the "
                      "pseudo-gradients, the replicas' average change since the last sync)"),
    "outer_momentum": Param("--outer-momentum", float, 0.9, 0, "diloco: the outer optimizer's Nesterov momentum "
                            "(0: plain SGD; below 1)"),
    "fragments": Param("--fragments", int, 1, 1, "diloco: streaming, the model cut into this many fragments, each "
                       "synced every --period steps at its own offset (1: the whole model at once)"),
    "sync_delay": Param("--sync-delay", int, 0, 0, "diloco: steps a fragment's average takes to arrive and be applied, "
                        "its exchange overlapped with them (below --period / --fragments)"),
}

# Which parameters each hook takes. Every PowerSGDState knob is reachable for
# powersgd; the batched variant ignores per-tensor knobs, so they are refused.
HOOK_PARAMS: Dict[str, Tuple[str, ...]] = {
    "allreduce": (),
    "fp16": (),
    "bf16": (),
    "noop": (),
    "powersgd": ("rank", "start_iter", "min_compression_rate", "error_feedback", "warm_start",
                 "orthogonalization_epsilon", "seed", "batch_same_shape"),
    "batched-powersgd": ("rank", "start_iter", "error_feedback", "warm_start", "orthogonalization_epsilon", "seed"),
    "localsgd": ("start_iter", "period"),
    "diloco": ("period", "outer_lr", "outer_momentum", "fragments", "sync_delay"),
}
REQUIRED: Dict[str, Tuple[str, ...]] = {"localsgd": ("period",), "diloco": ("period",)}
# localsgd: global allreduce only for warm-up; 0 means local SGD from the first step.
DEFAULT_OVERRIDES: Dict[str, Dict[str, Any]] = {"localsgd": {"start_iter": 0}}


def flag(key: str) -> str:
    """The CLI spelling of a hook parameter, used in every message."""
    p = PARAMS.get(key)
    return p.flag if p else key


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

    def effective_params(self) -> Dict[str, Any]:
        """Every parameter this hook takes, with defaults filled in."""
        out: Dict[str, Any] = {}
        for key in HOOK_PARAMS.get(self.name, ()):
            default = DEFAULT_OVERRIDES.get(self.name, {}).get(key, PARAMS[key].default)
            out[key] = self.params.get(key, default)
        return out

    def describe(self) -> str:
        parts = [self.name] + [f"{k}={v}" for k, v in sorted(self.params.items())]
        if self.wrap:
            parts.append(f"wrap={self.wrap}")
        return " ".join(parts)

    @property
    def label(self) -> str:
        """Short name: 'powersgd' or 'powersgd+fp16'."""
        return self.name + (f"+{self.wrap}" if self.wrap else "")


def _err(where: str, key: str, problem: str) -> ConfigError:
    """A hook error that knows its key (a recipe places it on hook.<key>'s line)."""
    return ConfigError(f"{where}: {problem}" if where else problem, key=key, problem=problem)


def _check_value(key: str, value: Any, where: str) -> Any:
    p = PARAMS[key]
    if p.kind is bool:
        if not isinstance(value, bool):
            raise _err(where, key, f"{p.flag} takes true/false, not {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(where, key, f"{p.flag} takes a number, not {value!r}")
    if p.kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise _err(where, key, f"{p.flag} takes a whole number, not {value!r}")
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise _err(where, key, f"{p.flag} takes a finite number, not {value!r}")
    if p.minimum is not None and value < p.minimum:
        lo = int(p.minimum) if p.kind is int else p.minimum
        raise _err(where, key, f"{p.flag} {value} is out of range; use a value >= {lo} ({p.help})")
    if key == "seed" and value >= 2 ** 32:
        raise _err(where, key, f"--seed {value} is out of range; use 0 .. {2 ** 32 - 1}")
    return value


def parse_hook(raw: Mapping[str, Any], where: str = "command line") -> HookSpec:
    """Turn {'name': ..., 'rank': ..., 'wrap': ...} into a validated HookSpec.

    Keys use snake_case (start_iter), as recipes and the CLI both produce.
    Raises ConfigError with one line naming `where`, the key and the fix.
    """
    name = raw.get("name")
    if name not in HOOK_NAMES:
        raise _err(where, "name", f"unknown hook {name!r}; known hooks: {', '.join(HOOK_NAMES)}")
    wrap = raw.get("wrap")
    if wrap is not None:
        if wrap not in WRAP_NAMES:
            raise _err(where, "wrap", f"--wrap {wrap!r} is not a known precision; use one of {', '.join(WRAP_NAMES)}")
        if name not in WRAPPABLE:
            why = "it sends nothing" if name == "noop" else f"it already sends {name}; drop --wrap"
            raise _err(where, "wrap", f"--wrap {wrap} cannot wrap hook {name!r} ({why}); "
                              f"--wrap works with {', '.join(WRAPPABLE)}")
        if wrap == "int8" and name != "diloco":
            raise _err(where, "wrap", f"--wrap int8 quantizes DiLoCo's pseudo-gradients only; with --hook {name} "
                              f"use --wrap {' or '.join(HALF_WRAPS)}")
    takes = HOOK_PARAMS[name]
    params: Dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("name", "wrap") or value is None:
            continue
        if key not in PARAMS:
            raise _err(where, key, f"unknown hook parameter {key!r}; hook {name!r} takes "
                              f"{', '.join(flag(k) for k in takes) or 'no parameters'}")
        if key not in takes:
            fix = (f"hook {name!r} takes {', '.join(flag(k) for k in takes)}" if takes
                   else f"hook {name!r} takes no parameters")
            raise _err(where, key, f"{flag(key)} does not apply to hook {name!r}; {fix}")
        params[key] = _check_value(key, value, where)
    for key in REQUIRED.get(name, ()):
        if key not in params:
            raise _err(where, "name", f"hook {name!r} needs {flag(key)} N ({PARAMS[key].help}), "
                              f"e.g. --hook {name} {flag(key)} 4")
    spec = HookSpec(name=name, params=params, wrap=wrap)
    if name == "diloco":
        eff = spec.effective_params()
        if eff["outer_momentum"] >= 1:
            raise _err(where, "outer_momentum", f"--outer-momentum {eff['outer_momentum']:g} is out of range; use a "
                                                f"value from 0 to below 1 (DiLoCo's is 0.9)")
        if eff["fragments"] > eff["period"]:
            raise _err(where, "fragments", f"--fragments {eff['fragments']} exceeds --period {eff['period']}: each "
                                           f"fragment syncs at its own step of the period; use --fragments "
                                           f"{eff['period']} or fewer")
        gap = eff["period"] // eff["fragments"]
        if eff["sync_delay"] >= gap:
            raise _err(where, "sync_delay", f"--sync-delay {eff['sync_delay']} is out of range: a fragment's average "
                                            f"must land before the next fragment's sync starts, {gap} step"
                                            f"{'s' if gap != 1 else ''} later (--period {eff['period']} / "
                                            f"--fragments {eff['fragments']}); use --sync-delay {gap - 1} or less")
    if name in ("powersgd", "batched-powersgd"):
        eff = spec.effective_params()
        # torch's PowerSGDState refuses this too, but only inside every worker after
        # start-up; DDP rebuilds its buckets after step 1, which would invalidate
        # per-bucket error and P/Q memories taken before.
        if (eff["error_feedback"] or eff["warm_start"]) and eff["start_iter"] <= 1:
            raise _err(
                where, "start_iter", f"--start-iter {eff['start_iter']} is too small for {name} with error feedback or warm start "
                "on (DDP rebuilds its buckets after step 1); use --start-iter 2 or more, "
                "or add --no-error-feedback --no-warm-start")
    return spec
