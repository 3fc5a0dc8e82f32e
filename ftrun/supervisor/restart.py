"""Restart policies: given a failure, restart the group, restart one replica, or give up.

Group policy (default, torchrun semantics): any failure stops every worker and
restarts them all, while the group's budget lasts. Replica policy (--ft): only
the failed replica restarts, each with its own budget; the run goes on while
at least --min-replicas are alive.
Must never touch processes: it only decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict


class Decision(enum.Enum):
    RESTART_GROUP = "restart the group"
    RESTART_REPLICA = "restart the replica"
    DROP_REPLICA = "carry on without the replica"
    GIVE_UP = "stop the run"


@dataclass
class GroupRestartPolicy:
    max_restarts: int
    restarts: int = 0

    def on_failure(self, rank: int) -> Decision:
        if self.restarts < self.max_restarts:
            self.restarts += 1
            return Decision.RESTART_GROUP
        return Decision.GIVE_UP

    @property
    def name(self) -> str:
        return "group restart"


@dataclass
class ReplicaRestartPolicy:
    max_restarts: int
    min_replicas: int
    restarts: Dict[int, int] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.restarts = {}

    def on_failure(self, rank: int, live_replicas_after: int = 0) -> Decision:
        used = self.restarts.get(rank, 0)
        if used < self.max_restarts:
            self.restarts[rank] = used + 1
            return Decision.RESTART_REPLICA
        if live_replicas_after >= self.min_replicas:
            return Decision.DROP_REPLICA
        return Decision.GIVE_UP

    @property
    def name(self) -> str:
        return "replica restart (ft)"
