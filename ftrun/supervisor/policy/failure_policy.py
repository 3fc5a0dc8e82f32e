"""The failure policy: what a worker's failure leads to. A pure component: it owns the restart
budgets (ftrun.supervisor.policy.restart) and the run's restart mode, takes a failure event and returns
an action; it never touches a process, the store, the console or a clock.

Two modes. Group restarts (torchrun's semantics, and any run without --ft): a failure stops
every worker and the group restarts while its budget lasts; a c10d run without --ft ends the
round instead and re-forms (its budget is the rounds'). Replica restarts (--ft): only the
failed replica restarts, within its own budget; past it the replica is dropped while at least
--min-replicas others live, else the run gives up. A failure that repeats the last one exactly
right after start is not retried (restart.Repeats). A restart the others' decision forced on a
replica (ftrun.supervisor.policy.peer_restarts) is charged to no budget.

The supervisor's loop (ftrun.supervisor.loop.run) applies the actions; the simulator may drive the
same object (ReplicaFailed in, RestartAction out).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from ftrun.supervisor.policy.restart import GroupRestartPolicy, ReplicaRestartPolicy, Repeats, RestartDecision

# Why a failure is not restarted although budget is left (restart.Repeats).
REPEATED = ("not restarted again: it failed the same way (the same exception at the same line) twice in a row "
            "right after start, before any step, which a restart cannot fix")
OTHERS_FINISHED = "after the others finished"          # no step is left to heal into
WHILE_SAVING = "while the run saves before stopping"   # a stop is under way: nothing restarts


class RestartVerdict(enum.Enum):
    RESTART_GROUP = "restart every worker"
    END_ROUND = "end the round: the nodes re-form the run (c10d)"
    RESTART_REPLICA = "restart the replica alone"
    DROP_REPLICA = "carry on without the replica"
    NOT_RESTARTED = "leave the replica failed, nothing else changes"
    GIVE_UP = "stop the run"


@dataclass(frozen=True)
class ReplicaFailed:
    """--ft: a worker of `replica` failed; `live_after` replicas live beside it."""

    replica: int
    live_after: int
    signature: Optional[str] = None   # set for a failure before any step (restart.Repeats)
    by_peers: bool = False            # a restart the others' decision of a round forced on it
    others_done: bool = False         # some worker has already left the training loop
    saving: bool = False              # the run saves before it stops


@dataclass(frozen=True)
class GroupFailed:
    """A failure of the group (the first of its attempt, agreed across nodes): `rank`'s."""

    rank: int
    signature: Optional[str] = None
    can_reform: bool = False          # c10d without --ft, rounds left: the nodes may re-form


@dataclass(frozen=True)
class RestartAction:
    """What the loop does about a failure. `restarts`: the restart this is (RESTART_*: the
    group's count or the replica's own), `counted`: charged to a budget, `why`: why not restarted
    (empty when the budget is simply spent)."""

    verdict: RestartVerdict
    replica: int = -1
    restarts: int = 0
    counted: bool = True
    why: str = ""


class FailurePolicy:
    """The run's restart mode and budgets. `repeats` spans the rounds of a c10d run."""

    def __init__(self, ft: bool, max_restarts: int, min_replicas: int = 1, repeats: Optional[Repeats] = None) -> None:
        self.max_restarts = max_restarts
        self.min_replicas = min_replicas
        self._budget = (ReplicaRestartPolicy(max_restarts, min_replicas) if ft
                        else GroupRestartPolicy(max_restarts, repeats=repeats or Repeats()))

    @property
    def group(self) -> bool:
        return isinstance(self._budget, GroupRestartPolicy)

    @property
    def name(self) -> str:
        return self._budget.name

    @property
    def group_restarts(self) -> int:
        """Group mode: the restarts of the group so far."""
        return self._budget.restarts if self.group else 0

    def restarts_of(self, replica: int) -> int:
        """Replica mode: the restarts charged to `replica` so far."""
        return 0 if self.group else self._budget.restarts.get(replica, 0)

    def to_group_restarts(self) -> None:
        """--ft on a script that never joins a quorum: the run goes on with group restarts, afresh."""
        self._budget = GroupRestartPolicy(self.max_restarts, repeats=Repeats())

    def on_replica_failure(self, ev: ReplicaFailed) -> RestartAction:
        rep = ev.replica
        if ev.saving:
            return RestartAction(RestartVerdict.NOT_RESTARTED, rep, why=WHILE_SAVING)
        if ev.others_done:
            return RestartAction(RestartVerdict.NOT_RESTARTED, rep, why=OTHERS_FINISHED)
        if ev.by_peers:
            return RestartAction(RestartVerdict.RESTART_REPLICA, rep, self.restarts_of(rep), counted=False)
        decision = self._budget.on_failure(rep, ev.live_after, ev.signature)
        if decision is RestartDecision.RESTART_REPLICA:
            return RestartAction(RestartVerdict.RESTART_REPLICA, rep, self.restarts_of(rep))
        why = REPEATED if self._budget.repeated else ""
        verdict = RestartVerdict.DROP_REPLICA if decision is RestartDecision.DROP_REPLICA else RestartVerdict.GIVE_UP
        return RestartAction(verdict, rep, self.restarts_of(rep), why=why)

    def on_group_failure(self, ev: GroupFailed) -> RestartAction:
        decision = self._budget.on_failure(ev.rank, ev.signature)
        if decision is RestartDecision.RESTART_GROUP:
            return RestartAction(RestartVerdict.RESTART_GROUP, restarts=self._budget.restarts)
        if self._budget.repeated:
            return RestartAction(RestartVerdict.GIVE_UP, restarts=self._budget.restarts, why=REPEATED)
        if ev.can_reform:
            return RestartAction(RestartVerdict.END_ROUND, restarts=self._budget.restarts)
        return RestartAction(RestartVerdict.GIVE_UP, restarts=self._budget.restarts)
