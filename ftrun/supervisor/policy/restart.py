"""Restart budgets: given a failure, restart the group, restart one replica, or give up.
The failure policy (ftrun.supervisor.policy.failure_policy) owns one and turns its decision into an action.

Group policy (default, torchrun semantics): any failure stops every worker and
restarts them all, while the group's budget lasts. Replica policy (--ft): only
the failed replica restarts, each with its own budget; the run goes on while
at least --min-replicas are alive.
Either way, a failure that repeats identically right after start (the same
exception at the same line, before any step, twice in a row: `signature`) is
not retried again, whatever budget is left: a restart cannot change a
script's deterministic error, and retrying it only spends every budget.
Must never touch processes: it only decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, Hashable, Optional


class RestartDecision(enum.Enum):
    RESTART_GROUP = "restart the group"
    RESTART_REPLICA = "restart the replica"
    DROP_REPLICA = "carry on without the replica"
    GIVE_UP = "stop the run"


class Repeats:
    """The last early failure (before any step) of each replica, or of the group: its signature."""

    def __init__(self) -> None:
        self.last: Dict[Hashable, str] = {}

    def repeated(self, key: Hashable, signature: Optional[str]) -> bool:
        """Whether this failure (`signature`: None unless it came before any step) repeats the
        last one of `key` exactly; remembers it either way."""
        before = self.last.pop(key, None)
        if signature is None:
            return False
        self.last[key] = signature
        return before == signature


@dataclass
class GroupRestartPolicy:
    max_restarts: int
    restarts: int = 0
    repeats: Repeats = field(default_factory=Repeats)
    repeated: bool = False  # the last decision gave up on a failure that repeated (see the module)

    def on_failure(self, rank: int, signature: Optional[str] = None) -> RestartDecision:
        self.repeated = self.repeats.repeated("group", signature)
        if self.restarts < self.max_restarts and not self.repeated:
            self.restarts += 1
            return RestartDecision.RESTART_GROUP
        return RestartDecision.GIVE_UP

    @property
    def name(self) -> str:
        return "group restart"


@dataclass
class ReplicaRestartPolicy:
    max_restarts: int
    min_replicas: int
    restarts: Dict[int, int] = field(default_factory=dict)
    repeats: Repeats = field(default_factory=Repeats)
    repeated: bool = False  # the last decision did not restart a failure that repeated (see the module)

    def on_failure(self, replica: int, live_replicas_after: int = 0,
                   signature: Optional[str] = None) -> RestartDecision:
        self.repeated = self.repeats.repeated(replica, signature)
        used = self.restarts.get(replica, 0)
        if used < self.max_restarts and not self.repeated:
            self.restarts[replica] = used + 1
            return RestartDecision.RESTART_REPLICA
        if live_replicas_after >= self.min_replicas:
            return RestartDecision.DROP_REPLICA
        return RestartDecision.GIVE_UP

    @property
    def name(self) -> str:
        return "replica restart (ft)"
